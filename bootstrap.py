"""Confidence intervals across seeds for the paper's comparison figures, by the bootstrap over seeds.

Paper Appendix A.4 defines the speed-up: (time for the baseline to first reach 0.99x its own peak accuracy) /
(time for the method to reach that same accuracy), on seed-mean curves; Fig. 4 draws those curves with 1.96-SE
bands. compare.py computes the point figures; this module adds how sure they are: each method's seeds are
resampled with replacement (independently per method: an arm with a failed seed still counts), the mean curves,
the threshold and the figures are recomputed on every resample, and the 95% interval is the 2.5th and 97.5th
percentile of the resampled values (actual resampled values, no interpolation between them). The generator is
seeded, so the intervals are the same on every call. The same figures are computed on a second axis, the step
(learning per step, independent of the machine's speed). study.py's PODS vs GRPO-GA study reports through here:

    python bootstrap.py RUN_DIR... --baseline-label "GRPO 16/16" [--budget-s 900] [--plot P.png] [--table ga.md]

Definitions (documented, tested): a method's curve is compare.py's seed mean with linear interpolation, kept
while every drawn seed has a value (compare.method_curve with min_seeds=0); peak = its maximum; final = the mean
over seeds of each seed's last evaluation; a method that never reaches the threshold has speed-up 0 (time
infinite) and one at 0 s has speed-up inf, so both still order the resamples; a resample where the speed-up is
undefined (the baseline's peak is 0, or the baseline reaches its threshold at 0) is left out of the interval
and counted. --budget-s reads every run as one with that --max-time-s would have logged it (`within_budget`),
so runs given a longer budget than the rest are compared on the same footing. Simplification: the percentile
bootstrap with 5 seeds slightly understates the spread (by about sqrt(4/5) for a mean), and cannot see beyond the
seeds that were run.
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

import compare

AXES = {"time": "training wall-clock (s)", "steps": "optimizer step"}
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
FRACTION = 0.99  # of the baseline's peak (Appendix A.4)


def on_axis(run, axis):
    """The run with its evaluations placed by training time ("time") or by optimizer step ("steps")."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {tuple(AXES)}, got {axis!r}")
    return run if axis == "time" else dataclasses.replace(run, eval_times_s=run.eval_steps.astype(float))


def within_budget(run, budget_s):
    """The run as one of `--max-time-s budget_s` would have logged it: train.py does not start a step that would
    probably end past the budget (after step k when elapsed_k + duration_k > budget_s), so its steps up to there
    (their per-phase clock too) and the evaluations made at those steps. (Such a run also evaluates after its last
    step; this one's last kept evaluation is the one before.) Without step lines, the evaluations up to budget_s.
    None or 0: no budget."""
    if not budget_s:
        return run
    durations, phases = np.asarray(run.step_durations_s, dtype=float), run.step_phases_s
    if len(durations):
        over = np.nonzero(np.cumsum(durations) + durations > budget_s)[0]
        last_step = int(over[0]) + 1 if len(over) else len(durations)
        keep, durations = run.eval_steps <= last_step, durations[:last_step]
        phases = {k: v[:last_step] for k, v in phases.items()}
    else:
        keep = run.eval_times_s <= budget_s
    return dataclasses.replace(run, eval_times_s=run.eval_times_s[keep], eval_accuracy=run.eval_accuracy[keep],
                               eval_steps=run.eval_steps[keep], step_durations_s=durations, step_phases_s=phases)


@dataclasses.dataclass
class SeedGrid:
    """One method's seeds on the union of their evaluation points: the rows a resample draws from."""
    points: np.ndarray    # the union of every seed's evaluation times (or steps)
    values: np.ndarray    # seeds x points, NaN outside a seed's own [first, last] evaluation
    final: np.ndarray     # each seed's last evaluation


def seed_grid(runs, axis="time"):
    runs = [on_axis(r, axis) for r in runs if len(r.eval_times_s)]
    if not runs:
        return SeedGrid(np.empty(0), np.empty((0, 0)), np.empty(0))
    points = np.unique(np.concatenate([r.eval_times_s for r in runs]))
    values = np.stack([compare.values_on_grid(r.eval_times_s, r.eval_accuracy, points) for r in runs])
    return SeedGrid(points, values, np.array([r.eval_accuracy[-1] for r in runs]))


def mean_curve(grid, rows):
    """(points, mean) of the drawn seeds (row indices), where every one of them has a value. The union grid of
    all seeds holds each drawn seed's own points, and a point more on a straight segment changes neither the
    curve's crossings nor its peak, so this is compare.method_curve's mean of the drawn seeds."""
    values = grid.values[rows]
    keep = ~np.isnan(values).any(axis=0)
    return grid.points[keep], values[:, keep].mean(axis=0)


