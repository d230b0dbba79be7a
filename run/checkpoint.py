"""Wall-clock checkpoints and exact resume for train.py.

The paper saves a checkpoint every 30 minutes of training time and plots test accuracy of those
checkpoints against wall-clock time (§4, Appendix A), so a checkpoint is keyed by elapsed training
seconds as well as the step. One checkpoint is a folder

    <out>/checkpoints/step_XXXXXX/
        adapter/            peft save_pretrained (loadable with PeftModel.from_pretrained); "model/" when
                            training without LoRA
        trainer_state.pt    optimizer state, python/numpy/torch RNG states, data position, step, elapsed_s,
                            cumulative counters, metrics.jsonl size at save time
        config.json         copy of the run's config
        metrics.jsonl       copy of the run's log up to this checkpoint (`check_metrics_log`: a resume restores a
                            log cut short or deleted from it)

and <out>/checkpoints/latest.txt names the newest complete one. A multi-process run (torchrun) writes the same
folder with dcp/ (sharded weights and optimizer) and rng/ instead of adapter/ or model/
(multigpu/sharded_checkpoint.py), published through the same `staging_folder` / `publish` below.

Atomicity: everything is written into a temporary folder beside the final one, flushed to disk, then
renamed into place (a rename within one file system is atomic), and only then is latest.txt replaced
(write temp file + os.replace). A crash at any point leaves the previous checkpoint and latest.txt intact;
a half-written temporary folder is removed by the next save.

What a resume restores besides weights and optimizer is a `TrainerState` (step, training seconds, the last step's
duration, data position, counters, the size metrics.jsonl had at save time: `open_metrics_log` cuts the lines
written after the checkpoint; the sampler fallback, so that a resumed run does not go back to a decode engine it
left). A checkpoint is never written from non-finite weights. Opening one never runs code from it: its .pt files are
read with torch.load(weights_only=True) (`load_state_file`), so a run folder someone shared is safe to evaluate or
resume.

Exact resume also needs the same prompts and the same random draws after the restart: the prompt order
is a pure function of (seed, data position) (`next_prompt_indices`), and the RNG streams that shape the
trajectory (generation, random down-sampling) are seeded from (seed, step) (sampling.derived_seed); the saved
global RNG states cover everything else.
"""

import dataclasses
import json
import os
import pickle
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it

