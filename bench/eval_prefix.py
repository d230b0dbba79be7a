"""Held-out evaluation with and without prefix sharing (paper §4's test accuracy; sampling.GenerationSettings'
prefix_sharing): the demo's prompts (SmolLM2-135M chat template, system prompt and one-shot example) are 96-98
tokens of which the first 85 are the same for every prompt of a chunk, so without sharing a chunk's prefill is
mostly one prefix computed again for every prompt.

Times eval.evaluate (what eval.py and train.py's held-out evaluation run, the first chunk's sampler check
included) on the demo's test prompts, greedy, with max_completion_tokens and rollout_batch_size of the demo preset,
in three modes, interleaved (their order rotates each round) in one process after an untimed warm-up call (the
engine's buffers, the first kernels), so a machine whose load drifts slows them alike:
  before  the evaluation as it was: every prompt prefilled in full, and each decode step reading every row's whole
          bucketed KV cache (engine.decode.EAGER_WINDOW off, a benchmark-only knob)
  off     --prefix-sharing off: every prompt prefilled in full; decoding reads the columns written so far
  on      --prefix-sharing on: the prefix every prompt shares prefilled once, and read once per decode step
  bf16    on, with the model's weights in bfloat16 (`--modes before,off,on,bf16`; train.py --bf16 with LoRA keeps
          the frozen base weights so): other arithmetic, so its completions may differ from fp32's (counted)
Prints each run (with the engine's prefill and decode seconds), the ratios of the best times (on / before, the
target, and on / off; load only adds time, as bench decode's best of --repeats), the prefill's token positions
(engine.STATS.prefill_tokens) and whether every mode gave the same completions. --no-check: generation and grading
alone.

--tiny: a 2-layer random Llama (SmolLM2's vocabulary and tokenizer), a few prompts, a few tokens: the code path
only (tests/test_bench.py).
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from run import config
import data
import engine
import eval as heldout
import models
import sampling
from bench.common import print_header, print_row, save_json, timed

COLUMNS = ["run", "mode", "seconds", "prefill_tokens", "prefill_s", "decode_s", "accuracy",
           "mean_completion_length"]
TARGET_RATIO = 0.35   # the evaluation with prefix sharing in at most 0.35x the time it took before
MODES = ("before", "off", "on")   # the default modes; "bf16" on request
ALL_MODES = MODES + ("bf16",)


def demo_eval_set(tokenizer, num_prompts):
    """The demo run's held-out prompts (eval.py --preset demo): arithmetic test split, one-shot, its system prompt."""
    demo = config.PRESETS["demo"]
    examples = data.build_prompt_set(demo["dataset"], "test", tokenizer, num_rows=num_prompts, seed=0,
                                     one_shot=demo["one_shot"], system_prompt=demo["system_prompt"])
    return [e.text for e in examples], [e.answer for e in examples]