def speedup(base_time, time):
    """T_baseline / T_method; 0 when the method never reaches the threshold, NaN when the ratio is undefined."""
    if base_time is None or base_time == 0:
        return math.nan
    if time is None:
        return 0.0
    return math.inf if time == 0 else base_time / time


def figures(grids, rows, baseline_label, fraction=FRACTION):
    """{label: {peak, final, threshold_at, speedup}} for the drawn seeds of each method ({label: row indices})."""
    curves = {label: mean_curve(grids[label], rows[label]) for label in grids}
    base_points, base_mean = curves[baseline_label]
    base_peak = float(np.max(base_mean)) if len(base_mean) else math.nan
    threshold = fraction * base_peak
    base_time = compare.first_time_reaching(base_points, base_mean, threshold) if base_peak > 0 else None
    result = {}
    for label, (points, mean) in curves.items():
        reached = compare.first_time_reaching(points, mean, threshold) if base_peak > 0 and len(mean) else None
        result[label] = {"peak": float(np.max(mean)) if len(mean) else math.nan,
                         "final": float(np.mean(grids[label].final[rows[label]])) if len(rows[label]) else math.nan,
                         "threshold": threshold, "threshold_at": reached, "speedup": speedup(base_time, reached)}
    return result


def interval(values):
    """(low, high, left out): the 2.5th and 97.5th percentiles of the defined (non-NaN) resampled values."""
    values = np.asarray(values, dtype=float)
    defined = values[~np.isnan(values)]
    if not len(defined):
        return math.nan, math.nan, len(values)
    low, high = np.quantile(defined, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high), len(values) - len(defined)


def bootstrap(runs_by_label, baseline_label, axis="time", resamples=RESAMPLES, seed=BOOTSTRAP_SEED,
              fraction=FRACTION):
    """Per method: the point figures on all its seeds, and a 95% interval for peak, final and speed-up."""
    if baseline_label not in runs_by_label:
        raise ValueError(f"baseline {baseline_label!r} is not among the methods {sorted(runs_by_label)}")
    grids = {label: seed_grid(runs, axis) for label, runs in runs_by_label.items()}
    point = figures(grids, {label: np.arange(len(g.final)) for label, g in grids.items()}, baseline_label, fraction)
    rng = np.random.default_rng(seed)
    drawn = {label: {key: [] for key in ("peak", "final", "speedup")} for label in grids}
    for _ in range(resamples):
        rows = {label: rng.integers(len(g.final), size=len(g.final)) if len(g.final) else np.empty(0, int)
                for label, g in grids.items()}
        for label, values in figures(grids, rows, baseline_label, fraction).items():
            for key in drawn[label]:
                drawn[label][key].append(values[key])
    return {label: dict(point[label], seeds=len(grids[label].final), axis=axis, resamples=resamples,
                        **{f"{key}_ci": interval(values) for key, values in drawn[label].items()})
            for label in grids}


def _ci(low_high_left, digits):
    low, high, left_out = low_high_left
    if math.isnan(low):
        return "undefined"
    return f"[{_number(low, digits)}, {_number(high, digits)}]" + (f" ({left_out} undefined)" if left_out else "")


def _number(value, digits):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "inf" if value == math.inf else f"{value:.{digits}f}"


def _speedup_text(value):
    if math.isnan(value):
        return "undefined"
    return "not reached" if value == 0 else f"{_number(value, 2)}x"


def markdown_table(by_axis, runs_by_label, baseline_label, metric="accuracy"):
    """The study's table: per method, the clock (per-step generate / update), peak and final accuracy, and the
    speed-up on the time and the step axis, each with its 95% bootstrap interval."""
    first = next(iter(by_axis["time"].values()))
    lines = [f"Held-out {metric}, mean over seeds [95% bootstrap interval over seeds, {first['resamples']} "
             f"resamples, seed {BOOTSTRAP_SEED}]. Baseline: {baseline_label}; threshold = {FRACTION} x its peak "
             f"({_number(by_axis['time'][baseline_label]['threshold'], 3)} on the time axis, "
             f"{_number(by_axis['steps'][baseline_label]['threshold'], 3)} on the step axis). Speed-up = baseline's "
             "time (steps) to the threshold / the method's; 'not reached' counts as 0x in the interval.", "",
             "| method | seeds | steps per run | generate / update / step (s) | peak | final | time to threshold (s) "
             "| speed-up (time) | steps to threshold | speed-up (steps) |",
             "|---|---:|---|---|---|---|---:|---|---:|---|"]
    for label, runs in runs_by_label.items():
        time, steps = by_axis["time"][label], by_axis["steps"][label]
        clock = [np.mean([r.phase_means_s.get(k, math.nan) for r in runs]) for k in compare.PHASES]
        durations = [d for r in runs for d in r.step_durations_s]
        clock.append(np.mean(durations) if durations else math.nan)
        lines.append(
            f"| {label} | {time['seeds']} | {','.join(str(len(r.step_durations_s)) for r in runs)} "
            f"| {' / '.join(_number(float(c), 1) for c in clock)} "
            f"| {_number(time['peak'], 3)} {_ci(time['peak_ci'], 3)} | {_number(time['final'], 3)} "
            f"{_ci(time['final_ci'], 3)} | {_number(time['threshold_at'], 0)} | {_speedup_text(time['speedup'])} "
            f"{_ci(time['speedup_ci'], 2)} | {_number(steps['threshold_at'], 1)} | {_speedup_text(steps['speedup'])} "
            f"{_ci(steps['speedup_ci'], 2)} |")
    return "\n".join(lines)


