"""grader.py: math-verify in worker processes forked by a grading server, under a hard per-comparison
deadline (a worker deaf to signals is killed and replaced), a pool of several workers, and the verdict
cache that never keeps a timed-out comparison. Serves the accuracy reward of paper Appendix A.1."""

import os
import signal
import threading
import time

import pytest

import grader
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


def test_a_hung_worker_is_killed_at_the_deadline_and_replaced():
    """SIGSTOP makes a worker deaf to everything, like C code that never returns."""
    assert grade_accuracy([formatted("x^{2}")], ["x^2"], timeout_s=5.0) == [1.0]  # worker is up
    worker = grader._workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.perf_counter()
    scores = grade_accuracy([formatted("\\sqrt{4}")], ["2"], timeout_s=0.3)
    elapsed_s = time.perf_counter() - start
    assert scores == [0.0] and elapsed_s < 1.5
    assert grader._workers[0].pid != worker.pid  # replaced
    assert ("2", "\\sqrt{4}") not in grader._verdict_cache  # no verdict from a killed worker
    assert grade_accuracy([formatted("\\sqrt{9}")], ["3"], timeout_s=5.0) == [1.0]


def test_a_timed_out_verdict_is_not_cached():
    """A busy machine may time out a legitimate comparison; that 0 must not stick for the whole run."""
    pair = ("\\frac{3}{4}", "\\frac{6}{8}")
    assert grader.verify_pairs([pair], timeout_s=1e-6) == [None]  # None: timed out, not "different"
    assert pair not in grader._verdict_cache
    assert grader.verify_pairs([pair], timeout_s=5.0) == [True]
    assert grader._verdict_cache[pair] is True
    completion, gold = formatted("\\frac{6}{8}"), "\\frac{3}{4}"  # and through the reward
    with grader._cache_lock:
        grader._verdict_cache.clear()
    assert grade_accuracy([completion], [gold], timeout_s=1e-6) == [0.0]
    assert grade_accuracy([completion], [gold], timeout_s=5.0) == [1.0]


def test_without_worker_processes_math_verify_runs_in_process_on_the_main_thread_only(monkeypatch):
    """The fallback where no worker can start (no fork): our SIGALRM timer on the main thread; off it, None."""
    assert grader._verify_in_process("\\frac{1}{2}", "0.5", timeout_s=5.0) is True
    assert grader._verify_in_process("\\frac{1}{2}", "0.6", timeout_s=5.0) is False
    assert grader._verify_in_process("\\frac{3}{4}", "\\frac{6}{8}", timeout_s=1e-6) is None  # timed out
    off_main = []
    thread = threading.Thread(target=lambda: off_main.append(grader._verify_in_process("x^2", "x^{2}", 5.0)))
    thread.start()
    thread.join()
    assert off_main == [None]
    monkeypatch.setattr(grader, "_workers_broken", True)  # what verify_pairs does once no worker could start
    assert grader.verify_pairs([("x^2", "x^{2}"), ("2", "3")], timeout_s=5.0) == [True, False]
