"""Rollout generation: paper Algorithm 1, line 1 ("generate n rollouts per prompt with the current policy").

PODS (Xu et al., "Not All Rollouts are Useful", §3) generates many rollouts (n) per prompt because
inference is embarrassingly parallel, then trains on a subset (m). This module is the inference half:
the P*n rows in chunks of at most `rollout_batch_size` sequences (the memory bound of one generation call),
each chunk seeded on its own, with the completion mask cut after the first EOS.

Two backends: "engine" (default; engine.py: prefill once per distinct prompt, a bucketed static KV cache,
one decode step recorded as a CUDA graph per bucket, finished rows dropped) for Llama-family models, and "hf", plain
Hugging Face `generate` (the reference; every other architecture falls back to it with a warning).
Only our flags shape the distribution on both: the model's own generation_config is never consulted.
Simplifications: no vLLM/paged attention, no continuous batching across chunks.
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig

import engine

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
BACKENDS = (None, "engine", "hf")


@dataclass
class Rollouts:
    """P prompts x n rollouts. Row i*n + j of every per-rollout field is rollout j of prompt i."""
    prompt_ids: torch.Tensor        # LongTensor[P, Tp], left padded
    prompt_mask: torch.Tensor       # LongTensor[P, Tp]
    completion_ids: torch.Tensor    # LongTensor[P*n, Tc], pad id after the completion
    completion_mask: torch.Tensor   # LongTensor[P*n, Tc], 1 up to and including the first EOS
    texts: list                     # list[str] of P*n decoded completions (special tokens skipped)
    lengths: torch.Tensor           # LongTensor[P*n], completion_mask.sum(1)
    truncated: torch.Tensor         # BoolTensor[P*n], no EOS within max_new_tokens
    prompt_index: torch.Tensor      # LongTensor[P*n], i for row i*n + j


def chunk_seed(seed, chunk_index):
    """Seed of one generation chunk, mixed from (step seed, chunk index) so chunks never share a stream."""
    return int(np.random.SeedSequence([int(seed), int(chunk_index)]).generate_state(1, np.uint64)[0] >> 1)


def eos_token_ids(model, tokenizer):
    """All ids that end a completion: the tokenizer's EOS plus the model's generation EOS list
    (Llama-3 instruct stops on <|eot_id|> as well as <|end_of_text|>)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    if not ids:
        raise ValueError("neither the tokenizer nor the model defines an EOS token id")
    return sorted(ids)


def completion_mask_after_eos(completion_ids, eos_ids):
    """(mask, truncated): mask is 1 up to and including the first EOS of each row, 0 after.

    Pad may equal EOS, so 'first EOS' is the only reliable end marker."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    width = completion_ids.shape[1]
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, width, dtype=torch.long))
    positions = torch.arange(width, device=completion_ids.device)
    mask = (positions[None, :] <= first_eos[:, None]).long()
    return mask, ~has_eos


def resolve_cache_implementation(model, cache_implementation):
    """HF backend's KV cache. None -> 'static' on CUDA (transformers then compiles the decode step) unless the
    weights are bitsandbytes-quantized (not compilable, and a static cache without compile is no faster), else
    'dynamic'."""
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
    if cache_implementation is not None:
        return cache_implementation
    device = next(model.parameters()).device
    quantized = getattr(model.config, "quantization_config", None) is not None
    return "static" if device.type == "cuda" and not quantized else "dynamic"


_WARNED = set()


def resolve_backend(model, backend, cache_implementation=None, cache_len=0):
    """None -> 'hf' if an HF cache_implementation is named (the reference path, as benchmarks ask for it), else
    'engine'. A model the engine cannot decode goes to 'hf' with a one-line warning (once per reason)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    resolve_cache_implementation(model, cache_implementation)  # fail on a bad value early
    if backend == "hf" or (backend is None and cache_implementation is not None):
        return "hf"
    reason = engine.unsupported_reason(model, cache_len)
    if reason is not None:
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(f"decode engine: {reason}; generating with Hugging Face generate() instead")
        return "hf"
    return "engine"


def _check_args(n, max_new_tokens, temperature, top_p, rollout_batch_size):
    for name, value in (("n", n), ("max_new_tokens", max_new_tokens), ("rollout_batch_size", rollout_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def generation_config_for(max_new_tokens, temperature, top_p, eos_ids, pad_id, cache_implementation,
                          max_cache_len=None, ignore_eos=False):
    """The GenerationConfig every HF-backend generation runs under (bench_gpu.py reuses it for its logit checks):
    our flags, neutral values spelled out (top_k=0 = off, not the library's 50). Run it inside
    `neutral_generation_config`, so nothing of the model's own generation_config is merged in."""
    sampling = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0) \
        if temperature > 0 else dict(do_sample=False)
    # eos_token_id=[] (not None, which would be filled in) is how ignore_eos disables stopping.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, use_cache=True, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        eos_token_id=[] if ignore_eos else list(eos_ids), pad_token_id=pad_id,
        cache_implementation=cache_implementation,
        # One cache length ceiling for every chunk: the compiled decode step keeps its shapes (no recompiles).
        max_cache_len=max_cache_len if cache_implementation == "static" else None, **sampling)


