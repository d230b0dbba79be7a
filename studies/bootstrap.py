"""Confidence intervals across seeds for the paper's comparison figures, by a paired bootstrap over seeds.

Paper Appendix A.4 defines the speed-up: (time for the baseline to first reach 0.99x its own peak accuracy) /
(time for the method to reach that same accuracy), on seed-mean curves; Fig. 4 draws those curves with 1.96-SE
bands. compare.py computes the point figures; this module adds how sure they are, on the clock and per optimizer
step (learning per step, whatever the machine's speed). study.py's PODS vs GRPO-GA study reports through here:

    python study.py bootstrap RUN_DIR... --baseline-label "GRPO 16/16" [--budget-s 900] [--plot P.png] [--table ga.md]
    python study.py bootstrap --from-data results/ga --baseline-label "GRPO 16/16"   (committed data, studydata.py)

Method (documented, tested):
- Paired by seed: a seed gives every arm the same prompts in the same order, so a resample draws seeds (with
  replacement) and every arm uses the same drawn seeds; speed-ups and differences are computed inside the resample
  from those paired arms, each arm against the baseline's runs of the drawn seeds both have (an arm run on fewer
  seeds, or a failed run, is compared on its own seeds only). An arm's own peak, final and mean accuracy are over
  its own drawn seeds.
- The threshold is fixed before resampling: 0.99 x the peak of the baseline's seed-mean curve over all seeds.
- Censoring: a mean curve (compare.py's seed mean, linear between evaluations, kept while every drawn seed has a
  value) that never reaches the threshold has not reached it by the end of its curve E, so its speed-up is a bound,
  T_b / T_m < T_b / E ("not reached (< 0.8x)"), never 0; a baseline that does not reach it makes the speed-up a
  lower bound (> E_b / T_m); neither: unknown. Each end of the 95% interval is the 2.5th (97.5th) percentile of
  the resampled values, and where censored resamples sit at that percentile it is written as the bound it is
  ("< 0.4"); the table gives the share of resamples whose curve reached the threshold. A resample where the ratio is
  undefined (the baseline at the threshold at 0) is left out and counted.
- Beside that knife-edged figure, the mean held-out accuracy over the window [S, H] (the area under the curve
  divided by its width; each seed's curve linear between evaluations, i.e. the trapezoid rule, held at its last
  evaluation past it): S is the latest first evaluation of any run (0 for train.py's step-0 evaluation), H the
  budget (--budget-s) on the clock, otherwise the earliest last evaluation of any run (the range every run covers),
  per step always the latter. Reported per arm and as the paired difference arm - baseline with its interval.
- peak = maximum of the mean curve; final = mean of each seed's last evaluation. Percentiles are resampled values
  (no interpolation); the generator is seeded, so the intervals are the same on every call. Speed-ups are printed
  to 2 significant digits and accuracies to 2 decimals: with 5 seeds an interval's end moves by more than that
  when the data are perturbed by a few percent (BENCHMARKS).
--budget-s reads every run as one with that --max-time-s would have logged it (compare.within_budget); runs of
different budgets are otherwise refused (compare.check_budgets). Simplification: the percentile bootstrap with 5
seeds understates the spread somewhat (by about sqrt(4/5) for a mean), and cannot see beyond the seeds that were run.
"""

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

import compare

AXES = {"time": "training wall-clock (s)", "steps": "optimizer step"}
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
FRACTION = 0.99  # of the baseline's peak (Appendix A.4)


def resample_count(text):
    """argparse type of --resamples (every study command's): an int >= 1, else one line naming the flag."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def on_axis(run, axis):
    """The run with its evaluations placed by training time ("time") or by optimizer step ("steps")."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {tuple(AXES)}, got {axis!r}")
    return run if axis == "time" else dataclasses.replace(run, eval_times_s=run.eval_steps.astype(float))


def mean_accuracy(points, values, start, end):
    """Mean of one curve over [start, end]: linear between evaluations (trapezoid rule), held at the first and
    last evaluation outside them; the area under the curve divided by end - start (NaN for an empty window)."""
    if not end > start:
        return math.nan
    inner = points[(points > start) & (points < end)]
    grid = np.concatenate([[start], inner, [end]])
    heights = np.interp(grid, points, values)
    return float(np.sum((heights[1:] + heights[:-1]) / 2 * np.diff(grid)) / (end - start))


