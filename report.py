"""What a training run logs and where it goes.

`step_metrics` / `record_step`: one training step's metrics line, under TRL's names (reward, reward_std,
frac_reward_zero_std, completions/..., clip_ratio/..., loss, grad_norm), plus this trainer's counters
(update_rows, optimizer_steps, num_zero_variance_dropped, num_truncated_masked, skipped_steps) and timings.
`open_metrics`: every line goes to <out>/metrics.jsonl (checkpoint.py), and with --report-to also to TensorBoard
or Weights & Biases under the same names, so runs can be browsed with the tools researchers already use.

Every numeric field of a metrics line is sent as a scalar at the line's "step" (train lines and held-out "eval/..."
lines share the step axis, as in the jsonl). metrics.jsonl stays the record compare.py reads; the other sinks are
views of it. Simplification: a resumed run re-sends the steps after its checkpoint (TensorBoard: the events past
that step are purged; W&B: a new run in the same project).

The completions log shows the method's one decision, which m of the n rollouts it trains on (paper §3.2): for every
--log-completions-interval-th step, <out>/completions/step_XXXXXX.jsonl holds each prompt once and each rollout with
its completion, every reward function's value and the weighted total, length, truncation, whether the rule kept it,
the advantage the loss used and its mean ratio pi / pi_sampler (rollout_check.py); eval_step_XXXXXX.jsonl holds a
sample of each evaluation's completions and grades.
`show_rollouts` prints one prompt's rollouts sorted by reward (`python eval.py rollouts RUN`); TensorBoard gets the
same as text, W&B as a table.
`start_line`, `eval_line`, `finish_lines`: what a run prints besides its progress bar (what trains, on what, for how
long, where; each held-out evaluation; where the results are and the commands that read them).
`timed` is the one stopwatch of the project: a step's phases (train.py), the decode engine's prefill and decode
(engine/), the benchmarks.
"""

import contextlib
import importlib.util
import io
import json
import math
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import checkpoint

