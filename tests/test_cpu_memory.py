"""run/cpu_memory.py: freed blocks kept for reuse, so a step stops faulting in fresh pages."""

import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# 10 blocks of 64 MiB (above glibc's largest dynamic mmap threshold, 32 MiB), each written in full and freed: the
# page faults they cost, with or without keep_freed_memory first.
FAULTS = """
import resource, sys
import numpy as np
sys.path.insert(0, {root!r})
if {keep}:
    from run import cpu_memory
    assert cpu_memory.keep_freed_memory("cpu")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    block = np.ones(2 ** 23)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep):
    code = FAULTS.format(root=str(ROOT), keep=keep)
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in str(ctypes.util.find_library("c")),
                    reason="glibc's mallopt")
def test_freed_blocks_are_reused_not_faulted_in_again():
    # Without it every block is a fresh mapping (faulted in page by page, or by huge page); with it the first
    # block's pages serve the nine after it.
    plain, kept = faults(False), faults(True)
    assert kept * 4 < plain, (plain, kept)


def test_a_run_on_another_device_leaves_the_allocator_as_it_is():
    from run import cpu_memory

    assert cpu_memory.keep_freed_memory("meta") is False