def auc_window(runs, budget=None):
    """[S, H] of the mean-accuracy figure: S the latest first evaluation, H the budget or else the earliest last
    evaluation among the runs (all placed on one axis)."""
    start = max(float(r.eval_times_s[0]) for r in runs)
    end = float(budget) if budget else min(float(r.eval_times_s[-1]) for r in runs)
    return start, end


@dataclasses.dataclass
class SeedGrid:
    """One arm's seeds on the union of their evaluation points: the rows a resample draws from."""
    rows: dict            # {index in the study's seed list: row}
    points: np.ndarray    # the union of every seed's evaluation times (or steps)
    values: np.ndarray    # rows x points, NaN outside a seed's own [first, last] evaluation
    final: np.ndarray     # each row's last evaluation
    mean_accuracy: np.ndarray  # each row's mean accuracy over the window

    def drawn(self, seed_indices):
        """This arm's rows of the drawn seeds (with repeats), the seeds it lacks left out."""
        return np.array([self.rows[i] for i in seed_indices if i in self.rows], dtype=int)


def seed_grid(runs, seeds, window):
    """runs: this arm's runs with evaluations (already on one axis); seeds: the study's seed list."""
    if not runs:
        return SeedGrid({}, np.empty(0), np.empty((0, 0)), np.empty(0), np.empty(0))
    points = np.unique(np.concatenate([r.eval_times_s for r in runs]))
    values = np.stack([compare.values_on_grid(r.eval_times_s, r.eval_accuracy, points) for r in runs])
    return SeedGrid({seeds.index(r.seed): row for row, r in enumerate(runs)}, points, values,
                    np.array([r.eval_accuracy[-1] for r in runs]),
                    np.array([mean_accuracy(r.eval_times_s, r.eval_accuracy, *window) for r in runs]))


def mean_curve(grid, rows):
    """(points, mean) of the drawn rows, where every one of them has a value. The union grid of all seeds holds
    each drawn seed's own points, and a point more on a straight segment changes neither the curve's crossings nor
    its peak, so this is compare.method_curve's mean of the drawn seeds."""
    values = grid.values[rows]
    keep = ~np.isnan(values).any(axis=0)
    return grid.points[keep], values[:, keep].mean(axis=0)


def speedup_bounds(base_time, base_end, time, end):
    """(low, high) of T_b / T_m from the two curves' first times at the threshold (None: not reached by the curve's
    end); equal ends when both reached, NaN when undefined (T_b = 0: the ratio says nothing about speed)."""
    if base_time == 0:
        return math.nan, math.nan
    if time == 0:
        return math.inf, math.inf
    if base_time is not None and time is not None:
        return base_time / time, base_time / time
    if time is not None:  # the baseline's curve never got there: T_b > its end
        return base_end / time, math.inf
    high = base_time / end if base_time is not None and end > 0 else math.inf  # T_m > the method's curve's end
    return 0.0, high


def curve_figures(grid, rows, threshold):
    """One arm's figures over the drawn rows (with repeats): its mean curve's peak and first time at the threshold,
    the mean final and mean-accuracy values; None when no drawn seed has a curve."""
    if not len(rows):
        return None
    points, mean = mean_curve(grid, rows)
    if not len(mean):  # the drawn seeds' evaluations do not overlap: no mean curve
        return None
    reached = compare.first_time_reaching(points, mean, threshold) if math.isfinite(threshold) else None
    return {"peak": float(np.max(mean)), "final": float(np.mean(grid.final[rows])),
            "mean_accuracy": float(np.mean(grid.mean_accuracy[rows])), "threshold_at": reached,
            "curve_end": float(points[-1])}


