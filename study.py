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
`pods`: does PODS help? The paper's single-device comparison, GRPO 4/4 against PODS n/4 (pods_study.py).
`objectives`: PODS max_variance 16/4 with the paper's loss against the same with GSPO's sequence-level ratio
(--importance-sampling-level sequence) and with CISPO's clipped, detached weight (--policy-loss cispo), on today's
demo settings (16 steps, lr 3e-4, 4 prompts a step, 100 greedy held-out prompts every 8 steps, bf16 where the CPU
computes it), 3 seeds paired by seed; every arm takes 2 optimizer steps per rollout batch (both objectives act on
the ratio pi / pi_old alone, which is 1 with one). Peak, final, mean accuracy and the speed-up per step and on the
clock with paired bootstrap intervals: <out>/objectives.md, .json, .png, and each run's data file in <out>/data.

    python study.py run --out runs/study --seeds 0 1 2 --max-time-s 120 [-- extra train.py flags]
    python study.py variants --out runs/variants --seeds 0 1 2 --max-time-s 150 [-- extra train.py flags]
    python study.py ga --out runs/ga --seeds 0 1 2 3 4 [--max-time-s 900] [--plot P] [-- extra train.py flags]
    python study.py pods --out runs/pods [--arms grpo ...] [--seeds ...] [-- extra train.py flags]
    python study.py pods --from-data results/pods   (the report recomputed from the committed data files)
    python study.py objectives --out runs/objectives --seeds 0 1 2 [--dry-run] [-- extra train.py flags]
    python study.py compare RUN_DIR...            (an alias of python compare.py)
    python study.py bootstrap RUN_DIR... --baseline-label "GRPO 16/16"   (the paired-bootstrap report of any runs)

Every setting the recorded tables depend on is passed explicitly (studyrun.py's `STUDY_TRAIN_ARGS`), evaluation
temperature included, so the documented command measures the same thing whatever the demo preset becomes.
Resumable (studyrun.py): a finished run is skipped, an interrupted one continues from its checkpoint.
Simplification: demo scale only; the paper-scale settings (a)-(d) are run with train.py directly.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

from studies import bootstrap
from studies import studyrun
from compare import budget_seconds, compare
from run.presets import DEMO_SYSTEM_PROMPT

METRIC_FILES = (("accuracy", ""), ("both_accuracy", "_both"))  # study output: rules.png, rules_both.png, ...
STUDY_RULES = ("max_variance", "random", "max_reward", "percentile")  # paper Fig. 5, plus the GRPO baseline


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
GA_TRAIN_ARGS = studyrun.with_settings(studyrun.STUDY_TRAIN_ARGS, GA_SETTINGS)
# Training wall-clock per run: ~23 GRPO-GA steps, ~55 PODS steps on 2 quiet cores. A first GRPO-GA run of 1800 s
# (BENCHMARKS) was on its plateau from ~200 s on, so half that budget is still ~4x its time to it; the report
# reads every run as a run of this budget (compare.within_budget), that first one included.
GA_MAX_TIME_S = 900.0
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


# The objectives study: {arm: flags on top of the paper's loss}. Every other setting is shared, clip bounds included
# (0.2 both ways: verl's default CISPO bounds; the GSPO paper's 3e-4 / 4e-4 would be a second change), so each arm
# differs from the baseline in its objective alone. All arms take OBJECTIVES_UPDATES_PER_BATCH optimizer steps per
# rollout batch, the baseline too: with one, both objectives give the paper's gradient exactly (their ratio is 1),
# and a baseline at one would credit the second step's extra update to the objective. The high-entropy-token arm
# ("Beyond the 80/20 rule", --top-entropy-quantile 0.2) acts at either mu; it runs at 2 to be paired alike.
OBJECTIVES = {"paper": [], "gspo": ["--importance-sampling-level", "sequence"], "cispo": ["--policy-loss", "cispo"],
              "entropy": ["--top-entropy-quantile", "0.2"]}  # the 80/20 paper's 20 %
OBJECTIVES_UPDATES_PER_BATCH = 2
OBJECTIVES_BASELINE = "PODS max_variance 16/4"
OBJECTIVES_STEPS = 16  # today's demo budget: steps, not seconds (run/presets.py)
# What the study changes in STUDY_TRAIN_ARGS: today's demo preset (run/presets.py "demo") where the recorded
# studies' settings differ from it, and mu; --bf16 follows the machine, as the demo's "auto" does
# (`objectives_train_args`).
OBJECTIVES_SETTINGS = {"--system-prompt": DEMO_SYSTEM_PROMPT, "--prompts-per-step": "4", "--learning-rate": "3e-4",
                       "--eval-samples": "100", "--eval-interval": "8", "--checkpoint-interval-s": "120",
                       "--prefix-sharing": "on", "--updates-per-batch": str(OBJECTIVES_UPDATES_PER_BATCH)}


def objectives_plan(seeds, num_rollouts=16, update_size=4):
    """{run name: train.py method flags}: every arm of OBJECTIVES with max_variance n/m, per seed, seed-major (a
    study cut short has whole seeds)."""
    return {f"{arm}-n{num_rollouts}-m{update_size}-s{seed}": [
        "--rule", "max_variance", "--num-rollouts", str(num_rollouts), "--update-size", str(update_size), "--seed",
        str(seed), *flags] for seed in seeds for arm, flags in OBJECTIVES.items()}


def objectives_train_args(native_bf16=None):
    """STUDY_TRAIN_ARGS with OBJECTIVES_SETTINGS, --bf16 where the CPU computes bf16 natively (native_bf16 None:
    ask policy.native_bf16, as the demo preset's "auto" does) and the demo's step budget."""
    if native_bf16 is None:
        import policy

        native_bf16 = policy.native_bf16("cpu")
    args = studyrun.with_settings(studyrun.STUDY_TRAIN_ARGS, OBJECTIVES_SETTINGS)
    args = tuple("--bf16" if arg == "--no-bf16" and native_bf16 else arg for arg in args)
    return args + ("--max-steps", str(OBJECTIVES_STEPS))


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
    failed = studyrun.train_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script)
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
    failed = studyrun.train_runs(out_dir, runs, max_time_s, train_args, dry_run, num_threads, train_script)
    if dry_run:
        return {}
    title = f"Loss variants of {baseline} (demo scale, mu = {VARIANT_UPDATES_PER_BATCH})"
    tables = compare_studies(out_dir, {"variants": list(runs)}, {"variants": title}, baseline_label=baseline)
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}")
    return tables


