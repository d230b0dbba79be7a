"""The update of setting (a) at the GPU's pace (paper §1: generation is cheap, the update is the step's cost): one
command that times the update with each change of `CHANGES` switched on in turn, `python -m bench update`.

The update is update.fill_logprobs + update.update_policy on 16 kept rows of one prompt (200 + 512 tokens), LoRA
r = 64 on the Qwen2.5-3B architecture (random bf16 weights, vocabulary 49 152 as `bench step`), preset (a)'s update
settings. The first row switches every change off (micro-batches of 4, every layer checkpointed, peft's fp32
adapter, the prompt's last token in a model call of its own, no fused kernels); each next row switches one more on;
the last is the code as it runs. Per row: the median of --repeats timed updates after one warm-up, the peak memory,
and for the first and last rows one more update under torch.profiler: its kernels, their summed time and the
GPU-busy fraction (summed kernel time / wall time), the measure of a host-bound update (python -m bench census
counts the kernels on a CPU). What cannot be switched off: the update reads the device once per optimizer step.
About 3 minutes on an H100 or H200; --tiny: a 2-layer float32 model at toy shapes on CPU (smoke figures; the bf16
adapter row then changes nothing).
"""

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

from run import config
import models
import policy
from engine import kernels as engine_kernels
from engine import prefix
import update
from bench import common
from bench.common import print_header, print_row

COLUMNS = ["change", "update_s", "speedup", "peak_gib", "replayed", "kernels", "kernel_s", "gpu_busy"]


@contextlib.contextmanager
def peft_adapter(model):
    """peft's own LoRA forward (fp32 adapter: input cast, fp32 products) instead of models.lora_in_base_dtype's."""
    own = {module: module.__dict__.pop("forward") for module in model.modules() if "forward" in module.__dict__
           and hasattr(module, "lora_A")}
    try:
        yield
    finally:
        for module, forward in own.items():
            module.forward = forward


@contextlib.contextmanager
def switched(model, changes, plans):
    """The block with only `changes` (names of CHANGES) on; the update's checkpoint plans go to `plans`."""
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patches())
        if "fold" not in changes:
            patch(prefix, "folds", lambda *args: False)
        if "bf16 adapter" not in changes:
            stack.enter_context(peft_adapter(model))
        planned = update.checkpoint_plan if "checkpoint as memory needs" in changes else lambda *args: (None, 0)
        patch(update, "checkpoint_plan", lambda *args: plans.append(planned(*args)) or plans[-1])
        model.__dict__.pop("_fused_kernels", None)  # checked again under this row's switch
        if "fused kernels" not in changes:
            patch(engine_kernels, "liger_kernels", lambda device: {})
        yield
    model.__dict__.pop("_fused_kernels", None)


@contextlib.contextmanager
def _patches():
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# name -> the UpdateSettings it changes (the other changes are switched in `switched`)
CHANGES = {"fold": {}, "bf16 adapter": {}, "micro-batch 16": {"micro_batch_size": 16},
           "checkpoint as memory needs": {}, "fused kernels": {}}


def profiled(fn, device):
    """(kernels, summed kernel seconds, wall seconds) of fn() under torch.profiler: CUDA kernels on a GPU (with
    memory copies and sets), CPU operations elsewhere."""
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as profile:
        _, wall = common.timed(fn, device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [event for event in profile.events() if event.device_type == kind]
    busy = sum(getattr(event, "device_time_total" if cuda else "self_cpu_time_total", 0) for event in events) / 1e6
    return len(events), busy, wall


def bench_update(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench update", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, toy shapes (always on for CPU)")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per row (default 2), after a warm-up")
    parser.add_argument("--out-dir", default="bench_out", help="bench_update.json goes here")
    args = parser.parse_args(argv)
    device = common.pick_device(args.device)
    tiny = args.tiny or device.type == "cpu"
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    rows, prompt, completion = (4, 8, 8) if tiny else (16, 200, 512)
    trainer = common.trainer_args(device, tiny=tiny, lora_rank=4 if tiny else 64, flags=["--micro-batch-size", "4"])
    base = dataclasses.replace(config.update_settings(trainer), micro_batch_size=2 if tiny else 4)
    label = common.device_label(device, tiny)
    print(f"# bench update: qwen2.5-3b architecture, {label}; {rows} rows of one prompt x ({prompt} + {completion}) "
          f"tokens, LoRA r = {trainer.lora_rank}, {'bf16' if trainer.bf16 else 'fp32'} base; {args.repeats} timed "
          "updates per row after a warm-up")
    model = common.build_policy("qwen2.5-3b", tiny=tiny, device=device, precision="bf16" if trainer.bf16 else "fp32",
                                args=trainer, seed=0, vocab_size=None if tiny else 49152)
    optimizer = update.make_optimizer(model, trainer.learning_rate, trainer.weight_decay, trainer.optimizer)
    vocab = policy.hf_model(model).config.vocab_size
    all_layers = len(engine_kernels.checkpointable_layers(model))

    def run(settings, seed):
        batch = common.synthetic_batch(rows, prompt, completion, vocab, seed)
        batch.sampler_logprobs = -3 * torch.rand(rows, completion, generator=torch.Generator().manual_seed(seed))
        update.fill_logprobs(model, [batch], settings)
        return update.update_policy(model, optimizer, [batch], settings)

    names = list(CHANGES)
    results = []
    print_header(COLUMNS)
    for index in range(len(names) + 1):
        on = names[:index]
        settings = base
        for name in on:
            settings = dataclasses.replace(settings, **CHANGES[name])
            if tiny and name == "micro-batch 16":
                settings = dataclasses.replace(settings, micro_batch_size=rows)
        row, plans = {"change": "every change off" if not on else f"+ {on[-1]}"}, []
        with switched(model, on, plans):
            run(settings, 1)  # warm-up: this row's kernels, allocations, the fused kernels' check
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = [common.timed(lambda: run(settings, 10 + repeat), device)[1] for repeat in range(args.repeats)]
            row["update_s"] = statistics.median(times)
            row["peak_gib"] = common.phase_peak_gib(device)
            whole, mlps = plans[-1]
            row["replayed"] = f"{all_layers if whole is None else whole} layers, {mlps} MLPs"
            if index in (0, len(names)):
                kernels, busy, wall = profiled(lambda: run(settings, 99), device)
                row.update(kernels=kernels, kernel_s=busy, gpu_busy=busy / wall if device.type == "cuda" else None)
        row["speedup"] = results[0]["update_s"] / row["update_s"] if results else 1.0
        results.append(row)
        print_row(row, COLUMNS)
    print(f"update: {results[0]['update_s']:.3g} s with every change off, {results[-1]['update_s']:.3g} s as it runs "
          f"({results[0]['update_s'] / results[-1]['update_s']:.2f}x); target on an H100 / H200: <= 1.0 s, peak "
          f"<= 40 GiB")
    saved = {"args": vars(args) | {"device": str(device), "tiny": tiny}, "device": label,
             "versions": {lib: __import__(lib).__version__ for lib in ("torch", "transformers", "peft")},
             "date": time.strftime("%Y-%m-%d"), "rows": results}
    common.save_json(args.out_dir, "update", saved)
    return saved
