"""`timed`, the project's one stopwatch (paper §4 plots accuracy against wall-clock training time: these are its
seconds): a training step's phases (train.py), the decode engine's prefill and decode (engine/), the benchmarks
(bench/). It imports nothing of the project but lazy.py, so the engine and the run share it.
Simplification: the host's wall-clock seconds, a CUDA device synchronised at the end of the block (no CUDA events)."""

import contextlib
import time

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it


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