def figures(grids, drawn, baseline_label, threshold, cache=None):
    """{label: figures} for one draw of seed indices. Each arm is compared with the baseline on the drawn seeds
    both have: an arm run on fewer seeds (5 against the baseline's 8) is paired with the baseline's runs of its
    own seeds, never with a mean over seeds it lacks. cache: a dict kept over one bootstrap's draws (the figures
    depend only on which rows are drawn how often, and draws of a few seeds repeat)."""
    cache = {} if cache is None else cache

    def curve(label, seed_indices):
        rows = np.sort(grids[label].drawn(seed_indices))
        key = (label, rows.tobytes())
        if key not in cache:
            cache[key] = curve_figures(grids[label], rows, threshold)
        return None if cache[key] is None else dict(cache[key])

    result = {label: curve(label, drawn) for label in grids}
    base_grid = grids[baseline_label]
    for label, values in result.items():
        if values is None:
            continue
        if result[baseline_label] is None or not math.isfinite(threshold):
            values.update(speedup=(math.nan, math.nan), mean_accuracy_difference=math.nan)
            continue
        if label == baseline_label:  # paired with itself: 1 whenever the ratio is defined
            bounds = (math.nan, math.nan) if values["threshold_at"] == 0 else (1.0, 1.0)
            values.update(speedup=bounds, mean_accuracy_difference=0.0)
            continue
        shared = [i for i in drawn if i in grids[label].rows and i in base_grid.rows]
        arm, base = curve(label, shared), curve(baseline_label, shared)
        if arm is None or base is None:  # no drawn seed that both arms ran
            values.update(speedup=(math.nan, math.nan), mean_accuracy_difference=math.nan)
            continue
        values.update(speedup=speedup_bounds(base["threshold_at"], base["curve_end"], arm["threshold_at"],
                                             arm["curve_end"]),
                      mean_accuracy_difference=arm["mean_accuracy"] - base["mean_accuracy"],
                      baseline_threshold_at=base["threshold_at"])  # on the drawn seeds the arm ran too
    return result


def interval(values):
    """(low, high, left out): the 2.5th and 97.5th percentiles of the defined (non-NaN) resampled values."""
    values = np.asarray(values, dtype=float)
    defined = values[~np.isnan(values)]
    if not len(defined):
        return math.nan, math.nan, len(values)
    low, high = np.quantile(defined, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high), len(values) - len(defined)


def bounded_interval(bounds):
    """The 95% interval of resampled values known as (low, high) bounds (censored ones), each end itself a range:
    {"low": (a, b), "high": (c, d), "undefined": n, "censored": k}. The 2.5th percentile of the true values lies
    between the 2.5th percentiles of the lows and of the highs (and the 97.5th alike)."""
    bounds = np.asarray(bounds, dtype=float).reshape(-1, 2)
    defined = bounds[~np.isnan(bounds[:, 0])]
    if not len(defined):
        return {"low": (math.nan, math.nan), "high": (math.nan, math.nan), "undefined": len(bounds), "censored": 0}
    ends = [tuple(float(np.quantile(defined[:, side], q, method="inverted_cdf")) for side in (0, 1))
            for q in (0.025, 0.975)]
    return {"low": ends[0], "high": ends[1], "undefined": len(bounds) - len(defined),
            "censored": int(np.sum(defined[:, 0] != defined[:, 1]))}