def plot(runs_by_label, by_axis, path, title=None, metric="accuracy"):
    """Accuracy against training time (left) and against steps (right): seed mean, 1.96-SE band (paper Fig. 4),
    and the threshold (0.99 x the baseline's peak)."""
    fig, panels = compare.two_panels()
    longest_s = max((r.eval_times_s[-1] for runs in runs_by_label.values() for r in runs if len(r.eval_times_s)),
                    default=0)
    for panel, axis in zip(panels, AXES):
        scale = 60.0 if axis == "time" and longest_s > 600 else 1.0  # long runs in minutes
        for label, runs in runs_by_label.items():
            curve = compare.method_curve(label, [on_axis(r, axis) for r in runs], min_seeds=0)
            line, = panel.plot(curve.times_s / scale, curve.mean, label=f"{label} (n={len(runs)})")
            panel.fill_between(curve.times_s / scale, *compare.band_limits(curve.mean, curve.band),
                               color=line.get_color(), alpha=0.2)
        threshold = next(iter(by_axis[axis].values()))["threshold"]
        if compare._finite(threshold):
            panel.axhline(threshold, color="gray", linestyle="--", linewidth=0.8, label="0.99 x baseline peak")
        xlabel = f"training wall-clock ({'min' if scale == 60 else 's'})" if axis == "time" else AXES[axis]
        panel.set(xlabel=xlabel, ylabel=f"held-out {metric}")
        panel.legend(fontsize=8)
    compare.save_figure(fig, path, title)


def report(run_dirs, baseline_label, plot_path=None, title=None, metric="accuracy", resamples=RESAMPLES,
           budget_s=None):
    """Read the runs (compare.py's rules; each cut to budget_s of training, `within_budget`), group them by
    method, bootstrap both axes; returns ({axis: {label: figures}}, markdown table) and draws the plot when
    plot_path is given."""
    runs = [within_budget(compare.read_run(path, metric=metric), budget_s)
            for path in compare.expand_run_dirs(run_dirs)]
    if not runs:
        raise ValueError("no runs to compare")
    runs_by_label = {}
    for run in runs:
        runs_by_label.setdefault(run.label, []).append(run)
    by_axis = {axis: bootstrap(runs_by_label, baseline_label, axis, resamples) for axis in AXES}
    table = markdown_table(by_axis, runs_by_label, baseline_label, metric)
    differences = compare.config_differences(runs)
    table += "".join(f"\n- settings differ between runs: {d}" for d in differences)
    if plot_path:
        plot(runs_by_label, by_axis, plot_path, title, metric)
    return by_axis, table


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bootstrap.py", description="peak, final accuracy and speed-up with "
                                     "95% bootstrap intervals over seeds, on the time and the step axis")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--baseline-label", required=True, help='e.g. "GRPO 16/16"')
    parser.add_argument("--plot", help="PNG path")
    parser.add_argument("--table", help="also write the markdown table here")
    parser.add_argument("--json", help="also write the figures as JSON")
    parser.add_argument("--metric", choices=compare.METRICS, default="accuracy")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--title")
    parser.add_argument("--budget-s", type=float, help="read every run as one with this --max-time-s (a run given "
                        "a longer budget: its steps and evaluations past it left out)")
    args = parser.parse_args(argv)
    by_axis, table = report(args.run_dirs, args.baseline_label, args.plot, args.title, args.metric, args.resamples,
                            args.budget_s)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(by_axis, indent=1))
    return by_axis


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as error:  # a missing path, no runs, no baseline: one line
        sys.exit(f"bootstrap.py: error: {error}")
