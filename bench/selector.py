"""Max-variance down-sampling (paper §3.3, Lemma 1): pods.max_variance_indices timed against torch.sort of the same
rewards (its floor: one sort and prefix sums) and against the authors' released per-split loop.

Targets: max_variance <= 2x torch.sort; >= 100x faster than the authors' loop. Both selectors are checked to reach
the same best variance on every input. --tiny: toy shapes and a few calls (the code path, not the figures).
"""

import argparse
import platform
import statistics
import time

import torch

import pods

# (prompts, n, m, rewards): the paper-scale shape with tied and with continuous rewards, and one prompt of setting (a)
SHAPES = ((64, 512, 128, "discrete"), (64, 512, 128, "continuous"), (1, 64, 16, "discrete"))
TINY_SHAPES = ((4, 32, 8, "discrete"), (4, 32, 8, "continuous"), (1, 16, 4, "discrete"))


def authors_loop(rewards, m):
    """Re-implementation of the authors' released selector (for timing only): per row, sort, then for every split
    k build a Python index list of the k highest + (m-k) lowest and call .var() on it."""
    chosen = []
    for row in rewards:
        order = torch.argsort(row)
        best_var, best_idx = None, None
        for k in range(m + 1):
            idx = order[: m - k].tolist() + order[len(row) - k:].tolist()
            var = row[idx].var().item()
            if best_var is None or var > best_var:
                best_var, best_idx = var, idx
        chosen.append(best_idx)
    return torch.tensor(chosen, device=rewards.device)


def median_and_best_s(fn, repeats, device):
    """Median and best wall-clock seconds of fn() over `repeats` calls, after two warm-up calls."""
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


def random_rewards(prompts, n, kind, generator):
    if kind == "discrete":  # summed accuracy/format-like rewards: 8 distinct values, many ties
        return (torch.randint(0, 4, (prompts, n), generator=generator).float()
                + 0.5 * torch.randint(0, 2, (prompts, n), generator=generator).float())
    return torch.randn(prompts, n, generator=generator)


def parse_args(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench selector", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls for the fast functions (default 200)")
    parser.add_argument("--loop-repeats", type=int, default=None, help="timed calls for the authors' loop (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, 3 + 1 timed calls: a smoke run")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.tiny else 200)
    args.loop_repeats = args.loop_repeats or (1 if args.tiny else 5)
    if min(args.repeats, args.loop_repeats) < 1:
        raise ValueError("--repeats and --loop-repeats must be >= 1")
    return args


def bench_selector(argv):
    """Time max_variance_indices vs torch.sort of the same tensor and vs the authors' per-split loop."""
    args = parse_args(argv)
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
    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompts, n, m, kind in TINY_SHAPES if args.tiny else SHAPES:
        rewards = random_rewards(prompts, n, kind, generator).to(device)
        ours, theirs = pods.max_variance_indices(rewards, m), authors_loop(rewards, m)
        if not torch.allclose(rewards.gather(-1, ours).var(-1), rewards.gather(-1, theirs).var(-1)):
            raise SystemExit("max_variance_indices and the authors' loop disagree on the best variance")
        fast = median_and_best_s(lambda: pods.max_variance_indices(rewards, m), args.repeats, device)
        plain = median_and_best_s(lambda: torch.sort(rewards, dim=-1), args.repeats, device)
        stable = median_and_best_s(lambda: torch.sort(rewards, dim=-1, stable=True), args.repeats, device)
        loop = median_and_best_s(lambda: authors_loop(rewards, m), args.loop_repeats, device)
        cells = " ".join(f"{med * 1e3:7.3f} ({best * 1e3:.3f})" for med, best in (fast, plain, stable))
        ratios = " ".join(f"{fast[0] / ref[0]:5.2f} ({fast[1] / ref[1]:4.2f})" for ref in (plain, stable))
        print(f"{f'{prompts} x {n} {kind}':>22} {m:>4} | {cells} {loop[0] * 1e3:8.1f} ({loop[1] * 1e3:.1f}) | "
              f"{ratios} {loop[0] / fast[0]:5.0f}x ({loop[1] / fast[1]:.0f}x)")
        rows.append({"prompts": prompts, "n": n, "m": m, "rewards": kind, "max_variance_s": fast,
                     "sort_s": plain, "stable_sort_s": stable, "authors_loop_s": loop})
    print("ratios: medians (bests). targets: max_variance <= 2x torch.sort; >= 100x faster than the authors' loop")
    print("(both selectors checked to reach the same best variance on every input)")
    return {"args": vars(args), "rows": rows}
