"""Does PODS help? The paper's main comparison (Sec. 4, settings (a)-(d): PODS n/m against GRPO m/m, the same rows
trained per step) and its n and rule ablations (Figs. 5, 6), at demo scale on CPU: `python study.py pods`.

Every arm trains m = 4 rows of each of the same 4 prompts per step: GRPO 4/4 (the baseline) against PODS max_variance
16/4 (the paper's method), random 16/4 (the control: the extra rollouts without the rule) and max_variance 8/4 and 32/4
(n scaling); seeds 0-7 for the first two, 0-4 for random, 0-2, 4 and 5 for the n arms (PODS_SEEDS; a seed gives every
arm the same prompt order). One run at a time on a quiet machine (the arms are compared on the clock), from a committed
checkout; 256 greedy held-out prompts every 100 s of training in every arm, so no arm is favoured by being evaluated
more often on the clock. The report (bootstrap.py's paired intervals over seeds) is per optimizer step (learning per
step, whatever the hardware) and on the CPU clock, where PODS pays for its extra rollouts, with the share of the clock
difference that is generation, each run's curve, and the pilot's "still rising" line. Simplifications: one demo-scale
task (2-digit addition, SmolLM2-135M, lr 1e-4, 600 s per run) where the paper ran 3B-7B models on GSM8K and MATH on
GPUs; the clock is a CPU's, on which generation is far from free.

    python study.py pods --out runs/pods --arms grpo --seeds 0 1   # the pilot: is GRPO 4/4 still rising at T/3?
    python study.py pods --out runs/pods                           # the study (~7 h on 2 cores), its report
    python study.py pods --from-data results/pods                  # the report recomputed from the data files
"""

import argparse
import json
import math
import shlex
import subprocess
from pathlib import Path

import numpy as np

from studies import bootstrap
import compare as compare_module
from studies import studydata
from studies import studyrun

# {arm: (rule, n)}: every arm trains m = PODS_UPDATE_SIZE rows of each prompt (the same update cost) and differs in
# how many rollouts it generates per prompt and which m it keeps.
PODS_ARMS = {"grpo": ("none", 4), "pods": ("max_variance", 16), "random": ("random", 16),
             "pods8": ("max_variance", 8), "pods32": ("max_variance", 32)}
PODS_UPDATE_SIZE = 4
# The seeds of each arm (--seeds: the same for every arm). Every arm of a seed trains on one machine, so that each
# paired clock comparison is within a machine: seeds 0-3 (0-2 of the n arms) ran on one 2-core VM (an AMD EPYC),
# the rest on another (an Intel Xeon, ~30% slower a step in float32). The n arms' seed 3 would have paired runs of
# the second machine with baseline runs of the first, so the n arms run seeds 4 and 5 instead.
PODS_SEEDS = {"grpo": tuple(range(8)), "pods": tuple(range(8)), "random": tuple(range(5)), "pods8": (0, 1, 2, 4, 5),
              "pods32": (0, 1, 2, 4, 5)}
PODS_BASELINE = "GRPO 4/4"
PODS_CONTROL = ("PODS max_variance 16/4", "PODS random 16/4")  # a second table: the control against the method
# THE TASK, LEARNING RATE AND BUDGET, set after the pilot (run_pods' docstring: the candidates and the reasoning). The
# GA study's 2-digit addition at lr 5e-4 was on its plateau within 5-20 GRPO-GA steps; the study needs a baseline
# whose mean curve still rises at a third of the budget (`rising_line`). The pilot, GRPO 4/4 at lr 1e-4 (seed 0, 900 s
# planned, stopped at 704 s; its data file: results/pods-pilot): greedy held-out accuracy 0.33, 0.30, 0.57, 0.63,
# 0.66, 0.68, 0.67, 0.65 at 0, 104, 212, 305, 406, 508, 607, 704 training seconds: on its plateau from ~400 s, so with
# 900 s a third of the budget (300 s) is already at 0.63 against ~0.66 over the rest (not rising by the 0.06 margin),
# while with 600 s a third (200 s) is at ~0.54 against ~0.64 over the rest: rising. Hence 600 s; the study's own GRPO
# 4/4 seeds answer the same question again in its report.
PODS_TASK = {"--dataset": "arithmetic", "--num-train-rows": "1000", "--learning-rate": "1e-4"}
# What else the study changes in STUDY_TRAIN_ARGS: 4 prompts per step, 256 held-out prompts (greedy: SE <= 3.1
# points) on the same training-seconds cadence for every arm (an arm evaluated more often on the clock would be
# favoured by the peak and the threshold crossing), no step cadence, a checkpoint every 10 minutes.
PODS_EVAL_INTERVAL_S = 100.0
PODS_SETTINGS = {**PODS_TASK, "--prompts-per-step": "4", "--eval-samples": "256", "--eval-interval": "0",
                 "--eval-interval-s": f"{PODS_EVAL_INTERVAL_S:g}", "--checkpoint-interval-s": "600",
                 "--prefix-sharing": "on"}  # each distinct token computed once: every arm's clock as it is today
