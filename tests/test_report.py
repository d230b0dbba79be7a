"""report.py: the metrics line's scalars, metrics.jsonl plus the --report-to sinks (TensorBoard event files read
back, W&B through a stand-in module), resume purging, and the missing-package error."""

import importlib.machinery
import json
import sys
import types

import pytest

import checkpoint
import report

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
