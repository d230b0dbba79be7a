"""What a run folder must survive besides a crash (checkpoint.py): a second run on it, a checkpoint cut short, a
full disk, a folder that cannot be written.

- One writer: train.py holds <out>/train.lock (the host, process id and the process's start time) while it runs; a
  second run on the folder is refused with one line. A lock whose process is gone (killed, even with SIGKILL), or
  whose process id now names a process started at another time, is stale and taken over, as is garbage (any bytes)
  and a lock of the older format (no start time) whose process started after it was written or is no Python; one
  written on another host cannot be checked from here: the message says to delete it if that run is over. A lock
  that could not be written (a full disk) is removed at once; a run that cannot start for a full disk says where.
- The newest readable checkpoint (`newest_checkpoint`): latest.txt names it; when latest.txt is missing or garbage,
  or the checkpoint it names has an empty or cut file (a disk failing, a copy interrupted), the newest earlier one
  that is whole is used instead, and the passed-over ones are named. Saves are atomic, so an earlier one is intact.
- A full disk during a save (`disk_full_said`): the partial copy is removed at once (it would keep the disk full)
  and the run stops with one line giving the space needed and what to do: resume from the previous checkpoint, which
  is intact, or, at the first checkpoint, start over.
- `check_output_dir`, `read_config`: a file in the way, a folder that cannot be written, a config.json that is not
  JSON: one line each, before any model loads.
Simplification: a lock file, not an OS lock (fcntl locks are unreliable on the network file systems of clusters).
"""

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
import zipfile
from pathlib import Path

import safetensors
from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it

from run import checkpoint

LOCK_FILE = "train.lock"


EMPTY_LOCK_STALE_S = 60.0  # a run writes its lock the moment it creates it: one empty for longer was left behind


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def process_start(pid):
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22), as text; "-" where it
    cannot be read (no /proc: macOS; the process gone). With the pid it names one process: pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]  # fields 3.. follow the command name in parentheses
    except (OSError, ValueError, IndexError):
        return "-"


def could_be_a_run(pid, written):
    """Whether process `pid` could be the run that wrote a lock of the older format (host and pid, no start time)
    at `written` (seconds since the epoch): not if it started after that, or is no Python process (pids are
    reused); True where /proc cannot tell."""
    try:
        started_ticks = int(process_start(pid))
        boot_s = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                      if line.startswith("btime "))
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except (OSError, ValueError, StopIteration):
        return True
    started_s = boot_s + started_ticks / os.sysconf("SC_CLK_TCK")
    return started_s <= written + 1 and "python" in Path(command.decode(errors="replace")).name


def lock_text():
    """What this process writes into a run's lock: host, process id, and the process's start time."""
    return f"{socket.gethostname()} {os.getpid()} {process_start(os.getpid())}\n"


def check_not_in_use(run_dir):
    """Refuse (ValueError, one line) a folder whose lock a live process on this host, or any on another host, holds;
    True when a lock is there but stale: its process is gone (or its pid now names a process started at another
    time), the file is garbage, or it was left empty for EMPTY_LOCK_STALE_S."""
    lock = Path(run_dir) / LOCK_FILE
    try:
        text, written = lock.read_bytes().decode(errors="replace"), lock.stat().st_mtime  # bytes: garbage is stale
    except FileNotFoundError:
        return False
    if not text:  # created, not yet written: a run starting this very moment, unless it was left so long ago
        if time.time() - written > EMPTY_LOCK_STALE_S:
            return True
        raise ValueError(f"{run_dir} is being taken by another train.py run ({lock} is empty: delete it if none is)")
    try:
        host, pid, *started = text.split()  # older locks: no start time
        pid = int(pid)
    except ValueError:
        return True  # garbage: stale
    if host == socket.gethostname() and (not _alive(pid) or started[:1] not in ([], ["-"], [process_start(pid)])
                                         or (not started and not could_be_a_run(pid, written))):
        return True
    where = "" if host == socket.gethostname() else f" on {host} (delete {lock} if that run is over)"
    raise ValueError(f"{run_dir} is in use by another train.py run (process {pid}{where}); wait for it to end or "
                     "pass another --output-dir")


