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

and <out>/checkpoints/latest.txt names the newest complete one.

Atomicity: everything is written into a temporary folder beside the final one, flushed to disk, then
renamed into place (a rename within one file system is atomic), and only then is latest.txt replaced
(write temp file + os.replace). A crash at any point leaves the previous checkpoint and latest.txt intact;
a half-written temporary folder is removed by the next save.

Exact resume also needs the same prompts and the same random draws after the restart: the prompt order
is a pure function of (seed, data position) (`next_prompt_indices`), and the RNG streams that shape the
trajectory (generation, random down-sampling) are seeded from (seed, step) (`step_seed`); the saved global
RNG states cover everything else.
"""

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

LATEST_FILE = "latest.txt"
TMP_PREFIX = ".tmp_"


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


def step_seed(seed, step, round_index=0):
    """Seed of step `step` (generation, random down-sampling): resumed steps regenerate identically."""
    return int(np.random.SeedSequence([seed, step, round_index]).generate_state(1)[0])


def checkpoint_root(run_dir):
    return Path(run_dir) / "checkpoints"


def rng_states():
    """Every global RNG stream a training step may touch (python, numpy, torch CPU, torch CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _fsync_tree(folder):
    """Flush every file under folder (and the folder entries) so the rename publishes complete data."""
    for path in sorted(Path(folder).rglob("*")) + [Path(folder)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_text_atomic(path, text):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _is_peft(model):
    return hasattr(model, "peft_config")


def save_checkpoint(run_dir, step, model, optimizer, trainer_state, config, keep_last=0):
    """Write checkpoint step_<step> atomically and point latest.txt at it; returns its path.

    trainer_state: plain picklable dict (data position, elapsed_s, counters); the optimizer state and RNG
    states are added here. keep_last > 0 deletes all but the newest keep_last checkpoints afterwards."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):  # left by a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    name = f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}_", dir=root))
    if _is_peft(model):
        model.save_pretrained(tmp / "adapter")
    else:
        model.save_pretrained(tmp / "model", max_shard_size="1000GB")  # one file: simple exact reload
    state = dict(trainer_state, step=step, optimizer=optimizer.state_dict(), rng=rng_states())
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
    _fsync_tree(tmp)
    final = root / name
    if final.exists():  # the same step saved again after a resume: the new copy replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(root / LATEST_FILE, name + "\n")
    if keep_last > 0:
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir):
    """Path of the newest complete checkpoint of a run, or None."""
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
    # Our own file (written by save_checkpoint); RNG states need full unpickling.
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state.pop("optimizer"))
    restore_rng_states(state.pop("rng"))
    return state