def bootstrap(runs_by_label, baseline_label, axis="time", resamples=RESAMPLES, seed=BOOTSTRAP_SEED,
              fraction=FRACTION, budget=None):
    """Per arm: the point figures on all seeds, and 95% paired-bootstrap intervals for peak, final, mean accuracy
    over the window, its difference from the baseline, and the speed-up. budget: H of the window (see the module
    docstring); give it on the clock axis only."""
    if not resamples >= 1:
        raise ValueError(f"--resamples must be >= 1, got {resamples}")
    evaluated, seeds, window, grids, peak = seed_grids(runs_by_label, baseline_label, axis, budget)
    threshold = fraction * peak if peak > 0 else math.nan  # fixed from here on
    point = figures(grids, range(len(seeds)), baseline_label, threshold)
    rng = np.random.default_rng(seed)
    keys = ("peak", "final", "mean_accuracy", "mean_accuracy_difference")
    drawn = {label: {key: [] for key in (*keys, "speedup", "reached")} for label in grids}
    cache = {}
    for _ in range(resamples):
        for label, values in figures(grids, rng.integers(len(seeds), size=len(seeds)), baseline_label,
                                     threshold, cache).items():
            for key in drawn[label]:
                if values is None:
                    drawn[label][key].append((math.nan, math.nan) if key == "speedup" else math.nan)
                elif key == "reached":
                    drawn[label][key].append(float(values["threshold_at"] is not None))
                else:
                    drawn[label][key].append(values[key])
    result = {}
    for label, runs in runs_by_label.items():
        counts = {"runs": len(runs), "seeds": len(evaluated[label]), "axis": axis, "resamples": resamples,
                  "threshold": threshold, "window": window}
        if point[label] is None:  # no run of this arm has an evaluation
            result[label] = dict(counts, missing=True)
            continue
        reached = np.array(drawn[label]["reached"])
        result[label] = dict(point[label], **counts, missing=False, reached_share=float(np.nanmean(reached)),
                             speedup_ci=bounded_interval(drawn[label]["speedup"]),
                             mean_accuracy_difference_t=paired_t_interval(grids[label], grids[baseline_label]),
                             **{f"{key}_ci": interval(drawn[label][key]) for key in keys})
    return result


def seed_grids(runs_by_label, baseline_label, axis, budget=None):
    """(the runs with evaluations on `axis` per arm, the study's seeds, the mean-accuracy window, each arm's
    SeedGrid, the peak of the baseline's seed-mean curve over all seeds)."""
    if baseline_label not in runs_by_label:
        raise ValueError(f"baseline {baseline_label!r} is not among the methods {sorted(runs_by_label)}")
    evaluated = {label: [on_axis(r, axis) for r in runs if len(r.eval_times_s)] for label, runs in
                 runs_by_label.items()}
    if not evaluated[baseline_label]:
        raise ValueError(f"the baseline {baseline_label!r} has no run with an evaluation: nothing to compare against")
    for label, runs in evaluated.items():
        seeds = [r.seed for r in runs]
        if len(set(map(str, seeds))) < len(seeds):
            raise ValueError(f"{label}: two runs of one seed ({', '.join(r.run_dir for r in runs)}); pairing by seed "
                             "needs one run per seed and arm")
    seeds = list(dict.fromkeys(r.seed for runs in evaluated.values() for r in runs))
    window = auc_window([r for runs in evaluated.values() for r in runs], budget)
    grids = {label: seed_grid(runs, seeds, window) for label, runs in evaluated.items()}
    _, base_mean = mean_curve(grids[baseline_label], grids[baseline_label].drawn(range(len(seeds))))
    return evaluated, seeds, window, grids, float(np.max(base_mean)) if len(base_mean) else math.nan


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); 1.96 beyond.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_t_interval(grid, base_grid):
    """(low, high, 0): the 95% t-interval of the mean of the per-seed differences arm - baseline in mean accuracy,
    over the seeds both ran: a check on the percentile bootstrap, which with 5-8 seeds is narrower (NaN: < 2)."""
    shared = [i for i in grid.rows if i in base_grid.rows]
    if len(shared) < 2:
        return math.nan, math.nan, 0
    differences = np.array([grid.mean_accuracy[grid.rows[i]] - base_grid.mean_accuracy[base_grid.rows[i]]
                            for i in shared])
    quantile = T_975[len(shared) - 2] if len(shared) - 1 <= len(T_975) else 1.96
    half = quantile * float(np.std(differences, ddof=1)) / math.sqrt(len(shared))
    return float(np.mean(differences)) - half, float(np.mean(differences)) + half, 0


SENSITIVITY_FRACTIONS = (0.90, 0.95, 0.97, 0.98, 0.99, 1.00)


def threshold_sensitivity(runs_by_label, baseline_label, label, axis, budget=None, fractions=SENSITIVITY_FRACTIONS):
    """{fraction: the point speed-up of `label` over the baseline (bounds) with the threshold at that fraction of
    the baseline's peak}: how much a speed-up owes to where the threshold sits (Appendix A.4 fixes 0.99)."""
    _, seeds, _, grids, peak = seed_grids(runs_by_label, baseline_label, axis, budget)
    return {fraction: figures(grids, range(len(seeds)), baseline_label, fraction * peak)[label]["speedup"]
            for fraction in fractions}