@contextlib.contextmanager
def folder_lock(run_dir):
    """Hold run_dir's lock (created exclusively, so two runs starting at once cannot both get it) until the block
    ends; a live holder on this host, or any holder on another host, refuses the run (ValueError, one line)."""
    lock, me = Path(run_dir) / LOCK_FILE, lock_text()
    for _ in range(2):  # a stale lock is removed once, then created again
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if check_not_in_use(run_dir):  # stale: its process is gone
                lock.unlink(missing_ok=True)
            continue
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(me)
        except BaseException:  # e.g. a full disk: an empty lock left behind would refuse the next run
            lock.unlink(missing_ok=True)
            raise
        break
    else:
        raise ValueError(f"{run_dir}: could not take {lock} (another run took it at the same time)")
    try:
        yield lock
    finally:
        if lock.is_file() and lock.read_bytes() == me.encode():
            lock.unlink()


def checkpoint_problem(path):
    """Why a checkpoint folder cannot be read (a weights or state file missing, empty or cut short), or None. Cheap:
    the safetensors header against the file size, the zip directory at the end of trainer_state.pt."""
    path, state = Path(path), Path(path) / "trainer_state.pt"
    if state.exists() and not zipfile.is_zipfile(state):  # torch.save writes a zip; a cut one has no directory
        return f"{state} is empty or cut short"
    if checkpoint.is_sharded(path):
        return None
    weights = [path / part for part in ("adapter/adapter_model.safetensors", "model/model.safetensors")]
    weights = [file for file in weights if file.is_file()]
    if not weights:
        return f"{path} holds no adapter/adapter_model.safetensors or model/model.safetensors"
    try:
        with safetensors.safe_open(weights[0], "pt"):  # reads the header, checks it against the file size
            pass
    except Exception as error:  # noqa: BLE001 (safetensors raises its own error type)
        return f"{weights[0]} is unreadable ({error})"
    return None


def newest_checkpoint(run_dir, readable=True):
    """(the newest readable checkpoint of a run (single- or multi-process), or None; [(what was passed over, why)]).
    The one latest.txt names comes first, then the other step_* folders, newest first. readable False: any with a
    trainer_state.pt (the flags' check, which opens no file)."""
    root, skipped = checkpoint.checkpoint_root(run_dir), []
    folders = sorted(root.glob("step_*"), reverse=True)
    try:
        named = root / (root / checkpoint.LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = None
    if folders and named not in folders:
        skipped.append((root / checkpoint.LATEST_FILE, "missing, or names no checkpoint folder"))
    for path in ([named] if named in folders else []) + [folder for folder in folders if folder != named]:
        state = path / "trainer_state.pt"
        problem = (checkpoint_problem(path) if readable else None) if state.is_file() else f"{state} is missing"
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def checkpoint_bytes(model, optimizer):
    """About what a checkpoint takes on disk: the saved weights (LoRA: the adapter) and the optimizer's tensors."""
    lora = hasattr(model, "peft_config")
    weights = [p for p in model.parameters() if p.requires_grad or not lora]
    moments = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in weights + moments)


def _size(num_bytes):
    return f"{num_bytes / 2 ** 30:.2f} GiB" if num_bytes >= 2 ** 30 else f"{num_bytes / 2 ** 20:.1f} MiB"


def _out_of_space(error):
    """ENOSPC however the library that wrote said it (an OSError, or safetensors' own error with the same text)."""
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)


@contextlib.contextmanager
def disk_full_said(run_dir, needed_bytes):
    """Around a checkpoint save: when it fails for lack of space (ENOSPC from any writer, safetensors' included, or
    torch.save's "unexpected pos" with less free than the checkpoint needs), remove the partial copy and raise one
    OSError line saying what to do."""
    try:
        yield
    except Exception as error:  # noqa: BLE001  re-raised below unless the disk is full
        root = checkpoint.checkpoint_root(run_dir)
        free = shutil.disk_usage(root).free
        if not _out_of_space(error) and (not isinstance(error, (OSError, RuntimeError)) or free >= needed_bytes):
            raise
        for partial in root.glob(checkpoint.TMP_PREFIX + "*"):  # we hold the lock: nobody else is writing here
            shutil.rmtree(partial, ignore_errors=True) if partial.is_dir() else partial.unlink(missing_ok=True)
        then = (f"the previous checkpoint is intact. Free some space, then continue with --output-dir {run_dir} "
                "--resume") if newest_checkpoint(run_dir)[0] is not None else \
            f"there is no checkpoint to resume. Free some space; {start_over(run_dir)}"
        raise OSError(f"disk full: a checkpoint needs ~{_size(needed_bytes)} in {root} "
                      f"({_size(shutil.disk_usage(root).free)} free); the partial copy is removed and {then}") from None