# What a trainer_state.pt holds besides tensors and plain values: numpy's RNG state (an array of uint32).
_core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
NUMPY_RNG_GLOBALS = [_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
LATEST_FILE = "latest.txt"
TMP_PREFIX = ".tmp_"
METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainerState:
    """Everything besides weights, optimizer and RNG states that a resumed run must continue from."""
    step: int = 0                    # training steps done
    elapsed_s: float = 0.0           # training wall-clock seconds (evaluation excluded)
    last_step_s: float = 0.0         # the last step's duration: --max-time-s starts no step it would likely end past
    position: tuple = (0, 0)         # (epoch, cursor) in the prompt order (next_prompt_indices)
    num_tokens: int = 0              # prompt + completion tokens generated so far
    metrics_bytes: int = 0           # size of metrics.jsonl when this state was saved
    skipped_steps: int = 0           # optimizer steps skipped for a non-finite loss or gradient norm
    nonfinite_streak: int = 0        # consecutive training steps with a skipped optimizer step
    evaluated_step: int = -1         # step of the last held-out evaluation in the log
    sampler_fallback: tuple | None = None  # (backend, why) when the run left the decode engine (sampling.fall_back)

    @classmethod
    def from_saved(cls, saved):
        """From the dict load_checkpoint returns (keys of older runs that are not fields are ignored)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in names})


def open_metrics_log(run_dir, keep_bytes=0):
    """metrics.jsonl of a run, opened for appending after cutting it back to the last complete line within its first
    `keep_bytes` (0: a new, empty log; a resume passes TrainerState.metrics_bytes, dropping lines written after its
    checkpoint). Never extended: a log cut short (a full disk, a copy) loses its broken line, not the next one."""
    path = Path(run_dir) / METRICS_FILE
    with open(path, "a+b") as handle:
        handle.seek(0)
        handle.truncate(handle.read(keep_bytes).rfind(b"\n") + 1)
    return open(path, "a")


def check_metrics_log(run_dir, checkpoint_path, metrics_bytes):
    """Before a resume from `checkpoint_path`: the run's metrics.jsonl must hold the `metrics_bytes` the checkpoint
    saw (the resume cuts away what follows). A log cut short or deleted would lose steps' lines silently: it is
    restored from the checkpoint's copy (returns the one line that says so; None: the log is whole), or, where the
    checkpoint holds none (multi-process checkpoints, older ones), refused in one ValueError line."""
    log, copy = Path(run_dir) / METRICS_FILE, Path(checkpoint_path) / METRICS_FILE
    size = log.stat().st_size if log.is_file() else None
    if size is not None and size >= metrics_bytes:
        return None
    what = "missing" if size is None else \
        f"cut short ({size} bytes; {Path(checkpoint_path).name} saw {metrics_bytes})"
    if not (copy.is_file() and copy.stat().st_size == metrics_bytes):
        raise ValueError(f"{log} is {what}, and the checkpoint holds no copy of it: the resumed run's log would lack "
                         "the steps before it. Put the whole file back, or start a new run in another --output-dir")
    tmp = log.with_name(f"{TMP_PREFIX}{os.getpid()}_{log.name}")
    shutil.copyfile(copy, tmp)
    os.replace(tmp, log)
    return f"{log} was {what}: restored from {copy}"


def append_metrics(log, record):
    """One JSON line, flushed (a killed run keeps every line written before the kill)."""
    log.write(json.dumps(record) + "\n")
    log.flush()


def next_prompt_indices(num_rows, count, seed, position):
    """`count` row indices from a seeded permutation per epoch, and the new (epoch, cursor) position.

    Pure function of (seed, position), so a resumed run draws exactly the prompts it would have drawn."""
    epoch, cursor = position
    picked = []
    while len(picked) < count:
        order = np.random.default_rng([seed, epoch]).permutation(num_rows)
        take = order[cursor:cursor + count - len(picked)]
        picked.extend(int(i) for i in take)
        cursor += len(take)
        if cursor >= num_rows:
            epoch, cursor = epoch + 1, 0
    return picked, (epoch, cursor)


def checkpoint_root(run_dir):
    return Path(run_dir) / "checkpoints"


def rng_states(device=None):
    """Every global RNG stream a training step may touch (python, numpy, torch CPU, torch CUDA). device: a
    rank's own GPU, whose stream alone is saved (all GPUs would open a CUDA context on each from every rank)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index or 0
        states["cuda"] = {index: torch.cuda.get_rng_state(index)}
    elif device is None and torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if isinstance(cuda, dict) and torch.cuda.is_available():  # one rank's own GPU
        for index, state in cuda.items():
            torch.cuda.set_rng_state(state, index)
    elif cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def load_state_file(path):
    """A .pt file of a checkpoint (trainer state, RNG states), read with weights_only=True: tensors, numbers,
    strings, containers and numpy's RNG state only. A file needing anything else (a pickle that would run code) is
    refused with a ValueError; nothing of it runs."""
    try:
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("\n")[-1].strip() or "not a plain state file"
        raise ValueError(f"refusing to open {path}: it holds Python objects that train.py never writes, and "
                         f"loading them could run code ({reason[:200]})") from None


def _fsync_tree(folder):
    """Flush every file under folder (and the folder entries) so the rename publishes complete data."""
    for path in sorted(Path(folder).rglob("*")) + [Path(folder)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text_atomic(path, text):
    """Replace `path` with `text` at once (temp file, flushed, renamed): a crash leaves the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}_{path.name}")  # open(), not mkstemp: the umask's permissions
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # e.g. a full disk: no partial temp file left beside `path`
        tmp.unlink(missing_ok=True)
        raise


def _is_peft(model):
    return hasattr(model, "peft_config")


def trainable_weights_finite(model):
    """No NaN or inf in the trainable weights (this process's shards of FSDP2 DTensors): a checkpoint of such weights
    would poison every later resume."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if p.requires_grad)
    return all(bool(torch.isfinite(p).all()) for p in local)


def is_sharded(path):
    """A checkpoint written by several processes (multigpu/): dcp/ instead of adapter/ or model/."""
    return (Path(path) / "dcp").is_dir()


def staging_folder(run_dir, step):
    """A new temporary folder beside the final step_<step>/, after removing what a crash during an earlier
    save left behind; write the checkpoint there, then `publish` it."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}step_{step:06d}_", dir=root))


def publish(staging, step, keep_last=0):
    """Flush a complete staging folder, rename it to step_<step>/, then point latest.txt at it (the order
    that keeps the previous checkpoint valid until this one is whole); keep_last > 0 prunes older ones."""
    root, name = Path(staging).parent, f"step_{step:06d}"
    _fsync_tree(staging)
    final = root / name
    if final.exists():  # the same step saved again after a resume: the new copy replaces it
        shutil.rmtree(final)
    os.replace(staging, final)
    write_text_atomic(root / LATEST_FILE, name + "\n")
    if keep_last > 0:
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(run_dir, step, model, optimizer, trainer_state, config, keep_last=0):
    """Write checkpoint step_<step> atomically and point latest.txt at it; returns its path.

    trainer_state: a TrainerState or a plain picklable dict (data position, elapsed_s, counters); the optimizer
    state and RNG states are added here. keep_last > 0 deletes all but the newest keep_last checkpoints
    afterwards. Non-finite trainable weights are refused (ValueError): they would poison every later resume."""
    if not trainable_weights_finite(model):
        raise ValueError(f"not saving step {step}: the trainable weights hold NaN or inf")
    if dataclasses.is_dataclass(trainer_state):
        trainer_state = dataclasses.asdict(trainer_state)
    tmp = staging_folder(run_dir, step)
    if _is_peft(model):
        model.save_pretrained(tmp / "adapter")
    else:
        model.save_pretrained(tmp / "model", max_shard_size="1000GB")  # one file: simple exact reload
    state = dict(trainer_state, step=step, optimizer=optimizer.state_dict(), rng=rng_states())
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
    log = Path(run_dir) / METRICS_FILE
    if "metrics_bytes" in trainer_state and log.is_file():  # the log as this checkpoint saw it (check_metrics_log)
        with open(log, "rb") as source, open(tmp / METRICS_FILE, "wb") as target:
            target.write(source.read(trainer_state["metrics_bytes"]))
    return publish(tmp, step, keep_last)


def latest_checkpoint(run_dir):
    """Path of the newest complete checkpoint of a run (single- or multi-process), or None."""
    root = checkpoint_root(run_dir)
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    path = root / latest.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def load_checkpoint(path, model, optimizer):
    """Restore model weights (adapter or full), optimizer and RNG states in place; returns trainer_state."""
    from safetensors.torch import load_file

    path = Path(path)
    if is_sharded(path):
        raise ValueError(f"{path} was written by several processes (dcp/): resume it under torchrun with as many "
                         "processes, or export it (python -m multigpu export) and start from the export")
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        weights = load_file(path / "adapter" / "adapter_model.safetensors")
        result = set_peft_model_state_dict(model, weights)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint {path} does not match the model (unexpected keys {unexpected[:3]}...)")
    else:
        weights = load_file(path / "model" / "model.safetensors")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied and "lm_head" not in k]:
            raise ValueError(f"checkpoint {path} does not match the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    state = load_state_file(path / "trainer_state.pt")
    optimizer.load_state_dict(state.pop("optimizer"))
    restore_rng_states(state.pop("rng"))
    return state


# ------------------------------------------------------------------------------------ Reading a run folder
# A run folder holds config.json, metrics.jsonl, checkpoints/ (above) and eval_<split>.json (eval.py).
# eval.py, compare.py and study.py read runs through these functions only.

CONFIG_FILE = "config.json"


def is_checkpoint(path):
    """A complete checkpoint folder: adapter/ (LoRA), model/ (full fine-tuning) or dcp/ (several processes),
    and config.json. Saves are renamed into place complete, so a step_* folder is never half-written."""
    path = Path(path)
    return any((path / part).is_dir() for part in ("adapter", "model", "dcp")) and (path / CONFIG_FILE).is_file()


def find_checkpoints(path):
    """Checkpoint folders, oldest first: `path` itself when it is a checkpoint, else every complete
    <path>/checkpoints/step_*."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if is_checkpoint(path):
        return [path]
    root = checkpoint_root(path)
    if not root.is_dir():
        raise ValueError(f"{path} is neither a checkpoint (adapter/, model/ or dcp/ + config.json) nor a run "
                         "directory (no checkpoints/)")
    found = [folder for folder in sorted(root.glob("step_*")) if is_checkpoint(folder)]
    if not found:
        raise ValueError(f"no checkpoint (step_*/ with adapter/, model/ or dcp/, and config.json) under {root}")
    return found


def run_dir_of(path):
    """The run folder of a checkpoint (<run>/checkpoints/step_*), or `path` itself."""
    path = Path(path)
    return path.parent.parent if path.parent == checkpoint_root(path.parent.parent) else path


def checkpoint_progress(checkpoint):
    """{"step", "elapsed_s"} (training seconds) saved with a checkpoint; None values where it has no
    trainer_state.pt (e.g. a model folder copied by hand)."""
    state_path = Path(checkpoint) / "trainer_state.pt"
    if not state_path.is_file():
        return {"step": None, "elapsed_s": None}
    state = load_state_file(state_path)
    return {"step": state.get("step"), "elapsed_s": state.get("elapsed_s")}


def read_run_config(path):
    """The settings of a run folder or a checkpoint folder (config.json; a run folder without one: its newest
    checkpoint's copy). `max_completion_tokens` is the one key for the completion length: runs that also or
    only wrote `max_new_tokens` have it folded in."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file() and checkpoint_root(path).is_dir():
        config_path = find_checkpoints(path)[-1] / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a run or checkpoint folder)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: malformed JSON ({error.msg})") from None
    legacy = config.pop("max_new_tokens", None)
    if legacy is not None:
        config.setdefault("max_completion_tokens", legacy)
    return config