# ... and every 10th step's rollouts (what each rule kept) in <run>/completions/, for reading why an arm learned or not
PODS_TRAIN_ARGS = (studyrun.with_settings(studyrun.STUDY_TRAIN_ARGS, PODS_SETTINGS)
                   + ("--log-completions-interval", "10"))
PODS_MAX_TIME_S = 600.0
PODS_DATA = Path(__file__).resolve().parents[1] / "results" / "pods"  # the committed data files (studydata.py) and pods.md
DATA_SUBFOLDER = "data"  # a study's own data files go to <out>/data unless --data names another folder
# The clock's intervals are quoted with how far their ends move when each run's clock is off by up to 10%: on this
# shared machine GRPO 4/4's median update took 2.5-3.1 s in its first four seeds, at the same completion lengths.
PODS_CLOCK_JITTER = 0.10
PODS_RISING_MARGIN = 2 * 0.5 / int(PODS_SETTINGS["--eval-samples"]) ** 0.5  # two SEs of one evaluation, at most


def pods_plan(arms=tuple(PODS_ARMS), seeds=None):
    """{run name: train.py method flags}: each arm of PODS_ARMS among `arms` for each of its seeds (None:
    PODS_SEEDS[arm]), seed-major (a study cut short has whole seeds, the first seeds of every arm)."""
    unknown = sorted(set(arms) - set(PODS_ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}: choose among {list(PODS_ARMS)}")
    per_arm = {arm: list(seeds) if seeds is not None else list(PODS_SEEDS[arm]) for arm in arms}
    runs = {}
    for seed in sorted({seed for arm_seeds in per_arm.values() for seed in arm_seeds}):
        for arm in arms:
            if seed in per_arm[arm]:
                rule, n = PODS_ARMS[arm]
                name = f"{'grpo' if rule == 'none' else rule}-n{n}-m{PODS_UPDATE_SIZE}-s{seed}"
                runs[name] = ["--rule", rule, "--num-rollouts", str(n), "--update-size", str(PODS_UPDATE_SIZE),
                              "--seed", str(seed)]
    return runs


def clock_lines(runs, baseline_label=PODS_BASELINE):
    """Per arm, its mean generate / update / step seconds and, against the baseline, how much of the step-time
    difference is generation: the arms train the same rows, so their updates cost about the same and the clock
    difference is the extra rollouts (what the paper's single-device comparison pays for)."""
    by_label = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)

    def means(label):
        phases = [r.phase_means_s for r in by_label[label]]
        steps = [d for r in by_label[label] for d in r.step_durations_s if np.isfinite(d)]
        values = {k: float(np.mean([p[k] for p in phases if k in p])) if any(k in p for p in phases) else math.nan
                  for k in compare_module.PHASES}
        return dict(values, step_s=float(np.mean(steps)) if steps else math.nan)

    lines = ["Per-step clock (mean over each arm's steps; the rest of a step is rewards and selection):", ""]
    base = means(baseline_label) if baseline_label in by_label else None
    for label in by_label:
        m = means(label)
        if not all(math.isfinite(v) for v in m.values()):
            lines.append(f"- {label}: not recorded (the runs' per-step generate / update times were not kept)")
            continue
        line = f"- {label}: generate {m['generate_s']:.1f} s, update {m['update_s']:.1f} s, step {m['step_s']:.1f} s"
        if base and all(math.isfinite(v) for v in base.values()) and label != baseline_label:
            step, generate = m["step_s"] - base["step_s"], m["generate_s"] - base["generate_s"]
            # a share of a difference within the steps' own spread says nothing
            share = f"{100 * generate / step:.0f}%" if abs(step) >= 0.05 * base["step_s"] else "step times within 5%"
            line += (f"; {step:+.1f} s per step against {baseline_label}, of which generation {generate:+.1f} s "
                     f"({share})")
        lines.append(line)
    return lines


