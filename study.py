"""The paper's down-sampling-rule study (Fig. 5), an n/m study, a loss-variant study and PODS vs GRPO-GA (settings
(e), (f)), at demo scale on CPU.

`run`: trains train.py's demo preset (SmolLM2-135M on synthetic addition) with each rule (max_variance, random,
max_reward, percentile) at n/m = 16/4 and the GRPO baseline (n = m = 4), and max_variance with m = 4 and
n in {4, 8, 16}, for every seed, one subprocess at a time; then compares them with compare.py (accuracy vs
wall-clock with 1.96 SE bands, speed-up ratio of paper Appendix A.4) into plots and markdown tables.
`variants`: PODS max_variance 16/4 with the paper's objective, with DAPO's token-level loss aggregation
(--loss-aggregation token) and with DAPO's clip-higher (--clip-eps-high 0.28), compared the same way against
the paper's objective (variants.png, variants.md). All three take 2 optimizer steps per rollout batch
(--updates-per-batch 2): with one, the ratio pi/pi_old is 1 and clip-higher could not change anything.
`ga`: the paper's comparison that does not depend on the hardware: every arm generates the same 16 rollouts for
each of 4 prompts per step; GRPO-GA (GRPO 16/16) trains on all 64, accumulating the gradient over micro-batches,
PODS max_variance 16/4 on 16 of them, and a random 16/4 control on 16 random ones (does max-variance matter, or
only fewer rows?). A 256-prompt held-out set every 5 steps; peak and final accuracy and the speed-up on the time
and the step axis with 95% bootstrap intervals over seeds (bootstrap.py): <out>/ga.md, ga.json, ga.png (--plot).
`pods`: does PODS help? The paper's single-device comparison: every arm trains m = 4 rows of each of the same 4
prompts per step; GRPO 4/4 (the baseline) against PODS max_variance 16/4, random 16/4 (the control) and
max_variance 8/4 and 32/4 (n scaling), 8 or 5 seeds, 256 held-out prompts every 100 s of training in every arm;
the report per step and on the clock (how much of the clock difference is generation), the runs' data files in
results/pods (`python study.py pods --help`: the pilot, the study, the report recomputed from the data).

    python study.py run --out runs/study --seeds 0 1 2 --max-time-s 120 [-- extra train.py flags]
    python study.py variants --out runs/variants --seeds 0 1 2 --max-time-s 150 [-- extra train.py flags]
    python study.py ga --out runs/ga --seeds 0 1 2 3 4 [--max-time-s 900] [--plot P] [-- extra train.py flags]
    python study.py pods --out runs/pods [--arms grpo ...] [--seeds ...] [-- extra train.py flags]
    python study.py pods --from-data results/pods   (the report recomputed from the committed data files)
    python study.py compare RUN_DIR...            (an alias of python compare.py)

Every setting the recorded tables depend on is passed explicitly (`STUDY_TRAIN_ARGS`), evaluation
temperature included, so the documented command measures the same thing whatever the demo preset becomes.
Resumable: a finished run has <out>/<name>/study_done.json and is skipped; an interrupted one continues
from its checkpoint (train.py --resume) or starts over; a failed one is listed and retried on the next call.
Simplification: demo scale only; the paper-scale settings (a)-(d) are run with train.py directly.
"""

import argparse
import dataclasses
import itertools
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import bootstrap
import compare as compare_module
import grpo_loss
import rewards
import runfolder
import studydata
from compare import compare

