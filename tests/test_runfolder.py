"""runfolder.py: one writer per run folder (a live holder refuses, a dead one's lock is taken over), the newest
readable checkpoint when latest.txt or the newest checkpoint is damaged, a full disk said in one line with the partial
copy removed, and a folder that cannot hold a run refused before anything loads."""

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from run import checkpoint
import models
from run import runfolder


def test_a_live_holder_refuses_the_folder_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lock = tmp_path / runfolder.LOCK_FILE
    try:
        lock.write_text(f"{socket.gethostname()} {holder.pid}\n")
        written = lock.stat().st_mtime  # an older lock's format: no start time, so /proc decides (could_be_a_run)
        assert runfolder.could_be_a_run(holder.pid, written), (  # what it read, should this ever fail again
            f"lock written at {written}; btime {Path('/proc/stat').read_text().split('btime')[1].split()[0]}; "
            f"holder started {runfolder.process_start(holder.pid)} ticks after it; "
            f"{Path(f'/proc/{holder.pid}/cmdline').read_bytes()}")
        with pytest.raises(ValueError, match=rf"in use by another train.py run \(process {holder.pid}\)"):
            with runfolder.folder_lock(tmp_path):
                pass
        assert lock.read_text() == f"{socket.gethostname()} {holder.pid}\n"  # the holder's lock is left alone
    finally:
        holder.kill()
        holder.wait()
    with runfolder.folder_lock(tmp_path):  # its process is gone: stale, taken over
        assert lock.read_text() == runfolder.lock_text()
        with pytest.raises(ValueError, match=f"process {os.getpid()}"):  # a second run of this very process too
            with runfolder.folder_lock(tmp_path):
                pass
    assert not lock.exists()  # released at the end
    lock.write_text("another-host 12\n")
    with pytest.raises(ValueError, match=f"on another-host \\(delete {lock} if that run is over\\)"):
        with runfolder.folder_lock(tmp_path):
            pass
    lock.write_text("")  # created this very moment by a run that has not written its id yet
    with pytest.raises(ValueError, match="is being taken by another train.py run"):
        with runfolder.folder_lock(tmp_path):
            pass


def test_a_lock_names_its_process_by_id_and_start_time_so_a_reused_id_is_stale(tmp_path):
    """A pid names another process once the run's process is gone and the id reused: the start time (/proc/<pid>/stat
    field 22) in the lock tells them apart. Where it cannot be read ("-", or a lock written before it was recorded),
    the pid alone decides."""
    lock, host = tmp_path / runfolder.LOCK_FILE, socket.gethostname()
    started = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    with runfolder.folder_lock(tmp_path):
        assert lock.read_text() == f"{host} {os.getpid()} {started}\n"
    lock.write_text(f"{host} {os.getpid()} {int(started) - 1}\n")  # this pid, once another process's
    with runfolder.folder_lock(tmp_path):
        assert lock.read_text() == runfolder.lock_text()
    for unknown in (f"{host} {os.getpid()} -\n", f"{host} {os.getpid()}\n"):  # no start time: the pid decides
        lock.write_text(unknown)
        with pytest.raises(ValueError, match=f"in use by another train.py run \\(process {os.getpid()}\\)"):
            with runfolder.folder_lock(tmp_path):
                pass
    lock.write_text(f"{host} {os.getpid()} {started}\n")  # the very process: live
    with pytest.raises(ValueError, match="in use by another train.py run"):
        with runfolder.folder_lock(tmp_path):
            pass


def test_a_lock_that_cannot_be_written_is_removed_and_an_old_empty_one_is_stale(tmp_path, monkeypatch):
    """A full disk when the lock is written: the empty file would refuse the next run; it is removed. An empty lock
    left for longer than a run takes to write its id (a kill at that instant) is stale too."""
    lock = tmp_path / runfolder.LOCK_FILE
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.handle = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.handle.close()

    with monkeypatch.context() as patch:
        patch.setattr(runfolder.os, "fdopen", FullDisk)
        with pytest.raises(OSError, match="No space left"):
            with runfolder.folder_lock(tmp_path):
                pass
    assert not lock.exists()
    with runfolder.folder_lock(tmp_path):  # the next run takes the folder
        pass
    lock.write_text("")
    old = lock.stat().st_mtime - runfolder.EMPTY_LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    with runfolder.folder_lock(tmp_path):
        assert lock.read_text() == runfolder.lock_text()


