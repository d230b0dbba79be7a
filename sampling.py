"""Rollout generation: paper Algorithm 1, line 1 ("generate n rollouts per prompt with the current policy").

PODS (Xu et al., "Not All Rollouts are Useful", §3) generates many rollouts (n) per prompt because
inference is embarrassingly parallel, then trains on a subset (m). This module is the inference half:
batched Hugging Face `generate` over the P*n rows, in chunks of at most `rollout_batch_size` sequences
(the memory bound of one generation call), with the completion mask cut after the first EOS.

Speed: on CUDA the default is a static KV cache, which makes transformers compile the decode step
(`torch.compile(mode="reduce-overhead")`, i.e. CUDA graphs); elsewhere the plain dynamic cache.
Simplifications: no vLLM/paged attention, no continuous batching (a chunk runs until its longest row ends).
"""

from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


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
    """None -> 'static' on CUDA (transformers then compiles the decode step) unless the weights are
    bitsandbytes-quantized (not compilable, and a static cache without compile is no faster), else 'dynamic'."""
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
    if cache_implementation is not None:
        return cache_implementation
    device = next(model.parameters()).device
    quantized = getattr(model.config, "quantization_config", None) is not None
    return "static" if device.type == "cuda" and not quantized else "dynamic"


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
    """The GenerationConfig every generation here runs under (bench_gpu.py reuses it for its logit checks)."""
    sampling = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0) \
        if temperature > 0 else dict(do_sample=False)
    # generate() fills every unset (None) field from model.generation_config, and instruct checkpoints ship
    # top_k / repetition_penalty / EOS defaults (Qwen2.5: top_k=20, repetition_penalty=1.05) that would
    # silently change the sampling distribution; so the neutral values are spelled out (top_k=0 = off).
    # eos_token_id=[] (not None, which would be filled in) is how ignore_eos disables stopping.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, use_cache=True, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        eos_token_id=[] if ignore_eos else list(eos_ids), pad_token_id=pad_id,
        cache_implementation=cache_implementation,
        # One cache length ceiling for every chunk: the compiled decode step keeps its shapes (no recompiles).
        max_cache_len=max_cache_len if cache_implementation == "static" else None, **sampling)


def shared_prefill_cache(model, ids, mask, rows):
    """KV cache of every row's prompt but its last token, computed once per *distinct* prompt and copied
    to that prompt's rows (rows[i] = prompt of chunk row i).

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


def sample_completions(model, prompt_ids, prompt_mask, n, max_new_tokens, eos_ids, pad_id, temperature=1.0,
                       top_p=1.0, rollout_batch_size=64, seed=0, cache_implementation=None, ignore_eos=False,
                       share_prefill=True):
    """Tensor core of generate_rollouts: left-padded prompt ids [P, Tp] -> (completion_ids, completion_mask,
    truncated) for the P*n rows (row i*n + j = rollout j of prompt i), on the CPU.

    Chunk c (rows c*B .. c*B+B-1, B = rollout_batch_size) is sampled under torch.manual_seed(chunk_seed(seed, c))
    inside a forked RNG, so the caller's RNG is untouched and a chunk's rollouts depend only on (seed, c, its
    own prompts): same seed + same B -> same rollouts. temperature=0 is greedy. With the dynamic cache each
    distinct prompt is prefilled once (shared_prefill_cache; share_prefill=False turns that off, as a
    reference for tests and benchmarks). ignore_eos=True (benchmarks)
    generates exactly max_new_tokens per row and treats EOS as an ordinary token: masks are all ones and
    every row counts as truncated."""
    _check_args(n, max_new_tokens, temperature, top_p, rollout_batch_size)
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or prompt_ids.shape[0] == 0:
        raise ValueError(f"prompt_ids and prompt_mask must both be [P, Tp] with P > 0, got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    cache_implementation = resolve_cache_implementation(model, cache_implementation)
    device = next(model.parameters()).device
    prompt_index = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
    generation_config = generation_config_for(max_new_tokens, temperature, top_p, eos_ids, pad_id,
                                              cache_implementation, prompt_ids.shape[1] + max_new_tokens, ignore_eos)
    shared_config = generation_config_for(max_new_tokens, temperature, top_p, eos_ids, pad_id, None,
                                          ignore_eos=ignore_eos)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off while sampling; every module's own flag is restored below
    chunks = []
    try:
        with torch.no_grad():
            for chunk_index, start in enumerate(range(0, len(prompt_index), rollout_batch_size)):
                rows = prompt_index[start:start + rollout_batch_size]
                ids, mask = prompt_ids[rows], prompt_mask[rows]
                keep = int(mask.sum(1).max())  # drop padding columns no row of this chunk needs
                ids, mask = ids[:, -keep:].to(device), mask[:, -keep:].to(device)
                config, shared = generation_config, {}
                if share_prefill and cache_implementation == "dynamic" and keep > 1:
                    # generate() refuses a cache object next to a cache_implementation; ours *is* dynamic.
                    config, shared = shared_config, {"past_key_values": shared_prefill_cache(model, ids, mask, rows)}
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(chunk_seed(seed, chunk_index))
                    output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **shared)
                chunks.append(output[:, keep:].cpu())
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
    return completion_ids.masked_fill(completion_mask == 0, pad_id), completion_mask, truncated


def generate_rollouts(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, top_p=1.0,
                      rollout_batch_size=64, seed=0, cache_implementation=None, ignore_eos=False, share_prefill=True):
    """Sample n completions for each prompt (rendered text) -> Rollouts. Seeding, chunking and ignore_eos
    as in sample_completions."""
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    _check_args(n, max_new_tokens, temperature, top_p, rollout_batch_size)
    resolve_cache_implementation(model, cache_implementation)  # fail on a bad value before tokenizing
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
        ignore_eos=ignore_eos, share_prefill=share_prefill)
    lengths = completion_mask.sum(1)
    texts = tokenizer.batch_decode([row[:length].tolist() for row, length in zip(completion_ids, lengths)],
                                   skip_special_tokens=True)
    return Rollouts(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                    completion_mask=completion_mask, texts=texts, lengths=lengths, truncated=truncated,
                    prompt_index=torch.arange(len(prompts)).repeat_interleave(n))
