"""The Triton kernels of the decode engine (engine/triton_kernels.py) on CPU tensors, through triton's interpreter,
for tests/test_engine_kernels.py:

    TRITON_INTERPRET=1 python tests/engine_triton_worker.py

The interpreter must be switched on before triton is first imported (its own library functions are decorated then),
so these checks run in a fresh process. Prints one JSON line {check: "ok" or why it failed}. The interpreter holds
bf16 as integers: it truncates where a GPU rounds, and its bf16 dot is wrong (the kernels take float32 operands
there), so bf16 results are compared within the run-time check's tolerance, float32 ones to rounding.
"""

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402
import engine.decode  # noqa: E402
import engine.ops as ops  # noqa: E402
import engine.triton_kernels as triton_kernels  # noqa: E402
from test_engine import EOS, eos_model, left_padded_prompts, run  # noqa: E402

R = ops.TENSOR_REFERENCE


def each_kernel_equals_its_reference(dtype):
    """Norm with and without the residual add, rotary (whole and half heads) with the cache write, attention over a
    shared prefix, own columns after pads and a row reading one column (one split and two), SiLU x up."""
    generator = torch.Generator().manual_seed(0)
    tolerance = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)

    def random(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    x, residual, weight = random(3, 1, 96), random(3, 1, 96, scale=4.0), random(96).abs() + 0.5
    for added, eps in ((None, 1e-6), (x, 1e-6), (x, 0.5)):   # an eps as large as the values: dropping it shows
        mine, theirs = residual.clone(), residual.clone()
        torch.testing.assert_close(triton_kernels.add_rms_norm(added, mine, weight, eps),
                                   R["add_rms_norm"](added, theirs, weight, eps), **tolerance)
        torch.testing.assert_close(mine, theirs, **tolerance)
    rows, heads, kv_heads, head_dim, length = 3, 4, 2, 16, 192
    q, k, v = random(rows, 1, (heads + 2 * kv_heads) * head_dim).split([heads * head_dim, kv_heads * head_dim,
                                                                         kv_heads * head_dim], -1)
    for rotary in (head_dim, head_dim // 2):   # each row at its own position: reading another row's shows
        angles = torch.rand(rows, 1, rotary // 2, generator=generator) * 20
        cos, sin = (torch.cat([f(angles), f(angles)], -1).to(dtype) for f in (torch.cos, torch.sin))
        caches = [random(rows, kv_heads, length, head_dim) for _ in range(2)]
        mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
        slots = torch.tensor([37])
        torch.testing.assert_close(triton_kernels.rotary_cache_write(q, k, v, cos, sin, *mine, slots),
                                   R["rotary_cache_write"](q, k, v, cos, sin, *theirs, slots), **tolerance)
        for got, want in zip(mine, theirs):
            torch.testing.assert_close(got, want, **tolerance)
    keys, values = random(rows, kv_heads, length, head_dim, scale=2.0), random(rows, kv_heads, length, head_dim)
    keys[:, :, :20], values[:, :, :20] = keys[:1, :, :20], values[:1, :, :20]   # a shared prefix of 20 columns
    query = random(rows, heads, 1, head_dim)
    bounds = torch.tensor([20, 51, 130]), torch.tensor([20]), torch.tensor([130])   # the last row: one column
    want = R["decode_attention"](query, keys, values, *bounds, 0.25)
    for splits in (1, 2):
        torch.testing.assert_close(triton_kernels.decode_attention(query, keys, values, *bounds, 0.25, splits=splits),
                                   want, **tolerance)
    gate, up = random(3, 1, 200, scale=3.0), random(3, 1, 200)
    torch.testing.assert_close(triton_kernels.act_mul(gate, up), R["act_mul"](gate, up), **tolerance)


def the_sampler_equals_the_reference(sample):
    """Argmax or inverse CDF over a vocabulary of two blocks, EOS forced on one row, an EOS emitted on another, a
    finished row: the same tokens, done flags, next inputs and positions; log-probs to 1e-5."""
    generator = torch.Generator().manual_seed(1)
    rows, vocab, length = 4, 5000, 16
    logits = torch.randn(rows, vocab, generator=generator) * 4

    def tensors():
        return dict(temperature=torch.tensor(0.7), draws=torch.rand(rows, length, generator=torch.Generator()
                                                                    .manual_seed(2)),
                    step=torch.tensor([5]), stop_at=torch.tensor([5, 2 ** 62, 2 ** 62, 2 ** 62]),
                    eos=torch.tensor([7, int(logits[1].argmax()), -1, -1, -1, -1, -1, -1]), pad=torch.tensor(3),
                    done=torch.tensor([False, False, False, True]), out=torch.zeros(rows, length, dtype=torch.long),
                    logprobs=torch.zeros(rows, length), tokens=torch.zeros(rows, dtype=torch.long),
                    positions=torch.arange(rows))

    mine, theirs = tensors(), tensors()
    triton_kernels.finish_step(logits, **mine, sample=sample)
    R["finish_step"](logits, **theirs, sample=sample)
    for name in ("out", "done", "tokens", "positions"):
        assert torch.equal(mine[name], theirs[name]), f"{name}: {mine[name]} != {theirs[name]}"
    torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], rtol=0, atol=1e-5)
    assert mine["out"][0, 5] == 7 and mine["out"][3, 5] == 3 and bool(mine["done"][0]) and bool(mine["done"][3])


def the_engine_decodes_generates_tokens():
    """The decode engine as a GPU runs it (engine/gpu_paths.py emulating one on the CPU: the kernels chosen as on
    CUDA), every fused op its Triton kernel, the attention split over the columns and combined: the run-time check
    passes (no warning), greedy tokens equal HF generate's and sampled tokens the plain step's, with its log-probs
    (float32)."""
    from engine import gpu_paths

    model = eos_model("qwen2", seed=1, num_hidden_layers=1)
    ids, mask = left_padded_prompts([3, 5])
    engine.decode.KERNELS = None
    splits, attention_splits = [], triton_kernels.attention_splits
    triton_kernels.attention_splits = lambda *args: splits.append(attention_splits(*args)) or splits[-1]
    try:
        with warnings.catch_warnings(), gpu_paths.emulated("cpu"):
            warnings.simplefilter("error")
            greedy = run(model, ids, mask, 1, 4, temperature=0.0)
            sampled = engine.generate(model, ids, mask, torch.arange(2), 4, [EOS], EOS, temperature=1.0, seed=3,
                                      return_logprobs=True)
            assert engine.decode.engine_for(model).kernels.fused == frozenset(ops.OPS)
    finally:
        triton_kernels.attention_splits = attention_splits
    assert splits and set(splits) == {2}, splits   # every decode step: the split kernel, then the combining one
    reference = run(model, ids, mask, 1, 4, temperature=0.0, backend="hf")
    assert all(torch.equal(a, b) for a, b in zip(greedy, reference)), "greedy tokens differ from generate()'s"
    engine.decode.KERNELS = "reference"
    plain = engine.generate(model, ids, mask, torch.arange(2), 4, [EOS], EOS, temperature=1.0, seed=3,
                            return_logprobs=True)
    assert torch.equal(sampled[0], plain[0]), "sampled tokens differ from the plain step's"
    torch.testing.assert_close(sampled[1], plain[1], rtol=0, atol=1e-5)


def a_fault_inside_a_kernel_is_caught():
    """The attention kernel reading the first BLOCK_N columns only (a loop bound wrong): the run-time check at the
    first bucket disables it with one warning, and the tokens are the plain step's."""
    engine.release()
    ops.DISABLED.clear()
    model = eos_model("llama", seed=1, num_hidden_layers=1)
    ids, mask = left_padded_prompts([3, 5])
    attention = triton_kernels.decode_attention

    def first_block_only(q, keys, values, start, shared, slot, scaling, splits=None):
        return attention(q, keys, values, start, shared, slot.clamp(max=triton_kernels.BLOCK_N - 1), scaling, splits)

    triton_kernels.decode_attention = first_block_only
    engine.decode.KERNELS = "fused"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = run(model, ids, mask, 1, 4, temperature=0.0)
    triton_kernels.decode_attention = attention
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1 and "the fused decode_attention differs" in messages[0], messages
    assert all(torch.equal(a, b) for a, b in zip(fused, run(model, ids, mask, 1, 4, temperature=0.0, backend="hf")))


CHECKS = {"each kernel equals its reference (float32)": lambda: each_kernel_equals_its_reference(torch.float32),
          "each kernel equals its reference (bfloat16)": lambda: each_kernel_equals_its_reference(torch.bfloat16),
          "the sampler equals the reference (greedy)": lambda: the_sampler_equals_the_reference(False),
          "the sampler equals the reference (sampled)": lambda: the_sampler_equals_the_reference(True),
          "the engine on Triton kernels decodes generate()'s tokens": the_engine_decodes_generates_tokens,
          "a fault inside a Triton kernel is caught": a_fault_inside_a_kernel_is_caught}


def main():
    if os.environ.get("TRITON_INTERPRET") != "1" or not ops.interpreting():
        sys.exit("run with TRITON_INTERPRET=1 and triton installed")
    torch.set_num_threads(1)
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = traceback.format_exc(limit=4)[-2000:]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