CONTROL_NOTE = (f"Per optimizer step, {PODS_CONTROL[1]} trains on 4 of 16 independent rollouts chosen uniformly at "
                f"random: distributed exactly as {PODS_BASELINE}'s 4 fresh rollouts, so random against "
                f"{PODS_BASELINE} per step is a null (A/A) comparison by construction, and its spread above is the "
                "noise of this many seeds. Whether the rule matters is this direct comparison, on the seeds both "
                "ran: max-variance against random, the same extra rollouts chosen by the rule or by chance.")


def sensitivity_lines(runs, label, budget_s, baseline_label=PODS_BASELINE):
    """How much `label`'s speed-up over the baseline owes to where the threshold sits (0.99 x the baseline's peak
    above): the point speed-up at other fractions, per step and on the clock. The mean accuracy over the window
    (the difference column) needs no threshold: it is the figure to lead with where this moves."""
    by_label = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    lines = [f"Threshold sensitivity of {label}'s speed-up over {baseline_label} (point figures at each fraction "
             "of the baseline's peak; the tables use 0.99):", ""]
    for axis in ("steps", "time"):
        if axis == "time" and not all(np.isfinite(r.eval_times_s).all() for r in runs):
            continue
        bounds = bootstrap.threshold_sensitivity(by_label, baseline_label, label, axis,
                                                 budget_s if axis == "time" else None)
        lines.append("- " + bootstrap.sensitivity_line(bounds, axis))
    return lines


def rising_line(runs, budget_s, baseline_label=PODS_BASELINE, margin=PODS_RISING_MARGIN):
    """The pilot's question, in one line: is the baseline's seed-mean curve still rising at a third of the budget?
    Yes when its mean accuracy over [T/3, T] exceeds its accuracy at T/3 by more than `margin` (two standard
    errors of one evaluation); a task on which it has already plateaued leaves the study nothing to resolve."""
    base = [r for r in runs if r.label == baseline_label and len(r.eval_times_s)]
    if not base:
        return f"Pilot: no {baseline_label} run with evaluations."
    curve = compare_module.method_curve(baseline_label, base, min_seeds=0)
    end = float(budget_s) if budget_s else float(curve.times_s[-1])
    third = end / 3
    if not len(curve.times_s) or curve.times_s[-1] < third:
        return f"Pilot: {baseline_label}'s mean curve ends before a third of the budget ({third:.0f} s)."
    at_third = float(np.interp(third, curve.times_s, curve.mean))
    later = bootstrap.mean_accuracy(curve.times_s, curve.mean, third, end)
    rising = later - at_third > margin
    advice = "" if rising else ": make the task harder or the learning rate lower (PODS_TASK)"
    return (f"Pilot: {baseline_label} ({len(base)} seed{'s' if len(base) > 1 else ''}): mean accuracy "
            f"{at_third:.2f} at a third of the budget ({third:.0f} s), {later:.2f} on average over the rest, peak "
            f"{float(np.max(curve.mean)):.2f}: {'still rising' if rising else 'NOT rising'} at a third of the budget "
            f"(margin {margin:.2f}){advice}.")


def arm_label(rule, n):
    """The method label train.py writes for an arm (compare.method_label): how the report finds each arm's runs."""
    return f"GRPO {n}/{PODS_UPDATE_SIZE}" if rule == "none" else f"PODS {rule} {n}/{PODS_UPDATE_SIZE}"


def in_arm_order(runs):
    """The runs by arm, in PODS_ARMS' order (baseline, method, control, n scaling), then by seed."""
    order = [arm_label(rule, n) for rule, n in PODS_ARMS.values()]
    return sorted(runs, key=lambda r: (order.index(r.label) if r.label in order else len(order), str(r.seed)))