METRIC_FILES = (("accuracy", ""), ("both_accuracy", "_both"))  # study output: rules.png, rules_both.png, ...
STUDY_RULES = ("max_variance", "random", "max_reward", "percentile")  # paper Fig. 5, plus the GRPO baseline
STUDY_SYSTEM_PROMPT = "Reason inside <think> </think>, then answer inside <answer> </answer>."
# The settings of the recorded study, all explicit (a later edit of the demo preset or of a flag's default
# cannot change them): SmolLM2-135M with LoRA r=16 on 2-digit addition with a one-shot example, fitted to a
# shared 2-core CPU: one prompt per step (the authors' single-GPU config), a 20-prompt greedy held-out set
# every 3 steps, only the final checkpoint. The method flags (rule, n, m, seed) come from study_plan; flags
# after `--` override all of these.
STUDY_TRAIN_ARGS = (
    "--model", "smollm2-135m-offline", "--lora-rank", "16", "--lora-alpha", "32",
    "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--no-bf16",
    "--no-gradient-checkpointing", "--dataset", "arithmetic", "--num-train-rows", "1000", "--one-shot",
    "--system-prompt", STUDY_SYSTEM_PROMPT, "--max-prompt-tokens", "256", "--advantage-normalization", "selected",
    "--reward-options", "", "--prompts-per-step", "1", "--grad-accum-steps", "1",
    "--updates-per-batch", "1", "--clip-eps", "0.2", "--kl-coef", "0", "--learning-rate", "5e-4",
    "--scale-rewards", "group", "--selection-scope", "prompt", "--no-drop-zero-variance", "--no-dynamic-sampling",
    "--clip-eps-high", "0.2", "--loss-aggregation", "sequence", "--no-mask-truncated", "--report-to", "none",
    "--weight-decay", "0", "--max-grad-norm", "1.0", "--optimizer", "adamw", "--temperature", "1.0",
    "--top-p", "1.0", "--max-completion-tokens", "32", "--rollout-batch-size", "64", "--micro-batch-size", "16",
    "--eval-samples", "20", "--eval-interval", "3", "--eval-interval-s", "0", "--eval-temperature", "0",
    "--checkpoint-interval-s", "100000", "--prefix-sharing", "off")  # the recorded studies ran every row in full


def study_plan(seeds, rules=STUDY_RULES, num_rollouts=16, update_size=4, nm_values=(4, 8, 16)):
    """{run name: train.py method flags} and {study: [run names]} for the demo preset.

    Rule study: every rule at n/m = num_rollouts/update_size, plus GRPO at n = m = update_size.
    n/m study: max_variance with m = update_size and each n in nm_values (n = m is the GRPO baseline);
    runs shared by both studies (GRPO, max_variance 16/4) are trained once."""
    runs, studies = {}, {"rules": [], "nm": []}

    def add(study_name, rule, n, seed):
        if n == update_size:
            name, flags = f"grpo-n{n}-m{n}-s{seed}", ["--rule", "none"]
        else:
            name, flags = f"{rule}-n{n}-m{update_size}-s{seed}", ["--rule", rule]
        runs[name] = flags + ["--num-rollouts", str(n), "--update-size", str(update_size), "--seed", str(seed)]
        studies[study_name].append(name)

    for seed in seeds:  # seed-major, rule study first: a study cut short still has whole seeds
        add("rules", "none", update_size, seed)
        for rule in rules:
            add("rules", rule, num_rollouts, seed)
    for seed in seeds:
        for n in nm_values:
            add("nm", "max_variance", n, seed)
    return runs, studies


# The variant study: {name: flags on top of the paper's objective}; every arm takes VARIANT_UPDATES_PER_BATCH
# optimizer steps per rollout batch (module docstring).
VARIANTS = {"paper": [], "token": ["--loss-aggregation", "token"], "cliphigh": ["--clip-eps-high", "0.28"]}
VARIANT_UPDATES_PER_BATCH = 2


def variants_plan(seeds, num_rollouts=16, update_size=4):
    """({run name: train.py method flags}, the baseline's label): each of VARIANTS with max_variance n/m, per seed."""
    runs = {f"{name}-n{num_rollouts}-m{update_size}-s{seed}": [
        "--rule", "max_variance", "--num-rollouts", str(num_rollouts), "--update-size", str(update_size), "--seed",
        str(seed), "--updates-per-batch", str(VARIANT_UPDATES_PER_BATCH), *flags]
        for seed in seeds for name, flags in VARIANTS.items()}  # seed-major: a study cut short has whole seeds
    return runs, f"PODS max_variance {num_rollouts}/{update_size}"


