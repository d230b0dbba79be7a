"""Held-out evaluation with and without prefix sharing (paper §4's test accuracy; sampling.GenerationSettings'
prefix_sharing): the demo's prompts (SmolLM2-135M chat template, system prompt and one-shot example) are 96-98
tokens of which the first 85 are the same for every prompt of a chunk, so without sharing a chunk's prefill is
mostly one prefix computed again for every prompt.

Times eval.evaluate (what eval.py and train.py's held-out evaluation run, the first chunk's sampler check
included: the check's forward pass does not share the prefix) on the demo's test prompts, greedy, with
max_completion_tokens and rollout_batch_size of the demo preset, prefix sharing off and on, interleaved (off, on,
on, off, ...) in one process after an untimed warm-up call (the engine's buffers, the first kernels), so a machine
whose load drifts slows both alike. Prints each run (with the engine's prefill and decode seconds: the decode work
is the same in both modes, so a difference there is the machine's load), the ratio of the best times (on / off:
load only adds time, as bench decode's best of --repeats), the prefill's token positions
(engine.STATS.prefill_tokens) and whether both gave the same completions. --no-check: generation and grading alone.

--tiny: a 2-layer random Llama (SmolLM2's vocabulary and tokenizer), a few prompts, a few tokens: the code path
only (tests/test_bench.py).
"""

import argparse
from dataclasses import replace

import torch

import config
import data
import engine
import eval as heldout
import models
import sampling
from bench.common import print_header, print_row, save_json, timed

COLUMNS = ["run", "prefix_sharing", "seconds", "prefill_tokens", "prefill_s", "decode_s", "accuracy",
           "mean_completion_length"]
TARGET_RATIO = 0.35   # the evaluation with prefix sharing in at most 0.35x the time without


def demo_eval_set(tokenizer, num_prompts):
    """The demo run's held-out prompts (eval.py --preset demo): arithmetic test split, one-shot, its system prompt."""
    demo = config.PRESETS["demo"]
    examples = data.build_prompt_set(demo["dataset"], "test", tokenizer, num_rows=num_prompts, seed=0,
                                     one_shot=demo["one_shot"], system_prompt=demo["system_prompt"])
    return [e.text for e in examples], [e.answer for e in examples]


def bench_evalprefix(argv):
    parser = argparse.ArgumentParser(prog="python -m bench evalprefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer random Llama, the code path only")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 256 (tiny: 6)")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs timed, interleaved")
    parser.add_argument("--max-completion-tokens", type=int, default=None, help="default: the demo's 32 (tiny: 4)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per generation call (default: the "
                                                                      "demo's rollout_batch_size, 64; tiny: 4)")
    parser.add_argument("--no-check", action="store_true", help="skip the first chunk's sampler check")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out-dir", default="bench_out")
    args = parser.parse_args(argv)
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
    prompts, answers = demo_eval_set(tokenizer, num_prompts)
    lengths = data.prompt_token_counts(prompts, tokenizer)
    settings = sampling.GenerationSettings(max_new_tokens=new_tokens, temperature=0.0, rollout_batch_size=batch_size)
    print(f"# bench evalprefix: {'tiny random Llama' if args.tiny else 'SmolLM2-135M'}, {len(prompts)} demo test "
          f"prompts of {min(lengths)}-{max(lengths)} tokens, greedy, {new_tokens} new tokens, {batch_size} rows per "
          f"call, sampler check {'off' if args.no_check else 'on'}, {torch.get_num_threads()} threads")
    print_header(COLUMNS)
    sampling.generate_rollouts(model, tokenizer, prompts[:2], 1, replace(settings, max_new_tokens=2))   # warm-up
    rows, samples = [], {}
    for run in range(args.rounds):
        for sharing in (False, True) if run % 2 == 0 else (True, False):
            before, completions_of_run = replace(engine.STATS), []
            result, seconds = timed(lambda: heldout.evaluate(
                model, tokenizer, prompts, answers, replace(settings, prefix_sharing=sharing),
                samples_out=completions_of_run, check_sampler=not args.no_check), torch.device("cpu"))
            samples.setdefault(sharing, completions_of_run)
            rows.append({"run": run, "prefix_sharing": "on" if sharing else "off", "seconds": seconds,
                         "prefill_tokens": engine.STATS.prefill_tokens - before.prefill_tokens,
                         "prefill_s": engine.STATS.prefill_s - before.prefill_s,
                         "decode_s": engine.STATS.decode_s - before.decode_s, "accuracy": result.accuracy,
                         "mean_completion_length": result.mean_completion_length})
            print_row(rows[-1], COLUMNS)
    best = {mode: min(r["seconds"] for r in rows if r["prefix_sharing"] == mode) for mode in ("off", "on")}
    ratio = best["on"] / best["off"]
    same = [s["completion"] for s in samples[True]] == [s["completion"] for s in samples[False]]
    print(f"best seconds: off {best['off']:.2f}, on {best['on']:.2f}; ratio on / off {ratio:.3f} "
          f"(target <= {TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}); prompt tokens {sum(lengths)}, "
          f"prefilled off {rows[0]['prefill_tokens']}, on {rows[1]['prefill_tokens']}; the same completions: {same}; "
          "decode work is the same in both modes, so differences in decode_s are the machine's load")
    result = {"rows": rows, "best_s": best, "ratio": ratio, "same_completions": same,
              "prompt_tokens": sum(lengths), "num_prompts": len(prompts), "threads": torch.get_num_threads()}
    save_json(args.out_dir, "evalprefix", result)
    return result