def run_table(runs):
    """Each run's held-out accuracy at each evaluation, with the training seconds and the step of each: the per-seed
    curves behind every figure of the report."""
    lines = ["Each run's held-out accuracy at each evaluation (training seconds / step of each):", "",
             "| method | seed | held-out accuracy | training s | step | peak | final |",
             "|---|---:|---|---|---|---:|---:|"]
    for run in runs:
        if not len(run.eval_accuracy):
            lines.append(f"| {run.label} | {run.seed} | no evaluation | | | | |")
            continue
        lines.append(f"| {run.label} | {run.seed} | {' '.join(f'{a:.2f}' for a in run.eval_accuracy)} | "
                     f"{' '.join(f'{t:.0f}' for t in run.eval_times_s)} | "
                     f"{' '.join(str(int(k)) for k in run.eval_steps)} | {np.max(run.eval_accuracy):.2f} | "
                     f"{run.eval_accuracy[-1]:.2f} |")
    return lines


def per_seed_plot(runs, path, title=None):
    """One panel per arm and axis (training seconds above, optimizer steps below): each seed's curve, thin, and the
    seed mean, thick; the baseline's seed mean drawn dashed in every panel for reference."""
    by_label = {}
    for run in runs:
        if len(run.eval_accuracy):
            by_label.setdefault(run.label, []).append(run)
    fig, panels = compare_module.panels(2, len(by_label), figsize=(3.2 * len(by_label), 6), sharey=True,
                                        squeeze=False)
    for row, axis in enumerate(bootstrap.AXES):
        base = compare_module.method_curve(PODS_BASELINE, [bootstrap.on_axis(r, axis) for r in
                                                           by_label.get(PODS_BASELINE, [])], min_seeds=0) \
            if PODS_BASELINE in by_label else None
        for column, (label, arm_runs) in enumerate(by_label.items()):
            panel = panels[row][column]
            placed = [bootstrap.on_axis(r, axis) for r in arm_runs]
            for run in placed:
                panel.plot(run.eval_times_s, run.eval_accuracy, linewidth=0.8, alpha=0.6)
            curve = compare_module.method_curve(label, placed, min_seeds=0)
            panel.plot(curve.times_s, curve.mean, color="black", linewidth=2, label=f"mean of {len(placed)}")
            if base is not None and label != PODS_BASELINE:
                panel.plot(base.times_s, base.mean, color="gray", linestyle="--", label=f"{PODS_BASELINE} mean")
            panel.set(title=label if row == 0 else None, xlabel=bootstrap.AXES[axis], ylim=(0, 1))
            panel.legend(fontsize=7)
        panels[row][0].set_ylabel("held-out accuracy")
    compare_module.save_figure(fig, path, title)


def pods_report(runs, budget_s, plot=None, resamples=bootstrap.RESAMPLES, cost=None):
    """The study's report from its runs (compare.RunData, each cut to budget_s): the arms against GRPO 4/4 per step
    and on the clock (bootstrap.py: paired intervals, speed-up, mean accuracy over the budget; each arm paired with
    the baseline on the seeds both ran; how far the clock's intervals move under PODS_CLOCK_JITTER), random against
    max-variance 16/4 the same way, the per-step clock split into generation and update, the pilot line, the cost
    line when given, and each run's curve. plot: the mean curves there, and each seed's curves beside it
    (<stem>_seeds.png)."""
    runs = in_arm_order(runs)
    labels = {r.label for r in runs}
    if PODS_BASELINE not in labels:
        raise ValueError(f"no {PODS_BASELINE} run (arm grpo): the report compares every arm against it")
    seeds = len({r.seed for r in runs})
    title = f"Does PODS help? m = {PODS_UPDATE_SIZE} rows per prompt, demo scale, {seeds} seeds, 1.96 SE bands"
    _, table = bootstrap.report_runs(runs, PODS_BASELINE, plot, title, resamples=resamples, budget_s=budget_s,
                                     jitter=PODS_CLOCK_JITTER)
    parts = [f"## Every arm against {PODS_BASELINE}", "", table]
    if PODS_CONTROL[0] in labels:
        parts += ["", *sensitivity_lines(runs, PODS_CONTROL[0], budget_s)]
    if set(PODS_CONTROL) <= labels:
        control = [r for r in runs if r.label in PODS_CONTROL]
        _, control_table = bootstrap.report_runs(control, PODS_CONTROL[0], resamples=resamples, budget_s=budget_s)
        parts += ["", f"## {PODS_CONTROL[1]} against {PODS_CONTROL[0]} (does max-variance matter?)", "",
                  CONTROL_NOTE, "", control_table]
    parts += ["", *clock_lines(runs), "", rising_line(runs, budget_s), *(["", cost] if cost else []), "",
              *run_table(runs)]
    if plot:
        plot = Path(plot)
        per_seed_plot(runs, plot.with_name(f"{plot.stem}_seeds{plot.suffix}"),
                      f"Each seed's held-out accuracy (thin lines) and their mean, {budget_s:g} s of training per run"
                      if budget_s else None)
    return "\n".join(parts)


