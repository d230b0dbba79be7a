"""report.py: the metrics line's scalars, metrics.jsonl plus the --report-to sinks (TensorBoard event files read
back, W&B through a stand-in module), resume purging, the missing-package error, and the completions log (rows from
scored rounds, the viewer's table, files kept and dropped at resume, the TensorBoard text and W&B table)."""

import importlib.machinery
import json
import sys
import types

import pytest

import torch

from run import checkpoint
from run import completions
import data
from run import report
import sampling
import train

LINES = [{"type": "eval", "step": 0, "elapsed_s": 0.0, "eval/accuracy": 0.25},
         {"type": "train", "step": 1, "elapsed_s": 1.5, "loss": 0.5, "num_zero_variance_dropped": 2, "label": "x",
          "loss_nan": float("nan"), "flag": True},
         {"type": "train", "step": 2, "elapsed_s": 3.0, "loss": 0.25, "num_zero_variance_dropped": 0}]


def test_scalars_keep_the_finite_numbers_under_their_names():
    assert report.scalars(LINES[1]) == {"elapsed_s": 1.5, "loss": 0.5, "num_zero_variance_dropped": 2.0}


def test_none_writes_only_metrics_jsonl(tmp_path):
    with report.open_metrics(tmp_path) as (log, write):
        for line in LINES:
            write(line)
        assert log.tell() > 0
    read = [json.loads(line) for line in (tmp_path / checkpoint.METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in read] == [0, 1, 2] and not (tmp_path / report.TENSORBOARD_DIR).exists()


def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / report.TENSORBOARD_DIR))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_the_same_names_and_a_resume_purges_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    with report.open_metrics(tmp_path, "tensorboard") as (_, write):
        for line in LINES:
            write(line)
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == [(1, 0.5), (2, 0.25)] and scalars["eval/accuracy"] == [(0, 0.25)]
    assert scalars["num_zero_variance_dropped"] == [(1, 2.0), (2, 0.0)] and "label" not in scalars
    # Resume from a checkpoint at step 1: step 2 is written again, and only once in the events.
    keep = len(json.dumps(LINES[0])) + len(json.dumps(LINES[1])) + 2
    with report.open_metrics(tmp_path, "tensorboard", keep_bytes=keep, first_step=2) as (_, write):
        write(dict(LINES[2], loss=0.125))
    assert tensorboard_scalars(tmp_path)["loss"] == [(1, 0.5), (2, 0.125)]
    assert len((tmp_path / checkpoint.METRICS_FILE).read_text().splitlines()) == 3


def test_wandb_gets_every_line_at_its_step(tmp_path, monkeypatch):
    logged, finished = [], []
    run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)),
                                finish=lambda: finished.append(True))
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: logged.append(("init", kwargs)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with report.open_metrics(tmp_path, "wandb", run_config={"seed": 3}) as (_, write):
        write(LINES[1])
    assert logged[0][1]["config"] == {"seed": 3} and logged[0][1]["name"] == tmp_path.name
    assert logged[1] == (1, report.scalars(LINES[1])) and finished == [True]


def test_unknown_sink_or_missing_package_is_one_line(monkeypatch):
    with pytest.raises(ValueError, match="--report-to must be one of"):
        report.check_report_to("mlflow")
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        report.check_report_to("tensorboard")
    report.check_report_to("none")


def scored_round():
    """2 prompts x 4 rollouts; rows 1, 2 (prompt 0) and 4, 7 (prompt 1) kept, with their advantages."""
    rewards = torch.tensor([[0.0, 2.0, 1.0, 0.5], [3.0, 1.0, 1.0, 0.0]])
    rollouts = sampling.Rollouts(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3),
                                 completion_ids=torch.zeros(8, 2), completion_mask=torch.ones(8, 2),
                                 texts=[f"completion {r}\nline 2" for r in range(8)], lengths=torch.arange(8) + 1,
                                 truncated=torch.arange(8) == 7, prompt_index=torch.arange(2).repeat_interleave(4))
    examples = [data.Example(text="Q0?", prompt=[], answer="7"), data.Example(text="Q1?", prompt=[], answer="8")]
    per_func = {"accuracy": rewards.flatten() / 3, "format": torch.full((8,), float("nan"))}
    scored = train.Round(examples, rollouts, rewards, per_func, grader_timeouts=torch.arange(8) == 5)
    scored.keep(torch.tensor([[1, 2], [0, 3]]), torch.tensor([[0.7, -0.7], [0.9, -0.9]]))
    return scored