@contextlib.contextmanager
def disk_full_at_start(run_dir):
    """Around a new run's first writes (its folder, lock, config.json, metrics.jsonl): a full disk is one OSError
    line naming the folder, instead of a bare "[Errno 28] No space left on device"."""
    try:
        yield
    except OSError as error:
        if not _out_of_space(error):
            raise
        raise OSError(f"disk full: no space left to start the run in {run_dir} (its lock and config.json); free "
                      "some space or pass another --output-dir") from None


@contextlib.contextmanager
def removed_if_left_empty(run_dir):
    """A run folder this block makes is removed again when the block fails leaving it empty (a run refused while it
    loads: an unreachable Hub, too few rows, a held-out row too long), so no empty folder stays behind."""
    existed = Path(run_dir).exists()
    try:
        yield
    except BaseException:
        if not existed and Path(run_dir).is_dir() and not any(Path(run_dir).iterdir()):
            Path(run_dir).rmdir()
        raise


def start_over(run_dir):
    """What to do with a run folder that holds no checkpoint yet (a run stopped before its first one)."""
    metrics = Path(str(run_dir)) / checkpoint.METRICS_FILE  # str: a --resume without --output-dir is refused after
    return f"delete {metrics} to start it over (the same command, without --resume), or pass another --output-dir"


def check_output_dir(path):
    """--output-dir can hold a run: not a file, and writable (tried, as permissions may not tell). One ValueError line
    each."""
    path = Path(path)
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--output-dir {path}: {existing} is a file, not a folder; pass another --output-dir")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise ValueError(f"--output-dir {path}: cannot write in {existing} ({error.strerror}); pass a writable "
                         "--output-dir") from None


def read_config(run_dir):
    """The run's config.json as a dict; a file that is not a JSON object is named in one ValueError line."""
    path = Path(run_dir) / checkpoint.CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): restore it from a checkpoint's copy "
                         f"({checkpoint.checkpoint_root(run_dir)}/step_*/config.json)") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no JSON object: restore it from a checkpoint's copy")
    return saved


def check_run_dir(args, restarted=False):
    """--output-dir against --resume: not in use by another run; a resume needs a checkpoint, a new run a folder
    without a run. A run stopped before its first checkpoint can only start over: both refusals say how."""
    if args.output_dir is not None:
        check_not_in_use(args.output_dir)  # first: a live run's folder is no evidence of anything
    if restarted and not args.resume:
        return  # restarted before the first checkpoint: the run starts over
    has_checkpoint = args.output_dir is not None and newest_checkpoint(args.output_dir, readable=False)[0] is not None
    metrics = Path(str(args.output_dir)) / checkpoint.METRICS_FILE
    stopped_early = f"it stopped before its first checkpoint: {start_over(args.output_dir)}"
    if args.resume:
        if args.output_dir is None:
            raise ValueError("--resume needs --output-dir")
        if not has_checkpoint:
            raise ValueError(f"--resume: no complete checkpoint in {checkpoint.checkpoint_root(args.output_dir)}; "
                             + stopped_early)
    elif args.output_dir is not None:
        if metrics.exists() and metrics.stat().st_size > 0:
            raise ValueError(f"{args.output_dir} already holds a run: " + (
                "pass --resume to continue it or another --output-dir" if has_checkpoint else stopped_early))


def resume_changes(args, saved, identity, recorded):
    """The run's config.json "changes" plus this resume's: {"step": None (train.py sets the step it continues from),
    flag: [old, new]} for the `recorded` flags given new values. A new value of an `identity` flag
    (config.RUN_IDENTITY) is refused, naming the flags (ValueError)."""
    def differs(key):
        return key in saved and json.dumps(saved[key], sort_keys=True) != json.dumps(getattr(args, key), sort_keys=True)

    refused = [key for key in identity if differs(key)]
    if refused:
        flags = ", ".join(f"--{key.replace('_', '-')} {saved[key]!r} -> {getattr(args, key)!r}" for key in refused)
        raise ValueError(f"--resume continues the run in {args.output_dir} as it is; these flags would change what it "
                         f"is: {flags}. Leave them out, or start a new run in another --output-dir")
    changed = {key: [saved[key], getattr(args, key)] for key in recorded if differs(key)}
    return list(saved.get("changes", [])) + ([dict(step=None, **changed)] if changed else [])