def write_pods_data(run_dirs, data_dir, budget_s, command, add=False):
    """Each run's data file (studydata.export_runs) and study.json (the budget, the settings, the commit) in
    data_dir: what the tables are recomputed from (`python study.py pods --from-data DATA_DIR`). A run data file
    already there that this export does not write (an earlier export's run) is removed: the report reads every data
    file of the folder, and must read this study's runs only. add: a study continued in another --out, whose earlier
    runs are in data_dir's files only: they are kept with their recorded costs, and the earlier export's command
    and commit go to study.json's "earlier"; refused unless study.json records this study's budget and settings.
    A run data file that git tracks (committed data) is never removed: the export is refused first, naming it."""
    study_file = Path(data_dir) / studydata.STUDY_FILE
    earlier = earlier_export(data_dir, budget_s) if add else {}
    names = {f"{Path(run_dir).name}.json" for run_dir in run_dirs}
    stale = [] if add else [path for path in sorted(Path(data_dir).glob("*.json"))
                            if path.name not in names and path.name != studydata.STUDY_FILE and _is_run_data(path)]
    committed = studydata.tracked_by_git(stale)
    if committed:
        raise ValueError(f"--data {data_dir} holds committed run data that this study's runs would replace "
                         f"({', '.join(p.name for p in committed[:3])}{', ...' if len(committed) > 3 else ''}): "
                         "give a --data folder of its own (default: <out>/data), or --add-to-data to report them "
                         "together")
    studydata.export_runs(run_dirs, data_dir)
    for path in stale:
        print(f"removing {path}: not among the runs reported now", flush=True)
        path.unlink()
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or None
    costs = {key: {**earlier.get(key, {}), **values} for key, values in run_costs(run_dirs).items()}
    history = earlier.get("earlier", []) + ([{"command": earlier.get("command"), "commit": earlier.get("commit")}]
                                            if earlier else [])
    studydata.write_record({"study": "pods", "baseline": PODS_BASELINE, "budget_s": budget_s, "commit": commit,
                            "command": command, "train_args": list(PODS_TRAIN_ARGS), **costs,
                            **({"earlier": history} if history else {})}, study_file)


def _is_run_data(path):
    try:
        return compare_module.read_json_object(path).get("format") == studydata.FORMAT
    except ValueError:
        return False


def earlier_export(data_dir, budget_s):
    """The study.json of the export a study continued in a new --out adds to (--add-to-data), refused unless it
    records this study's budget and settings: its runs and the new ones must be one study."""
    study_file = Path(data_dir) / studydata.STUDY_FILE
    if not study_file.is_file():
        raise ValueError(f"--add-to-data: {data_dir} has no {studydata.STUDY_FILE} (no earlier export to add to)")
    earlier = compare_module.read_json_object(study_file)
    for key, now in (("budget_s", budget_s), ("train_args", list(PODS_TRAIN_ARGS))):
        if earlier.get(key) != now:
            raise ValueError(f"--add-to-data: {study_file} records another {key} than this study's: its runs and "
                             "these would not be one study")
    return earlier


def run_costs(run_dirs):
    """{"run_wall_s": {run: seconds the study's train.py process took}, "run_eval_s": {run: seconds its evaluations
    took}} from the run folders (study_done.json, the eval lines of metrics.jsonl): the study's cost."""
    wall, evaluation = {}, {}
    for run_dir in map(Path, run_dirs):
        done = run_dir / "study_done.json"
        if done.is_file():
            wall[run_dir.name] = round(float(json.loads(done.read_text())["wall_s"]), 1)
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        evaluation[run_dir.name] = round(sum(line.get("eval/eval_s", 0.0) for line in lines
                                             if line.get("type") == "eval"), 1)
    return {"run_wall_s": wall, "run_eval_s": evaluation}


