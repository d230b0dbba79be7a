"""One training step of the paper's presets (a)-(d), and (e)'s update on one process, with the model on a stand-in
GPU (tests/stand_in_device.py: torch's `meta` device, the GPU's code paths taken there, the host's tensors on the
CPU), for every loss option (the paper's, GSPO, CISPO, the high-entropy tokens, each importance-sampling correction)
and both optimizers: no operation mixes the device's tensors with the host's, no shape or dtype disagrees, and the
host reads the device where the design says and nowhere else: once per optimizer step in the update, every
CHECK_EVERY decode steps and for the results in generation (the run-time checks of the fused kernels, once per model
or bucket, read what they compare). Narrow widths (bench.narrow.Narrow), 20 completion tokens. By default a covering
set (each preset, loss option and optimizer at least once); `-m slow` runs the whole cross product. A tensor left on
the host, and a read inside the update's loop, are planted and fail. --load-in-4bit cannot move to `meta`
(bitsandbytes' 4-bit parameters do not): tests/test_gpu_paths.py runs it on a CPU taking the GPU paths."""

import dataclasses
import itertools

import pytest
import torch

from bench import census
from engine import gpu_paths
import data
import engine.kernels
import engine.ops
import sampling
import train
import update
from run import config
from stand_in_device import HostTensorOnTheDevice, stand_in_gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread", "varied_rewards")

LOSS_OPTIONS = {
    "paper": [],
    "GSPO": ["--importance-sampling-level", "sequence", "--updates-per-batch", "2"],
    "CISPO": ["--policy-loss", "cispo", "--clip-eps", "1", "--clip-eps-high", "4", "--loss-aggregation", "token"],
    "top-entropy": ["--top-entropy-quantile", "0.2"],
    "tis": ["--importance-sampling-correction", "tis"],
    "token_reject": ["--importance-sampling-correction", "token_reject", "--loss-aggregation", "token"],
    "token_mask": ["--importance-sampling-correction", "token_mask"],
}
OPTIMIZERS = ("adamw", "adamw8bit")
# Each loss option once, the presets and optimizers taken in turn: every preset, option and optimizer by default.
COVERING = [(preset, option, optimizer) for (option, preset), optimizer in
            zip(zip(LOSS_OPTIONS, itertools.cycle("abcd")), itertools.cycle(OPTIMIZERS))]
EVERY = [case for case in itertools.product("abcd", LOSS_OPTIONS, OPTIMIZERS) if case not in COVERING]


def preset_args(preset, flags):
    """train.py's flags of `preset` (narrow-width model of its family, 20 completion tokens) for the stand-in."""
    with gpu_paths.emulated("meta"):   # --optimizer adamw8bit and --load-in-4bit need a GPU: this one
        args = config.parse_args(["--preset", preset, "--dataset", "arithmetic", "--eval-samples", "0", "--device",
                                  "meta", "--max-completion-tokens", "20", "--max-prompt-tokens", "256", *flags])
    args.census_model = "qwen2.5-3b" if "Qwen" in args.model else "llama-3.2-3b"
    return args


def on_the_stand_in(args):
    """The preset's policy (LoRA, bf16 base, checkpointing as train.py builds it) at narrow widths, moved to the
    stand-in, and its optimizer."""
    model = census.narrow_policy(args, 2, census.Narrow()).to("meta")
    return model, update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)


def labelled(recorder, monkeypatch):
    """The phases reads are counted under: the run-time checks (once per model or bucket), the update, generation."""
    for owner, name, phase in ((engine.ops, "check", "checks"), (engine.kernels, "kernels_disagree", "checks"),
                               (engine.kernels, "saved_bytes_per_token", "checks"),
                               (update, "fill_logprobs", "update"), (update, "update_policy", "update"),
                               (sampling, "generate_rollouts", "generation")):
        monkeypatch.setattr(owner, name, recorder.label(phase, getattr(owner, name)))


def one_step(preset, flags, tokenizer, monkeypatch):
    """train.train_step of `preset` with `flags` on the stand-in -> (the step's metrics, {(phase, kind): reads})."""
    args = preset_args(preset, flags)
    model, optimizer = on_the_stand_in(args)
    examples = [data.Example(text="What is 2 + 3?", prompt=[], answer="5")] * args.prompts_per_step
    with stand_in_gpu() as recorder:
        labelled(recorder, monkeypatch)
        metrics, _ = train.train_step(model, tokenizer, optimizer, [examples], train.step_settings(args), step=1)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(value.device.type == "meta" for state in optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.dim() > 0)
    return metrics, dict(recorder.reads)


