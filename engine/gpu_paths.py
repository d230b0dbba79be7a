"""Where the GPU's code paths run: on CUDA devices, and on whatever device tests and benchmarks name with `emulated`.

The GPU paths (the update's fast paths: fused kernels, replay plan, TF32; the bf16 LoRA product; the decode
engine's fused operations) run on the devices whose type is in DEVICE_TYPES. `emulated("cpu")` takes them on CPU
tensors too, so each CUDA-gated branch runs and is compared with the plain path on a machine without a GPU (the
decode engine's Triton kernels run under TRITON_INTERPRET=1); `emulated("meta")` takes them on the meta device, a
stand-in for a GPU's memory that holds shapes and no values: a tensor left on the host next to it fails
(tests/stand_in_device.py).
An emulated device has the card `Card` describes: its memory (the update's replay plan is made for it) and its
multiprocessors (the decode attention's splits). Not emulated, because no CPU can run it: recording CUDA graphs
(engine/graphs.py) and reading a real card's properties and memory statistics.
"""

import contextlib
from dataclasses import dataclass

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py)


@dataclass(frozen=True)
class Card:
    """What an emulated device reports as a GPU would: memory (free = total: nothing allocated yet) and
    multiprocessors (None: the decode attention splits in two, as under the interpreter)."""
    device_type: str = "cpu"
    memory_bytes: int = 80 * 2 ** 30
    multiprocessors: int | None = None


# The device types the GPU paths run on: CUDA, and the one `emulated` adds for its block. Callers test
# `torch.device(device).type in gpu_paths.DEVICE_TYPES` (a lookup: nothing of this module runs on a CPU's step).
DEVICE_TYPES = ("cuda",)
EMULATED = None   # the Card of the device `emulated` takes the GPU paths on, or None


def memory(device):
    """(free, total, allocated, reserved) bytes of `device`'s memory: a CUDA device's (torch.cuda), or the emulated
    card's (nothing allocated)."""
    if torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return EMULATED.memory_bytes, EMULATED.memory_bytes, 0, 0


def multiprocessors(device):
    """A CUDA device's multiprocessors (SMs); the emulated card's (None: not known)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return EMULATED.multiprocessors if EMULATED is not None else None


@contextlib.contextmanager
def emulated(device_type="cpu", **card):
    """For the block, the GPU paths run on `device_type` tensors too ("cpu" or "meta"), on a Card(**card)."""
    global DEVICE_TYPES, EMULATED
    if device_type == "cuda":
        raise ValueError("CUDA takes the GPU paths already: emulate 'cpu' or 'meta'")
    previous = DEVICE_TYPES, EMULATED
    DEVICE_TYPES, EMULATED = ("cuda", device_type), Card(device_type, **card)
    try:
        yield EMULATED
    finally:
        DEVICE_TYPES, EMULATED = previous
