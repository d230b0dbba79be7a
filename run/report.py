"""What a training run logs and where it goes.

`record_step`: one training step's metrics line (train.py's `step_metrics`: TRL's names, plus this trainer's
counters update_rows, optimizer_steps, num_zero_variance_dropped, num_truncated_masked, skipped_steps, and timings)
with the run's clock; `step_notes`: what a step says above the progress bar; `learning_signal`: whether the step gave
the update anything to learn from (its "cannot_learn" field, and the line naming the flag to change).
`open_metrics`: every line goes to <out>/metrics.jsonl (checkpoint.py), and with --report-to also to TensorBoard
or Weights & Biases under the same names, so runs can be browsed with the tools researchers already use.

Every numeric field of a metrics line is sent as a scalar at the line's "step" (train lines and held-out "eval/..."
lines share the step axis, as in the jsonl). metrics.jsonl stays the record compare.py reads; the other sinks are
views of it. Simplification: a resumed run re-sends the steps after its checkpoint (TensorBoard: the events past
that step are purged; W&B: a new run in the same project).

The completions log (completions.py) goes to <out>/completions/ and, as text or a table, to the same sinks.
`start_line`, `eval_line`, `finish_lines`: what a run prints besides its progress bar (what trains, on what, for how
long, where; each held-out evaluation; where the results are and the commands that read them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import shlex
from pathlib import Path

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it

from run import checkpoint
from run import completions

PHASE_KEYS = ("generate_s", "reward_s", "select_s", "update_s")  # a step's phases, timed by train.train_step
TIMING_KEYS = ("elapsed_s", *PHASE_KEYS, "step_s", "peak_mem_gib")
REPORT_TO = ("none", "tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


# Why a step gave the update nothing to learn from (TRL's completions/clipped_ratio and frac_reward_zero_std read as
# a verdict), as metrics.jsonl's "cannot_learn" codes, each with what to change.
TRUNCATED_LIMIT = 0.9  # of the completions cut at --max-completion-tokens
CANNOT_LEARN = {
    "truncated": "raise --max-completion-tokens (or ask for shorter answers in --prompt-template / --system-prompt)",
    "rewards_zero": "check that --prompt-template / --system-prompt ask for what the rewards grade (an <answer> "
                    "block) and the reward (--reward-function, --reward-weights)",
    "rewards_equal": "the reward tells no completion from another: check the reward (--reward-function, "
                     "--reward-weights) and the answers (--answer-field, --answer-kind)",
    "no_spread": "no group's rollouts differ in reward: easier or harder prompts, more rollouts (--num-rollouts), or "
                 "a reward that tells them apart",
}


def learning_signal(metrics):
    """{"cannot_learn": [codes of CANNOT_LEARN]} for a step that gave the update nothing to learn from: >= 90 % of its
    completions truncated, every reward 0 or every reward equal, or no group with a reward spread (every advantage
    0); {} for a step that had something."""
    codes = ["truncated"] if metrics["completions/clipped_ratio"] >= TRUNCATED_LIMIT else []
    if metrics["reward_min"] == metrics["reward_max"]:
        codes.append("rewards_zero" if metrics["reward_max"] == 0 else "rewards_equal")
    elif metrics["frac_reward_zero_std"] == 1:
        codes.append("no_spread")
    return {"cannot_learn": codes} if codes else {}


def cannot_learn_line(metrics, max_completion_tokens):
    """The one line of a step that could not learn (learning_signal), naming what to change."""
    said = {"truncated": f"{metrics['completions/clipped_ratio']:.0%} of the completions were cut at "
                         f"--max-completion-tokens {max_completion_tokens}",
            "rewards_zero": "every reward was 0", "rewards_equal": f"every reward was {metrics['reward_max']:g}",
            "no_spread": "no group of rollouts had a reward spread (every advantage 0)"}
    return "cannot learn: " + "; ".join(f"{said[code]}: {CANNOT_LEARN[code]}" for code in metrics["cannot_learn"])


def step_notes(metrics, args=None, stuck_steps=0, first=False):
    """The lines a step says where the run is watched (above the progress bar): rewards possibly wrong, nothing
    trained, and (learning_signal) nothing to learn from, at the run's first step and as it persists: the 2nd, 4th,
    8th ... step of a row of such steps (stuck_steps: how many in a row, this one included)."""
    import rewards
    from grading import grader

    notes = []
    persists = stuck_steps >= 2 and stuck_steps & (stuck_steps - 1) == 0
    if metrics.get("cannot_learn") and (first or persists):
        notes.append(cannot_learn_line(metrics, args.max_completion_tokens if args else "?")
                     + (f" ({stuck_steps} steps in a row)" if persists else ""))
    if metrics["rewards/grader_timeouts"]:
        notes.append(f"{metrics['rewards/grader_timeouts']} completions scored accuracy 0 because their answer "
                     f"comparison timed out twice ({rewards.VERIFY_TIMEOUT_S:g} s, then {grader.RETRY_FACTOR}x, of the "
                     "grader's CPU time): rewards/grader_timeouts")
    if metrics["update_rows"] == 0:
        notes.append("trained nothing: " + ("no group had a reward spread within --max-generation-rounds" if
                                            args and args.dynamic_sampling else "every prompt was dropped")
                     + " (no optimizer step)")
    return notes


@contextlib.contextmanager
def peak_memory_measured(device):
    """The block's peak memory counted from its start (CUDA: update.peak_memory_gib reads it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield


