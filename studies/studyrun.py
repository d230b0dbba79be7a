"""The studies' runner: train.py's demo preset, one subprocess at a time, with every setting the recorded tables
depend on passed explicitly (`STUDY_TRAIN_ARGS`, `registry_pins`), so a documented study command measures the same
thing whatever the demo preset or a flag's default becomes. study.py (rules, n/m, loss variants, PODS vs GRPO-GA)
and pods_study.py (does PODS help?) both train through it.

Resumable: a finished run has <out>/<name>/study_done.json (its command and process seconds) and is skipped; an
interrupted one continues from its checkpoint (train.py --resume) or starts over; a failed one is listed and
retried on the next call.
"""

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import rewards
from run import flags_update, runfolder

STUDY_SYSTEM_PROMPT = "Reason inside <think> </think>, then answer inside <answer> </answer>."
# The settings of the recorded study, all explicit (a later edit of the demo preset or of a flag's default
# cannot change them): SmolLM2-135M with LoRA r=16 on 2-digit addition with a one-shot example, fitted to a
# shared 2-core CPU: one prompt per step (the authors' single-GPU config), a 20-prompt greedy held-out set
# every 3 steps, only the final checkpoint. The method flags (rule, n, m, seed) come from each study's plan;
# flags after `--` override all of these.
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


def with_settings(args, settings):
    """args with the value after each flag of settings ({flag: value}, every flag among args) replaced."""
    args = list(args)
    for flag, value in settings.items():
        args[args.index(flag) + 1] = value
    return tuple(args)


# The timed studies (PODS vs GRPO-GA, does PODS help?) run one at a time on the 2-core machine and give each run
# both cores (BENCHMARKS: 1.5-1.85x faster than one thread).
TIMED_NUM_THREADS = 2


def registry_pins():
    """Pins for what the registries may gain after the tables were recorded: the paper's reward weights 1/1/1 and
    weight 0 for any other reward term (logged, not trained on); every loss option not in STUDY_TRAIN_ARGS at its
    LossSettings default, the paper's loss (an option whose default is None cannot be given: None is off)."""
    weights = ["accuracy=1", "format=1", "tag_count=1"]
    weights += [f"{name}=0" for name in rewards.REWARD_TERMS if name not in ("accuracy", "format", "tag_count")]
    pins = ["--reward-weights", ",".join(weights)]
    for option in flags_update.LOSS_FLAGS:
        flag = flags_update.loss_flag(option)
        pinned = flag in STUDY_TRAIN_ARGS or "--no-" + flag[2:] in STUDY_TRAIN_ARGS
        if not pinned and option.default is not None:
            is_bool = isinstance(option.default, bool)
            pins += [flag if option.default else "--no-" + flag[2:]] if is_bool else [flag, str(option.default)]
    return pins


def train_flags(run_dir, method_flags, max_time_s, num_threads=1, train_args=(), settings=STUDY_TRAIN_ARGS):
    """train.py's flags for one run of the study: the pinned settings, the run's method, then the user's."""
    return ["--preset", "demo", "--output-dir", str(run_dir), "--max-time-s", str(max_time_s), "--no-progress",
            "--num-threads", str(num_threads), "--device", "cpu", "--max-steps", "0", *settings,
            *registry_pins(), *method_flags, *train_args]


def train_runs(out_dir, runs, max_time_s, train_args=(), dry_run=False, num_threads=1,
               train_script=Path(__file__).resolve().parents[1] / "train.py", settings=STUDY_TRAIN_ARGS):
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