@contextmanager
def neutral_generation_config(model):
    """generate() fills every field our config leaves unset (e.g. min_p) from the model's generation_config and,
    on transformers 4.50-4.57, even overrides fields equal to the library default (Qwen2.5-Instruct: top_k=20,
    repetition_penalty=1.05, ...): the rollouts would come from another policy than the one the loss scores.
    For the call, the model's generation_config is a blank one."""
    hf = engine.hf_model(model)
    saved = hf.generation_config
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


def shared_prefill_cache(model, ids, mask, rows):
    """HF backend: KV cache of every row's prompt but its last token, computed once per *distinct* prompt and
    copied to that prompt's rows (rows[i] = prompt of chunk row i).

    generate() would prefill each of the n copies of a prompt separately: n times the prompt's compute.
    On a CPU that prefill dominates (SmolLM2 demo: 31 s of a 40 s generate call at n = 16). generate()
    then processes only the last prompt token and samples as usual; positions follow the attention mask
    exactly as generate() derives them, so the rollouts equal the unshared ones up to float rounding."""
    from transformers import DynamicCache

    distinct, row_to_distinct = torch.unique(rows, return_inverse=True)
    first_row = torch.zeros(len(distinct), dtype=torch.long).scatter_reduce(
        0, row_to_distinct, torch.arange(len(rows)), reduce="amin", include_self=False)
    prefix_ids, prefix_mask = ids[first_row, :-1], mask[first_row, :-1]
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix_ids, attention_mask=prefix_mask, past_key_values=cache, use_cache=True,
          position_ids=(prefix_mask.long().cumsum(-1) - 1).clamp(min=0), logits_to_keep=1)
    cache.batch_select_indices(row_to_distinct.to(ids.device))
    return cache


def _hf_chunk(model, ids, mask, rows, seed, configs, share_prefill, device):
    """One chunk through HF generate: (completion ids [R, <= max_new_tokens])."""
    config, shared = configs["plain"], {}
    if share_prefill and configs["cache"] == "dynamic" and ids.shape[1] > 1:
        # generate() refuses a cache object next to a cache_implementation; ours *is* dynamic.
        config, shared = configs["shared"], {"past_key_values": shared_prefill_cache(model, ids, mask, rows)}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), neutral_generation_config(model):
        torch.manual_seed(seed)
        output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **shared)
    return output[:, ids.shape[1]:]