PHASE_KEYS = ("generate_s", "reward_s", "select_s", "update_s")  # a step's phases, timed by train.train_step
TIMING_KEYS = ("elapsed_s", *PHASE_KEYS, "step_s", "peak_mem_gib")
REPORT_TO = ("none", "tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
COMPLETIONS_DIR = "completions"
EVAL_COMPLETIONS_LOGGED = 16  # held-out completions kept per evaluation (the first prompts of the fixed sample)
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass
class ScoredRound:
    """One rollout batch after scoring and selection: the step's metrics and its completions log come from it."""
    rewards: torch.Tensor        # [P, n] weighted total
    per_func: dict               # reward function -> [P*n] (NaN: not applicable)
    kept_rows: torch.Tensor      # [R] rollout rows trained on (m per prompt, or fewer/more: update.kept_rows)
    advantages: torch.Tensor     # [P*n] the advantage the loss used (NaN: not kept)
    zero_variance_dropped: int   # prompts left out by --drop-zero-variance
    lengths: torch.Tensor        # [P*n] completion tokens
    truncated: torch.Tensor      # [P*n] bool: no EOS within the budget
    prompt_tokens: int           # tokens of the P prompts, x n (each rollout re-reads its prompt)
    prompts: list                # [P] rendered prompt texts
    answers: list                # [P] reference answers
    texts: list                  # [P*n] completions
    filtered: torch.Tensor       # [P] bool: set aside by --dynamic-sampling (no reward spread), not trained on
    sampler_ratios: torch.Tensor | None = None  # [P*n] mean pi / pi_sampler over a kept rollout's tokens (NaN: not
                                                # kept); set by train_step after the update

    @classmethod
    def of(cls, rollouts, examples, rewards, per_func, kept_rows, kept_advantages, zero_variance_dropped,
           filtered=None):
        """From a sampling.Rollouts, its data.Examples and what was computed from them (kept_advantages: one per
        kept row, in kept_rows order, as the update received them; filtered: [P] bool, None: none)."""
        advantages = torch.full((rewards.numel(),), math.nan)
        advantages[kept_rows] = kept_advantages.float()
        filtered = torch.zeros(rewards.shape[0], dtype=torch.bool) if filtered is None else filtered
        return cls(rewards, per_func, kept_rows, advantages, zero_variance_dropped, rollouts.lengths,
                   rollouts.truncated, int(rollouts.prompt_mask.sum()) * rewards.shape[1],
                   [e.text for e in examples], [e.answer for e in examples], list(rollouts.texts), filtered,
                   torch.full((rewards.numel(),), math.nan))


@contextlib.contextmanager
def timed(totals, key, device=None):
    """Add the block's wall-clock seconds to totals[key] (a dict) or totals.key (a record); on a CUDA device, once
    the work it queued has finished."""
    start = time.perf_counter()
    yield
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if isinstance(totals, dict):
        totals[key] = totals.get(key, 0.0) + seconds
    else:
        setattr(totals, key, getattr(totals, key) + seconds)


def step_metrics(scored, result, optimizer, costs, mask_truncated=False):
    """Metrics over all n rollouts per prompt of every ScoredRound; "reward_selected" over the kept ones
    (absent when nothing was kept); num_truncated_masked: kept rows whose loss --mask-truncated zeroed."""
    rewards_all = torch.cat([s.rewards for s in scored])
    kept_rewards = torch.cat([s.rewards.flatten()[s.kept_rows] for s in scored])
    lengths = torch.cat([s.lengths for s in scored]).float()
    metrics = {"reward": float(rewards_all.mean()), "reward_std": float(rewards_all.std(dim=1).mean()),
               **({"reward_selected": float(kept_rewards.mean())} if len(kept_rewards) else {}),
               "frac_reward_zero_std": float((rewards_all.std(dim=1) == 0).float().mean())}
    for name in scored[0].per_func:
        metrics[f"rewards/{name}/mean"] = float(torch.cat([s.per_func[name] for s in scored]).nanmean())
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio":
                    float(torch.cat([s.truncated for s in scored]).float().mean())})
    metrics.update(result.token_means)
    if result.sampler_gap is not None:  # the sampler's log-probs against the update's (rollout_check.py)
        metrics.update(result.sampler_gap.metrics())
    step_tokens = sum(s.prompt_tokens + int(s.lengths.sum()) for s in scored)
    masked = sum(int(s.truncated[s.kept_rows].sum()) for s in scored) if mask_truncated else 0
    metrics.update(loss=result.loss, grad_norm=result.grad_norm, learning_rate=optimizer.param_groups[0]["lr"],
                   step_tokens=step_tokens, update_rows=result.rows, optimizer_steps=result.optimizer_steps,
                   num_zero_variance_dropped=sum(s.zero_variance_dropped for s in scored), num_truncated_masked=masked,
                   step_skipped=result.skipped_steps, **costs)
    return metrics


def record_step(state, metrics, step_s):
    """Advance the checkpoint.TrainerState by one finished step; returns its metrics line."""
    skipped = metrics.pop("step_skipped")
    state.step += 1
    state.elapsed_s += step_s
    state.num_tokens += metrics.pop("step_tokens")
    state.skipped_steps += skipped
    state.nonfinite_streak = state.nonfinite_streak + 1 if skipped else 0
    return {"type": "train", "step": state.step, "elapsed_s": state.elapsed_s, **metrics,
            "num_tokens": state.num_tokens, "skipped_steps": state.skipped_steps, "step_s": step_s}


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


# ------------------------------------------------------------------------------------------ the completions log

def _finite_or_none(value):
    value = float(value)
    return value if math.isfinite(value) else None


def completions_record(step, scored):
    """The completions log of a training step (its ScoredRounds): per prompt one "prompt" row (prompt_id counts
    over every rollout batch of the step), then its n "rollout" rows."""
    rows, prompt_id = [], -1
    for scored_round in scored:
        num_prompts, n = scored_round.rewards.shape
        kept = torch.zeros(num_prompts * n, dtype=torch.bool)
        kept[scored_round.kept_rows] = True
        for i in range(num_prompts):
            prompt_id += 1
            rows.append({"type": "prompt", "prompt_id": prompt_id, "prompt": scored_round.prompts[i],
                         "answer": scored_round.answers[i], "filtered": bool(scored_round.filtered[i])})
            for j in range(n):
                r = i * n + j
                rows.append({"type": "rollout", "prompt_id": prompt_id, "rollout": j,
                             "completion": scored_round.texts[r], "reward": float(scored_round.rewards[i, j]),
                             "rewards": {name: _finite_or_none(values[r])
                                         for name, values in scored_round.per_func.items()},
                             "length": int(scored_round.lengths[r]), "truncated": bool(scored_round.truncated[r]),
                             "kept": bool(kept[r]), "advantage": _finite_or_none(scored_round.advantages[r]),
                             "sampler_ratio": None if scored_round.sampler_ratios is None else
                             _finite_or_none(scored_round.sampler_ratios[r])})
    return {"type": "completions", "name": f"step_{step:06d}", "step": step, "rows": rows}


