"""train.py when the run is interrupted or its folder is damaged, on a tiny random model: a signal in the step-0
evaluation, the last step or the final evaluation; a run stopped before its first checkpoint; a full disk during a
save; a damaged newest checkpoint (eval.py skips it, --resume goes back one); sizes beyond the dataset; a folder that
another run holds. Each ends in one line or an exact resume, with no metrics line lost or written twice."""

import errno
import json
import os
import shutil
import signal
import socket

import pytest
import torch

import eval as heldout
import models
from run import runfolder, signals
import train
from run_helpers import TIMING, read_lines, tiny_argv

pytestmark = pytest.mark.usefixtures("varied_rewards")
EXTRA = ["--eval-interval", "5"]  # 2 steps: evaluations at step 0 and (the final one) at step 2


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The 2-step run every interrupted, then resumed, run must equal."""
    from run_helpers import fake_compute_rewards

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rewards.compute_rewards", fake_compute_rewards)
        return train.main(tiny_argv(tiny_model_dir, tmp_path_factory.mktemp("full") / "run", *EXTRA))


def assert_equals_uninterrupted(run_dir, full_dir):
    """Every metrics line (timings aside) once, in order, the completions files and the step-2 adapter bit for bit."""
    from safetensors.torch import load_file

    def lines(run):
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert lines(run_dir) == lines(full_dir)
    assert sorted(os.listdir(run_dir / "completions")) == sorted(os.listdir(full_dir / "completions"))
    a, b = (load_file(run / "checkpoints/step_000002/adapter/adapter_model.safetensors") for run in (run_dir, full_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def signal_at(monkeypatch, phase):
    """SIGTERM to this process during `phase`: "step 0 evaluation", "last step" (2) or "final evaluation"."""
    real_step, real_evaluate, calls = train.train_step, heldout.evaluate, {"evaluate": 0}

    def step(model, tokenizer, optimizer, rounds, args, step, *rest):
        if phase == "last step" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(model, tokenizer, optimizer, rounds, args, step, *rest)

    def evaluate(*args, **kwargs):
        calls["evaluate"] += 1
        if (phase, calls["evaluate"]) in (("step 0 evaluation", 1), ("final evaluation", 2)):
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(heldout, "evaluate", evaluate)


@pytest.mark.parametrize("phase, evaluated, saved", [("step 0 evaluation", [0], "step_000000"),
                                                     ("last step", [0], "step_000002"),
                                                     ("final evaluation", [0, 2], "step_000002")])
def test_a_signal_in_any_phase_stops_with_a_checkpoint_and_the_resume_is_exact(tiny_model_dir, tmp_path, monkeypatch,
                                                                              uninterrupted, phase, evaluated, saved,
                                                                              capsys):
    """The documented stop in every phase: the phase under way ends, a checkpoint, the resume hint, exit 128 + 15;
    the resume logs nothing twice (the step-0 evaluation included) and equals the uninterrupted run."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        signal_at(patch, phase)
        with pytest.raises(signals.Stopped) as stopped:
            train.main(tiny_argv(tiny_model_dir, run_dir, *EXTRA))
    assert stopped.value.code == 128 + signal.SIGTERM and "--resume" in capsys.readouterr().err
    assert (run_dir / "checkpoints/latest.txt").read_text().strip() == saved
    assert [e["step"] for e in read_lines(run_dir, "eval")] == evaluated
    train.main(["--output-dir", str(run_dir), "--resume", "--no-progress"])
    assert_equals_uninterrupted(run_dir, uninterrupted)


def test_a_run_stopped_before_its_first_checkpoint_says_how_to_start_over(tiny_model_dir, tmp_path, monkeypatch,
                                                                         uninterrupted):
    """No checkpoint yet: --resume and a rerun both say to delete metrics.jsonl; doing so gives the full run."""
    argv = tiny_argv(tiny_model_dir, tmp_path / "run", *EXTRA, "--checkpoint-interval-s", "1000")
    def lost(*args, **kwargs):
        raise RuntimeError("the machine went away")

    with monkeypatch.context() as patch:
        patch.setattr(train, "train_step", lost)
        with pytest.raises(RuntimeError, match="went away"):
            train.main(argv)  # stopped in step 1, after the step-0 evaluation was logged
    metrics = tmp_path / "run" / "metrics.jsonl"
    for extra in (["--resume"], []):
        with pytest.raises(ValueError, match=f"stopped before its first checkpoint: delete {metrics} to start it"):
            train.main(argv + extra)
    metrics.unlink()
    train.main(argv)
    assert_equals_uninterrupted(tmp_path / "run", uninterrupted)


