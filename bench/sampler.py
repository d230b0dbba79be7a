"""The sampler-trainer log-prob gap (policy.py's sampler check): what a correct sampler gives, what a faulty one
gives, and so where the fallback threshold (policy.LOGPROB_GAP_LIMIT) goes.

The policy of the demo (SmolLM2-135M, LoRA r=16 with its B matrices randomised as after some training) samples
rollouts of the demo's arithmetic prompts at T = 1 through sampling.generate_rollouts on each path, and the trainer's
log-probs of the same tokens come from eval.measure_sampler_gap (policy.token_logprobs on the unmerged adapter, as
the update computes them). In fp32 every correct path should agree to rounding; in bf16 the engine's merged copy
(base + B A rounded to bf16 once) against the trainer's unmerged adapter (x W + x A B in bf16) is the proxy, on
CPU, for what a GPU run sees (its kernels round differently again). Planted faults, each on the engine:

  wrong temperature   the engine samples (and records) at 1.25 T
  stale copy, k steps the merged copy is not refreshed while the adapter moves by k optimizer-sized steps (every
                      B entry by k x the demo's learning rate, 5e-4: what Adam's first step moves it by)
  perturbed copy      Gaussian noise of 2% of each merged weight's std added to the copy

--tiny: a 2-layer random model, random prompts (the code path only; tests/test_bench.py).
"""

import argparse
import contextlib

import torch

from run import config
import data
import engine
import engine.step
import eval as heldout
import models
import policy
import sampling
from bench.common import print_header, print_row
from bench.decode import perturb_adapters

COLUMNS = ["precision", "sampler", "tokens", "logprob_diff_mean", "logprob_diff_max", "kl", "ratio_max",
           "falls_back"]
FAULTS = ("wrong temperature", "stale copy, 1 step", "stale copy, 20 steps", "perturbed copy")


@contextlib.contextmanager
def planted(fault, model):
    """The engine with one fault planted (FAULTS), restored afterwards."""
    generate, refresh = engine.generate, engine.step.refresh_copies
    if fault == "wrong temperature":
        engine.generate = lambda *a, temperature, **k: generate(*a, temperature=1.25 * temperature, **k)
    elif fault.startswith("stale copy"):
        engine.engine_for(model)   # the copy is made from the current adapter ...
        engine.step.refresh_copies = lambda copies: None   # ... and never refreshed
        step_adapter(model, 5e-4 * int(fault.split(", ")[1].split()[0]))
    elif fault == "perturbed copy":
        def noisy(copies):
            refresh(copies)
            generator = torch.Generator().manual_seed(0)
            for _, weight in copies:
                noise = torch.randn(weight.shape, generator=generator).to(weight)
                weight.add_(noise * 0.02 * weight.float().std().to(weight.dtype))
        engine.step.refresh_copies = noisy
    try:
        yield
    finally:
        engine.generate, engine.step.refresh_copies = generate, refresh
        engine.release(model)


def step_adapter(model, learning_rate):
    """Every LoRA B entry moved by +-learning_rate (the size of Adam's first step)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                sign = torch.randint(0, 2, parameter.shape, generator=generator).to(parameter) * 2 - 1
                parameter.add_(sign * learning_rate)


def demo_policy(precision, tiny, seed):
    """The demo's policy (LoRA r=16, alpha 32) in fp32 or bf16 with randomised B, and its prompt texts."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    lora = dict(lora_rank=16, lora_alpha=32, lora_target_modules=models.DEFAULT_LORA_TARGETS)
    torch.manual_seed(seed)
    if tiny:
        model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=1024, seed=seed).to(dtype),
                                            **lora)
    else:
        model = models.load_policy(models.SMOLLM2_ALIAS, dtype=dtype, **lora)
    perturb_adapters(model, seed, std=0.02)
    return model


def gap_row(model, tokenizer, prompt_ids, prompts, settings, seed, tiny):
    """policy.SamplerGap of one generation on `settings`' path."""
    if tiny:   # random prompt ids, no tokenizer
        ids, mask, _, logprobs, _ = sampling.sample_completions(model, prompt_ids, torch.ones_like(prompt_ids), 4,
                                                                 [], 2, settings, seed)
        rollouts = sampling.Rollouts(prompt_ids, torch.ones_like(prompt_ids), ids, mask, [], mask.sum(1),
                                     mask.sum(1) == ids.shape[1],
                                     torch.arange(len(prompt_ids)).repeat_interleave(4), logprobs)
    else:
        rollouts = sampling.generate_rollouts(model, tokenizer, prompts, 4, settings, seed)
    return heldout.measure_sampler_gap(model, rollouts, settings.temperature)


def bench_sampler(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench sampler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer random model, random prompts")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--prompts", type=int, default=8, help="arithmetic prompts, 4 rollouts each")
    parser.add_argument("--new-tokens", type=int, default=32, help="the demo's --max-completion-tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    demo = config.PRESETS["demo"]
    tokenizer, prompts, prompt_ids = None, None, None
    if args.tiny:
        prompt_ids = torch.randint(3, 1000, (args.prompts, 6), generator=torch.Generator().manual_seed(args.seed))
    else:
        tokenizer = models.load_tokenizer(models.SMOLLM2_ALIAS)
        prompts = [e.text for e in data.build_prompt_set("arithmetic", "train", tokenizer, num_rows=args.prompts,
                                                         one_shot=True, system_prompt=demo["system_prompt"])]
    print(f"# bench sampler: {'tiny random llama' if args.tiny else 'SmolLM2-135M'} + LoRA r=16, "
          f"{args.prompts} prompts x 4 rollouts, {args.new_tokens} tokens, T = {demo['temperature']}, CPU; "
          f"fallback above a mean gap of {policy.LOGPROB_GAP_LIMIT}")
    print_header(COLUMNS)
    rows = []
    for precision in args.precisions.split(","):
        model = demo_policy(precision, args.tiny, args.seed)
        paths = [("engine, merged copy", {}, None), ("engine, LoRA unmerged", dict(generation_copy=False), None),
                 ("generate()", dict(backend="hf"), None)] + [(f"engine, {f}", {}, f) for f in FAULTS]
        for name, overrides, fault in paths:
            settings = sampling.GenerationSettings(max_new_tokens=args.new_tokens, temperature=demo["temperature"],
                                                   rollout_batch_size=4 * args.prompts, **overrides)
            with planted(fault, model) if fault else contextlib.nullcontext():
                gap = gap_row(model, tokenizer, prompt_ids, prompts, settings, args.seed, args.tiny)
            rows.append({"precision": precision, "sampler": name, "tokens": gap.tokens, **{
                key.split("/")[1]: value for key, value in gap.metrics().items()},
                "falls_back": gap.mean > policy.LOGPROB_GAP_LIMIT})
            print_row(rows[-1], COLUMNS)
    return {"rows": rows, "limit": policy.LOGPROB_GAP_LIMIT}
