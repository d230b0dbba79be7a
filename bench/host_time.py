"""The host's time of the update and of a decode step (paper §1: the update at the GPU's pace, not the host's),
taken beside the kernel census (`python -m bench census --host-repeats N`): at the narrowest widths on one thread no
operation computes for long, so what is left is the Python, dispatcher and autograd work a GPU would wait for.
Simplification: a GPU's fused attention and foreach AdamW stand in for the CPU's (`host_timing`), as their host sees
them; the figure is wall time, so it is taken on a quiet machine and its load average recorded.
"""

import contextlib

import torch

from bench.narrow import Narrow, narrow_policy, random_batch, sampler_check

# The widths at which the host's time is taken: small enough that no operation computes for long, so what is left
# is the Python, dispatcher and autograd work a GPU would wait for (the same operations as the counted run's).
HOST_NARROW = Narrow(half_head_dim=2, rank=4, intermediate=8, prefix=3, completion=4)
HOST_ROWS = 2


class _AttentionStandIn(torch.autograd.Function):
    """A GPU's fused attention as its host sees it: one operation forward, one backward. (Torch's CPU flash attention
    takes ~9 ms a call even at HOST_NARROW, which no GPU would: the host's time would be the CPU's arithmetic.)
    Zeros: the host's time does not depend on values."""

    @staticmethod
    def forward(ctx, query, key, value):
        ctx.save_for_backward(key, value)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    @staticmethod
    def backward(ctx, grad):
        key, value = ctx.saved_tensors
        return (grad.new_zeros(grad.shape[0], grad.shape[2], grad.shape[1], grad.shape[3]), torch.zeros_like(key),
                torch.zeros_like(value))


def _attention_stand_in(module, query, key, value, attention_mask, **kwargs):
    return _AttentionStandIn.apply(query, key, value), None


@contextlib.contextmanager
def host_timing():
    """For the block, what a GPU's host runs where a CPU's would differ: torch's multi-tensor (foreach) kernels on the
    CPU too (AdamW, clipping: a few operations over every tensor, as on CUDA), one thread."""
    import torch.utils._foreach_utils as foreach_utils

    supported, threads = foreach_utils._get_foreach_kernels_supported_devices, torch.get_num_threads()
    foreach_utils._get_foreach_kernels_supported_devices = lambda: [*supported(), "cpu"]
    torch.set_num_threads(1)
    try:
        yield
    finally:
        foreach_utils._get_foreach_kernels_supported_devices = supported
        torch.set_num_threads(threads)


def host_times(args, layers, plan, repeats=5, compile_backend=None):
    """{update_host_s, decode_host_ms_per_step, load_average}: the wall time of one update of `args`' preset (its
    layers, micro-batch, LoRA, checkpointing; the GPU paths taken on the CPU, `plan` = (layers, MLPs) replayed) and
    of one eager decode step, at HOST_NARROW widths on one thread (`host_timing`), the median of `repeats`
    interleaved runs after a warm-up; the load average over them (a busy machine's figure is not the host's).
    compile_backend: each decoder layer compiled by torch.compile with it (regional compilation, forward and
    backward; the warm-up compiles), for the host's time of a compiled update beside the eager one."""
    import os
    import statistics
    import time

    from transformers import AttentionInterface

    from run import config
    import engine
    import policy
    import update
    from engine import gpu_paths

    gap_limit = sampler_check().LOGPROB_GAP_LIMIT
    AttentionInterface.register("pods_host_stand_in", _attention_stand_in)
    generator = torch.Generator().manual_seed(0)
    settings = config.update_settings(args)
    with host_timing():
        model = narrow_policy(args, layers, HOST_NARROW).train()
        policy.hf_model(model).set_attn_implementation("pods_host_stand_in")
        if compile_backend:
            from torch import _dynamo

            _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 2 * layers)
            for layer in policy.hf_model(model).model.layers:
                layer.compile(backend=compile_backend, dynamic=False)
        optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)

        def update_seconds():
            batch = random_batch(model, HOST_NARROW, HOST_ROWS, settings.temperature, generator)
            start = time.perf_counter()
            with gpu_paths.emulated("cpu"):   # the update's GPU paths: bf16 LoRA product, replay plan, kernels
                update.fill_logprobs(model, [batch], settings)
                update.update_policy(model, optimizer, [batch], settings,
                                     max_sampler_gap=gap_limit)
            return time.perf_counter() - start

        def decode_seconds_per_step(steps=16):
            """A generation of 1 + steps tokens less one of 1 token, per step: the CPU's eager step (its plain
            operations, ~5x the fused step's a layer; on a GPU the engine replays each step as a CUDA graph)."""
            prompt = torch.randint(3, HOST_NARROW.vocab, (1, HOST_NARROW.prefix + 1), generator=generator)
            times = []
            for tokens in (1, 1 + steps):
                start = time.perf_counter()
                with torch.no_grad(), policy.dropout_off(model):
                    engine.generate(model, prompt, torch.ones_like(prompt), torch.zeros(HOST_ROWS, dtype=torch.long),
                                    tokens, [], 2, temperature=args.temperature, top_p=args.top_p, capture=False,
                                    compile_backend=False, check_every=steps + 1)
                times.append(time.perf_counter() - start)
            return (times[1] - times[0]) / steps

        planted = update.checkpoint_plan
        update.checkpoint_plan = lambda *unused: plan
        try:
            update_seconds(), decode_seconds_per_step()   # warm-up: the optimizer's state, the engine, the allocator
            loads, updates, steps = [os.getloadavg()[0]], [], []
            for _ in range(repeats):
                updates.append(update_seconds())
                steps.append(decode_seconds_per_step())
            loads.append(os.getloadavg()[0])
        finally:
            update.checkpoint_plan = planted
            engine.release(model)
    if compile_backend:
        _dynamo.reset()
    return dict(update_host_s=round(statistics.median(updates), 3),
                decode_host_ms_per_step=round(1e3 * statistics.median(steps), 3),
                load_average=[round(load, 2) for load in loads], repeats=repeats)