def run_ga(out_dir, seeds, max_time_s=GA_MAX_TIME_S, train_args=(), dry_run=False,
           num_threads=studyrun.TIMED_NUM_THREADS, plot=None, resamples=bootstrap.RESAMPLES,
           train_script=Path(__file__).with_name("train.py")):
    """PODS vs GRPO-GA (module docstring): train every arm for every seed, one run at a time, then write
    <out>/ga.md (table) and ga.json (figures with intervals) and draw the plot (None: <out>/ga.png); returns the
    table."""
    present = studyrun.trained_runs(out_dir, ga_plan(seeds), max_time_s, train_args, dry_run, num_threads,
                                    train_script, GA_TRAIN_ARGS)
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


def run_objectives(out_dir, seeds, train_args=(), dry_run=False, num_threads=studyrun.TIMED_NUM_THREADS,
                   resamples=bootstrap.RESAMPLES, train_script=Path(__file__).with_name("train.py")):
    """The objectives study (module docstring): train every arm for every seed, one run at a time, each for
    OBJECTIVES_STEPS steps, then write <out>/objectives.md, .json, .png and each run's data file in <out>/data (the
    report again from them: python study.py bootstrap --from-data <out>/data --baseline-label OBJECTIVES_BASELINE);
    returns the table."""
    from studies import studydata

    present = studyrun.trained_runs(out_dir, objectives_plan(seeds), 0, train_args, dry_run, num_threads,
                                    train_script, objectives_train_args())
    if dry_run:
        return None
    out_dir = Path(out_dir)
    title = (f"Objectives beside the paper's loss, {OBJECTIVES_BASELINE}, mu = {OBJECTIVES_UPDATES_PER_BATCH}, demo "
             f"scale, {len(seeds)} seed{'s' if len(seeds) > 1 else ''}")
    by_axis, table = bootstrap.report(present, OBJECTIVES_BASELINE, out_dir / "objectives.png", title,
                                      resamples=resamples)
    (out_dir / "objectives.md").write_text(table + "\n")
    (out_dir / "objectives.json").write_text(json.dumps(by_axis, indent=1))
    studydata.export_runs(present, out_dir / "data")
    print(f"\n## {title}\n\n{table}\nplot: {out_dir / 'objectives.png'}", flush=True)
    return table


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        import compare as compare_module

        return compare_module.main(argv[1:])
    if argv[:1] == ["pods"]:
        from studies import pods_study

        return pods_study.main(argv[1:])
    if argv[:1] == ["bootstrap"]:  # the paired-bootstrap report of any runs (studies/bootstrap.py)
        try:
            return bootstrap.main(argv[1:])
        except (ValueError, OSError) as error:  # a missing path, no runs, no baseline: one line
            sys.exit(f"study.py bootstrap: error: {error}")
    if argv[:1] in (["-h"], ["--help"]):  # the commands, as the module docstring shows them
        return print("\n\n".join(__doc__.split("\n\n")[1:3]) + "\n\npython study.py run --help (or variants, ga, "
                     "pods, bootstrap --help) lists a command's flags.")
    if argv[:1] not in (["run"], ["variants"], ["ga"], ["objectives"]):
        sys.exit("usage: python study.py compare RUN_DIR... [--plot P] | python study.py run --out DIR [...] | "
                 "python study.py variants --out DIR [...] | python study.py ga --out DIR [...] | python study.py pods "
                 "--out DIR [...] | python study.py objectives --out DIR [...] | python study.py bootstrap RUN_DIR... "
                 "(python study.py --help describes them)")
    if argv[0] == "objectives":
        return _objectives_main(argv[1:])
    command = argv[0]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    description = {"run": "rule study + n/m study", "variants": "loss variants (paper, token, clip-higher)",
                   "ga": "PODS 16/4 vs GRPO-GA 16/16 vs random 16/4"}[command]
    ga = command == "ga"
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog=f"study.py {command}", description=f"{description} at demo scale; "
                                     "arguments after -- go to every train.py run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4] if ga else [0, 1, 2])
    budget = {"run": RUN_MAX_TIME_S, "variants": VARIANTS_MAX_TIME_S, "ga": GA_MAX_TIME_S}[command]
    parser.add_argument("--max-time-s", type=budget_seconds, default=budget,
                        help=f"training wall-clock per run (default: the recorded study's, {budget:g})")
    if command == "run":
        parser.add_argument("--nm-values", type=int, nargs="+", default=[4, 8, 16], help="n values at m = 4")
    parser.add_argument("--num-threads", type=int, default=studyrun.TIMED_NUM_THREADS if ga else 1,
                        help="torch CPU threads per run: on a shared machine one thread avoids OpenMP spin-waits (here "
                        "2 threads were ~7x slower); the ga study, timed, wants a quiet machine and both of its cores")
    if ga:
        parser.add_argument("--plot", help="the plot's path (default: <out>/ga.png; the figure BENCHMARKS.md shows "
                            "is docs/study_ga.png)")
        parser.add_argument("--resamples", type=bootstrap.resample_count, default=bootstrap.RESAMPLES,
                            help="bootstrap resamples")
    parser.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    args = parser.parse_args(argv)
    if ga:
        return run_ga(args.out, args.seeds, args.max_time_s, train_args, args.dry_run, args.num_threads, args.plot,
                      args.resamples)
    if command == "variants":
        return run_variants(args.out, args.seeds, args.max_time_s, train_args, args.dry_run, args.num_threads)
    return run_study(args.out, args.seeds, args.max_time_s, train_args, tuple(args.nm_values), args.dry_run,
                     args.num_threads)


def _objectives_main(argv):
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="study.py objectives", description="PODS 16/4 with the paper's loss vs "
                                     "GSPO's and CISPO's objectives at demo scale, paired by seed; arguments after -- "
                                     "go to every train.py run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-threads", type=int, default=studyrun.TIMED_NUM_THREADS,
                        help="torch CPU threads per run: timed, it wants a quiet machine and both of its cores")
    parser.add_argument("--resamples", type=bootstrap.resample_count, default=bootstrap.RESAMPLES,
                        help="bootstrap resamples")
    parser.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    args = parser.parse_args(argv)
    return run_objectives(args.out, args.seeds, train_args, args.dry_run, args.num_threads, args.resamples)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:  # a missing path, no runs, a bad flag: one line
        sys.exit(f"study.py: error: {error}")