def sensitivity_line(bounds_by_fraction, axis):
    """'0.90: 1.2x, 0.95: 1.5x, ...' (a bound where a curve does not reach the threshold)."""
    def shown(low, high):
        return "undefined" if math.isnan(low) else f"{_end(low, high)}x"
    unit = "clock" if axis == "time" else "per step"
    return f"{unit}: " + ", ".join(f"{fraction:.2f}: {shown(*bounds)}" for fraction, bounds in
                                   bounds_by_fraction.items())


def _sig(value, digits=2):
    """A speed-up or its bound to `digits` significant digits (1.9, 0.84, 12, 150)."""
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0"
    text = f"{value:#.{digits}g}".rstrip(".")
    return f"{value:.0f}" if "e" in text else text


def _acc(value, digits=2):
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _signed(value):
    return "-" if math.isnan(value) else f"{value:+.2f}".replace("-0.00", "+0.00")


def _ci(low_high_left, number=_acc):
    low, high, left_out = low_high_left
    if math.isnan(low):
        return "undefined"
    return f"[{number(low)}, {number(high)}]" + (f" ({left_out} undefined)" if left_out else "")


def _end(low, high):
    """One end of a speed-up interval from the range it is known to lie in."""
    if low == high:
        return _sig(low)
    if low == 0 and math.isinf(high):  # censored both ways there: neither curve reached the threshold
        return "?"
    if low == 0:
        return f"< {_sig(high)}"
    if math.isinf(high):
        return f"> {_sig(low)}"
    return f"{_sig(low)}-{_sig(high)}"


def speedup_text(figure):
    """The point speed-up and its interval: 'not reached (< 0.83x) [< 0.40, 2.1]'."""
    low, high = figure["speedup"]
    if math.isnan(low):
        point = "undefined"
    elif low == high:
        point = f"{_sig(low)}x"
    elif low == 0 and math.isinf(high):
        point = "neither reached"
    elif low == 0:
        point = f"not reached (< {_sig(high)}x)"
    else:
        point = f"> {_sig(low)}x (baseline not reached)"
    ci = figure["speedup_ci"]
    if math.isnan(ci["low"][0]):
        return f"{point} undefined"
    left_out = f" ({ci['undefined']} undefined)" if ci["undefined"] else ""
    return f"{point} [{_end(*ci['low'])}, {_end(*ci['high'])}]{left_out}"


def axis_table(figures_by_label, runs_by_label, baseline_label, axis, clock=None):
    """One axis's markdown table: per arm its runs, clock, peak, final, the threshold crossing and speed-up, and the
    mean accuracy over the window with its paired difference from the baseline."""
    unit = "s" if axis == "time" else "steps"
    first = figures_by_label[baseline_label]
    start, end = first["window"]
    lines = [f"| method | seeds | steps per run | generate / update / step (s) | peak | final | {unit} to threshold "
             f"| {baseline_label}'s, same seeds | reached in | speed-up ({'time' if axis == 'time' else 'steps'}) "
             f"| mean accuracy, {_fmt_x(start)}-{_fmt_x(end)} {unit} | difference from {baseline_label} |",
             "|---|---|---|---|---|---|---:|---:|---:|---|---|---|"]
    for label, runs in runs_by_label.items():
        f = figures_by_label[label]
        without = f["runs"] - f["seeds"]
        seeds = f"{f['seeds']}" + (f" ({without} of {f['runs']} runs without evaluation)" if without else "")
        steps = ",".join(str(len(r.step_durations_s)) for r in runs)
        cells = [label, seeds, steps, _clock(runs, (clock or {}).get(label))]
        if f["missing"]:
            lines.append("| " + " | ".join(cells + ["missing: no evaluation"] + ["-"] * 7) + " |")
            continue
        at = "not reached" if f["threshold_at"] is None else _fmt_x(f["threshold_at"], axis)
        paired = "-" if label == baseline_label or "baseline_threshold_at" not in f else \
            "not reached" if f["baseline_threshold_at"] is None else _fmt_x(f["baseline_threshold_at"], axis)
        difference = "-" if label == baseline_label else \
            (f"{_signed(f['mean_accuracy_difference'])} {_ci(f['mean_accuracy_difference_ci'], _signed)}, "
             f"t {_ci(f['mean_accuracy_difference_t'], _signed)}")
        cells += [f"{_acc(f['peak'])} {_ci(f['peak_ci'])}", f"{_acc(f['final'])} {_ci(f['final_ci'])}", at, paired,
                  f"{100 * f['reached_share']:.0f}%", speedup_text(f),
                  f"{_acc(f['mean_accuracy'])} {_ci(f['mean_accuracy_ci'])}", difference]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt_x(value, axis="time"):
    return f"{value:.0f}" if axis == "time" or float(value).is_integer() else f"{value:.1f}"


