"""Hugging Face `generate`: the reference backend of sampling.py (paper Algorithm 1, line 1), which every model the
decode engine cannot run, and every fallback from it, generates with.

Only our settings shape the distribution: the model's own generation_config is never consulted
(`neutral_generation_config`); temperature and top-p are generate()'s own warpers, with the sampler's log-prob of each
token read between them (`SamplerLogprobs`), which the update compares with its own (policy.py's sampler check). The
prefix every row starts with runs once, its KV cache repeated to every row (`shared_prefix_cache`).
"""

import inspect
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

import policy
from engine import prefix


def generation_config_for(max_new_tokens, temperature, top_p, eos_ids, pad_id):
    """The GenerationConfig of the HF backend: our settings, neutral values spelled out (top_k=0 = off, not the
    library's 50). Run it inside `neutral_generation_config`, so nothing of the model's own config is merged in.
    Temperature and top-p are not in it but in `logits_processors` (the same warpers, in generate's order), so
    the sampler's log-probs can be read between the two."""
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if temperature > 0 else dict(do_sample=False)
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, use_cache=True, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, eos_token_id=list(eos_ids),
        pad_token_id=pad_id, **sampling)


class SamplerLogprobs(LogitsProcessor):
    """At each step of generate(), the log-prob of the token chosen at the previous step under the distribution
    kept from that step (the temperature-scaled scores, before top-p): one [rows, vocab] tensor is held, never
    [steps, rows, vocab]. `logprobs(completion_ids)` adds the last token's after the call."""

    def __init__(self):
        self.kept, self.columns = None, []

    def __call__(self, input_ids, scores):
        if self.kept is not None:
            self.columns.append(self.kept.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.kept = scores.float().log_softmax(-1)
        return scores

    def logprobs(self, completion_ids):
        if self.kept is not None and len(self.columns) < completion_ids.shape[1]:
            self.columns.append(self.kept.gather(-1, completion_ids[:, -1:]).squeeze(-1))
        self.kept = None
        return torch.stack(self.columns, 1) if self.columns else torch.zeros(completion_ids.shape)


def logits_processors(temperature, top_p, recorder):
    """generate()'s temperature and top-p warpers (what it would build from the config), `recorder` between."""
    if temperature == 0:
        return [recorder]
    return [TemperatureLogitsWarper(float(temperature)), recorder] + ([TopPLogitsWarper(float(top_p))] if top_p < 1
                                                                       else [])


@contextmanager
def neutral_generation_config(model):
    """generate() fills every field our config leaves unset (e.g. min_p) from the model's generation_config and,
    on transformers 4.50-4.57, even overrides fields equal to the library default (Qwen2.5-Instruct: top_k=20,
    repetition_penalty=1.05, ...): the rollouts would come from another policy than the one the loss scores.
    For the call, the model's generation_config is a blank one."""
    hf = policy.hf_model(model)
    saved = hf.generation_config
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


def shared_prefix_cache(model, ids, mask):
    """(ids, mask, cache) for generate() with the prefix every row starts with computed once: the rows re-laid out
    as [prefix][suffix, left padded] (prefix.shared_prefix_layout) and the prefix's KV cache, run as one row and
    repeated to every row; generate() then runs only the suffixes (it takes position ids from the mask, so the pads
    between prefix and suffix shift nothing). cache None (ids, mask unchanged): no prefix, or a model whose cache
    cannot be repeated over rows."""
    new_ids, new_mask, shared = prefix.shared_prefix_layout(ids, mask)
    if shared == 0:
        return ids, mask, None
    parameters = inspect.signature(policy.hf_model(model).forward).parameters
    name = prefix.cache_argument(model)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}   # no [prefix, vocab] logits
    output = model(input_ids=new_ids[:1, :shared], attention_mask=new_mask[:1, :shared], use_cache=True, **keep)
    cache = getattr(output, "cache", None)
    cache = getattr(output, "past_key_values", None) if cache is None else cache
    if cache is None or not hasattr(cache, "batch_repeat_interleave") or cache.get_seq_length() != shared:
        return ids, mask, None
    cache.batch_repeat_interleave(len(ids))
    return new_ids, new_mask, {name: cache}


def generate_chunk(model, ids, mask, settings, eos_ids, pad_id, seed):
    """One chunk of left-padded prompt rows ids / mask [R, W] through Hugging Face generate, seeded with `seed`:
    (completion ids [R, <= max_new_tokens], their sampler log-probs). settings: sampling.GenerationSettings;
    with prefix_sharing the rows' common prefix is computed once (shared_prefix_cache)."""
    config = generation_config_for(settings.max_new_tokens, settings.temperature, settings.top_p, eos_ids, pad_id)
    device, recorder, cache = ids.device, SamplerLogprobs(), {}
    if settings.prefix_sharing:
        ids, mask, cache = shared_prefix_cache(model, ids, mask)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), neutral_generation_config(model):
        torch.manual_seed(seed)
        output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                logits_processor=logits_processors(settings.temperature, settings.top_p, recorder),
                                **(cache or {}))
    completions = output[:, ids.shape[1]:]
    return completions, recorder.logprobs(completions)
