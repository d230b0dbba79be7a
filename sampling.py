"""Rollout generation: paper Algorithm 1, line 1 ("generate n rollouts per prompt with the current policy").

The P*n rows are generated in chunks of at most `rollout_batch_size` (the memory bound), each seeded on its own, by
Hugging Face `generate` ("hf", the reference) or, for Llama-family models, the fast path in engine/ ("engine", the
default), which falls back to eager decoding, then to "hf", on an error. Only our settings shape the distribution
(never the model's generation_config); each token's log-prob under the sampler comes back for the update's check
against the trainer's (policy.py).
Simplifications: no vLLM / paged attention, no continuous batching across chunks.
"""

import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

import engine
import policy
from engine import hf_generate

BACKENDS = (None, "engine", "hf")
BACKEND_NAMES = {"engine": "the decode engine", "eager": "the decode engine without CUDA graphs",
                 "hf": "Hugging Face generate()"}


class SamplerError(RuntimeError):
    """The fast path failed or samples from another policy, and `--backend engine` allows no fallback."""


@dataclass(frozen=True)
class GenerationSettings:
    """How rollouts are sampled (config.generation_settings builds it from the flags)."""
    max_new_tokens: int = 256
    temperature: float = 1.0              # 0 = greedy
    top_p: float = 1.0
    rollout_batch_size: int = 64          # rows per generation call: the memory bound of generation
    backend: str | None = None            # "engine" (no fallback), "hf", or None: the engine with fallbacks
    generation_copy: bool | None = None   # engine: decode from a merged 16-bit weight copy (None: unless 4-bit)
    cache_tokens: int = 0                 # engine: floor on the KV-cache length (a run's calls share CUDA graphs)
    prefix_sharing: bool = True           # a chunk's common prompt prefix computed once (log-probs equal to rounding)


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
    sampler_logprobs: torch.Tensor | None = None  # FloatTensor[P*n, Tc]: log p under the sampler; 0 after EOS
    backend: str = "hf"             # what generated them: "engine", "eager" or "hf" (BACKEND_NAMES)


def derived_seed(*parts):
    """A seed mixed from integers (run seed, step, chunk, process, ...): distinct parts never share a stream."""
    return int(np.random.SeedSequence([int(part) for part in parts]).generate_state(1, np.uint64)[0] >> 1)


def eos_token_ids(model, tokenizer):
    """All ids that end a completion: the tokenizer's EOS plus the model's generation EOS list (Llama-3: <|eot_id|>)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    if not ids:
        raise ValueError("neither the tokenizer nor the model defines an EOS token id")
    return sorted(ids)


def completion_mask_after_eos(completion_ids, eos_ids):
    """(mask, truncated): mask is 1 up to and including the first EOS of each row (pad may equal EOS), 0 after."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    width = completion_ids.shape[1]
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, width, dtype=torch.long))
    positions = torch.arange(width, device=completion_ids.device)
    mask = (positions[None, :] <= first_eos[:, None]).long()
    return mask, ~has_eos


_WARNED = set()
_FALLBACKS = weakref.WeakKeyDictionary()   # model -> (the backend it fell back to: "eager" or "hf", why)


def resolve_backend(model, backend, cache_len=0):
    """The backend to generate with: None -> "engine" if it can decode the model (or what it fell back to), else
    "hf" with a warning; "engine" where it cannot raises SamplerError."""
    if backend == "hf":
        return "hf"
    reason = engine.unsupported_reason(model, cache_len)
    if reason is not None:
        if backend == "engine":
            raise SamplerError(f"--backend engine: the decode engine cannot run this model ({reason}); leave "
                               "--backend unset to generate with Hugging Face generate()")
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(f"decode engine: {reason}; generating with Hugging Face generate() instead")
        return "hf"
    return "engine" if backend == "engine" else _FALLBACKS.get(model, ("engine",))[0]