def cost_line(runs, wall_s, eval_s):
    """The study's cost in one line, from the recorded process and evaluation seconds of each run."""
    names = [Path(r.run_dir).stem for r in runs]  # a run's data file is named after its folder
    walls = [wall_s[n] for n in names if n in wall_s]
    if not walls:
        return "Cost: not recorded."
    evaluation = [eval_s[n] for n in names if n in eval_s]
    return (f"Cost: {len(walls)} runs, {sum(walls) / 3600:.1f} h one after the other; a run took "
            f"{min(walls) / 60:.1f}-{max(walls) / 60:.1f} min (mean {np.mean(walls) / 60:.1f}), its training budget "
            f"plus its evaluations ({np.mean(evaluation):.0f} s a run on average) and loading.")


def report_pods_data(data_dir, budget_s=None, plot=None, resamples=bootstrap.RESAMPLES, seeds=None):
    """The report recomputed from data files (studydata.py): the budget recorded in study.json unless given; seeds:
    only those seeds' runs (a part of the study, e.g. the seeds one machine ran)."""
    runs, _ = studydata.read_study([data_dir])
    if seeds is not None:
        seeds = set(seeds)
        absent = sorted(seeds - {r.seed for r in runs})
        if absent:
            raise ValueError(f"--seeds: {data_dir} holds no run of seed {', '.join(map(str, absent))}")
        runs = [r for r in runs if r.seed in seeds]
    study_file = Path(data_dir) / studydata.STUDY_FILE
    recorded = compare_module.read_json_object(study_file) if study_file.is_file() else {}
    budget_s = recorded.get("budget_s") if budget_s is None else budget_s
    compare_module.check_budgets(runs, budget_s, flag="--max-time-s")
    cost = cost_line(runs, recorded.get("run_wall_s", {}), recorded.get("run_eval_s", {}))
    return pods_report([compare_module.within_budget(r, budget_s) for r in runs], budget_s, plot, resamples, cost)


def check_finished_runs(out_dir, runs, max_time_s, train_args, num_threads):
    """A finished run (study_done.json) is skipped, so one trained with other flags (a pilot before PODS_TASK
    changed, another budget) would enter the report as if it were this study's: refused, naming the run."""
    for name, flags in runs.items():
        done = Path(out_dir) / name / "study_done.json"
        if not done.is_file():
            continue
        recorded = [arg for arg in json.loads(done.read_text()).get("command", [])[2:] if arg != "--resume"]
        expected = studyrun.train_flags(Path(out_dir) / name, flags, max_time_s, num_threads, train_args,
                                        PODS_TRAIN_ARGS)
        if "--output-dir" in recorded:  # the same folder, however --out was spelled
            recorded[recorded.index("--output-dir") + 1] = expected[expected.index("--output-dir") + 1]
        if recorded != expected:
            changed = [(f"{expected[i - 1]} " if i and expected[i - 1].startswith("--") else "") + f"{a} (now {b})"
                       for i, (a, b) in enumerate(zip(recorded, expected)) if a != b] or ["flags added or left out"]
            raise ValueError(f"{done.parent} was trained with other flags than this study's ({', '.join(changed[:3])})"
                             ": give another --out, or delete the run to train it again")


