"""Grading throughput of the three reward functions (paper Appendix A.1: accuracy, format, tag count), in
completions per second, on GSM8K- and MATH-style completions built from the test sets, and the worst time of
adversarial completions against the grader's timeout.

Every run is cold: the verdict cache cleared and fresh grading workers (their parser caches empty), as at the start
of training. The data folder is found as train.py finds it: --data-dir, else $PODS_DATA_DIR, else the repository's
sibling ../shared/data (data.default_data_dir). --tiny: a few completions, one run, the cheap adversarial cases:
the code path, not the figures. Target: >= 500 GSM8K-style completions/s on one core.
"""

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import data
from grading import grader
import rewards

ADVERSARIAL = ["9^9^9^9", "10**10**10**10", "(10^{10})!", "\\int_0^\\infty e^{-x^2} dx", "\\binom{10^{12}}{10^6}",
               "\\frac{1}{0}", "((((((1))))))", "{" * 10_000, "x" * 1_000_000, "</answer>" * 100_000]
TINY_ADVERSARIAL = ["9^9^9^9", "\\frac{1}{0}", "{" * 10_000]   # refused before any parser runs: fast


def gsm8k_completions(rows, count):
    """GSM8K-style completions in the shapes a policy writes: formatted right/wrong, "The answer is N.",
    \\boxed{N}, "$N", a unit word, untagged text (last-number fallback) and a truncated reply."""
    completions, answers = [], []
    for i in range(count):
        row = rows[i % len(rows)]
        reasoning, final = row["answer"].split("####")
        reasoning, gold = re.sub(r"<<[^>]*>>", "", reasoning).strip(), final.strip().replace(",", "")
        shapes = [gold, str(int(gold) + 7), f"The answer is {gold}.", f"\\boxed{{{gold}}}", f"${gold}",
                  f"{gold} dollars"]
        shape = i % (len(shapes) + 2)
        if shape < len(shapes):
            completions.append(f"<think>\n{reasoning}\n</think>\n<answer>\n{shapes[shape]}\n</answer>")
        elif shape == len(shapes):
            completions.append(f"{reasoning}\nSo the answer is {gold}.")
        else:
            completions.append(f"<think>\n{reasoning[: len(reasoning) // 2]}")
        answers.append(gold)
    return completions, answers


