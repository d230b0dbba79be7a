"""Comparing runs as the paper does: accuracy vs wall-clock time, confidence bands, speed-up ratio.

Paper §4 figures: held-out accuracy against training wall-clock time, mean over seeds with a band;
Appendix A.4: speed-up = (time for the baseline to first reach 0.99x its own peak accuracy) / (time for the
method to reach that same accuracy). study.py runs the down-sampling-rule and n/m studies and calls this.

    python compare.py RUN_DIR... --plot out.png [--table out.md] [--baseline-label "GRPO 4/4"] [--budget-s S]

With a single method (e.g. the one demo run) the curve and the table come without a speed-up.

Curve rules (documented, tested): each seed's eval points (eval lines of metrics.jsonl, or --eval-file
written by eval.py) are joined linearly (--interp step: held until the next eval). A method's curve lives on
the union of its seeds' eval times; outside a seed's own [first, last] eval time that seed has no value
(no extrapolation), and only grid times where >= --min-seeds seeds have a value are kept (ragged runs end
where too few seeds remain). Band = mean +- 1.96 * sample-std / sqrt(k) over the k seeds present; one seed
gives no band. Threshold crossing times are interpolated the same way as the curve. What is left out (runs
without evals, unreadable lines, eval points whose time or value is not a finite number) is listed under the table.
Runs of different budgets (config max_time_s / max_steps) are not pooled: refused, unless --budget-s S reads every
run as one of S seconds of training (`within_budget`; a run trained for less than S, or runs of different step
limits, still refused).
"""

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from run import checkpoint
from run import report

Z_95 = 1.96
METRICS = ("accuracy", "format_accuracy", "both_accuracy")
PHASES = ("generate_s", "update_s")  # the per-step clock a comparison reports beside the curves
# Config keys that legitimately differ between the runs of one comparison: the method (rule, n/m, GRPO-GA and the
# variant flags its label names), the seed, bookkeeping. Any other difference is listed under the table.
PER_RUN_KEYS = {"label", "rule", "num_rollouts", "update_size", "seed", "output_dir", "resume", "progress",
                "value_sources",
                "baseline", "grad_accum_steps", "loss_aggregation", "clip_eps_high", "scale_rewards",
                "selection_scope", "mask_truncated", "drop_zero_variance", "dynamic_sampling",
                "dynamic_sampling_metric", "report_to"}


@dataclass
class RunData:
    run_dir: str
    label: str
    seed: object
    eval_times_s: np.ndarray      # training wall-clock of each evaluation (eval/checkpoint time excluded)
    eval_accuracy: np.ndarray
    step_durations_s: np.ndarray  # wall-clock of each optimizer step, in step order
    step_phases_s: dict           # generate_s / update_s of each step, NaN where not logged
    skipped_lines: int = 0        # unreadable lines (e.g. a run killed mid-write)
    config: dict = field(default_factory=dict)
    nonfinite_evals: int = 0      # eval points left out: their time or value is not a finite number (NaN)
    eval_steps: np.ndarray = field(default_factory=lambda: np.empty(0))  # the step of each evaluation
    cannot_learn: Counter = field(default_factory=Counter)  # steps that gave the update nothing to learn, by why

    @property
    def phase_means_s(self):
        """Mean seconds per step of each phase over the steps that logged it (derived: a cut run keeps it right)."""
        return {k: float(np.nanmean(v)) for k, v in self.step_phases_s.items() if np.isfinite(v).any()}


@dataclass
class MethodCurve:
    label: str
    runs: list
    times_s: np.ndarray
    mean: np.ndarray
    band: np.ndarray              # 1.96 * SE; NaN where fewer than 2 seeds
    count: np.ndarray             # seeds present at each grid time
    notes: list = field(default_factory=list)


