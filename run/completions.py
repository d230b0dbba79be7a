"""The completions log: what the method decided, readable (paper §3.2: which m of the n rollouts it trains on).

For every --log-completions-interval-th step, <out>/completions/step_XXXXXX.jsonl holds each prompt once (marked when
--dynamic-sampling set it aside) and each rollout with its completion, every reward function's value and the
weighted total, whether its answer comparison timed out twice (accuracy 0, unverified), length, truncation, whether
the rule kept it, the advantage the loss used, its mean ratio pi / pi_sampler (policy.py's sampler check) and, under
"logged", the columns a reward function gave TRL's log_extra;
eval_step_XXXXXX.jsonl holds a sample of each evaluation's completions and
grades. `rollout_table` prints one prompt's rollouts sorted by reward (`python eval.py rollouts RUN`); report.py's
sinks send the same to TensorBoard as text and to W&B as a table. Files are written atomically (checkpoint.py), and a
resumed run drops those past its checkpoint, so no step is logged twice or lost.
"""

import json
import math
import re
from pathlib import Path

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it

from run import checkpoint

COMPLETIONS_DIR = "completions"
EVAL_COMPLETIONS_LOGGED = 16  # held-out completions kept per evaluation (the first prompts of the fixed sample)


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
                         "answer": scored_round.answers[i],
                         **{mark: bool(marked[i]) for mark, marked in scored_round.marks.items()}})
            for j in range(n):
                r = i * n + j
                rows.append({"type": "rollout", "prompt_id": prompt_id, "rollout": j,
                             "completion": scored_round.texts[r], "reward": float(scored_round.rewards[i, j]),
                             "rewards": {name: _finite_or_none(values[r])
                                         for name, values in scored_round.per_func.items()},
                             "length": int(scored_round.lengths[r]), "truncated": bool(scored_round.truncated[r]),
                             "grader_timeout": bool(scored_round.grader_timeouts[r]),
                             "kept": bool(kept[r]), "advantage": _finite_or_none(scored_round.advantages[r]),
                             "sampler_ratio": None if scored_round.sampler_ratios is None else
                             _finite_or_none(scored_round.sampler_ratios[r]),
                             **({"logged": scored_round.logged_columns[r]} if scored_round.logged_columns[r] else {})})
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


def logged_files(run_dir, name):
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
        for logged_step, path in logged_files(run_dir, name).items():
            if logged_step > step:
                path.unlink()


def read_completions(run_dir, step=None, name="step"):
    """(step, rows) of a run's completions log at `step` (None: the newest); name "step" or "eval_step"."""
    files = logged_files(run_dir, name)
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
             f"{', set aside by --dynamic-sampling (no reward spread)' if prompt.get('filtered') else ''}"
             + (", set aside by --dynamic-sampling to even out the processes' rows" if prompt.get("set_aside") else "")
             + ", by reward:",
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