def fall_back(model, backend, reason):
    """From now on `model` generates with `backend` ("eager" or "hf") unless a call asks for "engine"; warns."""
    _FALLBACKS[model] = (backend, reason)
    warnings.warn(f"{reason}; generating with {BACKEND_NAMES[backend]} from now on")


def fallback_reason(model):
    """Why `model` no longer generates with the decode engine (`fall_back`), or None."""
    return _FALLBACKS.get(model, (None, None))[1]


def fallback_of(model):
    """(the backend `model` fell back to, why) or None: what a checkpoint keeps, for `fall_back` on resume."""
    return _FALLBACKS.get(model)


def after_engine_error(model, backend, error, requested):
    """The backend to retry a chunk with after `error` inside the engine: "eager" after "engine", then "hf"
    (requested "engine": SamplerError)."""
    what = f"{BACKEND_NAMES[backend]} failed ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]})"
    if requested == "engine":
        raise SamplerError(f"{what}, and --backend engine allows no fallback; leave --backend unset to fall back "
                           "to eager decoding, then Hugging Face generate()") from error
    fall_back(model, "eager" if backend == "engine" else "hf", what)
    return _FALLBACKS[model][0]


def after_gap(model, gap, backend, requested, where, rejected=False):
    """None if `gap` (the sampler's log-probs against the trainer's) trusts `backend`, else fall back to HF and return
    the reason (requested "engine": SamplerError); rejected: the update was not applied. An "hf" gap is not acted on."""
    why = None if backend == "hf" else policy.off_policy(gap, where, rejected)
    if why is None:
        return None
    reason = f"{BACKEND_NAMES[backend]} samples from another policy than the one trained ({why})"
    if requested == "engine":
        raise SamplerError(f"{reason}; --backend engine allows no fallback: leave --backend unset to fall back to "
                           "Hugging Face generate(), or --backend hf")
    fall_back(model, "hf", reason)
    return reason


def after_step(model, result, rounds, requested, where):
    """A step's sampler metrics: "sampler/engine" (1.0: the engine generated every rollout) and "sampler/fallback"
    (the reason, when the step's gap made generation fall back to HF)."""
    backends = {backend for round_ in rounds for backend in round_.backends}
    metrics = {"sampler/engine": float("hf" not in backends)}
    fast = next((backend for backend in sorted(backends) if backend != "hf"), "hf")
    if result.sampler_gap is not None and (fallback := after_gap(model, result.sampler_gap, fast, requested, where,
                                                                 result.sampler_rejected)):
        metrics["sampler/fallback"] = fallback
    return metrics


