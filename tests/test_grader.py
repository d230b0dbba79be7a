"""grader.py: math-verify in worker processes forked by a grading server, under a per-comparison limit of the
worker's CPU time (a worker that stays silent is killed and replaced), one retry with a longer limit, a pool of
several workers, and the verdict cache that never keeps a timed-out comparison. Serves the accuracy reward of paper
Appendix A.1. A busy machine's load is in test_rewards.py."""

import math
import os
import signal
import threading
import time

import pytest

from grading import grader
import rewards
from rewards import grade_accuracy


def formatted(answer, thinking="some reasoning"):
    return f"<think>\n{thinking}\n</think>\n<answer>\n{answer}\n</answer>"


@pytest.fixture(autouse=True)
def empty_verdict_cache():
    """Every pair below must really reach a worker, whatever ran before in this process."""
    with grader._cache_lock:
        grader._verdict_cache.clear()


def test_a_pool_of_two_workers_gives_the_same_verdicts_as_one():
    golds = ["\\frac{1}{2}", "(1, 2)", "x^2", "\\sqrt{3}"] * 4
    predictions = ["0.5", "(1,2)", "x^{2}", "1.8"] * 4
    pairs = [(g, p + " " * i) for i, (g, p) in enumerate(zip(golds, predictions))]  # 16 distinct pairs
    for num_workers in (2, 0):  # 0 still means one worker process
        with grader._cache_lock:
            grader._verdict_cache.clear()  # each pool computes every verdict itself
        assert grader.verify_pairs(pairs, timeout_s=5.0, num_workers=num_workers) == [True, True, True, False] * 4
        assert len(grader._workers) >= max(1, num_workers)
    completions = [formatted(p) for p in predictions]  # through the reward: same scores either way
    expected = [1.0, 1.0, 1.0, 0.0] * 4
    assert grade_accuracy(completions, golds, num_workers=2, timeout_s=5.0) == expected
    assert grade_accuracy(completions, golds, num_workers=0, timeout_s=5.0) == expected


def test_a_silent_worker_is_killed_at_its_wall_limit_and_the_retry_decides_on_a_fresh_one():
    """SIGSTOP makes a worker deaf to everything and idle (no CPU time passes): only the wall limit ends it."""
    assert grade_accuracy([formatted("x^{2}")], ["x^2"], timeout_s=5.0) == [1.0]  # worker is up
    worker = grader._workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    timeout_s = 0.02
    wall_limit_s = grader.WALL_FACTOR * timeout_s + grader.KILL_GRACE_S
    start = time.perf_counter()
    first = grader._verify_in_workers([("2", "\\sqrt{4}")], 0, timeout_s)
    elapsed_s = time.perf_counter() - start
    assert first == ["timeout"] and wall_limit_s <= elapsed_s < wall_limit_s + 2.0
    assert grader._workers[0].pid != worker.pid  # replaced
    assert ("2", "\\sqrt{4}") not in grader._verdict_cache  # no verdict from a killed worker
    os.kill(grader._workers[0].pid, signal.SIGSTOP)  # and through verify_pairs: the retry on a fresh worker decides
    assert grader.verify_pairs([("3", "\\sqrt{9}")], timeout_s=timeout_s) == [True]


def test_a_timed_out_pair_is_retried_once_with_a_longer_limit(monkeypatch):
    calls = []
    real = grader._verify_in_workers

    def first_times_out(items, num_workers, timeout_s):
        calls.append((list(items), timeout_s))
        return ["timeout"] * len(items) if len(calls) == 1 else real(items, num_workers, timeout_s)

    monkeypatch.setattr(grader, "_verify_in_workers", first_times_out)
    pairs = [("\\frac{1}{2}", "0.5"), ("x^2", "x^{2}")]
    assert grader.verify_pairs(pairs, timeout_s=0.5) == [True, True]
    assert calls == [(pairs, 0.5), (pairs, 0.5 * grader.RETRY_FACTOR)]
    calls.clear()  # timed out twice: "timeout", not cached
    monkeypatch.setattr(grader, "_verify_in_workers", lambda items, workers, timeout_s: ["timeout"] * len(items))
    assert grader.verify_pairs([("7", "\\sqrt{49}")], timeout_s=0.5) == ["timeout"]
    assert ("7", "\\sqrt{49}") not in grader._verdict_cache


