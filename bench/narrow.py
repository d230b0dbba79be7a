"""A preset's policy at narrow widths, as the census counts it and the host's time is taken on it (bench/census.py,
bench/host_time.py): every dimension that the census maps back to the real model's (`Narrow`) made small and
distinct, the rest (layers, heads, LoRA targets, precision, checkpointing) as train.py builds it from the preset.
"""

import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Narrow:
    """The narrow width of each real dimension the census maps back. Each must differ from every other and from the
    small counts that stay real (rows, heads); `width_map` checks what it can."""
    half_head_dim: int = 17       # rotary halves; the head dim is twice this
    rank: int = 19                # LoRA rank
    intermediate: int = 23        # MLP width
    vocab: int = 101
    prefix: int = 28              # the step's prefix (the prompt but its last token); the prompt is one more
    completion: int = 38
    decode_cache: int = 256       # the engine's cache length (its bucket: engine.decode.CACHE_BUCKET_TOKENS)


def sampler_check():
    """The module of the sampler check, LOGPROB_GAP_LIMIT and SamplerGap: policy.py (formerly engine/rollout_check.py;
    older code)."""
    import importlib

    import policy

    return policy if hasattr(policy, "SamplerGap") else importlib.import_module("engine.rollout_check")


def narrow_model(name, layers, narrow, dtype):
    """A random-weight model of the shipped config `name` (bench.common.MODEL_CONFIGS) with `layers` layers at the
    narrow widths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import common

    values = json.loads((common.CONFIG_DIR / common.MODEL_CONFIGS[name]).read_text())
    values = {key: value for key, value in values.items() if not key.startswith("_") and key != "architectures"}
    values.update(hidden_size=values["num_attention_heads"] * narrow.half_head_dim * 2,
                  head_dim=narrow.half_head_dim * 2, intermediate_size=narrow.intermediate, vocab_size=narrow.vocab,
                  num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=2, use_sliding_window=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**values), dtype=dtype)


def trainer_args(preset, flags=()):
    """The preset's flags as train.py resolves them, in bf16 (the GPU's precision), without data or evaluation."""
    import warnings

    from run import config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --bf16 on a CPU without bf16 instructions: counted, not timed
        return config.parse_args(["--preset", preset, "--dataset", "arithmetic", "--eval-samples", "0", "--device",
                                  "cpu", "--bf16", *flags])


def narrow_policy(args, layers, narrow):
    """The policy as train.py builds it from `args` (LoRA, checkpointing, precision), on a narrow model."""
    from run import config
    import models

    dtype = models.compute_dtypes(args.bf16, args.lora_rank)[0]
    lora = {key: value for key, value in config.model_options(args).items() if key != "load_in_4bit"}
    return models.prepare_for_training(narrow_model(args.census_model, layers, narrow, dtype), **lora)


def random_batch(model, narrow, rows, temperature, generator):
    """An update.UpdateBatch of `rows` random completions of one random prompt at the `narrow` widths, with random
    advantages; the sampler's log-probs are the policy's own, so the update's sampler check passes and it takes its
    optimizer step."""
    import policy
    import update

    prompt_ids = torch.randint(3, narrow.vocab, (1, narrow.prefix + 1), generator=generator).expand(rows, -1)
    completion_ids = torch.randint(3, narrow.vocab, (rows, narrow.completion), generator=generator)
    kept = update.UpdateBatch(prompt_ids.clone(), torch.ones_like(prompt_ids), completion_ids,
                              torch.ones_like(completion_ids), torch.randn(rows, generator=generator),
                              torch.ones(rows, dtype=torch.bool))
    with torch.no_grad(), policy.dropout_off(model):
        ids = torch.cat([kept.prompt_ids, completion_ids], 1)
        kept.sampler_logprobs = policy.token_logprobs(model, ids, torch.ones_like(ids), narrow.completion,
                                                      temperature).float()
    return kept