def test_completions_rows_hold_every_rollout_and_what_was_kept():
    record = completions.completions_record(5, [scored_round(), scored_round()])
    rows = record["rows"]
    assert record["name"] == "step_000005" and [r["prompt_id"] for r in rows if r["type"] == "prompt"] == [0, 1, 2, 3]
    rollouts = [r for r in rows if r["type"] == "rollout"]
    assert len(rollouts) == 16 and [r["rollout"] for r in rollouts[:4]] == [0, 1, 2, 3]
    assert [r["kept"] for r in rollouts[:8]] == [False, True, True, False, True, False, False, True]
    assert [r["advantage"] for r in rollouts[:8] if r["kept"]] == pytest.approx([0.7, -0.7, 0.9, -0.9])
    assert all(r["advantage"] is None for r in rollouts if not r["kept"])
    assert rollouts[1]["reward"] == 2.0 and rollouts[1]["rewards"] == {"accuracy": pytest.approx(2 / 3), "format": None}
    assert rollouts[7]["truncated"] and rollouts[7]["length"] == 8
    assert rollouts[3]["completion"] == "completion 3\nline 2"
    assert [r["grader_timeout"] for r in rollouts[:8]] == [r == 5 for r in range(8)]  # accuracy 0, unverified
    json.dumps(record)  # plain JSON: no NaN, no tensors


def test_the_viewer_sorts_by_reward_and_marks_the_kept_rollouts():
    rows = completions.completions_record(5, [scored_round()])["rows"]
    lines = completions.rollout_table(rows, 1)
    assert lines[0].startswith("prompt 1 (answer '8')") and "4 rollouts, 2 kept" in lines[1]
    body = lines[3:]
    assert [line.split()[0] for line in body] == ["3.00", "1.00", "1.00", "0.00"]  # best first
    assert "*" in body[0] and "+0.900" in body[0] and "*" in body[3] and "-0.900" in body[3]  # top and bottom kept
    assert "*" not in body[1] + body[2] and "8+" in body[3]  # truncated rows' lengths carry a +
    assert "completion 4\\nline 2" in body[0]  # one line per rollout
    with pytest.raises(ValueError, match="no prompt 2; this step has prompts 0-1"):
        completions.rollout_table(rows, 2)


def test_completion_files_of_steps_after_the_checkpoint_go_at_resume(tmp_path):
    with report.open_metrics(tmp_path) as (_, write):
        for step in (2, 4, 6):
            write(completions.completions_record(step, [scored_round()]))
        write(completions.eval_completions_record(4, [{"prompt": "Q", "answer": "1", "completion": "1", "correct": True,
                                                  "formatted": False}]))
        write(LINES[1])
    assert completions.read_completions(tmp_path)[0] == 6 and len(completions.read_completions(tmp_path, 2)[1]) == 10
    assert completions.read_completions(tmp_path, name="eval_step")[1][0]["correct"] is True
    metrics = (tmp_path / checkpoint.METRICS_FILE).read_text()
    assert metrics.splitlines() == [json.dumps(LINES[1])]  # completions never go to metrics.jsonl
    (tmp_path / completions.COMPLETIONS_DIR / "notes_step_9.txt").write_text("a user's file stays")
    killed = tmp_path / completions.COMPLETIONS_DIR / f"{checkpoint.TMP_PREFIX}1_step_000006.jsonl"
    killed.write_text('{"half')  # a kill left it half-written
    with report.open_metrics(tmp_path, keep_bytes=len(metrics), first_step=5):  # resumed from step 4's checkpoint
        pass
    assert sorted(p.name for p in (tmp_path / completions.COMPLETIONS_DIR).iterdir()) == [
        "eval_step_000004.jsonl", "notes_step_9.txt", "step_000002.jsonl", "step_000004.jsonl"]
    with pytest.raises(ValueError, match="no step completions at step 6; logged steps: 2, 4"):
        completions.read_completions(tmp_path, 6)