def bench_evalprefix(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench evalprefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer random Llama, the code path only")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 256 (tiny: 6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the modes, timed, interleaved")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(ALL_MODES)} (before and "
                        "on are needed for the ratio)")
    parser.add_argument("--max-completion-tokens", type=int, default=None, help="default: the demo's 32 (tiny: 4)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per generation call (default: the "
                                                                      "demo's rollout_batch_size, 64; tiny: 4)")
    parser.add_argument("--no-check", action="store_true", help="skip the first chunk's sampler check")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out-dir", default="bench_out")
    parser.add_argument("--from-json", help="no timing: the summary of a saved run (its bench_evalprefix.json), "
                        "recomputed from its rows")
    args = parser.parse_args(argv)
    args.modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    if not {"before", "on"} <= set(args.modes) or not set(args.modes) <= set(ALL_MODES):
        raise ValueError(f"--modes: a comma list of {', '.join(ALL_MODES)} with before and on, got {args.modes}")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(f"# bench evalprefix, from {args.from_json}: {saved['num_prompts']} prompts, {saved['threads']} threads")
        return eval_summary(saved["rows"], same=saved["same_completions"], bf16_same=saved.get("bf16_same_share"))
    demo = config.PRESETS["demo"]
    num_prompts = args.num_prompts or (6 if args.tiny else 256)
    new_tokens = args.max_completion_tokens or (4 if args.tiny else demo["max_completion_tokens"])
    batch_size = args.batch_size or (4 if args.tiny else demo["rollout_batch_size"])
    for name, value in (("--num-prompts", num_prompts), ("--rounds", args.rounds), ("--batch-size", batch_size),
                        ("--max-completion-tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    tokenizer = models.load_tokenizer(models.SMOLLM2_ALIAS)
    model = (models.tiny_random_model("llama") if args.tiny else models.load_policy(models.SMOLLM2_ALIAS)).eval()
    models_of = {mode: model for mode in args.modes}
    if "bf16" in args.modes:
        models_of["bf16"] = (models.tiny_random_model("llama").to(torch.bfloat16) if args.tiny else
                             models.load_policy(models.SMOLLM2_ALIAS, dtype=torch.bfloat16)).eval()
    prompts, answers = demo_eval_set(tokenizer, num_prompts)
    lengths = data.prompt_token_counts(prompts, tokenizer)
    settings = sampling.GenerationSettings(max_new_tokens=new_tokens, temperature=0.0, rollout_batch_size=batch_size)
    print(f"# bench evalprefix: {'tiny random Llama' if args.tiny else 'SmolLM2-135M'}, {len(prompts)} demo test "
          f"prompts of {min(lengths)}-{max(lengths)} tokens, greedy, {new_tokens} new tokens, {batch_size} rows per "
          f"call, sampler check {'off' if args.no_check else 'on'}, {torch.get_num_threads()} threads")
    print_header(COLUMNS)
    for warm in set(models_of.values()):   # warm-up
        sampling.generate_rollouts(warm, tokenizer, prompts[:2], 1, replace(settings, max_new_tokens=2))
    rows, samples, modes = [], {}, args.modes
    for run in range(args.rounds):
        for mode in modes[run % len(modes):] + modes[:run % len(modes)]:
            before, completions_of_run = replace(engine.STATS), []
            engine.decode.EAGER_WINDOW = mode != "before"
            try:
                mode_settings = replace(settings, prefix_sharing=mode in ("on", "bf16"))
                result, seconds = timed(lambda: heldout.evaluate(
                    models_of[mode], tokenizer, prompts, answers, mode_settings,
                    samples_out=completions_of_run, check_sampler=not args.no_check), torch.device("cpu"))
            finally:
                engine.decode.EAGER_WINDOW = True
            samples.setdefault(mode, completions_of_run)
            rows.append({"run": run, "mode": mode, "seconds": seconds,
                         "prefill_tokens": engine.STATS.prefill_tokens - before.prefill_tokens,
                         "prefill_s": engine.STATS.prefill_s - before.prefill_s,
                         "decode_s": engine.STATS.decode_s - before.decode_s, "accuracy": result.accuracy,
                         "mean_completion_length": result.mean_completion_length})
            print_row(rows[-1], COLUMNS)
    result = {"rows": rows, **eval_summary(rows, samples, modes=modes), "prompt_tokens": sum(lengths),
              "num_prompts": len(prompts), "threads": torch.get_num_threads()}
    save_json(args.out_dir, "evalprefix", result)
    return result


def eval_summary(rows, samples=None, same=None, modes=None, bf16_same=None):
    """The best time per mode and the ratios, printed and returned: {best_s, ratio (on / before), same_completions
    (the fp32 modes' completions token for token), bf16_same_share (the share of bf16's completions equal to fp32's,
    with that mode), ratio_bf16 (bf16 / before)} from the completions of each mode (`samples`) or a saved run's."""
    modes = modes or tuple(dict.fromkeys(r["mode"] for r in rows))
    best = {mode: min(r["seconds"] for r in rows if r["mode"] == mode) for mode in modes}
    ratio = best["on"] / best["before"]
    completions = {mode: [s["completion"] for s in samples[mode]] for mode in modes} if samples is not None else None
    if completions is not None:
        same = all(completions[mode] == completions["before"] for mode in modes if mode != "bf16")
        if "bf16" in modes:
            bf16_same = sum(a == b for a, b in zip(completions["bf16"], completions["on"])) / len(completions["on"])
    tokens = {mode: next(r["prefill_tokens"] for r in rows if r["mode"] == mode) for mode in modes}
    line = ("best seconds: " + ", ".join(f"{mode} {best[mode]:.2f}" for mode in modes) + f"; ratio on / before "
            f"{ratio:.3f} (target <= {TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'})")
    if "off" in modes:
        line += f", on / off {best['on'] / best['off']:.3f}"
    summary = {"best_s": best, "ratio": ratio, "same_completions": same}
    if "bf16" in modes:
        summary.update(ratio_bf16=best["bf16"] / best["before"], bf16_same_share=bf16_same)
        line += (f", bf16 / before {summary['ratio_bf16']:.3f} (target: "
                 f"{'PASS' if summary['ratio_bf16'] <= TARGET_RATIO else 'FAIL'}; {bf16_same:.0%} of its completions "
                 "equal fp32's)")
    print(line + "; prefilled " + ", ".join(f"{mode} {tokens[mode]}" for mode in modes)
          + f"; the same completions in every fp32 mode: {same}")
    return summary
