"""How many CPU threads torch computes with: as many as the machine has free, not as many as it has.

Not the paper's method: how a CPU run stays fast on a machine it shares. torch's default is one thread per core. On a
machine busy with other work that is the slowest choice there is: each parallel operation waits for its slowest
thread, and a thread on a crowded core waits for the scheduler (on 2 cores shared with other work, demo steps took
7-40x longer with 2 threads than with 1: BENCHMARKS.md, "Threads on a busy machine"). So with --num-threads 0 (the
default) a CPU run counts the cores other processes keep busy (the whole machine's busy time, from /proc/stat, less
this process's own) and computes with the rest, at least one thread:
- at the start, over the seconds the imports took (`sample` when the flags are parsed, `choose` before loading);
- again over every training step (`adjust`): other work that starts or stops mid-run changes the count at the next
  step, said in one line above the progress bar and logged as `num_threads` in each step's metrics.
The count changes no result: the kernels a run uses give the same numbers on 1 and 2 threads (tests/test_threads.py;
the demo's adapter after 2 steps is byte-identical). --num-threads N fixes the count; on CUDA the host's threads only
queue work, and torch's default stays. Where /proc/stat cannot be read (not Linux) the default stays too.
"""

import os
import time
from dataclasses import dataclass

# Hysteresis, in cores kept busy by other work: a thread is dropped when the others take more than this share of the
# cores it would run on, and added back only when they take less than half of it, so a count does not flap.
DROP_ABOVE = 0.5
ADD_BELOW = 0.25


@dataclass(frozen=True)
class CpuSample:
    """A point in time: the wall clock, the whole machine's busy CPU seconds, this process's CPU seconds."""
    wall_s: float
    busy_s: float
    own_s: float


def sample(stat_path="/proc/stat"):
    """The CpuSample of now, or None where the machine's CPU times cannot be read (not Linux)."""
    try:
        with open(stat_path) as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = sum(fields[3:5])  # idle and iowait
    own = os.times()
    return CpuSample(time.monotonic(), (sum(fields[:8]) - idle) / ticks, own.user + own.system)


def others_busy_cores(before, after):
    """The cores other processes kept busy between two CpuSamples, on average (>= 0)."""
    wall_s = after.wall_s - before.wall_s
    if wall_s <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall_s)


def fitting_threads(others, cores, most, now=None):
    """The threads that fit beside `others` busy cores of `cores`: at most `most`, at least 1. now: the count in use,
    which changes only past the hysteresis (DROP_ABOVE, ADD_BELOW)."""
    if now is None:
        return max(1, min(most, int(cores - others + 1 - DROP_ABOVE)))
    if others > cores - now + DROP_ABOVE and now > 1:
        return max(1, min(now - 1, int(cores - others + 1 - DROP_ABOVE)))
    if others < cores - now - 1 + ADD_BELOW and now < most:
        return now + 1
    return now


@dataclass
class Threads:
    """The thread count of a run. source: "flag" (--num-threads N), "auto" (--num-threads 0 on a CPU: chosen from
    what is free, adjusted after each step) or "default" (torch's, on CUDA or where CPU times cannot be read); most:
    torch's default, one per core; others: the cores other work kept busy, last measured."""
    count: int
    source: str
    most: int
    cores: int
    others: float = 0.0

    def describe(self):
        """For the start line: the count and why."""
        if self.source == "flag":
            return f"{self.count} CPU threads (--num-threads)"
        if self.source == "default":
            return f"{self.count} CPU threads (torch's default)"
        return (f"{self.count} of {self.cores} CPU threads (other work keeps {self.others:.1f} cores busy; the count "
                "follows it, --num-threads N fixes it)")


def choose(num_threads, device, since=None):
    """The run's Threads, set in torch: num_threads > 0 as given; 0 on a CPU, those that fit beside the other work
    measured since the CpuSample `since`; else (CUDA, or CPU times unreadable) torch's default."""
    import torch

    most, cores = torch.get_num_threads(), os.cpu_count() or 1
    if num_threads > 0:
        torch.set_num_threads(num_threads)
        return Threads(num_threads, "flag", most, cores)
    now = sample()
    if torch.device(device).type != "cpu" or since is None or now is None:
        return Threads(most, "default", most, cores)
    others = others_busy_cores(since, now)
    threads = Threads(fitting_threads(others, cores, most), "auto", most, cores, others)
    torch.set_num_threads(threads.count)
    return threads


def adjust(threads, since, what):
    """After a step that began at the CpuSample `since`: the count that fits beside the other work measured over it,
    set in torch; returns the line that says a change (None: unchanged, or the count is not automatic)."""
    now = sample()
    if threads.source != "auto" or since is None or now is None:
        return None
    import torch

    threads.others = others_busy_cores(since, now)
    count = fitting_threads(threads.others, threads.cores, threads.most, threads.count)
    if count == threads.count:
        return None
    line = (f"CPU threads {threads.count} -> {count}: other work kept {threads.others:.1f} of {threads.cores} cores "
            f"busy during {what} (--num-threads N fixes the count)")
    threads.count = count
    torch.set_num_threads(count)
    return line
