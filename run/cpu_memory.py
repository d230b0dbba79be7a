"""Freed memory kept for the next step instead of handed back to the kernel: the page faults of a CPU run.

Not the paper's method: how a CPU run stops paying for fresh pages at every step. glibc's malloc serves a block
above its mmap threshold (128 KiB at the start, raised as such blocks are freed) with a fresh mapping, and gives
the free top of its heaps back to the kernel; the pages of either are zero-filled by the kernel at their first touch.
A decode step's [rows, vocabulary] float32 logits (12.6 MB for 64 rows of SmolLM2) and the update's activations are
such blocks, so every step faulted in its memory anew: about 500,000 page faults and a second of kernel time per
generation of the demo (4 prompts x 16 rollouts). `keep_freed_memory` (glibc's mallopt) serves blocks up to 1 GiB
from the heap and never trims it, so a step reuses the pages of the step before: ~14,000 faults and 0.05 s
(BENCHMARKS.md, "The host out of the way").

Simplification: the process keeps the high-water mark of its heap until it exits (the demo: ~3 GiB), so a run
computing on a GPU, whose host memory holds the loaded weights for a while, leaves it unset. glibc only: elsewhere
(musl, macOS, Windows) nothing changes.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1   # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
HEAP_BLOCKS_UP_TO = 2 ** 30   # a larger block still gets its own mapping (and gives it back when freed)
NEVER_TRIM = 2 ** 31 - 1      # an int: mallopt's value argument


def keep_freed_memory(device):
    """Freed blocks up to 1 GiB kept in this process for reuse (glibc) when `device`, where the run computes, is the
    CPU; returns whether the allocator took it (False on any other device)."""
    import torch

    if torch.device(device).type != "cpu":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc's own: mallopt's parameter numbers are glibc's
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