def test_tensorboard_text_and_wandb_table_of_the_completions(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with report.open_metrics(tmp_path, "tensorboard") as (_, write):
        write(completions.completions_record(3, [scored_round()]))
    events = EventAccumulator(str(tmp_path / report.TENSORBOARD_DIR), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("step/text_summary")
    assert text.step == 3 and b"2 kept" in text.tensor_proto.string_val[0]
    tables = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.Table = lambda columns, data: tables.append((columns, data)) or "table"
    fake.init = lambda **kwargs: types.SimpleNamespace(log=lambda values, step: tables.append((step, values)),
                                                       finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "w").mkdir()
    with report.open_metrics(tmp_path / "w", "wandb") as (_, write):
        write(completions.completions_record(3, [scored_round()]))
    columns, table_rows = tables[0]
    assert "kept" in columns and "advantage" in columns and len(table_rows) == 8 and tables[1] == (3, {"step": "table"})


def test_the_closing_lines_offer_only_the_commands_the_run_can_answer():
    from types import SimpleNamespace

    args = SimpleNamespace(eval_samples=0, eval_interval=0, log_completions_interval=0, checkpoint_interval_s=-1.0,
                           max_time_s=0.0, max_steps=3, model="m", dataset="gsm8k")
    assert report.finish_lines("runs/a b", args, 3, 4.6) == ["done: 3 steps, 5 s of training -> runs/a b",
                                                            "  results: runs/a b/metrics.jsonl (a line per step and "
                                                            "per evaluation)"]
    assert report.start_line("GRPO 4/4", args, "r") == "GRPO 4/4: m on gsm8k, 3 steps; no held-out evaluation -> r"
    args.checkpoint_interval_s, args.eval_samples = 0.0, 10
    commands = report.finish_lines("runs/a b", args, 3, 4.6)[2:]
    assert [line.split("#")[0].strip() for line in commands] == [
        "next:    python compare.py 'runs/a b' --plot 'runs/a b/accuracy.png'",
        "python eval.py --checkpoint 'runs/a b'"]  # quoted: the folder has a space; no completions log
    assert "evaluation of 10 prompts at step 0 and the end" in report.start_line("GRPO 4/4", args, "r")


def step_line(clipped=0.0, low=0.0, high=1.0, zero_std=0.5):
    return {"completions/clipped_ratio": clipped, "reward_min": low, "reward_max": high, "reward": (low + high) / 2,
            "frac_reward_zero_std": zero_std, "rewards/grader_timeouts": 0, "update_rows": 4}


@pytest.mark.parametrize("line, codes, says", [
    (step_line(), [], None),
    (step_line(clipped=0.875), [], None),
    (step_line(clipped=0.9), ["truncated"], "90% of the completions were cut at --max-completion-tokens 32: raise "
                                            "--max-completion-tokens"),
    (step_line(high=0.0, zero_std=1.0), ["rewards_zero"], "every reward was 0: check that --prompt-template / "
                                                          "--system-prompt ask for what the rewards grade"),
    (step_line(low=1.5, high=1.5, zero_std=1.0), ["rewards_equal"], "every reward was 1.5: the reward tells no "
                                                                    "completion from another"),
    (step_line(zero_std=1.0), ["no_spread"], "no group of rollouts had a reward spread (every advantage 0): "),
    (step_line(clipped=1.0, high=0.0, zero_std=1.0), ["truncated", "rewards_zero"], "cut at --max-completion-tokens"),
])
def test_a_step_that_cannot_learn_says_why_and_names_what_to_change(line, codes, says):
    """TRL's truncation and zero-std metrics read as a verdict: >= 90 % of the completions cut, every reward 0 or
    equal, or no group with a spread is a "cannot_learn" field of the metrics line and one line naming the flag."""
    line.update(report.learning_signal(line))
    assert line.get("cannot_learn", []) == codes
    notes = report.step_notes(line, types.SimpleNamespace(max_completion_tokens=32, dynamic_sampling=False), 1,
                              first=True)
    assert notes == ([] if says is None else [notes[0]]) and (says is None or (
        notes[0].startswith("cannot learn: ") and says in notes[0]))


def test_cannot_learn_is_said_at_the_first_step_and_as_it_persists():
    """The line comes at the run's first step and at the 2nd, 4th, 8th ... step of a row of such steps; a single such
    step later in a run (an easy prompt mix) is only in the metrics line."""
    line = dict(step_line(zero_std=1.0), cannot_learn=["no_spread"])
    args = types.SimpleNamespace(max_completion_tokens=32, dynamic_sampling=False)
    said = [stuck for stuck in range(1, 10) if report.step_notes(line, args, stuck, first=stuck == 1)]
    assert said == [1, 2, 4, 8]
    assert report.step_notes(line, args, 1, first=False) == []
    assert report.step_notes(line, args, 4)[0].endswith("(4 steps in a row)")