def eval_completions_record(step, samples):
    """The completions log of a held-out evaluation: eval.py's graded samples (prompt, answer, completion, correct,
    formatted) of its first prompts."""
    return {"type": "completions", "name": f"eval_step_{step:06d}", "step": step,
            "rows": [dict(sample, type="eval") for sample in samples]}


def write_completions(run_dir, record):
    folder = Path(run_dir) / COMPLETIONS_DIR
    folder.mkdir(exist_ok=True)
    lines = [json.dumps({"type": "step", "step": record["step"]})] + [json.dumps(row) for row in record["rows"]]
    checkpoint.write_text_atomic(folder / f"{record['name']}.jsonl", "\n".join(lines) + "\n")


def _logged_files(run_dir, name):
    """{step: path} of the completions files named `name` ("step" or "eval_step") in a run folder."""
    files = {}
    for path in (Path(run_dir) / COMPLETIONS_DIR).glob(f"{name}_*.jsonl"):
        match = re.fullmatch(rf"{name}_(\d+)\.jsonl", path.name)
        if match:
            files[int(match[1])] = path
    return files


def drop_completions_after(run_dir, step):
    """A resumed run re-logs the steps after its checkpoint (identically): their files written before the restart
    go, so that none is left from steps the resumed run does not reach; so does a file a kill left half-written."""
    for path in (Path(run_dir) / COMPLETIONS_DIR).glob(checkpoint.TMP_PREFIX + "*"):
        path.unlink()
    for name in ("step", "eval_step"):
        for logged_step, path in _logged_files(run_dir, name).items():
            if logged_step > step:
                path.unlink()


def read_completions(run_dir, step=None, name="step"):
    """(step, rows) of a run's completions log at `step` (None: the newest); name "step" or "eval_step"."""
    files = _logged_files(run_dir, name)
    if not files:
        raise ValueError(f"{run_dir}: no {name} completions logged (see --log-completions-interval)")
    step = max(files) if step is None else step
    if step not in files:
        raise ValueError(f"{run_dir}: no {name} completions at step {step}; logged steps: "
                         f"{', '.join(map(str, sorted(files)))}")
    return step, [json.loads(line) for line in files[step].read_text().splitlines()][1:]


def _clip(text, width, end=False):
    """One line of at most `width` characters: its start (end=True: its end), newlines shown as \\n."""
    text = text.replace("\n", "\\n")
    if len(text) <= width:
        return text
    return "..." + text[3 - width:] if end else text[:width - 3] + "..."


def rollout_table(rows, prompt_id, width=100):
    """Lines: one prompt's rollouts sorted by reward (best first), the kept ones marked * with their advantage."""
    prompt = next((row for row in rows if row["type"] == "prompt" and row["prompt_id"] == prompt_id), None)
    if prompt is None:
        count = sum(row["type"] == "prompt" for row in rows)
        raise ValueError(f"no prompt {prompt_id}; this step has prompts 0-{count - 1}")
    rollouts = sorted((row for row in rows if row["type"] == "rollout" and row["prompt_id"] == prompt_id),
                      key=lambda row: -row["reward"])
    names = list(rollouts[0]["rewards"]) if rollouts else []
    lines = [f"prompt {prompt_id} (answer {prompt['answer']!r}): {_clip(prompt['prompt'], width + 40, end=True)}",
             f"{len(rollouts)} rollouts, {sum(r['kept'] for r in rollouts)} kept (*)"
             f"{', set aside by --dynamic-sampling' if prompt.get('filtered') else ''}, by reward:",
             "  reward " + "".join(f"{name[:9]:>10}" for name in names) + "  tokens  kept advantage  completion"]
    for row in rollouts:
        values = "".join(f"{'-' if v is None else format(v, '.2f'):>10}" for v in row["rewards"].values())
        kept = f"   *  {row['advantage']:+9.3f}" if row["kept"] else " " * 16
        length = f"{row['length']}{'+' if row['truncated'] else ''}"
        lines.append(f"{row['reward']:8.2f}{values}{length:>8}{kept}  {_clip(row['completion'], width)}")
    return lines