def math_completions(rows, count):
    """MATH-style: the gold answer raw, boxed or in $...$ (right), or another problem's answer (wrong)."""
    completions, answers = [], []
    for i in range(count):
        gold, other = rows[i % len(rows)]["answer"], rows[(i * 7 + 3) % len(rows)]["answer"]
        shape = (gold, f"\\boxed{{{gold}}}", f"${gold}$", other)[(i // len(rows)) % 4]  # 4 shapes per row
        completions.append(f"<think>\nwork\n</think>\n<answer>\n{shape}\n</answer>")
        answers.append(gold)
    return completions, answers


def cold_rate(fn, count, repeats):
    """Median completions per second of fn() (which grades `count` completions) over `repeats` cold runs."""
    rates = []
    for _ in range(repeats):
        grader.reset_workers()
        start = time.perf_counter()
        fn()
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def parse_args(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench rewards", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None,
                        help="folder with gsm8k/test.jsonl and math/test500.jsonl (default: $PODS_DATA_DIR, else "
                             "../shared/data next to the repository, as train.py)")
    parser.add_argument("--num-gsm8k", type=int, default=None, help="GSM8K-style completions per run (default 8192)")
    parser.add_argument("--num-math", type=int, default=None, help="MATH-style completions per run (default 2000)")
    parser.add_argument("--workers", default=None, help="comma list of num_workers for the MATH runs (default 0,2)")
    parser.add_argument("--repeats", type=int, default=None, help="cold runs, median kept (default 3)")
    parser.add_argument("--tiny", action="store_true", help="64 + 16 completions, one run, no workers: a smoke run")
    args = parser.parse_args(argv)
    for name, full, tiny in (("num_gsm8k", 8192, 64), ("num_math", 2000, 16), ("workers", "0,2", "0"),
                             ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    args.workers = [int(w) for w in str(args.workers).split(",")]
    args.data_dir = Path(args.data_dir) if args.data_dir else data.default_data_dir()
    if args.data_dir is None:
        sys.exit("no data folder: pass --data-dir or set PODS_DATA_DIR (the folder holding gsm8k/ and math/)")
    return args


def bench_rewards(argv):
    """Grading throughput (completions/s) on GSM8K- and MATH-style completions, and worst adversarial time."""
    import torch  # noqa: F401  compute_rewards imports it lazily: keep that out of the timings

    args = parse_args(argv)

    def read(relative):
        return [row for _, row in data.read_jsonl(args.data_dir / relative, required_fields=("answer",))]

    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs visible, load "
          f"average {os.getloadavg()[0]:.1f}; median of {args.repeats} cold runs (no cached verdicts)")
    start = time.perf_counter()
    rewards.accuracy_reward("<answer>x^2</answer>", "x^2")
    result = {"args": vars(args), "server_start_s": time.perf_counter() - start}
    print(f"grader server start + first verdict: {result['server_start_s']:.2f} s (once per process)")

    completions, answers = gsm8k_completions(read("gsm8k/test.jsonl"), args.num_gsm8k)
    prompts = [""] * len(completions)
    fast = sum(rewards._grade_cheaply(c, a)[1] is None for c, a in zip(completions, answers))
    print(f"\nGSM8K-style, {len(completions)} completions ({fast / len(completions):.1%} decided without "
          "sympy), main process:")
    result["gsm8k_per_s"] = {}
    for name, fn in (("accuracy", lambda: rewards.grade_accuracy(completions, answers)),
                     ("format", lambda: rewards.format_rewards(prompts, completions)),
                     ("tag_count", lambda: rewards.tag_count_rewards(prompts, completions)),
                     ("all three (compute_rewards)", lambda: rewards.compute_rewards(prompts, completions, answers))):
        result["gsm8k_per_s"][name] = cold_rate(fn, len(completions), args.repeats)
        print(f"  {name:<28} {result['gsm8k_per_s'][name]:>10,.0f} completions/s")

    completions, answers = math_completions(read("math/test500.jsonl"), args.num_math)
    slow = len({item for c, a in zip(completions, answers)
                if (item := rewards._grade_cheaply(c, a)[1]) is not None})
    print(f"\nMATH-style, {len(completions)} completions ({slow} distinct math-verify items, the rest plain "
          "numbers):")
    result["math_per_s"] = {}
    for workers in args.workers:
        rate = cold_rate(lambda: rewards.grade_accuracy(completions, answers, num_workers=workers),
                         len(completions), args.repeats)
        result["math_per_s"][f"num_workers={workers}"] = rate
        print(f"  accuracy, num_workers={workers:<2} {rate:>10,.0f} completions/s")
    start = time.perf_counter()
    rewards.grade_accuracy(completions, answers)
    print(f"  accuracy, warm verdict cache {len(completions) / (time.perf_counter() - start):>9,.0f} completions/s")

    cases = TINY_ADVERSARIAL if args.tiny else ADVERSARIAL
    worst_s, worst_case = 0.0, ""
    for case in cases:
        for completion in (case, f"<think>\nx\n</think>\n<answer>\n{case}\n</answer>"):
            start = time.perf_counter()
            rewards.accuracy_reward(completion, "5")
            rewards.format_reward(completion)
            rewards.tag_count_reward(completion)
            if time.perf_counter() - start > worst_s:
                worst_s, worst_case = time.perf_counter() - start, case[:30]
    result["adversarial_worst_s"] = worst_s
    print(f"\nadversarial: worst of {2 * len(cases)} cases {worst_s:.2f} s ({worst_case!r}); the limit is "
          f"{rewards.VERIFY_TIMEOUT_S} s soft + {grader.KILL_GRACE_S} s to the kill")
    print(f"target: >= 500 GSM8K-style completions/s on one core; load average now {os.getloadavg()[0]:.1f}")
    return result
