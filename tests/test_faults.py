"""Damaged inputs and a full disk, each said in one line naming the file or folder (the fault sweep's cases): data
files and benchmark JSON cut short, not UTF-8 or of the wrong shape; non-finite budgets and no resamples; committed
study data never removed; locks of the older format or of garbage bytes; a checkpoint or a new run on a full disk;
an adapter of another model. Paired statistics are in test_bootstrap.py, the run folder's other cases in
test_runfolder.py."""

import errno
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studies import bootstrap
from studies import pods_study
from run import runfolder
from studies import studydata
from bench.show import bench_show

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "results" / "pods" / "grpo-n4-m4-s0.json"


def damaged_copies(folder):
    """{case: a data file damaged that way}, beside one intact copy of a committed run data file."""
    folder.mkdir(parents=True, exist_ok=True)
    text = COMMITTED.read_text()
    cases = {"cut": text[:300].encode(), "not utf-8": b"\xff\xfe" + text.encode()[2:], "a list": b"[1, 2]",
             "no evaluations": json.dumps({**json.loads(text), "evaluations": None}).encode(),
             "no label": json.dumps({k: v for k, v in json.loads(text).items() if k != "label"}).encode()}
    paths = {}
    for case, payload in cases.items():
        paths[case] = folder / f"{case.replace(' ', '_')}.json"
        paths[case].write_bytes(payload)
    return paths


@pytest.mark.parametrize("case", ["cut", "not utf-8", "a list", "no evaluations", "no label"])
def test_a_damaged_data_file_is_one_line_naming_it(tmp_path, case):
    path = damaged_copies(tmp_path)[case]
    with pytest.raises(ValueError) as error:
        studydata.read_study([path])
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    if case in ("cut", "not utf-8", "a list"):  # and bench show, on the same file (any JSON object is a result there)
        with pytest.raises(SystemExit) as exit_info:
            bench_show([str(path)])
        assert str(exit_info.value.code).startswith(f"python -m bench show: {path}: ")


def test_bench_show_says_a_list_that_is_no_table_instead_of_skipping_it(tmp_path, capsys):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"rows": [{"a": 1}, 5], "summary": 3}))
    with pytest.raises(SystemExit, match=r"'rows' is not a table of rows \(item 1 is 5\)"):
        bench_show([str(path)])
    path.write_text(json.dumps({"rows": [{"a": 1}], "summary": 3}))
    assert "summary: 3" in (bench_show([str(path)]) and capsys.readouterr().out)


def run_command(script, argv):
    script, *subcommand = script.split()  # "study.py bootstrap": study.py's subcommand
    argv = [*subcommand, *argv]
    sys_argv = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        return str(stop.code)
    finally:
        sys.argv = sys_argv
    return None


