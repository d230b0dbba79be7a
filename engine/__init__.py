"""Decode engine: the fast path of rollout generation (paper Algorithm 1, line 1) for Llama-family models; beside it
in this package, the other generation backend and the fast paths the update shares (the last paragraph).

PODS (§1, §3) rests on inference being cheap next to the update; HF `generate` is not (small kernel launches
per token, a recompile per prompt width, an unmerged LoRA adapter on every projection). So this package decodes
by hand over the model's own modules, with one idea: every shape comes from a few buckets, so a decode step is
one fixed-shape function, recorded as a CUDA graph (optionally compiled first) once per bucket and process, and
replayed per token.

- Prefill: each distinct prompt (all but its last token) runs once; its K/V is copied to its n rows. The prefix
  every distinct prompt of the chunk starts with (found from the ids: prefix.shared_prefix_layout) runs once for all.
- Decode: a preallocated cache [rows, kv_heads, cache_len, head_dim] per layer (cache_len = prompt width - 1 +
  max_new_tokens, or the caller's cache_tokens if larger, rounded up to CACHE_BUCKET_TOKENS; rows = the next of
  `row_buckets`). A step embeds the last tokens, writes their K/V, attends over the columns each row may read (the
  shared prefix, then its own from its first real token to the newest; no mask tensor on a GPU), samples (inverse
  CDF with one uniform per row hashed from (seed, row, step): no RNG state to capture, and a row's tokens do not
  depend on its batch) and records the token, in place. Every `check_every` steps the host checks the rows left;
  when they fit a smaller bucket they are gathered into it, so a chunk costs about the sum of its rows' lengths,
  not rows x the longest.
- The step's kernels (ops.py): on CUDA (triton importable) the residual add + RMSNorm, rotary + cache write, the
  attention, SiLU x up and the sampler's whole step are one Triton kernel each (triton_kernels.py), 9 operations a
  decoder layer instead of 44; each is compared with its plain PyTorch reference on every bucket's shapes before the
  bucket runs, and one that disagrees or fails runs its reference from then on (one warning line). The CPU runs
  the reference. Model families: decode.FAMILIES (docs/generation.md's table); others go through HF generate.
- Weights: LoRA is merged into a separate copy of the adapted projections, q|k|v and gate|up stacked (one GEMM
  each), refreshed at every call (Qwen2.5-3B: 2.77 B params, 5.5 GB in bf16). The training weights are never
  touched (peft's in-place merge_adapter() / unmerge_adapter() would leave a bf16 rounding error in the frozen
  base weights at every step). 4-bit models: the copy (dequantized + merged, bf16: the same 5.5 GB next to ~1.4 GB
  of 4-bit projections) is opt-in with generation_copy=True; without it the bitsandbytes modules run eagerly.
- FSDP2 (torchrun, multigpu/): the gathered full weights are freed and re-allocated around every unshard, so
  a graph recorded over them would read stale addresses: a sharded model decodes eagerly (capture=None, the
  default, decides), one kernel launch per op and token (on GPU several times slower per token than a replayed
  graph; the cost of the multi-GPU path until weights get a fixed home).
- Eager decoding with the plain PyTorch step (the CPU): attention reads only the cache columns written so far, and
  the prefix every prompt of the chunk shares once for all rows (step.attend_shared); the fused kernel does both
  in a recorded graph too (it reads the row's bounds from the device).
Simplifications: batch-synchronous (no continuous batching, no paged attention); the prefix's K/V are still stored
in every row; the top-p nucleus samples with the reference (a sort); other architectures go through Hugging Face
generate (sampling.py).

Files: decode.py (the supported families, the loop, buckets), graphs.py (CUDA-graph recording, compilation), step.py
(one decode step in plain PyTorch, the prefill, token choice, and the merged LoRA copies it multiplies), ops.py (the
fused operations and their run-time check), triton_kernels.py (their Triton kernels). sampling.py calls `generate`;
benchmarks also use `forced_lengths` (synthetic EOS positions).
Beside the engine: hf_generate.py (Hugging Face generate, sampling.py's reference backend and the engine's fallback),
prefix.py (each distinct prompt token computed once, in generation and in the update), kernels.py (the update's fused
kernels and checkpoint plan on CUDA), lora_bf16.py (a bf16 base's LoRA adapter computed in bf16). The sampler's
log-probs are checked against the update's every step by policy.py's sampler check.
"""

from engine.decode import (CHECK_EVERY, STATS, DecodeStats, engine_for, generate, release,  # noqa: F401
                           row_buckets, unsupported_reason)
from engine.graphs import fsdp_sharded  # noqa: F401