def _clock(runs, recorded=None):
    """generate / update / step seconds per step, mean over the arm's runs' steps; `recorded` ({generate_s,
    update_s, step_s}) stands in where the runs' step times were not kept."""
    durations = [d for r in runs for d in r.step_durations_s if math.isfinite(d)]
    if not durations:
        if not recorded:
            return "not recorded"
        return " / ".join(_acc(recorded.get(k, math.nan), 1) for k in (*compare.PHASES, "step_s")) + " (arm mean)"
    phases = [[r.phase_means_s[k] for r in runs if k in r.phase_means_s] for k in compare.PHASES]
    return " / ".join(_acc(float(np.mean(p)) if p else math.nan, 1) for p in phases) + \
        f" / {_acc(float(np.mean(durations)), 1)}"


def markdown_table(by_axis, runs_by_label, baseline_label, metric="accuracy", clock=None, clock_note=None):
    """The study's tables, per step and on the clock (an axis without recorded times says so in one line;
    clock_note: how the clock's times were obtained, when they are not all measured)."""
    known = next(iter(v for v in by_axis.values() if v))
    first = known[baseline_label]
    lines = [f"Held-out {metric}: paired bootstrap over seeds ({first['resamples']} resamples, seed "
             f"{BOOTSTRAP_SEED}; every arm drawn on the same seeds), 95% intervals in brackets. Baseline: "
             f"{baseline_label}; threshold = {FRACTION} x its peak over all seeds, fixed before resampling. "
             "Speed-up = the baseline's time (steps) to the threshold / the arm's; an arm whose curve ends below it "
             "has not reached it by that end, a bound (< x), never 0x; an interval end written '< x' ('> x') has "
             "censored resamples there, '?' resamples where neither curve reached it, 'a-b' lies between a and b; "
             "'reached in': share of resamples whose mean curve reaches the threshold; the baseline's time to it on "
             "the arm's own seeds is beside each arm's (the speed-up pairs them). Mean accuracy: area under "
             "each seed's curve (trapezoid rule, held at its last evaluation) over the window, divided by its width; "
             "difference: paired, arm - baseline, with the bootstrap's interval and the paired t-interval over the "
             "seeds both ran ('t', wider with 5-8 seeds: the percentile bootstrap understates the spread)."]
    clock_title = f"On the clock, {clock_note}" if clock_note else "On the clock (training wall-clock)"
    for axis, title in (("steps", "Per optimizer step"), ("time", clock_title)):
        figures_by_label = by_axis.get(axis)
        lines += ["", f"{title}:", ""]
        if not figures_by_label:
            lines.append("not recorded: the evaluations' training seconds were not kept for every run.")
            continue
        threshold = figures_by_label[baseline_label]["threshold"]
        lines += [f"threshold {_acc(threshold, 3)}.", ""]
        lines += axis_table(figures_by_label, runs_by_label, baseline_label, axis, clock)
    return "\n".join(lines)