def with_settings(args, settings):
    """args with the value after each flag of settings ({flag: value}, every flag among args) replaced."""
    args = list(args)
    for flag, value in settings.items():
        args[args.index(flag) + 1] = value
    return tuple(args)


# The PODS vs GRPO-GA study: {arm: (rule, m)} at n = 16. GRPO-GA is rule none with m = n: the label train.py writes
# is "GRPO 16/16" (--grad-accum-steps counts rollout batches of new prompts, so the same rollouts trained in
# parts are micro-batches: 4 of 16 rows per step).
GA_ARMS = {"grpo_ga": ("none", 16), "pods": ("max_variance", 4), "random": ("random", 4)}
GA_BASELINE = "GRPO 16/16"
# What the study changes in STUDY_TRAIN_ARGS: the demo's 4 prompts per step (the clock BENCHMARKS measured for the
# two methods), 256 held-out prompts (one greedy evaluation's SE <= 0.5 / sqrt(256) = 3.1 points; 4 batches of 64)
# every 5 steps, the same prompts for every arm and seed, and a checkpoint every 10 minutes (an interrupted run
# resumes losing at most that).
GA_SETTINGS = {"--prompts-per-step": "4", "--eval-samples": "256", "--eval-interval": "5",
               "--checkpoint-interval-s": "600"}
GA_TRAIN_ARGS = with_settings(STUDY_TRAIN_ARGS, GA_SETTINGS)
# Training wall-clock per run: ~23 GRPO-GA steps, ~55 PODS steps on 2 quiet cores. A first GRPO-GA run of 1800 s
# (BENCHMARKS) was on its plateau from ~200 s on, so half that budget is still ~4x its time to it; the report
# reads every run as a run of this budget (compare.within_budget), that first one included.
GA_MAX_TIME_S = 900.0
GA_NUM_THREADS = 2      # one run at a time on the 2-core machine, both cores to it (BENCHMARKS: 1.5-1.85x faster)
# Training wall-clock per run of the recorded rule / n/m study and loss-variant study (BENCHMARKS.md): the commands'
# defaults, so that `python study.py run|variants --out DIR` trains as long as the recorded runs did.
RUN_MAX_TIME_S = 120.0
VARIANTS_MAX_TIME_S = 150.0


def ga_plan(seeds, num_rollouts=16):
    """{run name: train.py method flags}: every arm of GA_ARMS for each seed, seed-major (a study cut short has
    whole seeds)."""
    return {f"{arm}-n{num_rollouts}-m{m}-s{seed}": ["--rule", rule, "--num-rollouts", str(num_rollouts),
                                                    "--update-size", str(m), "--seed", str(seed)]
            for seed in seeds for arm, (rule, m) in GA_ARMS.items()}


# "Does PODS help?" (`pods`): the paper's single-device comparison. Every arm trains m = PODS_UPDATE_SIZE rows of
# each of the same 4 prompts per step (16 rows, the same update cost); the arms differ in how many rollouts they
# generate per prompt and which m they keep: {arm: (rule, n)}. GRPO 4/4 is the baseline, max_variance 16/4 the
# paper's method, random 16/4 the control (more rollouts, kept at random), max_variance 8/4 and 32/4 the n scaling.
PODS_ARMS = {"grpo": ("none", 4), "pods": ("max_variance", 16), "random": ("random", 16),
             "pods8": ("max_variance", 8), "pods32": ("max_variance", 32)}
PODS_UPDATE_SIZE = 4
PODS_SEEDS = {"grpo": 8, "pods": 8, "random": 5, "pods8": 5, "pods32": 5}  # seeds 0..k-1 per arm (--seeds: all arms)
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
PODS_MAX_TIME_S = 600.0
PODS_DATA = Path(__file__).with_name("results") / "pods"  # the committed data files (studydata.py) and pods.md
PODS_RISING_MARGIN = 2 * 0.5 / int(PODS_SETTINGS["--eval-samples"]) ** 0.5  # two SEs of one evaluation, at most


