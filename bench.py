"""Benchmarks for pods: `python bench.py <name> [options]`.

Speed and memory targets live here as printed figures (ratios measured in one run), never in timed
tests. Measured numbers, with the command that made them, are recorded in BENCHMARKS.md.

  selector   max-variance down-sampling vs torch.sort and the authors' loop (paper §3.3, Lemma 1)
  rewards    grading throughput of the three reward functions (paper Appendix A.1)
  asymmetry  generation vs update time over rollouts per step (paper Fig. 1)   -> bench_phases.py
  memory     peak memory per phase of a setting-(a) PODS step                  -> bench_phases.py
  decode     decode step time vs the memory-bandwidth bound and generate()     -> bench_decode.py
  step       the real train_step, GRPO-PODS 64/16 vs GRPO 16/16                -> bench_step.py
  save-tokenizer DIR   the offline SmolLM2 tokenizer, for `step --tokenizer DIR` on a GPU machine

The GPU commands (and what each times) are listed in bench_gpu.py's docstring.
"""

import sys


def _selector_authors_loop(rewards, m):
    """Re-implementation of the authors' released selector (for timing only): per row, sort, then for
    every split k build a Python index list of the k highest + (m-k) lowest and call .var() on it."""
    import torch

    chosen = []
    for row in rewards:
        order = torch.argsort(row)
        best_var, best_idx = None, None
        for k in range(m + 1):
            idx = order[: m - k].tolist() + order[len(row) - k :].tolist()
            var = row[idx].var().item()
            if best_var is None or var > best_var:
                best_var, best_idx = var, idx
        chosen.append(best_idx)
    return torch.tensor(chosen, device=rewards.device)


def _selector_time_s(fn, repeats, device):
    """Median and best wall-clock seconds of fn() over `repeats` calls, after two warm-up calls."""
    import statistics
    import time

    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def bench_selector(argv):
    """Time max_variance_indices vs torch.sort of the same tensor and vs the authors' per-split loop."""
    import argparse
    import platform

    import torch

    import pods

    parser = argparse.ArgumentParser(prog="python bench.py selector", description=bench_selector.__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls for the fast functions")
    parser.add_argument("--loop-repeats", type=int, default=5, help="timed calls for the authors' loop")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"{platform.machine()}; times in ms, median (best) of {args.repeats} calls "
          f"({args.loop_repeats} for the authors' loop)")
    header = (f"{'rewards':>22} {'m':>4} | {'max_variance':>15} {'torch.sort':>15} {'stable sort':>15} "
              f"{'authors loop':>16} | {'/sort':>12} {'/stable':>12} {'speed-up':>13}")
    print(header)
    print("-" * len(header))
    gen = torch.Generator().manual_seed(0)
    for prompts, n, m, kind in ((64, 512, 128, "discrete"), (64, 512, 128, "continuous"), (1, 64, 16, "discrete")):
        if kind == "discrete":  # summed accuracy/format-like rewards: 8 distinct values, many ties
            rewards = (torch.randint(0, 4, (prompts, n), generator=gen).float()
                       + 0.5 * torch.randint(0, 2, (prompts, n), generator=gen).float())
        else:
            rewards = torch.randn(prompts, n, generator=gen)
        rewards = rewards.to(device)
        ours = pods.max_variance_indices(rewards, m)
        theirs = _selector_authors_loop(rewards, m)
        if not torch.allclose(rewards.gather(-1, ours).var(-1), rewards.gather(-1, theirs).var(-1)):
            raise SystemExit("max_variance_indices and the authors' loop disagree on the best variance")
        fast = _selector_time_s(lambda: pods.max_variance_indices(rewards, m), args.repeats, device)
        plain = _selector_time_s(lambda: torch.sort(rewards, dim=-1), args.repeats, device)
        stable = _selector_time_s(lambda: torch.sort(rewards, dim=-1, stable=True), args.repeats, device)
        loop = _selector_time_s(lambda: _selector_authors_loop(rewards, m), args.loop_repeats, device)
        cells = " ".join(f"{med * 1e3:7.3f} ({best * 1e3:.3f})" for med, best in (fast, plain, stable))
        ratios = " ".join(f"{fast[0] / ref[0]:5.2f} ({fast[1] / ref[1]:4.2f})" for ref in (plain, stable))
        print(f"{f'{prompts} x {n} {kind}':>22} {m:>4} | {cells} {loop[0] * 1e3:8.1f} ({loop[1] * 1e3:.1f}) | "
              f"{ratios} {loop[0] / fast[0]:5.0f}x ({loop[1] / fast[1]:.0f}x)")
    print("ratios: medians (bests). targets: max_variance <= 2x torch.sort; >= 100x faster than the authors' loop")
    print("(both selectors checked to reach the same best variance on every input)")


def _rewards_gsm8k_completions(rows, count):
    """GSM8K-style completions in the shapes a policy writes: formatted right/wrong, "The answer is N.",
    \\boxed{N}, "$N", a unit word, untagged text (last-number fallback) and a truncated reply."""
    import re

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