@pytest.mark.parametrize("script, argv, message", [
    ("study.py bootstrap", ["--from-data", "results/pods", "--baseline-label", "GRPO 4/4", "--budget-s", "nan"],
     "argument --budget-s: must be a finite number > 0, got nan"),
    ("study.py bootstrap", ["--from-data", "results/pods", "--baseline-label", "GRPO 4/4", "--resamples", "0"],
     "argument --resamples: must be >= 1, got 0"),
    ("study.py", ["pods", "--from-data", "results/pods", "--max-time-s", "nan"],
     "argument --max-time-s: must be a finite number > 0, got nan"),
    ("study.py", ["objectives", "--out", "unused", "--resamples", "0"], "argument --resamples: must be >= 1, got 0"),
    ("study.py", ["ga", "--out", "unused", "--resamples", "-3"], "argument --resamples: must be >= 1, got -3"),
    ("study.py", ["run", "--out", "unused", "--max-time-s", "0"], "argument --max-time-s: must be a finite number > 0"),
    ("study.py", ["pods", "--from-data", "results/pods", "--max-time-s", "1e9"],
     "--max-time-s 1e+09: runs trained for less"),  # the command's own flag, not bootstrap's
])
def test_a_budget_or_resample_count_that_means_nothing_is_refused(script, argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    said = run_command(script, argv)
    said = said if said and said != "2" else capsys.readouterr().err.strip().splitlines()[-1]
    assert message in said


def test_a_study_writes_its_data_into_its_own_folder_and_never_deletes_committed_data(tmp_path, monkeypatch):
    """Before: `study.py pods --out RUN --arms grpo --seeds 0 --report-only` wrote into results/pods and deleted the
    30 other runs' committed data files. Now the data go to <out>/data, and a data folder whose committed files the
    export would replace is refused before anything is written."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    for name in ("grpo-n4-m4-s1.json", "max_variance-n16-m4-s1.json"):
        (repo / "data" / name).write_text(COMMITTED.read_text())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "data"], cwd=repo, check=True)
    assert [p.name for p in studydata.tracked_by_git(sorted((repo / "data").glob("*.json")))] == [
        "grpo-n4-m4-s1.json", "max_variance-n16-m4-s1.json"]
    run = tmp_path / "out" / "grpo-n4-m4-s0"
    run.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--data .* holds committed run data that this study's runs would replace "
                                         r"\(grpo-n4-m4-s1.json, max_variance-n16-m4-s1.json\)"):
        pods_study.write_pods_data([run], repo / "data", 600, "python study.py pods ...")
    assert sorted(p.name for p in (repo / "data").iterdir()) == ["grpo-n4-m4-s1.json", "max_variance-n16-m4-s1.json"]
    calls = {}
    monkeypatch.setattr(pods_study.studyrun, "trained_runs", lambda *args, **kwargs: [])
    monkeypatch.setattr(pods_study, "write_pods_data", lambda runs, data_dir, *args, **kwargs: calls.update(
        data_dir=data_dir) or Path(data_dir).mkdir(parents=True))
    with pytest.raises(ValueError, match="no run of the study"):  # nothing trained here: stops before writing
        pods_study.run_pods(tmp_path / "out", ("grpo",), [0])
    monkeypatch.setattr(pods_study.studyrun, "trained_runs", lambda *args, **kwargs: [run])
    monkeypatch.setattr(pods_study, "report_pods_data", lambda data_dir, *args: "table")
    pods_study.run_pods(tmp_path / "out", ("grpo",), [0])
    assert calls["data_dir"] == tmp_path / "out" / "data"  # not the committed results/pods


def test_a_lock_of_garbage_bytes_or_of_the_older_format_with_a_reused_pid_is_stale(tmp_path):
    lock = tmp_path / runfolder.LOCK_FILE
    lock.write_bytes(b"garbage\x00\xff")  # was: a UnicodeDecodeError naming no file
    assert runfolder.check_not_in_use(tmp_path) is True
    host = __import__("socket").gethostname()
    lock.write_text(f"{host} 1\n")  # the older two-field format; pid 1 is alive but is no train.py run
    assert runfolder.check_not_in_use(tmp_path) is True
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # a Python process started before the lock was written: it may be the run, refused as before
        time.sleep(0.1)
        lock.write_text(f"{host} {child.pid}\n")
        with pytest.raises(ValueError, match=f"in use by another train.py run \\(process {child.pid}"):
            runfolder.check_not_in_use(tmp_path)
        os.utime(lock, (time.time() - 3600, time.time() - 3600))  # written before the process started: not its
        assert runfolder.check_not_in_use(tmp_path) is True
    finally:
        child.kill()
        child.wait()


def test_a_checkpoint_on_a_full_disk_through_safetensors_is_one_line_and_leaves_no_partial_folder(tmp_path):
    class SafetensorError(Exception):  # safetensors raises its own type, not an OSError
        pass

    root = tmp_path / "checkpoints"
    partial = root / ".tmp_step_000001_x" / "adapter"
    partial.mkdir(parents=True)
    (partial / "README.md").write_text("x")
    with pytest.raises(OSError, match=r"disk full: a checkpoint needs .* the partial copy is removed and there is no "
                                      r"checkpoint to resume"):
        with runfolder.disk_full_said(tmp_path, 10):
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                  "\"No space left on device\" })")
    assert list(root.iterdir()) == []


def test_a_new_run_on_a_full_disk_names_its_folder(tmp_path):
    with pytest.raises(OSError) as error:
        with runfolder.disk_full_at_start(tmp_path / "run"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(error.value) == (f"disk full: no space left to start the run in {tmp_path / 'run'} (its lock and "
                                "config.json); free some space or pass another --output-dir")
    with pytest.raises(PermissionError):  # another error: kept as it is
        with runfolder.disk_full_at_start(tmp_path / "run"):
            raise PermissionError(errno.EACCES, "denied")


def test_an_adapter_of_another_model_is_one_line_naming_both(tmp_path):
    import eval as heldout
    import models

    small = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=256), lora_rank=4, lora_alpha=8)
    small.save_pretrained(tmp_path / "step_000001" / "adapter")
    other = models.tiny_random_model("llama", vocab_size=256, hidden_size=48)
    with pytest.raises(ValueError, match=r"--checkpoint .*step_000001: its adapter does not fit other-model \(its "
                                         r"layers' shapes differ\).*: give --base-model the model the run trained"):
        heldout.load_adapter(other, tmp_path / "step_000001" / "adapter", "other-model")


def test_a_conversion_killed_mid_way_leaves_no_staging_folder_for_the_next_one(tmp_path):
    import models

    old, running = tmp_path / ".tmp-killed", tmp_path / ".tmp-running"
    for folder in (old, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    os.utime(old, (time.time() - 2 * models.STALE_STAGING_S,) * 2)
    models.remove_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-running"]  # a conversion under way is left alone