def eval_table(rows, width=100):
    lines = ["correct formatted  answer      completion"]
    for row in rows:
        lines.append(f"{'yes' if row['correct'] else 'no':>7} {'yes' if row['formatted'] else 'no':>9}  "
                     f"{_clip(str(row['answer']), 10):<10}  {_clip(row['completion'], width)}")
    return lines


# ------------------------------------------------------------------------------------------ sinks

def _tensorboard_sink(run_dir, first_step):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: events from first_step on were written after the resumed checkpoint: dropped.
    writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=first_step or None)

    def write(record):
        if record["type"] == "completions":  # text, as the viewer prints it: every prompt of the step
            rows = record["rows"]
            lines = eval_table(rows) if rows and rows[0]["type"] == "eval" else \
                [line for i in range(sum(r["type"] == "prompt" for r in rows)) for line in rollout_table(rows, i)]
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
    drop_completions_after(run_dir, first_step - 1)  # a new run (0) in a folder whose run started over: every file
    with checkpoint.open_metrics_log(run_dir, keep_bytes) as log:
        send, close = (lambda record: None), (lambda: None)
        if report_to == "tensorboard":
            send, close = _tensorboard_sink(run_dir, first_step)
        elif report_to == "wandb":
            send, close = _wandb_sink(run_dir, run_config or {})

        def write(record):
            if record["type"] == "completions":
                write_completions(run_dir, record)
            else:
                checkpoint.append_metrics(log, record)
            send(record)

        try:
            yield log, write
        finally:
            close()


# ------------------------------------------------------------------ what a run prints (train.py, main process)

def start_line(label, args, run_dir):
    """The run's first line: the method, the model, the dataset, the budget and the run folder."""
    budget = " or ".join(text for text in (f"{args.max_time_s:g} s of training" if args.max_time_s else "",
                                           f"{args.max_steps} steps" if args.max_steps else "") if text)
    schedule = f"step 0, every {args.eval_interval} steps and the end" if args.eval_interval else "step 0 and the end"
    evaluation = (f"held-out evaluation of {args.eval_samples} prompts at {schedule} (not counted in the budget)"
                  if args.eval_samples else "no held-out evaluation")
    return f"{label}: {args.model} on {args.dataset}, {budget or 'no time or step limit'}; {evaluation} -> {run_dir}"


def eval_line(step, result):
    """One held-out evaluation's result (eval.EvalResult)."""
    return (f"step {step}: held-out accuracy {result.accuracy:.2f}, format {result.format_accuracy:.2f} "
            f"({result.num_samples} samples, {result.elapsed_s:.0f} s)")


def finish_lines(run_dir, args, steps, elapsed_s):
    """Where a finished run's results are, and the commands that read them, with the run's own folder."""
    run, plot = shlex.quote(str(run_dir)), shlex.quote(str(Path(run_dir) / "accuracy.png"))
    commands = []
    if args.eval_samples:
        commands.append(f"python compare.py {run} --plot {plot}   # held-out accuracy vs training time")
    if args.log_completions_interval:
        commands.append(f"python eval.py rollouts {run}   # one prompt's rollouts, the kept ones marked")
    if args.checkpoint_interval_s >= 0:
        commands.append(f"python eval.py --checkpoint {run} --repeats 5   # re-evaluate every checkpoint")
    return [f"done: {steps} steps, {elapsed_s:.0f} s of training -> {run_dir}",
            f"  results: {Path(run_dir) / checkpoint.METRICS_FILE} (a line per step and per evaluation)",
            *(f"  {'next:' if i == 0 else '':8} {command}" for i, command in enumerate(commands))]