def plot(runs_by_label, by_axis, path, title=None, metric="accuracy"):
    """Accuracy against training time (left) and against steps (right): seed mean, 1.96-SE band (paper Fig. 4),
    and the threshold (0.99 x the baseline's peak)."""
    fig, panels = compare.panels()
    longest_s = max((r.eval_times_s[-1] for runs in runs_by_label.values() for r in runs if len(r.eval_times_s)),
                    default=0)
    for panel, axis in zip(panels, AXES):
        if not by_axis.get(axis):
            panel.set_title(f"{AXES[axis]}: not recorded")
            continue
        scale = 60.0 if axis == "time" and longest_s > 600 else 1.0  # long runs in minutes
        for label, runs in runs_by_label.items():
            curve = compare.method_curve(label, [on_axis(r, axis) for r in runs], min_seeds=0)
            line, = panel.plot(curve.times_s / scale, curve.mean, marker="o", markersize=3,
                               label=compare.seeds_label(label, runs))
            panel.fill_between(curve.times_s / scale, *compare.band_limits(curve.mean, curve.band),
                               color=line.get_color(), alpha=0.2)
        threshold = next(iter(by_axis[axis].values()))["threshold"]
        if compare._finite(threshold):
            panel.axhline(threshold, color="gray", linestyle="--", linewidth=0.8, label="0.99 x baseline peak")
        xlabel = f"training wall-clock ({'min' if scale == 60 else 's'})" if axis == "time" else AXES[axis]
        panel.set(xlabel=xlabel, ylabel=f"held-out {metric}")
        panel.legend(fontsize=8)
    compare.save_figure(fig, path, title)


def report_runs(runs, baseline_label, plot_path=None, title=None, metric="accuracy", resamples=RESAMPLES,
                budget_s=None, clock=None, clock_note=None, jitter=0.0):
    """Group runs (compare.RunData, each already cut to its budget) by method and bootstrap both axes; the clock
    axis is left out (None) when some evaluation's training seconds are not recorded. jitter > 0 adds the clock
    figures' sensitivity to it (`jitter_lines`). Returns (by_axis, table)."""
    if not runs:
        raise ValueError("no runs to compare")
    if not any(len(r.eval_accuracy) for r in runs):
        raise ValueError(f"none of the {len(runs)} runs has an evaluation (no eval lines in metrics.jsonl: stopped "
                         "before the first --eval-interval?); nothing to report")
    runs_by_label = {}
    for run in runs:
        runs_by_label.setdefault(run.label, []).append(run)
    timed = all(np.isfinite(r.eval_times_s).all() for r in runs)
    by_axis = {"time": bootstrap(runs_by_label, baseline_label, "time", resamples, budget=budget_s) if timed else None,
               "steps": bootstrap(runs_by_label, baseline_label, "steps", resamples)}
    table = markdown_table(by_axis, runs_by_label, baseline_label, metric, clock, clock_note)
    if jitter and timed:
        table += "\n\n" + "\n".join(jitter_lines(runs_by_label, baseline_label, jitter, resamples, budget_s))
    table += "".join(f"\n- settings differ between runs: {d}" for d in compare.config_differences(runs))
    if plot_path:
        plot(runs_by_label, by_axis, plot_path, title, metric)
    return by_axis, table


JITTER_DRAWS = 10