def check_settings(settings, n=1):
    for name, value in (("n", n), ("max_new_tokens", settings.max_new_tokens),
                        ("rollout_batch_size", settings.rollout_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not settings.temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {settings.temperature!r}")
    if not 0 < settings.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {settings.top_p!r}")
    if settings.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {settings.backend!r}")
    if not isinstance(settings.prefix_sharing, bool):
        raise ValueError(f"prefix_sharing must be True or False, got {settings.prefix_sharing!r}")


def sample_completions(model, prompt_ids, prompt_mask, n, eos_ids, pad_id, settings, seed=0, first_chunk=0):
    """Left-padded prompt ids [P, Tp] -> (completion_ids, completion_mask, truncated, sampler_logprobs, backend) of
    the P*n rows, on the CPU. eos_ids=[]: every completion runs to max_new_tokens (benchmarks). Chunk c of
    rollout_batch_size rows is seeded with derived_seed(seed, first_chunk + c), whatever the caller's RNG: a process
    generating part of a batch (first_chunk > 0) draws what one process generating all of it would."""
    check_settings(settings, n)
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or prompt_ids.shape[0] == 0:
        raise ValueError(f"prompt_ids and prompt_mask must both be [P, Tp] with P > 0, got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    s = settings
    backend = resolve_backend(model, s.backend, prompt_ids.shape[1] - 1 + s.max_new_tokens)
    prompt_index = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
    chunks = []
    with torch.no_grad(), policy.dropout_off(model):
        for chunk_index, start in enumerate(range(0, len(prompt_index), s.rollout_batch_size)):
            rows = prompt_index[start:start + s.rollout_batch_size]
            keep = int(prompt_mask[rows].sum(1).max())  # drop padding columns no row of this chunk needs
            seed_c = derived_seed(seed, first_chunk + chunk_index)
            while True:
                try:
                    chunks.append([t.cpu() for t in _chunk(model, prompt_ids, prompt_mask, rows, keep, backend, s,
                                                           eos_ids, pad_id, seed_c, chunk_index == 0)])
                    break
                except (ValueError, torch.cuda.OutOfMemoryError):
                    raise   # bad arguments; out of memory (the caller names the flags that bound it)
                except Exception as error:
                    if backend == "hf":
                        raise
                    backend = after_engine_error(model, backend, error, s.backend)
    width = max(ids.shape[1] for ids, _ in chunks)
    completion_ids, logprobs = (torch.cat([torch.nn.functional.pad(chunk[i], (0, width - chunk[i].shape[1]),
                                                                   value=pad) for chunk in chunks])
                                for i, pad in ((0, pad_id), (1, 0.0)))
    completion_mask, truncated = completion_mask_after_eos(completion_ids, eos_ids)
    # The engine runs up to check_every steps past the last EOS; generate() stops at it: same width for both.
    width = int(completion_mask.sum(1).max())
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    return (completion_ids.masked_fill(completion_mask == 0, pad_id), completion_mask, truncated,
            logprobs[:, :width].float() * completion_mask, backend)


def _chunk(model, prompt_ids, prompt_mask, rows, keep, backend, s, eos_ids, pad_id, seed, first):
    """One chunk's (completion ids, sampler log-probs) on `backend`; `keep` prompt columns."""
    device = next(model.parameters()).device
    if backend == "hf":
        ids, mask = prompt_ids[rows, -keep:].to(device), prompt_mask[rows, -keep:].to(device)
        return hf_generate.generate_chunk(model, ids, mask, s, eos_ids, pad_id, seed)
    distinct, row_prompt = torch.unique(rows, return_inverse=True)  # each distinct prompt prefilled once
    return engine.generate(  # the prompts from the host: the engine decides their layout there, then sends them
        model, prompt_ids[distinct, -keep:], prompt_mask[distinct, -keep:], row_prompt,
        s.max_new_tokens, eos_ids, pad_id, temperature=s.temperature, top_p=s.top_p, seed=seed,
        max_rows=s.rollout_batch_size, generation_copy=s.generation_copy, refresh_weights=first,
        cache_tokens=s.cache_tokens, capture=False if backend == "eager" else None, return_logprobs=True,
        prefix_sharing=s.prefix_sharing)


def generate_rollouts(model, tokenizer, prompts, n, settings, seed=0, first_chunk=0):
    """n completions for each prompt (rendered text) as Rollouts, seeded as in sample_completions."""
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    check_settings(settings, n)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    # Prompts are fully rendered (chat template included), so no extra BOS is added; tokenized once.
    encoded = tokenizer(list(prompts), padding=True, padding_side="left", add_special_tokens=False,
                        return_tensors="pt")
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    if (prompt_mask.sum(1) == 0).any():
        raise ValueError("a prompt tokenizes to zero tokens")
    completion_ids, completion_mask, truncated, logprobs, backend = sample_completions(
        model, prompt_ids, prompt_mask, n, eos_ids, pad_id, settings, seed, first_chunk)
    lengths = completion_mask.sum(1)
    texts = tokenizer.batch_decode([row[:length].tolist() for row, length in zip(completion_ids, lengths)],
                                   skip_special_tokens=True)
    return Rollouts(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                    completion_mask=completion_mask, texts=texts, lengths=lengths, truncated=truncated,
                    prompt_index=torch.arange(len(prompts)).repeat_interleave(n), sampler_logprobs=logprobs,
                    backend=backend)