def run_pods(out_dir, arms=tuple(PODS_ARMS), seeds=None, max_time_s=PODS_MAX_TIME_S, train_args=(), dry_run=False,
             num_threads=studyrun.TIMED_NUM_THREADS, data_dir=None, plot=None, resamples=bootstrap.RESAMPLES,
             train_script=Path(__file__).resolve().parents[1] / "train.py", report_only=False, add_to_data=False):
    """Does PODS help? Train every run of pods_plan (one at a time), then write the report to <out>/pods.md and
    <data_dir>/pods.md, the plot to <out>/pods.png (or `plot`), and each run's data file to data_dir (None:
    <out>/data; the committed data are PODS_DATA, given as data_dir only on purpose); returns the report.
    report_only: train nothing and report the finished runs (study_done.json) of a study still under way
    or cut short, leaving out a run in progress. add_to_data: keep data_dir's run files, the report covering them
    and this --out's runs (write_pods_data's add: a study continued in a new --out).

    The task (PODS_TASK), for a pilot to confirm. The model is the demo's SmolLM2-135M (the study runs on CPU), so
    the candidates are the tasks it can learn something of. Probed at step 0 (one-shot prompt, 32 completion tokens):
    - 2-digit addition, lr 1e-4 (the recommended candidate; no code needed): greedy held-out accuracy 0.33, and the
      GA study's runs reached ~0.62-0.68, so there is room; sampled at temperature 1, a rollout is correct 8% of
      the time (16 prompts x 16 samples), so a group of 4 rollouts has an accuracy spread for ~21% of prompts
      against ~43% for 16 and ~52% for 32: the regime where generating more rollouts can give PODS more to learn
      from per step. What plateaued at once in the GA study was the learning rate: 5e-4 put GRPO-GA on its plateau
      within 5-20 steps and made PODS's curves swing by +-0.1 between evaluations. At 1e-4 Adam's steps are 5x
      smaller, so the same progress takes ~5x the steps, and the curves should be steadier. The pilot (one GRPO
      4/4 seed) put the plateau at ~400 s: the budget is 600 s (PODS_MAX_TIME_S; the figures above PODS_TASK).
    - 3-digit addition (data.load_split's max_digits=3; train.py has no flag for it yet): greedy accuracy 0-6% at
      step 0 (16-64 prompts), the format breaking at 32 tokens (the target is 33: give 48). Harder than a 135M
      model may learn within the budget: GRPO 4/4 would see a correct rollout in few groups, and a flat baseline
      says nothing either. A second study, if the first saturates even at 1e-4.
    - GSM8K (../shared/data): the paper's task, but a 135M model solves almost none of it, and its 200+-token
      completions make a step ~10x slower on CPU: settings (a)-(d) on a GPU, with train.py directly.
    A pilot: `--arms grpo --seeds 0 1` (two baseline runs); the report's last line says whether the baseline's
    mean curve still rises at a third of the budget. If not, lower the learning rate (or make the task harder) in
    PODS_TASK, or shorten the budget, commit, and run the pilot again; then run the study from that commit."""
    runs = pods_plan(arms, seeds)
    data_dir = Path(out_dir) / DATA_SUBFOLDER if data_dir is None else data_dir
    command = ["python", "study.py", "pods", "--out", str(out_dir), "--arms", *arms] + \
        (["--seeds", *map(str, seeds)] if seeds is not None else []) + ["--max-time-s", f"{max_time_s:g}"] + \
        (["--add-to-data"] if add_to_data else []) + (["--", *train_args] if train_args else [])
    check_finished_runs(out_dir, runs, max_time_s, train_args, num_threads)
    if add_to_data:
        earlier_export(data_dir, max_time_s)  # refused before anything is trained
    if report_only:
        present = [Path(out_dir) / name for name in runs if (Path(out_dir) / name / "study_done.json").is_file()]
        missing = [name for name in runs if Path(out_dir) / name not in present]
        in_data = [name for name in missing if add_to_data and (Path(data_dir) / f"{name}.json").is_file()]
        missing = [name for name in missing if name not in in_data]
        print(f"reporting the {len(present)} finished runs of {len(runs)}"
              + (f" and {len(in_data)} from {data_dir}'s data files" if in_data else "")
              + (f"; not finished: {', '.join(missing)}" if missing else ""), flush=True)
    else:
        present = studyrun.trained_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script,
                                        PODS_TRAIN_ARGS)
    if dry_run:
        return None
    out_dir = Path(out_dir)
    if not present:
        raise ValueError(f"{out_dir}: no run of the study has {'finished' if report_only else 'a metrics.jsonl'}; "
                         "nothing to report")
    write_pods_data(present, data_dir, max_time_s, shlex.join(command), add=add_to_data)
    table = report_pods_data(data_dir, max_time_s, plot or out_dir / "pods.png", resamples)  # as it recomputes
    for folder in (out_dir, Path(data_dir)):
        (folder / "pods.md").write_text(table + "\n")
    print(f"\n{table}\nplot: {plot or out_dir / 'pods.png'}; data: {data_dir}", flush=True)
    return table