def registry_pins():
    """Pins for what the registries may gain after the tables were recorded: the paper's reward weights 1/1/1 and
    weight 0 for any other reward term (logged, not trained on); every loss option not in STUDY_TRAIN_ARGS at its
    LossSettings default, the paper's loss (an option whose default is None cannot be given: None is off)."""
    weights = ["accuracy=1", "format=1", "tag_count=1"]
    weights += [f"{name}=0" for name in rewards.REWARD_TERMS if name not in ("accuracy", "format", "tag_count")]
    pins = ["--reward-weights", ",".join(weights)]
    for option in dataclasses.fields(grpo_loss.LossSettings):
        flag = grpo_loss.flag_name(option)
        pinned = flag in STUDY_TRAIN_ARGS or "--no-" + flag[2:] in STUDY_TRAIN_ARGS
        if option.metadata["help"] and not pinned and option.default is not None:
            is_bool = isinstance(option.default, bool)
            pins += [flag if option.default else "--no-" + flag[2:]] if is_bool else [flag, str(option.default)]
    return pins


def train_flags(run_dir, method_flags, max_time_s, num_threads=1, train_args=(), settings=STUDY_TRAIN_ARGS):
    """train.py's flags for one run of the study: the pinned settings, the run's method, then the user's."""
    return ["--preset", "demo", "--output-dir", str(run_dir), "--max-time-s", str(max_time_s), "--no-progress",
            "--num-threads", str(num_threads), "--device", "cpu", "--max-steps", "0", *settings,
            *registry_pins(), *method_flags, *train_args]


def train_runs(out_dir, runs, max_time_s, train_args=(), dry_run=False, num_threads=1,
               train_script=Path(__file__).with_name("train.py"), settings=STUDY_TRAIN_ARGS):
    """Train every run of {name: method flags} (sequentially, one subprocess each) into <out>/<name>; returns the
    names that failed. Resumable: a run with <out>/<name>/study_done.json is skipped; an interrupted one continues
    from its latest checkpoint (train.py --resume) or, without one, starts over."""
    out_dir = Path(out_dir)
    if not dry_run:
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    failed = []
    for index, (name, flags) in enumerate(runs.items(), start=1):
        run_dir = out_dir / name
        if (run_dir / "study_done.json").is_file():
            continue
        command = [sys.executable, str(train_script),
                   *train_flags(run_dir, flags, max_time_s, num_threads, train_args, settings)]
        if runfolder.newest_checkpoint(run_dir, readable=False)[0] is not None:  # latest.txt may be lost
            command.append("--resume")
        elif run_dir.exists() and not dry_run:
            shutil.rmtree(run_dir)  # interrupted before its first checkpoint: nothing worth keeping
        print(f"[{index}/{len(runs)}] {shlex.join(command)}", flush=True)
        if dry_run:
            continue
        start = time.perf_counter()
        with open(out_dir / "logs" / f"{name}.log", "a") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            failed.append(name)
            print(f"    failed (exit {code}); see {out_dir / 'logs' / (name + '.log')}", flush=True)
            continue
        done = {"command": command, "wall_s": time.perf_counter() - start}
        (run_dir / "study_done.json").write_text(json.dumps(done))
    return failed


def trained_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script, settings):
    """`train_runs`, then the folders of the runs that have a metrics.jsonl (None with dry_run); the failed runs are
    said first, since the report that follows may have too few runs to be made."""
    failed = train_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script, settings)
    if dry_run:
        return None
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}")
    return [Path(out_dir) / name for name in runs if (Path(out_dir) / name / "metrics.jsonl").is_file()]