def test_a_full_disk_during_a_save_stops_in_one_line_and_the_resume_is_exact(tiny_model_dir, tmp_path, monkeypatch,
                                                                            uninterrupted):
    run_dir, real_save, saves = tmp_path / "run", torch.save, []

    def save_until_full(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:  # step 2's trainer_state.pt
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", save_until_full)
        with pytest.raises(OSError, match="disk full: a checkpoint needs .* previous checkpoint is intact"):
            train.main(tiny_argv(tiny_model_dir, run_dir, *EXTRA))
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest.txt", "step_000001"]  # the partial copy is gone
    assert not (run_dir / runfolder.LOCK_FILE).exists()
    train.main(["--output-dir", str(run_dir), "--resume", "--no-progress"])
    assert_equals_uninterrupted(run_dir, uninterrupted)


def test_a_full_disk_at_the_first_checkpoint_says_to_start_over_and_that_works(tiny_model_dir, tmp_path, monkeypatch,
                                                                               uninterrupted):
    """No checkpoint to resume: the line does not advise --resume (which would be refused) but what works; doing
    what it says gives the full run, with no lock left in the way."""
    argv = tiny_argv(tiny_model_dir, tmp_path / "run", *EXTRA)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", full)
        with pytest.raises(OSError) as error:
            train.main(argv)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert str(error.value).startswith("disk full: a checkpoint needs ") and "\n" not in str(error.value)
    assert "--resume" not in str(error.value).replace("without --resume", "")
    assert str(error.value).endswith(f"there is no checkpoint to resume. Free some space; delete {metrics} to start "
                                     "it over (the same command, without --resume), or pass another --output-dir")
    assert not (tmp_path / "run" / runfolder.LOCK_FILE).exists()
    metrics.unlink()
    train.main(argv)
    assert_equals_uninterrupted(tmp_path / "run", uninterrupted)


@pytest.mark.parametrize("damage", ["cut", "deleted"])
def test_a_log_cut_or_deleted_is_restored_from_the_checkpoint_or_refused(tiny_model_dir, tmp_path, uninterrupted,
                                                                       damage, capsys):
    """metrics.jsonl shorter than its checkpoint saw, or gone: the resume restores it from the checkpoint's copy and
    says so in one line (the resumed run's log equals the uninterrupted one); a checkpoint without a copy refuses."""
    run_dir = tmp_path / "run"
    argv = tiny_argv(tiny_model_dir, run_dir, *EXTRA)
    train.main(argv)
    metrics, copy = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "step_000002" / "metrics.jsonl"
    whole = metrics.read_bytes()
    assert copy.read_bytes() == whole  # the step-2 checkpoint saw the whole log
    for missing_copy in (True, False):
        metrics.write_bytes(whole[:len(whole) // 2]) if damage == "cut" else metrics.unlink(missing_ok=True)
        if missing_copy:
            copy.rename(copy.with_suffix(".away"))
            with pytest.raises(ValueError, match=f"{metrics} is {'cut short' if damage == 'cut' else 'missing'}.*"
                                                 "the checkpoint holds no copy of it"):
                train.main(argv + ["--resume"])
            copy.with_suffix(".away").rename(copy)
            continue
        capsys.readouterr()
        train.main(argv + ["--resume"])
        said = [line for line in capsys.readouterr().err.splitlines() if "restored from" in line]
        assert len(said) == 1 and said[0].startswith(f"{metrics} was {'cut short' if damage == 'cut' else 'missing'}")
        assert said[0].endswith(f": restored from {copy}")
    assert_equals_uninterrupted(run_dir, uninterrupted)


def test_a_new_run_on_a_full_disk_leaves_nothing_that_blocks_the_next_run(tiny_model_dir, tmp_path, monkeypatch):
    """The disk is full when the run writes its lock: one line, and no empty train.lock (which would refuse the next
    run as "being taken") nor temporary file left; the same command runs once there is space."""
    argv = tiny_argv(tiny_model_dir, tmp_path / "run", "--eval-samples", "0", "--max-steps", "1")
    real_fdopen, real_fsync = os.fdopen, os.fsync

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fdopen", lambda fd, *args, **kwargs: type("Full", (), dict(
            __enter__=lambda self: self, __exit__=lambda self, *exc: os.close(fd), write=full))())
        with pytest.raises(OSError, match="disk full: no space left to start the run in .*run"):  # the folder named
            train.main(argv)
    assert not (tmp_path / "run").exists()  # the folder it made, left empty: removed
    with monkeypatch.context() as patch:  # the lock fits, config.json does not
        patch.setattr(os, "fsync", full)
        with pytest.raises(OSError, match="disk full: no space left to start the run in .*run"):
            train.main(argv)
    assert not (tmp_path / "run").exists()
    assert os.fdopen is real_fdopen and os.fsync is real_fsync
    train.main(argv)
    assert [line["step"] for line in read_lines(tmp_path / "run", "train")] == [1]


def test_a_damaged_newest_checkpoint_is_skipped_by_eval_and_resumed_from_the_one_before(tmp_path, uninterrupted,
                                                                                       capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    adapter = run_dir / "checkpoints/step_000002/adapter/adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:200])  # a copy interrupted, a disk failing
    results = heldout.main(["--checkpoint", str(run_dir), "--num-prompts", "2", "--repeats", "1", "--no-progress"])
    assert list(results["results"]) == ["step_000001"]  # step 2's is named and skipped
    assert f"skipping {adapter.parent.parent}: {adapter} is unreadable" in capsys.readouterr().err
    train.main(["--output-dir", str(run_dir), "--resume", "--no-progress"])
    assert f"passed over {adapter.parent.parent}" in capsys.readouterr().err
    (run_dir / "eval_test.json").unlink()
    assert_equals_uninterrupted(run_dir, uninterrupted)  # step 2 trained again, exactly


def test_sizes_beyond_the_dataset_and_a_held_folder_are_refused_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="--prompts-per-step 1000000000 exceeds the 64 training prompts"):
        train.main(tiny_argv(tiny_model_dir, run_dir, "--prompts-per-step", "1000000000"))
    with pytest.raises(ValueError, match="arithmetic: 100000000 rows asked"):
        train.main(tiny_argv(tiny_model_dir, run_dir, "--eval-samples", "100000000"))
    assert not run_dir.exists()  # a run refused while it loads leaves no empty folder behind
    run_dir.mkdir()
    parent = os.getppid()  # a live process, in the lock's format
    (run_dir / runfolder.LOCK_FILE).write_text(f"{socket.gethostname()} {parent} {runfolder.process_start(parent)}\n")
    with pytest.raises(ValueError, match=f"{run_dir} is in use by another train.py run"):
        train.main(tiny_argv(tiny_model_dir, run_dir))
    assert sorted(os.listdir(run_dir)) == [runfolder.LOCK_FILE]  # nothing written: the run can be started again