def record_step(state, metrics, step_s):
    """Advance the checkpoint.TrainerState by one finished step; returns its metrics line."""
    skipped = metrics.pop("step_skipped")
    state.step += 1
    state.elapsed_s += step_s
    state.last_step_s = step_s
    state.num_tokens += metrics.pop("step_tokens")
    state.skipped_steps += skipped
    state.nonfinite_streak = state.nonfinite_streak + 1 if skipped else 0
    return {"type": "train", "step": state.step, "elapsed_s": state.elapsed_s, **metrics,
            "num_tokens": state.num_tokens, "skipped_steps": state.skipped_steps, "step_s": step_s}


def progress_bar(args, state, label, enabled):
    """The run's progress bar (closed before an error): training seconds against --max-time-s, else steps against
    --max-steps, with the ETA tqdm estimates from the wall clock so far (evaluations included)."""
    from tqdm import tqdm

    if args.max_time_s:
        total_s = round(args.max_time_s)
        return tqdm(total=total_s, initial=min(round(state.elapsed_s), total_s), desc=label, disable=not enabled,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s of training "
                               "[{elapsed}<{remaining}{postfix}]")
    return tqdm(total=args.max_steps or None, initial=state.step, desc=label, unit="step", disable=not enabled)


def show_progress(bar, args, state, reward, accuracy):
    """Advance the bar to the run's state after a step; its fields: step (on the time bar), reward (the step's mean
    total reward), acc (the latest held-out accuracy, "-" before the first)."""
    bar.update((min(round(state.elapsed_s), bar.total) if args.max_time_s else state.step) - bar.n)
    fields = dict(step=state.step) if args.max_time_s else {}
    bar.set_postfix(fields, reward=f"{reward:.2f}", acc="-" if accuracy is None else f"{accuracy:.2f}")


def check_report_to(report_to):
    """ValueError (one line) when the sink is unknown or its package is not installed: checked before loading."""
    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to must be one of {REPORT_TO}, got {report_to!r}")
    package = _PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(f"--report-to {report_to} needs the {package!r} package: pip install {package} "
                         "(or --report-to none)")