PODS_USAGE = """Does PODS help? Every arm trains m = 4 rows of each of the same 4 prompts per step: GRPO 4/4 (the
baseline), PODS max_variance 16/4, PODS random 16/4 (the control), PODS max_variance 8/4 and 32/4 (n scaling); seeds
0-7 for the first two, 0-4 for random, 0-2, 4 and 5 for 8/4 and 32/4 (--seeds: the same for every arm). One run at a
time on a quiet machine, every arm of a seed on the same machine, from a committed (pinned) checkout; 256 greedy
held-out prompts every 100 s of training in every arm.

  python study.py pods --out runs/pods --arms grpo --seeds 0 1      # the pilot: is GRPO 4/4 still rising at T/3?
  python study.py pods --out runs/pods --dry-run                    # the 31 train.py commands
  python study.py pods --out runs/pods                              # the study (~7 h: 13 min a run), then its report
  python study.py pods --out runs/pods --report-only                # the report of the runs finished so far
  python study.py pods --out runs/more --add-to-data                # a study continued in a new --out (below)
  python study.py pods --from-data results/pods                     # the report recomputed from the data files
  python study.py pods --from-data results/pods --seeds 4 5 6 7     # ... from some seeds' runs only
  python study.py bootstrap --from-data results/pods --baseline-label "GRPO 4/4" --budget-s 600   # its first table alone

The run writes <out>/pods.md, pods.png (the seed means) and pods_seeds.png (each seed's curve), and <out>/data/
(--data): one data file per run, study.json (budget, settings, the reporting checkout's commit) and pods.md, to
commit as results/pods (--data results/pods writes there; committed data files are never removed). Settings:
pods_study.py's PODS_TASK / PODS_SETTINGS (set the task and learning rate there after the pilot); arguments after --
go to every train.py run. A study whose run folders are gone (a new machine) continues in a new
--out with --add-to-data: the runs already in the data folder are kept and reported with the new ones (--seeds and
--arms pick the runs left to train)."""


def main(argv):
    """`python study.py pods ...` (PODS_USAGE)."""
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="study.py pods", description=PODS_USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder of the run folders (required unless --from-data)")
    parser.add_argument("--from-data", metavar="DIR", help="report from data files (studydata.py); trains nothing")
    parser.add_argument("--arms", nargs="+", choices=list(PODS_ARMS), default=list(PODS_ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds of every arm (default: 0-7 for grpo and pods, "
                        "0-4 for random, 0-2, 4, 5 for pods8 and pods32: PODS_SEEDS); with --from-data: report only "
                        "these seeds' runs")
    parser.add_argument("--max-time-s", type=compare_module.budget_seconds, help="training wall-clock per run (default "
                        f"{PODS_MAX_TIME_S:g}; with --from-data: the budget the runs are read at, default the one "
                        "study.json records)")
    parser.add_argument("--num-threads", type=int, default=studyrun.TIMED_NUM_THREADS, help="torch CPU threads per "
                        "run (the study is timed: one run at a time, a quiet machine, both cores)")
    parser.add_argument("--data", help="where the runs' data files, study.json and pods.md go (default: <out>/data; "
                        "the committed ones are results/pods: give it to replace them on purpose)")
    parser.add_argument("--plot", help="the plot's path (default <out>/pods.png; none with --from-data unless given)")
    parser.add_argument("--resamples", type=bootstrap.resample_count, default=bootstrap.RESAMPLES,
                        help="bootstrap resamples")
    parser.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    parser.add_argument("--report-only", action="store_true", help="train nothing: report the runs already finished "
                        "(a study under way or cut short; a run in progress is left out)")
    parser.add_argument("--add-to-data", action="store_true", help="keep the data folder's run files and report them "
                        "with this --out's runs (a study continued in a new --out); refused unless the data folder's "
                        "study.json records this study's budget and settings")
    args = parser.parse_args(argv)
    if args.report_only and args.dry_run:
        parser.error("--report-only trains nothing and --dry-run only prints the train.py commands: give one of them")
    if args.from_data:
        if args.out or args.dry_run or args.report_only or args.add_to_data or train_args:
            parser.error("--from-data reports committed data: it trains nothing (no --out, --dry-run, --report-only, "
                         "--add-to-data or -- flags)")
        table = report_pods_data(args.from_data, args.max_time_s, args.plot, args.resamples, args.seeds)
        print(table)
        return table
    if not args.out:
        parser.error("give --out DIR (where the runs go) or --from-data DIR (report committed data)")
    return run_pods(args.out, tuple(args.arms), args.seeds, args.max_time_s or PODS_MAX_TIME_S, train_args,
                    args.dry_run, args.num_threads, args.data, args.plot, args.resamples,
                    report_only=args.report_only, add_to_data=args.add_to_data)