def _read_jsonl(path):
    records, skipped = [], 0
    for line in filter(str.strip, Path(path).read_text().splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            skipped += 1
    return records, skipped


def read_json_object(path):
    """The JSON object a results file holds; ValueError (one line naming the file) for one cut short, not UTF-8, not
    JSON, or holding something else than an object."""
    try:
        record = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON, cut short or corrupt ({error.msg}, line {error.lineno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: holds a JSON {type(record).__name__}, not the object a results file holds")
    return record


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def method_label(config):
    return str(config["label"]) if config.get("label") else \
        f"{config.get('rule', '?')} {config.get('num_rollouts', '?')}/{config.get('update_size', '?')}"


def read_run(run_dir, eval_file=None, metric="accuracy"):
    """One run's eval curve of `metric` and its step times. A step logged twice (resume) keeps its last line."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    run_dir = Path(run_dir)
    metrics_path = run_dir / checkpoint.METRICS_FILE
    if not (run_dir / checkpoint.CONFIG_FILE).is_file() or not metrics_path.is_file():
        raise ValueError(f"{run_dir}: not a run directory (needs config.json and metrics.jsonl)")
    config = checkpoint.read_run_config(run_dir)
    records, skipped = _read_jsonl(metrics_path)
    train = {r["step"]: r for r in records if r.get("type", "train") == "train" and "step" in r}
    if eval_file:
        points = eval_file_points(run_dir / eval_file, metric)
    else:
        points = {r["step"]: (r.get("elapsed_s"), r.get(f"eval/{metric}")) for r in records
                  if r.get("type") == "eval" and "step" in r}
    points = [(t, a, s) for s, (t, a) in points.items() if a is not None]  # lines without the metric: not its curve
    finite = sorted((t, a, s) for t, a, s in points if _finite(t) and _finite(a))
    steps = [train[s] for s in sorted(train)]
    elapsed = [r.get("elapsed_s") for r in steps]
    if steps and all(_finite(t) for t in elapsed):
        durations = np.diff(np.array([0.0] + elapsed))
    else:  # no training clock: fall back to the sum of the phase timers
        durations = np.array([sum(r.get(k) or 0.0 for k in report.PHASE_KEYS) for r in steps])
    step_phases = {k: np.array([r[k] if _finite(r.get(k)) else np.nan for r in steps], dtype=float)
                   for k in PHASES if any(_finite(r.get(k)) for r in steps)}
    return RunData(str(run_dir), method_label(config), config.get("seed"),
                   np.array([t for t, _, _ in finite], dtype=float), np.array([a for _, a, _ in finite], dtype=float),
                   durations.astype(float), step_phases, skipped, config, len(points) - len(finite),
                   np.array([s for _, _, s in finite], dtype=float),
                   Counter(code for r in steps for code in r.get("cannot_learn") or ()))


def eval_file_points(path, metric):
    """{step: (training seconds, mean `metric`)} of an eval.py results file; a file that is missing, cut short, not
    UTF-8 or not eval.py's is one ValueError naming it."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file (eval.py writes it: python eval.py --checkpoint RUN)")
    try:
        return {r["step"]: (r["elapsed_s"], r[metric]["mean"])
                for r in read_json_object(path)["results"].values()}
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: not an eval.py results file (no {error} in it)") from None


def within_budget(run, budget_s):
    """The run as one of `--max-time-s budget_s` would have logged it: train.py does not start a step that would
    probably end past the budget (after step k when elapsed_k + duration_k > budget_s), so its steps up to there
    (their per-phase clock too) and the evaluations made at those steps. (Such a run also evaluates after its last
    step; this one's last kept evaluation is the one before.) Without step lines, the evaluations up to budget_s.
    None or 0: no budget; a run trained with that budget or less: itself. A run whose step times or evaluation times
    are not recorded cannot be cut: refused."""
    if not budget_s or 0 < _budget(run)[0] <= budget_s:
        return run
    durations, phases = np.asarray(run.step_durations_s, dtype=float), run.step_phases_s
    if len(durations) and np.isfinite(durations).all():
        over = np.nonzero(np.cumsum(durations) + durations > budget_s)[0]
        last_step = int(over[0]) + 1 if len(over) else len(durations)
        keep, durations = run.eval_steps <= last_step, durations[:last_step]
        phases = {k: v[:last_step] for k, v in phases.items()}
    elif not len(durations) and np.isfinite(run.eval_times_s).all():
        keep = run.eval_times_s <= budget_s
    else:
        raise ValueError(f"{run.run_dir}: its step or evaluation times are not recorded, so it cannot be cut to a "
                         f"budget of {budget_s:g} s (leave out --budget-s)")
    return replace(run, eval_times_s=run.eval_times_s[keep], eval_accuracy=run.eval_accuracy[keep],
                   eval_steps=run.eval_steps[keep], step_durations_s=durations, step_phases_s=phases)


def budget_seconds(text):
    """argparse type of a time budget (--budget-s, study.py's --max-time-s): a finite number of seconds > 0 (a
    negative one would cut every run to its first step; NaN would read as no budget)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _budget(run):
    """(max_time_s, max_steps) of the run's config; 0 = no limit (as train.py reads it)."""
    return tuple(float(run.config.get(key) or 0) for key in ("max_time_s", "max_steps"))


def check_budgets(runs, budget_s=None, flag="--budget-s"):
    """Refuse to pool runs trained to different budgets (a 180 s and a 600 s run are not two seeds of one curve, and
    arms of different budgets are not on the same footing). With budget_s every run is read as one of budget_s
    seconds: each must have trained at least that long, and all to the same step limit. flag: the command's name
    for budget_s, in the refusals."""
    def listing(key_of):
        groups = {}
        for run in runs:
            groups.setdefault(key_of(run), []).append(Path(run.run_dir).name)
        return groups, "; ".join(f"{key}: {', '.join(names)}" for key, names in groups.items())

    if budget_s:
        short = [f"{Path(r.run_dir).name} ({_budget(r)[0]:g} s)" for r in runs if 0 < _budget(r)[0] < budget_s]
        if short:
            raise ValueError(f"{flag} {budget_s:g}: runs trained for less cannot be read as runs of that budget: "
                             f"{', '.join(short)}")
        groups, text = listing(lambda r: f"max_steps {_budget(r)[1]:g}")
        if len(groups) > 1:
            raise ValueError(f"runs of different step limits ({flag} cuts the clock, not the steps): {text}")
        return
    groups, text = listing(lambda r: f"max_time_s {_budget(r)[0]:g}, max_steps {_budget(r)[1]:g}")
    if len(groups) > 1:
        raise ValueError(f"runs of different budgets are not pooled as seeds: {text}. Pass {flag} S to read "
                         "every run as one of S seconds of training, or compare them apart")


def band_limits(mean, band):
    """The plotted band mean -/+ band, held to [0, 1] (every metric is a fraction: a 1.96-SE band over few seeds can
    overshoot it); where there is no band (one seed, NaN), the mean itself."""
    band = np.nan_to_num(band)
    return np.clip(mean - band, 0.0, 1.0), np.clip(mean + band, 0.0, 1.0)


def values_on_grid(times_s, accuracy, grid_s, interp="linear"):
    """A seed's accuracy at each grid time; NaN before its first and after its last evaluation."""
    if interp not in ("linear", "step"):
        raise ValueError(f"interp must be 'linear' or 'step', got {interp!r}")
    out = np.full(len(grid_s), np.nan)
    if len(times_s) == 0:
        return out
    inside = (grid_s >= times_s[0]) & (grid_s <= times_s[-1])
    if interp == "linear":
        out[inside] = np.interp(grid_s[inside], times_s, accuracy)
    else:
        out[inside] = accuracy[np.searchsorted(times_s, grid_s[inside], side="right") - 1]
    return out


def method_curve(label, runs, interp="linear", min_seeds=2):
    """Mean curve and 1.96*SE band across seeds on the union of their eval times.

    min_seeds <= 0 means every seed must be present; it is capped at the number of seeds with evals."""
    with_evals = [r for r in runs if len(r.eval_times_s)]
    notes = [f"{Path(r.run_dir).name}: no evaluation, left out" for r in runs if not len(r.eval_times_s)]
    if not with_evals:
        return MethodCurve(label, runs, *(np.empty(0) for _ in range(4)), notes + ["no evaluations"])
    needed = len(with_evals) if min_seeds <= 0 else min(min_seeds, len(with_evals))
    grid = np.unique(np.concatenate([r.eval_times_s for r in with_evals]))
    values = np.stack([values_on_grid(r.eval_times_s, r.eval_accuracy, grid, interp) for r in with_evals])
    count = np.sum(~np.isnan(values), axis=0)
    keep = count >= needed
    grid, values, count = grid[keep], values[:, keep], count[keep]
    mean = np.array([np.mean(col[~np.isnan(col)]) for col in values.T])
    band = np.array([Z_95 * np.std(col[~np.isnan(col)], ddof=1) / math.sqrt(k) if k > 1 else np.nan
                     for col, k in zip(values.T, count)])
    ends = sorted(float(r.eval_times_s[-1]) for r in with_evals)
    if ends[0] != ends[-1]:
        notes.append(f"seeds' last evals at {ends[0]:.0f}-{ends[-1]:.0f} s; curve kept while >= {needed} seeds")
    if len(with_evals) == 1:
        notes.append("1 seed: no band")
    return MethodCurve(label, runs, grid, mean, band, count, notes)


def first_time_reaching(times_s, values, threshold, interp="linear"):
    """First time the curve is >= threshold (linear: interpolated crossing), None if it never is."""
    above = np.nonzero(values >= threshold)[0]
    if len(above) == 0:
        return None
    i = above[0]
    if i == 0 or interp == "step":
        return float(times_s[i])
    t0, t1, v0, v1 = times_s[i - 1], times_s[i], values[i - 1], values[i]
    return float(t0 + (threshold - v0) / (v1 - v0) * (t1 - t0))


def speedup_rows(curves, baseline_label, interp="linear", fraction=0.99):
    """Per method: peak accuracy, time to fraction x (baseline peak), speed-up vs the baseline (Appendix A.4).
    baseline_label None (one method): no threshold, time or speed-up (those fields are None)."""
    by_label = {c.label: c for c in curves}
    if baseline_label is not None and baseline_label not in by_label:
        raise ValueError(f"baseline {baseline_label!r} is not among the methods {sorted(by_label)}")
    base = by_label.get(baseline_label)
    base_peak = float(np.max(base.mean)) if base is not None and len(base.mean) else float("nan")
    threshold = fraction * base_peak if base is not None else None
    base_time = first_time_reaching(base.times_s, base.mean, threshold, interp) if base_peak > 0 else None
    rows = []
    for c in curves:
        time_s = first_time_reaching(c.times_s, c.mean, threshold, interp) if base_peak > 0 else None
        if base is None:  # one method: nothing to compare against
            speedup = None
        elif not base_peak > 0:
            speedup = "undefined (baseline peak is 0 or missing)"
        elif base_time == 0:  # T_b / T_m = 0 / T_m: the ratio says nothing about speed
            speedup = "undefined (baseline reaches the threshold at 0 s)"
        elif time_s is None:
            speedup = "not reached"
        elif time_s == 0:
            speedup = "inf (reached at 0 s)"
        else:
            speedup = f"{base_time / time_s:.2f}x"
        steps = np.concatenate([r.step_durations_s for r in c.runs]) if c.runs else np.empty(0)
        evals = [len(r.eval_times_s) for r in c.runs]
        rows.append({"method": c.label, "seeds": len(c.runs), "evals_per_seed": evals,
                     "curve_end_s": float(c.times_s[-1]) if len(c.times_s) else None,
                     "peak_accuracy": float(np.max(c.mean)) if len(c.mean) else None,
                     "peak_band": float(c.band[np.argmax(c.mean)]) if len(c.mean) else None,
                     "time_to_threshold_s": time_s, "speedup": speedup,
                     "step_s": float(np.mean(steps)) if len(steps) else None,
                     **{k: float(np.mean([r.phase_means_s[k] for r in c.runs if k in r.phase_means_s]))
                        for k in PHASES if any(k in r.phase_means_s for r in c.runs)},
                     "threshold": threshold, "notes": c.notes})
    return rows


def _fmt(value, digits=3):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(rows, baseline_label, fraction=0.99, metric="accuracy"):
    """The rows as markdown; baseline_label None: no time-to-threshold and speed-up columns."""
    with_speedup = baseline_label is not None
    intro = (f"Held-out {metric}. Baseline: {baseline_label}; threshold = {fraction} x its peak = "
             f"{_fmt(rows[0]['threshold'] if rows else None)}." if with_speedup
             else f"Held-out {metric}, one method (no speed-up: that needs a baseline).")
    speedup_head, speedup_rule = ("| time to threshold (s) | speed-up ", "---:|---|") if with_speedup else ("", "")
    lines = [intro + " Peak = max of the seed-mean curve (+- 1.96 SE there).", "",
             f"| method | seeds | evals per seed | curve ends (s) | peak {metric} {speedup_head}"
             "| mean step time (s) | generate / update (s) |", f"|---|---:|---|---:|---|{speedup_rule}---:|---|"]
    for r in rows:
        peak = _fmt(r["peak_accuracy"]) + (f" +- {_fmt(r['peak_band'])}" if _finite(r["peak_band"]) else "")
        speedup = f"| {_fmt(r['time_to_threshold_s'], 1)} | {r['speedup']} " if with_speedup else ""
        lines.append(f"| {r['method']} | {r['seeds']} | {','.join(map(str, r['evals_per_seed']))} "
                     f"| {_fmt(r['curve_end_s'], 0)} | {peak} {speedup}| {_fmt(r['step_s'], 2)} "
                     f"| {_fmt(r.get('generate_s'), 2)} / {_fmt(r.get('update_s'), 2)} |")
    notes = [f"- {r['method']}: {note}" for r in rows for note in r["notes"]]
    return "\n".join(lines + ([""] + notes if notes else []))


def seeds_label(label, runs):
    """A curve's legend: its method and how many seeds its mean is over ("n" is the rollout count in the labels)."""
    return f"{label}, {len(runs)} seed{'s' if len(runs) != 1 else ''}"


def plot_curves(curves, path, threshold=None, title=None, metric="accuracy"):
    """Left: accuracy vs training wall-clock (mean line through the evaluations, marked; 1.96 SE band). Right:
    per-step time by step (each step marked: a run of one step is one point)."""
    from matplotlib.ticker import MaxNLocator

    minutes = max((c.times_s[-1] for c in curves if len(c.times_s)), default=0) > 600
    scale = 60.0 if minutes else 1.0  # long runs in minutes
    fig, (left, right) = panels()
    for c in curves:
        line, = left.plot(c.times_s / scale, c.mean, marker="o", markersize=3, label=seeds_label(c.label, c.runs))
        left.fill_between(c.times_s / scale, *band_limits(c.mean, c.band), color=line.get_color(), alpha=0.2)
        durations = [r.step_durations_s for r in c.runs if len(r.step_durations_s)]
        if durations:
            width = max(len(d) for d in durations)
            padded = np.array([np.pad(d, (0, width - len(d)), constant_values=np.nan) for d in durations])
            right.plot(np.arange(1, width + 1), np.nanmean(padded, axis=0), color=line.get_color(), marker="o",
                       markersize=3, label=c.label)
    if threshold is not None and _finite(threshold):
        left.axhline(threshold, color="gray", linestyle="--", linewidth=0.8, label="0.99 x baseline peak")
    left.set(xlabel=f"training wall-clock ({'min' if minutes else 's'})", ylabel=f"held-out {metric}")
    left.legend(fontsize=8)
    right.set(xlabel="step", ylabel="step time (s), mean over seeds")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    save_figure(fig, path, title or f"Held-out {metric} against training time (seed mean, 1.96 SE band); step time")


def panels(rows=1, columns=2, figsize=(12, 4.5), **options):
    """A headless figure of rows x columns panels (every plot of the repository: compare.py's, bootstrap.py's, the
    PODS study's per-seed curves); options go to plt.subplots."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=figsize, **options)


def save_figure(fig, path, title=None):
    """The end of every plot: its title, the layout, the file (its folder made), the figure closed."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cannot_learn_note(run):
    """The line under the table of a run some of whose steps gave the update nothing to learn from (metrics.jsonl's
    "cannot_learn", report.learning_signal), with what to change."""
    codes = run.cannot_learn.most_common()
    return (f"- {run.run_dir}: steps that could not learn: " + ", ".join(f"{count} {code}" for code, count in codes)
            + f" of {len(run.step_durations_s)} steps; {report.CANNOT_LEARN[codes[0][0]]}")


def config_differences(runs):
    """'key: value (n runs), value (n runs)' for every other setting that is not the same in all runs
    (e.g. a preset edited between runs: their curves are then not comparable)."""
    differences = []
    for key in sorted(set().union(*(r.config for r in runs)) - PER_RUN_KEYS):
        counts = Counter(json.dumps(r.config.get(key), sort_keys=True) for r in runs)
        if len(counts) > 1:
            differences.append(f"{key}: " + ", ".join(f"{v} ({n} runs)" for v, n in counts.items()))
    return differences


def expand_run_dirs(paths):
    expanded = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        is_run = (path / checkpoint.METRICS_FILE).exists()
        inner = [] if is_run else sorted(p.parent for p in path.glob(f"*/{checkpoint.METRICS_FILE}"))
        expanded += inner or [path]
    return expanded


def compare(run_dirs, *, baseline_label=None, interp="linear", min_seeds=2, eval_file=None, plot=None,
            title=None, metric="accuracy", budget_s=None):
    """Read runs, group seeds by label, build curves, and return (rows, markdown table).

    A folder that is not a run but holds runs (e.g. a study's --out) stands for all of them. Runs of different
    budgets are refused (`check_budgets`) unless budget_s reads each as a run of that budget (`within_budget`)."""
    runs, problems = [], []
    for run_dir in expand_run_dirs(run_dirs):
        try:
            runs.append(read_run(run_dir, eval_file, metric))
        except (ValueError, OSError, KeyError, json.JSONDecodeError) as error:
            problems.append(f"- skipped {run_dir}: {error}")
    if not runs:
        raise ValueError("no readable run directory: " + "; ".join(p.removeprefix("- skipped ") for p in problems))
    settings = Counter(f"{r.config.get('preset')} ({r.config.get('dataset')}, {r.config.get('model')})" for r in runs)
    if len(settings) > 1:  # seeds of one label on two datasets are not one method's curve
        raise ValueError(f"runs of different presets, datasets or models (compare them apart): {dict(settings)}")
    check_budgets(runs, budget_s)
    runs = [within_budget(r, budget_s) for r in runs]
    problems += [f"- {r.run_dir}: {r.skipped_lines} unreadable metrics lines skipped" for r in runs if r.skipped_lines]
    problems += [f"- {r.run_dir}: {r.nonfinite_evals} eval points left out, their time or {metric} not a finite number"
                 for r in runs if r.nonfinite_evals]
    problems += [f"- settings differ between runs: {d}" for d in config_differences(runs)]
    problems += [cannot_learn_note(r) for r in runs if r.cannot_learn]
    labels = list(dict.fromkeys(r.label for r in runs))
    if len(labels) == 1 and baseline_label in (None, labels[0]):  # nothing to compare against: no speed-up
        baseline_label = None
    elif baseline_label is None:
        grpo = [label for label in labels if label.upper().startswith("GRPO")]
        if len(grpo) != 1:
            raise ValueError(f"cannot pick the baseline among {labels}: pass --baseline-label")
        baseline_label = grpo[0]
    curves = [method_curve(label, [r for r in runs if r.label == label], interp, min_seeds) for label in labels]
    rows = speedup_rows(curves, baseline_label, interp)  # checks that the baseline is among them
    table = markdown_table(rows, baseline_label, metric=metric) + ("\n" + "\n".join(problems) if problems else "")
    if plot:
        plot_curves(curves, plot, rows[0]["threshold"], title, metric)
    return rows, table


def compare_benchmarks(run_dirs, eval_files, *, plot=None, title=None, metric="accuracy", **options):
    """`compare` on each benchmark's eval.py result file (paper Appendix: trained on GSM8K, evaluated on GSM8K Platinum
    and MATH-500) -> ({file: rows}, the tables one after another); plot: one accuracy panel per benchmark, side by
    side."""
    rows, tables, curves = {}, [], {}
    for eval_file in eval_files:
        rows[eval_file], table = compare(run_dirs, eval_file=eval_file, metric=metric, **options)
        tables.append(f"### {eval_file}\n\n{table}")
        runs = [read_run(run_dir, eval_file, metric) for run_dir in expand_run_dirs(run_dirs)]
        curves[eval_file] = [method_curve(label, [r for r in runs if r.label == label], options.get("interp", "linear"),
                                          options.get("min_seeds", 2)) for label in dict.fromkeys(r.label for r in runs)]
    if plot:
        fig, axes = panels(1, len(eval_files), figsize=(5 * len(eval_files), 4.5), squeeze=False)
        for ax, (eval_file, file_curves) in zip(axes[0], curves.items()):
            for c in file_curves:
                line, = ax.plot(c.times_s, c.mean, marker="o", markersize=3, label=seeds_label(c.label, c.runs))
                ax.fill_between(c.times_s, *band_limits(c.mean, c.band), color=line.get_color(), alpha=0.2)
            ax.set(title=eval_file, xlabel="training wall-clock (s)", ylabel=f"held-out {metric}")
            ax.legend(fontsize=8)
        save_figure(fig, plot, title or f"Held-out {metric} on each benchmark against training time (seed mean)")
    return rows, "\n\n".join(tables)


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="compare.py", description="accuracy vs wall-clock, speed-up")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--plot", help="PNG path")
    parser.add_argument("--table", help="also write the markdown table here")
    parser.add_argument("--json", help="also write the per-method rows as JSON")
    parser.add_argument("--baseline-label", help="default: the one label starting with GRPO")
    parser.add_argument("--interp", choices=("linear", "step"), default="linear")
    parser.add_argument("--min-seeds", type=int, default=2, help="seeds needed at a time point (0 = all)")
    parser.add_argument("--eval-file", nargs="+", help="read accuracy from <run>/<this> (eval.py output) instead of "
                        "metrics; several (e.g. eval_test.json eval_gsm8k-platinum_test.json): one table each and "
                        "their accuracy panels side by side in --plot")
    parser.add_argument("--metric", choices=METRICS, default="accuracy",
                        help="held-out metric to compare (both_accuracy = correct and well-formatted)")
    parser.add_argument("--title")
    parser.add_argument("--budget-s", type=budget_seconds, help="read every run as one of this --max-time-s (runs of "
                        "different budgets are otherwise refused)")
    args = vars(parser.parse_args(argv))
    table_path, json_path = args.pop("table"), args.pop("json")
    eval_files = args.pop("eval_file") or [None]
    if len(eval_files) > 1:  # benchmarks side by side
        rows, table = compare_benchmarks(eval_files=eval_files, **args)
    else:
        rows, table = compare(eval_file=eval_files[0], **args)  # every other flag is one of compare()'s arguments
    print(table)
    if table_path:
        Path(table_path).write_text(table + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as error:  # a missing path, no runs, no baseline, the disk: one line
        sys.exit(f"compare.py: error: {error}")