# A legitimate comparison that takes sympy ~0.1-0.3 s of CPU: the CPU-time timer (scheduler ticks of a few ms)
# reliably stops it at a tiny limit, where a cheap pair may finish before the first tick.
SLOW_GOLD = "(x+2)^{20}"
SLOW_PREDICTION = " + ".join(f"{c} x^{{{20 - k}}}" if k < 20 else str(c)
                             for k, c in enumerate(math.comb(20, k) * 2 ** k for k in range(21)))


def test_a_timed_out_verdict_is_not_cached():
    """A busy machine may time out a legitimate comparison; that 0 must not stick for the whole run."""
    pair = (SLOW_GOLD, SLOW_PREDICTION)
    assert grader.verify_pairs([pair], timeout_s=1e-6) == ["timeout"]  # timed out (twice), not "different"
    assert pair not in grader._verdict_cache
    assert grader.verify_pairs([pair], timeout_s=5.0) == [True]
    assert grader._verdict_cache[pair] is True
    completion, gold = formatted(SLOW_PREDICTION), SLOW_GOLD  # and through the reward
    with grader._cache_lock:
        grader._verdict_cache.clear()
    with rewards.timeouts_counted() as timeouts:
        assert grade_accuracy([formatted("1"), completion], ["1", gold], timeout_s=1e-6) == [1.0, 0.0]
    assert timeouts.positions == {1}  # counted: a possibly wrong 0
    with rewards.timeouts_counted() as timeouts:
        assert grade_accuracy([completion], [gold], timeout_s=5.0) == [1.0]
    assert timeouts.positions == set()


def test_without_worker_processes_math_verify_runs_in_process_on_the_main_thread_only(monkeypatch):
    """The fallback where no worker can start (no fork): our CPU-time timer on the main thread; off it, None."""
    assert grader._verify_in_process("\\frac{1}{2}", "0.5", timeout_s=5.0) is True
    assert grader._verify_in_process("\\frac{1}{2}", "0.6", timeout_s=5.0) is False
    assert grader._verify_in_process(SLOW_GOLD, SLOW_PREDICTION, timeout_s=1e-6) == "timeout"
    off_main = []
    thread = threading.Thread(target=lambda: off_main.append(grader._verify_in_process("x^2", "x^{2}", 5.0)))
    thread.start()
    thread.join()
    assert off_main == [None]
    monkeypatch.setattr(grader, "_workers_broken", True)  # what verify_pairs does once no worker could start
    assert grader.verify_pairs([("x^2", "x^{2}"), ("2", "3")], timeout_s=5.0) == [True, False]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the worker's limits from /proc (Linux)")
def test_a_worker_runs_each_comparison_under_a_kernel_cpu_time_limit():
    """The backstop for C code deaf to the soft timer: before each comparison the worker's RLIMIT_CPU is set to its
    CPU time so far + the comparison's limit + 2 s, so the kernel ends a comparison stuck past it (an unlimited
    soft limit would leave only the wall-time kill, WALL_FACTOR times later)."""
    timeout_s = 0.5
    assert grader.verify_pairs([("x^2", "x^{2}")], timeout_s=timeout_s) == [True]
    pid = grader._workers[0].pid
    line = next(line for line in open(f"/proc/{pid}/limits") if line.startswith("Max cpu time"))
    soft = line.split()[3]
    assert soft != "unlimited", line
    ticks = os.sysconf("SC_CLK_TCK")
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    used_s = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    assert used_s < int(soft) <= used_s + timeout_s + 3