def compare_studies(out_dir, studies, titles, baseline_label=None):
    """<out>/<study>{,_both}.png and .md for each {study: [run names]} (compare.py); returns {file stem: table}."""
    out_dir, tables = Path(out_dir), {}
    # accuracy is the paper's metric; both_accuracy (correct *and* formatted) also shows format learning,
    # which dominates the first minutes of the demo.
    for (study_name, names), (metric, suffix) in itertools.product(studies.items(), METRIC_FILES):
        present = [out_dir / name for name in dict.fromkeys(names) if (out_dir / name / "metrics.jsonl").is_file()]
        if not present:
            continue
        name = study_name + suffix
        # Every run has the same time budget, so seeds end within one step of each other: keep the curve
        # only while all seeds have data (a mean over a changing subset of seeds jumps at the end).
        _, table = compare(present, plot=out_dir / f"{name}.png", title=titles[study_name], metric=metric,
                           min_seeds=0, baseline_label=baseline_label)
        tables[name] = table
        (out_dir / f"{name}.md").write_text(table + "\n")
        print(f"\n## {titles[study_name]}\n\n{table}\nplot: {out_dir / (name + '.png')}", flush=True)
    return tables


def run_study(out_dir, seeds, max_time_s, train_args=(), nm_values=(4, 8, 16), dry_run=False, num_threads=1,
              train_script=Path(__file__).with_name("train.py")):
    """The rule study and the n/m study: train every planned run (`train_runs`), then compare each study."""
    runs, studies = study_plan(seeds, nm_values=nm_values)
    failed = train_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script)
    if dry_run:
        return {}
    titles = {"rules": "Down-sampling rules (demo scale, paper Fig. 5)", "nm": "n/m study (demo scale)"}
    tables = compare_studies(out_dir, studies, titles)
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}")
    return tables


def run_variants(out_dir, seeds, max_time_s, train_args=(), dry_run=False, num_threads=1,
                 train_script=Path(__file__).with_name("train.py")):
    """The loss-variant study (module docstring): train its runs, then compare them against the paper's objective."""
    runs, baseline = variants_plan(seeds)
    failed = train_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script)
    if dry_run:
        return {}
    title = f"Loss variants of {baseline} (demo scale, mu = {VARIANT_UPDATES_PER_BATCH})"
    tables = compare_studies(out_dir, {"variants": list(runs)}, {"variants": title}, baseline_label=baseline)
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}")
    return tables


def run_ga(out_dir, seeds, max_time_s=GA_MAX_TIME_S, train_args=(), dry_run=False, num_threads=GA_NUM_THREADS,
           plot=None, resamples=bootstrap.RESAMPLES, train_script=Path(__file__).with_name("train.py")):
    """PODS vs GRPO-GA (module docstring): train every arm for every seed, one run at a time, then write
    <out>/ga.md (table) and ga.json (figures with intervals) and draw the plot (None: <out>/ga.png); returns the
    table."""
    present = trained_runs(out_dir, ga_plan(seeds), max_time_s, train_args, dry_run, num_threads, train_script,
                           GA_TRAIN_ARGS)
    if dry_run:
        return None
    out_dir = Path(out_dir)
    plot = out_dir / "ga.png" if plot is None else plot
    title = (f"PODS 16/4 vs GRPO-GA (GRPO 16/16: all rollouts trained), demo scale, {len(seeds)} "
             f"seed{'s' if len(seeds) > 1 else ''}, 1.96 SE bands")
    by_axis, table = bootstrap.report(present, GA_BASELINE, plot, title, resamples=resamples, budget_s=max_time_s)
    (out_dir / "ga.md").write_text(table + "\n")
    (out_dir / "ga.json").write_text(json.dumps(by_axis, indent=1))
    print(f"\n## {title}\n\n{table}\nplot: {plot}", flush=True)
    return table


# ... and every 10th step's rollouts (what each rule kept) in <run>/completions/, for reading why an arm learned or not
PODS_TRAIN_ARGS = with_settings(STUDY_TRAIN_ARGS, PODS_SETTINGS) + ("--log-completions-interval", "10")