def sample_completions(model, prompt_ids, prompt_mask, n, max_new_tokens, eos_ids, pad_id, temperature=1.0,
                       top_p=1.0, rollout_batch_size=64, seed=0, cache_implementation=None, ignore_eos=False,
                       share_prefill=True, backend=None, forced_lengths=None, generation_copy=None, cache_tokens=0,
                       first_chunk=0):
    """Tensor core of generate_rollouts: left-padded prompt ids [P, Tp] -> (completion_ids, completion_mask,
    truncated) for the P*n rows (row i*n + j = rollout j of prompt i), on the CPU.

    Chunk c (rows c*B .. c*B+B-1, B = rollout_batch_size) is sampled with seed chunk_seed(seed, c), so the caller's
    RNG is untouched and a chunk's rollouts depend only on (seed, c, its own prompts): same seed + same B -> same
    rollouts. temperature=0 is greedy. Each distinct prompt is prefilled once (share_prefill=False: once per row,
    a reference for tests and benchmarks; HF backend: dynamic cache only). backend: see resolve_backend;
    cache_implementation picks the HF backend's cache. ignore_eos=True (benchmarks) generates exactly
    max_new_tokens per row and treats EOS as an ordinary token: masks are all ones and every row counts as
    truncated. forced_lengths [P*n] (engine, benchmarks): row r ends with EOS after exactly forced_lengths[r]
    tokens (if it has not ended before). generation_copy: engine.engine_for (LoRA / 4-bit weight copy).
    first_chunk: the index of the first chunk (seed chunk_seed(seed, first_chunk + c)): a process generating
    rows k*B.. of a larger batch draws what one process generating all of it draws (distributed.first_chunk)."""
    _check_args(n, max_new_tokens, temperature, top_p, rollout_batch_size)
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or prompt_ids.shape[0] == 0:
        raise ValueError(f"prompt_ids and prompt_mask must both be [P, Tp] with P > 0, got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    backend = resolve_backend(model, backend, cache_implementation, prompt_ids.shape[1] - 1 + max_new_tokens)
    if forced_lengths is not None and (backend != "engine" or ignore_eos or len(forced_lengths) != len(prompt_ids) * n):
        raise ValueError("forced_lengths needs the engine backend, EOS (no ignore_eos) and one length per row")
    cache = resolve_cache_implementation(model, cache_implementation)
    device = next(model.parameters()).device
    prompt_index = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
    configs = dict(cache=cache, plain=generation_config_for(
        max_new_tokens, temperature, top_p, eos_ids, pad_id, cache, prompt_ids.shape[1] + max_new_tokens, ignore_eos),
        shared=generation_config_for(max_new_tokens, temperature, top_p, eos_ids, pad_id, None, ignore_eos=ignore_eos))
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off while sampling; every module's own flag is restored below
    chunks = []
    try:
        with torch.no_grad():
            for chunk_index, start in enumerate(range(0, len(prompt_index), rollout_batch_size)):
                rows = prompt_index[start:start + rollout_batch_size]
                keep = int(prompt_mask[rows].sum(1).max())  # drop padding columns no row of this chunk needs
                if backend == "hf":
                    chunks.append(_hf_chunk(model, prompt_ids[rows, -keep:].to(device), prompt_mask[rows, -keep:].to(
                        device), rows, chunk_seed(seed, first_chunk + chunk_index), configs, share_prefill, device).cpu())
                    continue
                distinct, row_prompt = torch.unique(rows, return_inverse=True) if share_prefill else \
                    (rows, torch.arange(len(rows)))
                chunks.append(engine.generate(
                    model, prompt_ids[distinct, -keep:].to(device), prompt_mask[distinct, -keep:].to(device),
                    row_prompt, max_new_tokens, [] if ignore_eos else eos_ids,
                    pad_id, temperature=temperature, top_p=top_p, seed=chunk_seed(seed, first_chunk + chunk_index),
                    max_rows=rollout_batch_size, generation_copy=generation_copy, refresh_weights=chunk_index == 0,
                    cache_tokens=cache_tokens,
                    forced_lengths=None if forced_lengths is None else forced_lengths[start:start + len(rows)]).cpu())
    finally:
        for module, training in modes:
            module.training = training

    width = max(chunk.shape[1] for chunk in chunks)
    completion_ids = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])
    if ignore_eos:
        completion_mask = torch.ones_like(completion_ids)
        truncated = torch.ones(len(completion_ids), dtype=torch.bool)
    else:
        completion_mask, truncated = completion_mask_after_eos(completion_ids, eos_ids)
        # The engine runs up to check_every steps past the last EOS; generate() stops at it: same width for both.
        width = int(completion_mask.sum(1).max())
        completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    return completion_ids.masked_fill(completion_mask == 0, pad_id), completion_mask, truncated


def generate_rollouts(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, top_p=1.0,
                      rollout_batch_size=64, seed=0, cache_implementation=None, ignore_eos=False, share_prefill=True,
                      backend=None, generation_copy=None, cache_tokens=0, first_chunk=0):
    """Sample n completions for each prompt (rendered text) -> Rollouts. Seeding, chunking, ignore_eos and the
    backend as in sample_completions; cache_tokens: engine.generate's floor on the KV-cache length (a run passes
    max prompt + completion tokens, so its every call shares one set of recorded graphs); first_chunk: see
    sample_completions."""
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    _check_args(n, max_new_tokens, temperature, top_p, rollout_batch_size)
    resolve_backend(model, backend, cache_implementation)  # fail on a bad value before tokenizing
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    # Prompts are fully rendered (chat template included), so no extra BOS is added; tokenized once.
    encoded = tokenizer(list(prompts), padding=True, padding_side="left", add_special_tokens=False,
                        return_tensors="pt")
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    if (prompt_mask.sum(1) == 0).any():
        raise ValueError("a prompt tokenizes to zero tokens")
    completion_ids, completion_mask, truncated = sample_completions(
        model, prompt_ids, prompt_mask, n, max_new_tokens, eos_ids, pad_id, temperature=temperature, top_p=top_p,
        rollout_batch_size=rollout_batch_size, seed=seed, cache_implementation=cache_implementation,
        ignore_eos=ignore_eos, share_prefill=share_prefill, backend=backend, generation_copy=generation_copy,
        cache_tokens=cache_tokens, first_chunk=first_chunk)
    lengths = completion_mask.sum(1)
    texts = tokenizer.batch_decode([row[:length].tolist() for row, length in zip(completion_ids, lengths)],
                                   skip_special_tokens=True)
    return Rollouts(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                    completion_mask=completion_mask, texts=texts, lengths=lengths, truncated=truncated,
                    prompt_index=torch.arange(len(prompts)).repeat_interleave(n))