def jitter_lines(runs_by_label, baseline_label, jitter, resamples=RESAMPLES, budget_s=None, draws=JITTER_DRAWS):
    """How far the clock's intervals move when each run's evaluation times are scaled by a factor drawn uniformly
    from [1 - jitter, 1 + jitter] (one per run and draw, a seeded generator): a machine's clock varies by a few
    percent from run to run. One line per arm: the range of each interval end over the draws."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    ends = {label: {"low": [], "high": [], "difference": []} for label in runs_by_label}
    for _ in range(draws):
        scaled = {label: [dataclasses.replace(r, eval_times_s=r.eval_times_s * rng.uniform(1 - jitter, 1 + jitter))
                          for r in runs] for label, runs in runs_by_label.items()}
        for label, f in bootstrap(scaled, baseline_label, "time", resamples, budget=budget_s).items():
            if not f["missing"]:
                ends[label]["low"].append(_end(*f["speedup_ci"]["low"]))
                ends[label]["high"].append(_end(*f["speedup_ci"]["high"]))
                ends[label]["difference"].append(_ci(f["mean_accuracy_difference_ci"], _signed))
    lines = [f"Clock jitter: {draws} draws, each run's times x U[{1 - jitter:g}, {1 + jitter:g}]; the speed-up "
             "interval's ends and the mean-accuracy difference's interval seen over the draws:"]
    for label, seen in ends.items():
        if label != baseline_label and seen["low"]:
            low, high, difference = (", ".join(dict.fromkeys(seen[key])) for key in ("low", "high", "difference"))
            lines.append(f"- {label}: low end {low}; high end {high}; difference {difference}")
    return lines


def report(run_dirs, baseline_label, plot_path=None, title=None, metric="accuracy", resamples=RESAMPLES,
           budget_s=None, jitter=0.0):
    """Read the run folders (compare.py's rules; runs of different budgets refused unless budget_s, to which each
    is cut: `compare.within_budget`) and report them (`report_runs`); draws the plot when plot_path is given."""
    runs = [compare.read_run(path, metric=metric) for path in compare.expand_run_dirs(run_dirs)]
    compare.check_budgets(runs, budget_s)
    return report_runs([compare.within_budget(r, budget_s) for r in runs], baseline_label, plot_path, title, metric,
                       resamples, budget_s, jitter=jitter)


def main(argv=None):
    from studies import studydata

    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="study.py bootstrap", description="peak, final and mean accuracy and the "
                                     "speed-up with paired 95% bootstrap intervals over seeds, per step and on "
                                     "the clock")
    parser.add_argument("run_dirs", nargs="+", help="run folders (or folders of them); with --from-data, data "
                        "files (studydata.py) or folders of them")
    parser.add_argument("--from-data", action="store_true", help="read committed data files, not run folders")
    parser.add_argument("--baseline-label", required=True, help='e.g. "GRPO 16/16"')
    parser.add_argument("--plot", help="PNG path")
    parser.add_argument("--table", help="also write the markdown table here")
    parser.add_argument("--json", help="also write the figures as JSON")
    parser.add_argument("--export-data", metavar="DIR", help="also write each run's data file (studydata.py) here")
    parser.add_argument("--metric", choices=compare.METRICS, default="accuracy")
    parser.add_argument("--resamples", type=resample_count, default=RESAMPLES)
    parser.add_argument("--title")
    parser.add_argument("--budget-s", type=compare.budget_seconds, help="read every run as one with this "
                        "--max-time-s (a run given a longer budget: its steps and evaluations past it left out)")
    parser.add_argument("--estimate-clock", action="store_true", help="with --from-data: place evaluations whose "
                        "seconds were not recorded at step x the arm's mean step time (reported as an estimate)")
    parser.add_argument("--jitter", type=float, default=0.0, help="also show how the clock's intervals move when "
                        "each run's times are scaled by up to +- this fraction (e.g. 0.03)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.jitter) and 0 <= args.jitter < 1):
        parser.error(f"--jitter must be in [0, 1), got {args.jitter}")
    if args.estimate_clock and not args.from_data:
        parser.error("--estimate-clock is for data files whose seconds were not recorded: give --from-data")
    if args.from_data and args.export_data:
        parser.error("--export-data writes data files from run folders: it cannot be given with --from-data")
    if args.from_data:
        runs, clock = studydata.read_study(args.run_dirs, args.metric)
        compare.check_budgets(runs, args.budget_s)
        runs = [compare.within_budget(r, args.budget_s) for r in runs]
        note = None
        if args.estimate_clock:
            runs, note = studydata.estimate_clock(runs, clock), ("ESTIMATED: an evaluation's training seconds, where "
                                                                 "not recorded, = its step x the arm's mean step time")
        by_axis, table = report_runs(runs, args.baseline_label, args.plot, args.title, args.metric, args.resamples,
                                     args.budget_s, clock, note, args.jitter)
    else:
        by_axis, table = report(args.run_dirs, args.baseline_label, args.plot, args.title, args.metric,
                                args.resamples, args.budget_s, args.jitter)
    if args.export_data:
        studydata.export_runs(args.run_dirs, args.export_data, args.metric)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(by_axis, indent=1))
    return by_axis