def reads_as_designed(metrics, reads, chunks):
    """The update reads the device once per optimizer step (its loss, gradient norm, metrics and sampler check, in
    one copy); generation, each decode loop's check for finished rows and each chunk's results; nothing else outside
    the run-time checks."""
    outside_checks = {key: count for key, count in reads.items() if key[0] != "checks"}
    assert outside_checks.pop(("update", "copy to the host")) == metrics["optimizer_steps"] > 0
    assert outside_checks.pop(("generation", "copy to the host")) == 2 * chunks   # tokens and log-probs
    assert outside_checks.pop(("generation", "nonzero")) >= chunks
    assert outside_checks == {}, outside_checks


def run_case(preset, option, optimizer, tokenizer, monkeypatch):
    flags = [*LOSS_OPTIONS[option], "--optimizer", optimizer]
    metrics, reads = one_step(preset, flags, tokenizer, monkeypatch)
    args = preset_args(preset, flags)
    chunks = -(-args.num_rollouts * args.prompts_per_step // args.rollout_batch_size)
    reads_as_designed(metrics, reads, chunks)
    assert metrics["optimizer_steps"] == args.updates_per_batch and metrics["update_rows"] == args.update_size


@pytest.mark.parametrize("preset, option, optimizer", COVERING, ids=lambda value: str(value))
def test_a_step_on_the_stand_in_gpu(preset, option, optimizer, smollm2_tokenizer, monkeypatch):
    run_case(preset, option, optimizer, smollm2_tokenizer, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("preset, option, optimizer", EVERY, ids=lambda value: str(value))
def test_every_preset_option_and_optimizer_on_the_stand_in_gpu(preset, option, optimizer, smollm2_tokenizer,
                                                               monkeypatch):
    run_case(preset, option, optimizer, smollm2_tokenizer, monkeypatch)


def test_presets_e_update_on_one_process():
    """(e): full fine-tuning, fp32 master weights, a rollout batch of 32 kept rows (of the 4 its step accumulates),
    micro-batches of 4. (autocast has no meta device: the stand-in runs its forward in the weights' float32.)"""
    args = preset_args("e", ["--max-completion-tokens", "24"])
    model, optimizer = on_the_stand_in(args)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(1):
        prompts = torch.randint(3, 100, (1, 30), generator=generator).expand(args.update_size, -1)
        completions = torch.randint(3, 100, (args.update_size, 24), generator=generator)
        mask = (torch.arange(24) < torch.randint(1, 25, (args.update_size, 1), generator=generator)).long()
        batch = update.UpdateBatch(prompts.clone(), torch.ones_like(prompts), completions, mask,
                                   torch.randn(args.update_size, generator=generator), mask.all(1))
        batch.sampler_logprobs = -torch.rand(completions.shape, generator=generator)
        batches.append(batch)
    settings = config.update_settings(args)
    with stand_in_gpu() as recorder, pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "autocast", lambda device_type, **kwargs: torch.amp.autocast("cpu", enabled=False))
        labelled(recorder, patch)
        update.fill_logprobs(model, batches, settings)
        metrics = update.update_policy(model, optimizer, batches, settings)
    assert settings.autocast_dtype == torch.bfloat16 and args.lora_rank == 0
    assert metrics.optimizer_steps == 1 and metrics.rows == args.update_size and args.grad_accum_steps == 4
    assert {key: n for key, n in recorder.reads.items() if key[0] != "checks"} == {("update", "copy to the host"): 1}


def test_a_tensor_left_on_the_host_fails(smollm2_tokenizer, monkeypatch):
    """The micro-batch's advantages left on the host (not sent with the rest): the step fails at the first operation
    mixing them with the device's tensors, as it would on a GPU."""
    micro_batches = update.micro_batches

    def host_advantages(batch, *args, **kwargs):
        for micro in micro_batches(batch, *args, **kwargs):
            yield dataclasses.replace(micro, advantages=batch.advantages[micro.rows])

    monkeypatch.setattr(update, "micro_batches", host_advantages)
    with pytest.raises(HostTensorOnTheDevice, match="host tensors"):
        one_step("a", [], smollm2_tokenizer, monkeypatch)


def test_a_read_inside_the_update_loop_fails(smollm2_tokenizer, monkeypatch):
    """A micro-batch's loss read by the host (`float(loss)`: a sync per micro-batch on a GPU) is counted: the update
    reads more than once per optimizer step."""
    loss = update.micro_batch_loss

    def read_each(*args, **kwargs):
        result = loss(*args, **kwargs)
        float(result[0].detach())
        return result

    monkeypatch.setattr(update, "micro_batch_loss", read_each)
    metrics, reads = one_step("c", [], smollm2_tokenizer, monkeypatch)
    assert reads[("update", "item")] >= 1
    with pytest.raises(AssertionError):
        reads_as_designed(metrics, reads, 1)