def _rewards_math_completions(rows, count):
    """MATH-style: the gold answer raw, boxed or in $...$ (right), or another problem's answer (wrong)."""
    completions, answers = [], []
    for i in range(count):
        gold, other = rows[i % len(rows)]["answer"], rows[(i * 7 + 3) % len(rows)]["answer"]
        shape = (gold, f"\\boxed{{{gold}}}", f"${gold}$", other)[(i // len(rows)) % 4]  # 4 shapes per row
        completions.append(f"<think>\nwork\n</think>\n<answer>\n{shape}\n</answer>")
        answers.append(gold)
    return completions, answers


def _rewards_rate(fn, count, repeats):
    """Median completions per second of fn() (which grades `count` completions) over `repeats` cold runs:
    verdict cache cleared and fresh workers (their parser caches empty), as at the start of training."""
    import statistics
    import time

    import grader

    rates = []
    for _ in range(repeats):
        grader.reset_workers()
        start = time.perf_counter()
        fn()
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_rewards(argv):
    """Grading throughput (completions/s) on GSM8K- and MATH-style completions, and worst adversarial time."""
    import argparse
    import json
    import os
    import platform
    import time
    from pathlib import Path

    import torch  # noqa: F401  compute_rewards imports it lazily: keep that out of the timings

    import data
    import grader
    import rewards

    parser = argparse.ArgumentParser(prog="python bench.py rewards", description=bench_rewards.__doc__)
    parser.add_argument("--data-dir", default=None, help="folder with gsm8k/ and math/ (default ../shared/data)")
    parser.add_argument("--num-gsm8k", type=int, default=8192, help="GSM8K-style completions per run")
    parser.add_argument("--num-math", type=int, default=2000, help="MATH-style completions per run")
    parser.add_argument("--workers", default="0,2", help="comma list of num_workers for the MATH runs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    folder = Path(args.data_dir) if args.data_dir else data.default_data_dir()
    if folder is None:
        sys.exit("no data folder: pass --data-dir")

    def read(relative):
        return [json.loads(line) for line in open(folder / relative, encoding="utf-8") if line.strip()]

    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs visible, load "
          f"average {os.getloadavg()[0]:.1f}; median of {args.repeats} cold runs (no cached verdicts)")
    start = time.perf_counter()
    rewards.accuracy_reward("<answer>x^2</answer>", "x^2")
    print(f"grader server start + first verdict: {time.perf_counter() - start:.2f} s (once per process)")

    completions, answers = _rewards_gsm8k_completions(read("gsm8k/test.jsonl"), args.num_gsm8k)
    prompts = [""] * len(completions)
    fast = sum(rewards._grade_cheaply(c, a)[1] is None for c, a in zip(completions, answers))
    print(f"\nGSM8K-style, {len(completions)} completions ({fast / len(completions):.1%} decided without "
          "sympy), main process:")
    for name, fn in (("accuracy", lambda: rewards.grade_accuracy(completions, answers)),
                     ("format", lambda: rewards.format_rewards(prompts, completions)),
                     ("tag_count", lambda: rewards.tag_count_rewards(prompts, completions)),
                     ("all three (compute_rewards)", lambda: rewards.compute_rewards(prompts, completions, answers))):
        print(f"  {name:<28} {_rewards_rate(fn, len(completions), args.repeats):>10,.0f} completions/s")

    completions, answers = _rewards_math_completions(read("math/test500.jsonl"), args.num_math)
    slow = len({item for c, a in zip(completions, answers)
                if (item := rewards._grade_cheaply(c, a)[1]) is not None})
    print(f"\nMATH-style, {len(completions)} completions ({slow} distinct math-verify items, the rest plain "
          "numbers):")
    for workers in [int(w) for w in args.workers.split(",")]:
        rate = _rewards_rate(lambda: rewards.grade_accuracy(completions, answers, num_workers=workers),
                             len(completions), args.repeats)
        print(f"  accuracy, num_workers={workers:<2} {rate:>10,.0f} completions/s")
    start = time.perf_counter()
    rewards.grade_accuracy(completions, answers)
    print(f"  accuracy, warm verdict cache {len(completions) / (time.perf_counter() - start):>9,.0f} completions/s")

    cases = ["9^9^9^9", "10**10**10**10", "(10^{10})!", "\\int_0^\\infty e^{-x^2} dx", "\\binom{10^{12}}{10^6}",
             "\\frac{1}{0}", "((((((1))))))", "{" * 10_000, "x" * 1_000_000, "</answer>" * 100_000]
    worst_s, worst_case = 0.0, ""
    for case in cases:
        for completion in (case, f"<think>\nx\n</think>\n<answer>\n{case}\n</answer>"):
            start = time.perf_counter()
            rewards.accuracy_reward(completion, "5")
            rewards.format_reward(completion)
            rewards.tag_count_reward(completion)
            if time.perf_counter() - start > worst_s:
                worst_s, worst_case = time.perf_counter() - start, case[:30]
    print(f"\nadversarial: worst of {2 * len(cases)} cases {worst_s:.2f} s ({worst_case!r}); the limit is "
          f"{rewards.VERIFY_TIMEOUT_S} s soft + {grader._KILL_GRACE_S} s to the kill")
    print(f"target: >= 500 GSM8K-style completions/s on one core; load average now {os.getloadavg()[0]:.1f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    local = {"selector": bench_selector, "rewards": bench_rewards}
    gpu = ("asymmetry", "decode", "memory", "step", "save-tokenizer")
    if not argv or argv[0] not in (*local, *gpu):
        sys.exit(f"usage: python bench.py {{{','.join((*local, *gpu))}}} [options]")
    name, rest = argv[0], argv[1:]
    if name in local:
        return local[name](rest)
    import bench_gpu  # model-shape benchmarks live in their own modules

    return bench_gpu.main(name, rest)


if __name__ == "__main__":
    main()