def pods_plan(arms=tuple(PODS_ARMS), seeds=None):
    """{run name: train.py method flags}: each arm of PODS_ARMS among `arms` for each of its seeds (None: seeds
    0..PODS_SEEDS[arm]-1), seed-major (a study cut short has whole seeds, the first seeds of every arm)."""
    unknown = sorted(set(arms) - set(PODS_ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}: choose among {list(PODS_ARMS)}")
    per_arm = {arm: list(seeds) if seeds is not None else list(range(PODS_SEEDS[arm])) for arm in arms}
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


def pods_report(runs, budget_s, plot=None, resamples=bootstrap.RESAMPLES):
    """The study's report from its runs (compare.RunData, each cut to budget_s): the arms against GRPO 4/4 per step
    and on the clock (bootstrap.py: paired intervals, speed-up, mean accuracy over the budget), random against
    max-variance 16/4 the same way, the per-step clock split into generation and update, and the pilot line."""
    labels = {r.label for r in runs}
    if PODS_BASELINE not in labels:
        raise ValueError(f"no {PODS_BASELINE} run (arm grpo): the report compares every arm against it")
    seeds = len({r.seed for r in runs})
    title = f"Does PODS help? m = {PODS_UPDATE_SIZE} rows per prompt, demo scale, {seeds} seeds, 1.96 SE bands"
    _, table = bootstrap.report_runs(runs, PODS_BASELINE, plot, title, resamples=resamples, budget_s=budget_s)
    parts = [f"## Every arm against {PODS_BASELINE}", "", table]
    if set(PODS_CONTROL) <= labels:
        control = [r for r in runs if r.label in PODS_CONTROL]
        _, control_table = bootstrap.report_runs(control, PODS_CONTROL[0], resamples=resamples, budget_s=budget_s)
        parts += ["", f"## {PODS_CONTROL[1]} against {PODS_CONTROL[0]} (does max-variance matter?)", "",
                  control_table]
    parts += ["", *clock_lines(runs), "", rising_line(runs, budget_s)]
    return "\n".join(parts)


def write_pods_data(run_dirs, data_dir, budget_s, command):
    """Each run's data file (studydata.export_runs) and study.json (the budget, the settings, the commit) in
    data_dir: what the tables are recomputed from (`python study.py pods --from-data DATA_DIR`)."""
    studydata.export_runs(run_dirs, data_dir)
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or None
    studydata.write_record({"study": "pods", "baseline": PODS_BASELINE, "budget_s": budget_s, "commit": commit,
                            "command": command, "train_args": list(PODS_TRAIN_ARGS)},
                           Path(data_dir) / studydata.STUDY_FILE)


def report_pods_data(data_dir, budget_s=None, plot=None, resamples=bootstrap.RESAMPLES):
    """The report recomputed from data files (studydata.py): the budget recorded in study.json unless given."""
    runs, _ = studydata.read_study([data_dir])
    study_file = Path(data_dir) / studydata.STUDY_FILE
    if budget_s is None and study_file.is_file():
        budget_s = json.loads(study_file.read_text()).get("budget_s")
    compare_module.check_budgets(runs, budget_s)
    return pods_report([compare_module.within_budget(r, budget_s) for r in runs], budget_s, plot, resamples)


def check_finished_runs(out_dir, runs, max_time_s, train_args, num_threads):
    """A finished run (study_done.json) is skipped, so one trained with other flags (a pilot before PODS_TASK
    changed, another budget) would enter the report as if it were this study's: refused, naming the run."""
    for name, flags in runs.items():
        done = Path(out_dir) / name / "study_done.json"
        if not done.is_file():
            continue
        recorded = [arg for arg in json.loads(done.read_text()).get("command", [])[2:] if arg != "--resume"]
        expected = train_flags(Path(out_dir) / name, flags, max_time_s, num_threads, train_args, PODS_TRAIN_ARGS)
        if "--output-dir" in recorded:  # the same folder, however --out was spelled
            recorded[recorded.index("--output-dir") + 1] = expected[expected.index("--output-dir") + 1]
        if recorded != expected:
            changed = [(f"{expected[i - 1]} " if i and expected[i - 1].startswith("--") else "") + f"{a} (now {b})"
                       for i, (a, b) in enumerate(zip(recorded, expected)) if a != b] or ["flags added or left out"]
            raise ValueError(f"{done.parent} was trained with other flags than this study's ({', '.join(changed[:3])})"
                             ": give another --out, or delete the run to train it again")


def run_pods(out_dir, arms=tuple(PODS_ARMS), seeds=None, max_time_s=PODS_MAX_TIME_S, train_args=(), dry_run=False,
             num_threads=GA_NUM_THREADS, data_dir=PODS_DATA, plot=None, resamples=bootstrap.RESAMPLES,
             train_script=Path(__file__).with_name("train.py")):
    """Does PODS help? Train every run of pods_plan (one at a time), then write the report to <out>/pods.md and
    <data_dir>/pods.md, the plot to <out>/pods.png (or `plot`), and each run's data file to data_dir; returns the
    report.

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
    command = ["python", "study.py", "pods", "--out", str(out_dir), "--arms", *arms] + \
        (["--seeds", *map(str, seeds)] if seeds is not None else []) + ["--max-time-s", f"{max_time_s:g}"] + \
        (["--", *train_args] if train_args else [])
    check_finished_runs(out_dir, runs, max_time_s, train_args, num_threads)
    present = trained_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script, PODS_TRAIN_ARGS)
    if dry_run:
        return None
    out_dir = Path(out_dir)
    if not present:
        raise ValueError(f"{out_dir}: no run of the study has a metrics.jsonl; nothing to report")
    write_pods_data(present, data_dir, max_time_s, shlex.join(command))
    table = report_pods_data(data_dir, max_time_s, plot or out_dir / "pods.png", resamples)  # as it recomputes
    for folder in (out_dir, Path(data_dir)):
        (folder / "pods.md").write_text(table + "\n")
    print(f"\n{table}\nplot: {plot or out_dir / 'pods.png'}; data: {data_dir}", flush=True)
    return table


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        import compare as compare_module

        return compare_module.main(argv[1:])
    if argv[:1] == ["pods"]:
        return pods_main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):  # the commands, as the module docstring shows them
        return print("\n\n".join(__doc__.split("\n\n")[1:3]) + "\n\npython study.py run --help (or variants, ga, "
                     "pods --help) lists a command's flags.")
    if argv[:1] not in (["run"], ["variants"], ["ga"]):
        sys.exit("usage: python study.py compare RUN_DIR... [--plot P] | python study.py run --out DIR [...] | "
                 "python study.py variants --out DIR [...] | python study.py ga --out DIR [...] | python study.py pods "
                 "--out DIR [...] "
                 "(python study.py --help describes them)")
    command = argv[0]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    description = {"run": "rule study + n/m study", "variants": "loss variants (paper, token, clip-higher)",
                   "ga": "PODS 16/4 vs GRPO-GA 16/16 vs random 16/4"}[command]
    ga = command == "ga"
    parser = argparse.ArgumentParser(prog=f"study.py {command}", description=f"{description} at demo scale; "
                                     "arguments after -- go to every train.py run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4] if ga else [0, 1, 2])
    parser.add_argument("--max-time-s", type=float, help="training wall-clock per run (default: the recorded "
                        "study's, " + {"run": f"{RUN_MAX_TIME_S:g}", "variants": f"{VARIANTS_MAX_TIME_S:g}",
                                       "ga": f"{GA_MAX_TIME_S:g}"}[command] + ")",
                        default={"run": RUN_MAX_TIME_S, "variants": VARIANTS_MAX_TIME_S, "ga": GA_MAX_TIME_S}[command])
    if command == "run":
        parser.add_argument("--nm-values", type=int, nargs="+", default=[4, 8, 16], help="n values at m = 4")
    parser.add_argument("--num-threads", type=int, default=GA_NUM_THREADS if ga else 1, help="torch CPU threads "
                        "per run: on a shared machine one thread avoids OpenMP spin-waits (here 2 threads were ~7x "
                        "slower); the ga study, timed, wants a quiet machine and both of its cores")
    if ga:
        parser.add_argument("--plot", help="the plot's path (default: <out>/ga.png; the figure BENCHMARKS.md shows "
                            "is docs/study_ga.png)")
        parser.add_argument("--resamples", type=int, default=bootstrap.RESAMPLES, help="bootstrap resamples")
    parser.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    args = parser.parse_args(argv)
    if ga:
        return run_ga(args.out, args.seeds, args.max_time_s, train_args, args.dry_run, args.num_threads, args.plot,
                      args.resamples)
    if command == "variants":
        return run_variants(args.out, args.seeds, args.max_time_s, train_args, args.dry_run, args.num_threads)
    return run_study(args.out, args.seeds, args.max_time_s, train_args, tuple(args.nm_values), args.dry_run,
                     args.num_threads)


PODS_USAGE = """Does PODS help? Every arm trains m = 4 rows of each of the same 4 prompts per step: GRPO 4/4 (the
baseline), PODS max_variance 16/4, PODS random 16/4 (the control), PODS max_variance 8/4 and 32/4 (n scaling); seeds
0-7 for the first two, 0-4 for the others (--seeds: the same for every arm). One run at a time on a quiet machine,
from a committed (pinned) checkout; 256 greedy held-out prompts every 100 s of training in every arm.

  python study.py pods --out runs/pods --arms grpo --seeds 0 1      # the pilot: is GRPO 4/4 still rising at T/3?
  python study.py pods --out runs/pods --dry-run                    # the 31 train.py commands
  python study.py pods --out runs/pods                              # the study (~14 h, estimated), then its report
  python study.py pods --from-data results/pods                     # the report recomputed from the data files
  python bootstrap.py --from-data results/pods --baseline-label "GRPO 4/4" --budget-s 600   # its first table alone

The run writes <out>/pods.md and pods.png, and results/pods/ (--data): one data file per run, study.json (budget,
settings, commit) and pods.md, to commit. Settings: study.py's PODS_TASK / PODS_SETTINGS (set the task and learning
rate there after the pilot); arguments after -- go to every train.py run."""


def pods_main(argv):
    """`python study.py pods ...` (PODS_USAGE)."""
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="study.py pods", description=PODS_USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder of the run folders (required unless --from-data)")
    parser.add_argument("--from-data", metavar="DIR", help="report from data files (studydata.py); trains nothing")
    parser.add_argument("--arms", nargs="+", choices=list(PODS_ARMS), default=list(PODS_ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds of every arm (default: 0-7 for grpo and pods, "
                        "0-4 for the others: PODS_SEEDS)")
    parser.add_argument("--max-time-s", type=float, help=f"training wall-clock per run (default {PODS_MAX_TIME_S:g}; "
                        "with --from-data: the budget the runs are read at, default the one study.json records)")
    parser.add_argument("--num-threads", type=int, default=GA_NUM_THREADS, help="torch CPU threads per run (the "
                        "study is timed: one run at a time, a quiet machine, both cores)")
    parser.add_argument("--data", default=str(PODS_DATA), help="where the runs' data files and pods.md go")
    parser.add_argument("--plot", help="the plot's path (default <out>/pods.png; none with --from-data unless given)")
    parser.add_argument("--resamples", type=int, default=bootstrap.RESAMPLES, help="bootstrap resamples")
    parser.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    args = parser.parse_args(argv)
    if args.from_data:
        if args.out or args.dry_run or train_args:
            parser.error("--from-data reports committed data: it trains nothing (no --out, --dry-run or -- flags)")
        table = report_pods_data(args.from_data, args.max_time_s, args.plot, args.resamples)
        print(table)
        return table
    if not args.out:
        parser.error("give --out DIR (where the runs go) or --from-data DIR (report committed data)")
    return run_pods(args.out, tuple(args.arms), args.seeds, args.max_time_s or PODS_MAX_TIME_S, train_args,
                    args.dry_run, args.num_threads, args.data, args.plot, args.resamples)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:  # a missing path, no runs, a bad flag: one line
        sys.exit(f"study.py: error: {error}")