@pytest.fixture
def three_checkpoints(tmp_path):
    """A run folder with checkpoints of steps 1-3 of a tiny LoRA model (latest.txt: step 3)."""
    torch.manual_seed(0)
    model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=256), lora_rank=4, lora_alpha=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, {"elapsed_s": float(step)}, {})
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("damage, expected, passed_over", [
    ("latest.txt deleted", "step_000003", "latest.txt: missing, or names no checkpoint folder"),
    ("latest.txt garbage", "step_000003", "latest.txt: missing, or names no checkpoint folder"),
    ("latest.txt names a missing folder", "step_000003", "latest.txt: missing, or names no checkpoint folder"),
    ("newest adapter cut short", "step_000002", "adapter_model.safetensors is unreadable"),
    ("newest trainer_state.pt empty", "step_000002", "trainer_state.pt is empty or cut short"),
])
def test_a_damaged_latest_falls_back_to_the_newest_readable_checkpoint(three_checkpoints, damage, expected,
                                                                       passed_over):
    root, newest = three_checkpoints, three_checkpoints / "step_000003"
    if damage == "latest.txt deleted":
        (root / "latest.txt").unlink()
    elif damage == "latest.txt garbage":
        (root / "latest.txt").write_bytes(b"\xff\x00garbage")
    elif damage == "latest.txt names a missing folder":
        (root / "latest.txt").write_text("step_000009\n")
    elif damage == "newest adapter cut short":
        adapter = newest / "adapter" / "adapter_model.safetensors"
        adapter.write_bytes(adapter.read_bytes()[:100])
    else:
        (newest / "trainer_state.pt").write_bytes(b"")
    path, skipped = runfolder.newest_checkpoint(root.parent)
    assert path == root / expected and any(passed_over in f"{where}: {why}" for where, why in skipped)
    assert checkpoint.load_state_file(path / "trainer_state.pt")["step"] == int(expected[-1])  # it loads
    assert runfolder.newest_checkpoint(root.parent, readable=False)[0] is not None  # the flags' check: one exists


def test_a_full_disk_removes_the_partial_copy_and_says_so(three_checkpoints, monkeypatch):
    """ENOSPC from the writer, or torch.save's RuntimeError while less space is free than the checkpoint needs: one
    line with the space needed, the partial folder gone, latest.txt and the previous checkpoint untouched."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=256), lora_rank=4, lora_alpha=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=r"disk full: a checkpoint needs ~\d+\.\d MiB in .* Free some space, then "
                                      r"continue with --output-dir .* --resume"):
        with runfolder.disk_full_said(three_checkpoints.parent, runfolder.checkpoint_bytes(model, optimizer)):
            checkpoint.save_checkpoint(three_checkpoints.parent, 4, model, optimizer, {}, {})
    assert sorted(p.name for p in three_checkpoints.iterdir()) == ["latest.txt", "step_000001", "step_000002",
                                                                  "step_000003"]  # no partial folder left
    assert runfolder.newest_checkpoint(three_checkpoints.parent) == (three_checkpoints / "step_000003", [])
    monkeypatch.setattr(runfolder.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10})())
    with pytest.raises(OSError, match="disk full"):  # torch.save's zip writer on a full disk
        with runfolder.disk_full_said(three_checkpoints.parent, 10 ** 6):
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    with pytest.raises(RuntimeError, match="something else"):  # space enough: not the disk, kept as it is
        with runfolder.disk_full_said(three_checkpoints.parent, 1):
            raise RuntimeError("something else")


def test_a_folder_that_cannot_hold_a_run_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="a_file is a file, not a folder"):
        runfolder.check_output_dir(tmp_path / "a_file" / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"seed": 0, ')
    with pytest.raises(ValueError, match=r"run/config.json is not valid JSON .* checkpoint's copy"):
        runfolder.read_config(tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"seed": 3}))
    runfolder.check_output_dir(tmp_path / "run")
    assert runfolder.read_config(tmp_path / "run") == {"seed": 3}

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runfolder.tempfile, "TemporaryFile", read_only)  # tests run as root: chmod would not stop it
    with pytest.raises(ValueError, match=r"cannot write in .* \(Read-only file system\); pass a writable"):
        runfolder.check_output_dir(tmp_path / "run" / "new")