def scalars(record):
    """The numeric fields of a metrics line, without its bookkeeping ("type", "step") and non-finite values."""
    return {key: float(value) for key, value in record.items()
            if key not in ("type", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


# ------------------------------------------------------------------------------------------ sinks

def _tensorboard_sink(run_dir, first_step):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: events from first_step on were written after the resumed checkpoint: dropped.
    writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=first_step or None)

    def write(record):
        if record["type"] == "completions":  # text, as the viewer prints it: every prompt of the step
            rows = record["rows"]
            prompts = range(sum(row["type"] == "prompt" for row in rows))
            lines = completions.eval_table(rows) if rows and rows[0]["type"] == "eval" else \
                [line for i in prompts for line in completions.rollout_table(rows, i)]
            writer.add_text(record["name"].rpartition("_")[0], "    " + "\n    ".join(lines), record["step"])
        for key, value in scalars(record).items():
            writer.add_scalar(key, value, global_step=record["step"])
        writer.flush()  # a killed run keeps what was written, as metrics.jsonl does

    return write, writer.close


def _wandb_sink(run_dir, run_config):
    import wandb

    run = wandb.init(dir=str(run_dir), name=Path(run_dir).name, config=run_config)

    def write(record):
        if record["type"] == "completions":
            rows = [{k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()} for row in record["rows"]
                    if row["type"] != "prompt"]
            columns = list(rows[0]) if rows else []
            table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
            run.log({record["name"].rpartition("_")[0]: table}, step=record["step"])
            return
        run.log(scalars(record), step=record["step"])

    return write, run.finish


@contextlib.contextmanager
def open_metrics(run_dir, report_to="none", *, keep_bytes=0, first_step=0, run_config=None, enabled=True):
    """(metrics.jsonl handle, write(record)): `write` appends a metrics line to metrics.jsonl
    (checkpoint.append_metrics) or a completions record to its own file under completions/, and sends either to the
    --report-to sink. keep_bytes: see checkpoint.open_metrics_log; first_step: the step a resumed run writes (its
    earlier TensorBoard events and completion files are kept, later ones dropped; 0: a new run). enabled False
    (torchrun ranks but 0): nothing is written; the handle is an empty in-memory file."""
    check_report_to(report_to)
    if not enabled:
        yield io.StringIO(), (lambda record: None)
        return
    # a resume drops the files past its checkpoint; a new run (first_step 0) in a folder whose run started over: all
    completions.drop_completions_after(run_dir, first_step - 1)
    with checkpoint.open_metrics_log(run_dir, keep_bytes) as log:
        send, close = (lambda record: None), (lambda: None)
        if report_to == "tensorboard":
            send, close = _tensorboard_sink(run_dir, first_step)
        elif report_to == "wandb":
            send, close = _wandb_sink(run_dir, run_config or {})

        def write(record):
            if record["type"] == "completions":
                completions.write_completions(run_dir, record)
            else:
                checkpoint.append_metrics(log, record)
            send(record)

        try:
            yield log, write
        finally:
            close()


# ------------------------------------------------------------------ what a run prints (train.py, main process)

def start_line(label, args, run_dir, cpu_threads=None):
    """The run's first line: the method, the model, the dataset, the budget, the run folder (and the CPU threads, a
    run.threads.Threads)."""
    budget = " or ".join(text for text in (f"{args.max_time_s:g} s of training" if args.max_time_s else "",
                                           f"{args.max_steps} steps" if args.max_steps else "") if text)
    every = [f"every {args.eval_interval} steps" if args.eval_interval else "",
             f"every {args.eval_interval_s:g} s of training" if getattr(args, "eval_interval_s", 0) else ""]
    schedule = f"step 0, {' and '.join(text for text in every if text)} and the end" if any(every) else \
        "step 0 and the end"
    evaluation = (f"held-out evaluation of {args.eval_samples} prompts at {schedule} (not counted in the budget)"
                  if args.eval_samples else "no held-out evaluation")
    threads = f"; {cpu_threads.describe()}" if cpu_threads is not None else ""
    return (f"{label}: {args.model} on {args.dataset}, {budget or 'no time or step limit'}; {evaluation}{threads} -> "
            f"{run_dir}")


def own_rows_line(args):
    """Said after the start line when your own rows took settings in place of the preset's task settings
    (presets.OWN_ROWS): which, and where to change them; None otherwise."""
    taken = [key for key, source in getattr(args, "value_sources", {}).items()
             if source.startswith("your own rows") and key != "one_shot"]
    if not taken:
        return None
    shown = {("system_prompt", None): "the paper's (data.SYSTEM_PROMPT)", ("system_prompt", ""): "none"}
    values = ", ".join(f"--{key.replace('_', '-')} {shown.get((key, getattr(args, key)), getattr(args, key))}"
                       for key in taken)
    return (f"your own rows: {values}, not the {args.preset} preset's task settings (presets.OWN_ROWS; a flag sets "
            "any of them, --print-config shows where each value comes from)")


def eta_line(args, state, step_s):
    """Said once, after a run's first step: what that step took and what the budget then means in time, so a slow
    machine shows its pace at once, not at the end (None: no budget)."""
    if args.max_steps:
        left = args.max_steps - state.step
        return (f"step {state.step} took {step_s:.0f} s: the {left} steps left take about {left * step_s / 60:.1f} min "
                "more, plus the held-out evaluations")
    if args.max_time_s:
        fit = max(0, int((args.max_time_s - state.elapsed_s) // max(step_s, 1e-9)))
        return f"step {state.step} took {step_s:.0f} s: about {fit} more fit in the {args.max_time_s:g} s budget"
    return None


def eval_line(step, result):
    """One held-out evaluation's result (eval.EvalResult)."""
    timeouts = f", {result.grader_timeouts} scored 0 for a grader time-out" if result.grader_timeouts else ""
    return (f"step {step}: held-out accuracy {result.accuracy:.2f}, format {result.format_accuracy:.2f} "
            f"({result.num_samples} samples, {result.elapsed_s:.0f} s{timeouts})")


def finish_lines(run_dir, args, steps, elapsed_s):
    """Where a finished run's results are, and the commands that read them, with the run's own folder."""
    run, plot = shlex.quote(str(run_dir)), shlex.quote(str(Path(run_dir) / "accuracy.png"))
    commands = []
    if args.eval_samples:
        commands.append(f"python compare.py {run} --plot {plot}   # held-out accuracy vs training time")
    if args.log_completions_interval:
        commands.append(f"python eval.py rollouts {run}   # one prompt's rollouts, the kept ones marked")
    if args.checkpoint_interval_s >= 0:
        commands.append(f"python eval.py --checkpoint {run}   # every checkpoint, as the run evaluated its policy")
    return [f"done: {steps} steps, {elapsed_s:.0f} s of training -> {run_dir}",
            f"  results: {Path(run_dir) / checkpoint.METRICS_FILE} (a line per step and per evaluation)",
            *(f"  {'next:' if i == 0 else '':8} {command}" for i, command in enumerate(commands))]
