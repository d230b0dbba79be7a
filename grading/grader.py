"""Math-verify equivalence with a hard per-comparison time limit that works off the main thread.

Serves the accuracy reward of the PODS paper (Appendix A.1, rewards.py): is a model's final answer equal
to the ground truth under Hugging Face's math-verify (sympy based)? Two problems make a plain call unsafe
in a trainer: math-verify's own timeout uses signal.alarm, which only works on the main thread (a trainer
may grade from any thread), and sympy can hang on adversarial model output, sometimes inside C code that
no signal interrupts. So, for each (gold, prediction) pair that rewards.py could not decide cheaply:
  1. a verdict cache answers repeats (rollouts of one prompt repeat answers); timed-out pairs are not
     cached, since a busy machine must not fix a wrong 0 for the whole run;
  2. math-verify runs in worker processes with its signal timeouts off and our own soft timer; the limit
     is CPU time of the worker (ITIMER_PROF), not wall time, so a machine busy with other work slows a
     comparison down without timing it out. A pair that times out is tried once more with a limit
     RETRY_FACTOR times longer; if that times out too it gets None (the caller scores 0 and counts it:
     `timeouts_counted`);
  3. hard limits for C code deaf to signals: a kernel CPU-time limit (RLIMIT_CPU) ends such a worker, and a
     worker that stays silent for WALL_FACTOR times its limit in wall time (stopped, or starved) is
     SIGKILLed and replaced.
Workers are forked by a small grading server (a fresh interpreter that imported and warmed math-verify
once), so a replacement is ready in milliseconds and the caller's process (threads, CUDA) never forks.
POSIX only; where no worker can start, math-verify runs in-process under SIGPROF on the main thread, and
off the main thread such pairs get None.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
# `resource` is POSIX only: imported inside the server and worker, so `import grader` works anywhere.

RETRY_FACTOR = 4  # a timed-out pair is tried once more with this many times the limit
WALL_FACTOR = 20  # a worker silent for this many times its CPU limit (+ KILL_GRACE_S) in wall time is killed:
# 16 busy processes on 2 cores leave a worker ~1/9 of a core, so its CPU limit passes in ~9x the wall time
KILL_GRACE_S = 0.25
_STARTUP_TIMEOUT_S = 60.0  # the grader server imports sympy and warms up once (~2 s; more when busy)
_WORKER_MEMORY_BYTES = 4 << 30  # RLIMIT_AS of a worker: a huge integer raises MemoryError there
_CACHE_SIZE = 1 << 16
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- math-verify (workers)
_gold_cache = {}


def _math_verify_equal(gold, prediction):
    """math-verify equivalence, timeouts off (the caller enforces them). Raw LaTeX without `$` is wrapped
    in \\boxed{} (math-verify extracts nothing from bare LaTeX); a prediction without delimiters is tried
    both as text and wrapped, because bare `[1, 2)` read as text yields just `2`."""
    from math_verify import parse, verify

    if gold not in _gold_cache:
        _gold_cache[gold] = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        if len(_gold_cache) > 4096:
            _gold_cache.pop(next(iter(_gold_cache)))
    gold_parsed = _gold_cache[gold]
    if not gold_parsed:
        return False
    candidates = [prediction]
    if "$" not in prediction and "\\boxed" not in prediction:
        candidates.append("\\boxed{" + prediction + "}")
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=None)
        if parsed and verify(gold_parsed, parsed, timeout_seconds=None):
            return True
    return False


class _SoftTimeout(BaseException):  # BaseException: math-verify's `except Exception` cannot swallow it
    pass


def _on_alarm(signum, frame):
    raise _SoftTimeout


# One of each answer kind: the first of a kind pays lazy imports (sympy.physics.units alone ~0.25 s),
# which would otherwise be paid, and could time out, in every fresh worker.
_WARMUP = (("72", "72"), ("\\frac{1}{2}", "0.5"), ("(3, \\frac{\\pi}{2})", "(3,\\frac{\\pi}{2})"),
           ("[1, 2)", "[1,2)"), ("x^2 + 1", "$1+x^2$"), ("\\text{Evelyn}", "Evelyn"), ("90^\\circ", "90"),
           ("y = 2x + 3", "y=2x+3"), ("x \\in [-2,7]", "$x \\in [-2,7]$"), ("x > 2", "(2,\\infty)"),
           ("\\{1,2\\}", "\\{2,1\\}"), ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)"), ("3+4i", "4i+3"),
           ("\\sin x + \\log_2 8", "\\sin(x)+3"), ("\\sqrt{2}", "2^{1/2}"), ("x^2-1", "(x-1)(x+1)"))


def _timed_verdict(gold, prediction, timeout_s):
    """math-verify under our soft timer of timeout_s seconds of this process's CPU time (the caller, on the main
    thread, has made _on_alarm the SIGPROF handler): True/False, "timeout", or None (MemoryError, RecursionError:
    no verdict)."""
    try:
        signal.setitimer(signal.ITIMER_PROF, timeout_s)
        return bool(_math_verify_equal(gold, prediction))
    except (MemoryError, RecursionError):
        return None
    except Exception:  # noqa: BLE001  sympy/parser errors: an ordinary "not equal"
        return False
    except _SoftTimeout:
        return "timeout"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def _worker_loop(conn):
    """Answer (gold, prediction, timeout_s) requests until EOF with _timed_verdict's answer: after "timeout"
    we stay usable and warm; after None (MemoryError, RecursionError) the parent replaces us."""
    import resource

    signal.signal(signal.SIGPROF, _on_alarm)
    while True:
        try:
            gold, prediction, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        # kernel backstop for C code deaf to SIGPROF, which also ends an orphaned worker
        with contextlib.suppress(ValueError, OSError):
            used_s = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            resource.setrlimit(resource.RLIMIT_CPU, (int(used_s + timeout_s) + 2, resource.RLIM_INFINITY))
        conn.send(_timed_verdict(gold, prediction, timeout_s))


def _zygote_main(control_fd):
    """Grader server (a fresh interpreter): import and warm math-verify once, then fork one worker per
    request and pass its socket (and pidfd) to the parent. Forking from this single-threaded warm process
    makes a replacement worker cost milliseconds, and the trainer (threads, CUDA) itself never forks."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole inputs on failures
    warnings.simplefilter("ignore")  # sympy/parser warnings about model text are noise on the trainer's stderr
    # inherited by workers: a huge integer raises MemoryError instead of eating the machine
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    for gold, prediction in _WARMUP:  # fills parser caches once; every worker inherits them
        _math_verify_equal(gold, prediction)
    control = socket.socket(fileno=control_fd)
    with contextlib.suppress(OSError):  # the parent is gone
        while control.recv(1):
            parent_end, worker_end = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                control.close()
                parent_end.close()
                try:
                    _worker_loop(Connection(worker_end.detach()))
                finally:
                    os._exit(0)
            worker_end.close()
            fds = [parent_end.fileno()]
            with contextlib.suppress(AttributeError, OSError):
                fds.append(os.pidfd_open(pid))  # race-free kill for the parent (Linux >= 5.3)
            socket.send_fds(control, [str(pid).encode()], fds)
            for fd in fds[1:]:
                os.close(fd)
            parent_end.close()


@dataclass
class _Worker:
    pid: int
    conn: Connection
    pidfd: int | None = None


_workers: list[_Worker] = []
_workers_lock = threading.Lock()
_zygote = {}  # "process": Popen, "control": socket, "owner_pid": pid that started it
_workers_broken = False  # True once no worker could be started: grade in-process from then on


def _start_zygote():
    parent_end, zygote_end = socket.socketpair()
    folder, module = os.path.dirname(os.path.abspath(__file__)), os.path.splitext(os.path.basename(__file__))[0]
    code = (f"import sys; sys.path.insert(0, {folder!r}); import {module}; "
            f"{module}._zygote_main({zygote_end.fileno()})")
    process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[zygote_end.fileno()],
                               stdin=subprocess.DEVNULL)
    zygote_end.close()
    parent_end.settimeout(_STARTUP_TIMEOUT_S)  # the first fork waits for imports and warm-up
    _zygote.update(process=process, control=parent_end, owner_pid=os.getpid())


def _fork_worker():
    for attempt in range(2):  # a dead grader server is restarted once
        if not _zygote or _zygote["process"].poll() is not None:
            _stop_zygote()
            _start_zygote()
        with contextlib.suppress(OSError):
            _zygote["control"].sendall(b"f")
            message, fds, _, _ = socket.recv_fds(_zygote["control"], 64, 2)
            if message and fds:
                return _Worker(int(message), Connection(fds[0]), fds[1] if len(fds) > 1 else None)
        _stop_zygote()
    raise RuntimeError("the math-verify grader server did not start")


def _kill_worker(worker):
    with contextlib.suppress(OSError):  # already gone
        if worker.pidfd is not None:
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
        else:
            os.kill(worker.pid, signal.SIGKILL)
    worker.conn.close()
    if worker.pidfd is not None:
        os.close(worker.pidfd)


def _stop_zygote():
    if _zygote:
        _zygote["control"].close()
        with contextlib.suppress(OSError, ValueError):
            _zygote["process"].kill()
            _zygote["process"].wait(timeout=5)
        _zygote.clear()


@atexit.register
def reset_workers():
    """Kill the workers (the server stays) and forget every verdict: a cold start, for benchmarks."""
    _verdict_cache.clear()
    with _workers_lock:
        for worker in _workers:
            _kill_worker(worker)
        _workers.clear()


def shutdown_workers():
    """Kill the grading workers and their server (they would also exit on EOF once we are gone)."""
    with _workers_lock:
        if _zygote.get("owner_pid", os.getpid()) == os.getpid():  # a forked child does not own them
            for worker in _workers:
                _kill_worker(worker)
            _stop_zygote()
        _workers.clear()
        _zygote.clear()


def _worker_pool(size):
    """size live workers, or None (after logging why) when worker processes cannot run here."""
    global _workers_broken
    if _zygote and _zygote["owner_pid"] != os.getpid():  # we are a fork of the owner: start our own
        _workers.clear()
        _zygote.clear()
    try:
        while len(_workers) < size:
            _workers.append(_fork_worker())
        return _workers[:size]
    except (OSError, RuntimeError, ValueError, AttributeError) as error:
        logger.warning("cannot start math-verify worker processes (%s); grading in-process", error)
        _workers_broken = True
        return None


def _replace_worker(pool, slot):
    global _workers_broken
    _kill_worker(pool[slot])
    try:
        pool[slot] = _workers[slot] = _fork_worker()
    except RuntimeError:  # the server cannot start (twice): stop paying its start-up timeout every batch
        _workers_broken = True
        raise


def _verify_in_workers(items, num_workers, timeout_s):
    """True/False per (gold, prediction) item from max(1, num_workers) workers, each under a CPU-time limit;
    "timeout" where it ran out of time (its soft timer, or silent for WALL_FACTOR x timeout_s + grace of wall time:
    killed and replaced), None where it crashed."""
    verdicts = [None] * len(items)
    with _workers_lock:
        pool = None if _workers_broken else _worker_pool(max(1, num_workers))
        if pool is None:
            return [_verify_in_process(gold, prediction, timeout_s) for gold, prediction in items]
        pending, busy = deque(range(len(items))), {}  # busy: slot -> (item index, deadline)
        while pending or busy:
            for slot in range(len(pool)):
                if pending and slot not in busy:
                    try:
                        pool[slot].conn.send((*items[pending[0]], timeout_s))
                    except (OSError, ValueError):  # died between batches: replace, resend next round
                        _replace_worker(pool, slot)
                        continue
                    wall_limit_s = WALL_FACTOR * timeout_s + KILL_GRACE_S
                    busy[slot] = (pending.popleft(), time.monotonic() + wall_limit_s)
            if not busy:
                continue
            nearest = min(deadline for _, deadline in busy.values())
            ready = wait_for_connections([pool[slot].conn for slot in busy],
                                         timeout=max(0.0, nearest - time.monotonic()))
            for slot in list(busy):
                index, deadline = busy[slot]
                if pool[slot].conn in ready:
                    del busy[slot]
                    try:
                        verdict = pool[slot].conn.recv()
                    except (EOFError, OSError):
                        verdict = None
                    verdicts[index] = verdict if isinstance(verdict, bool) or verdict == "timeout" else None
                    if verdict is None:  # crashed or ran out of memory: start afresh
                        _replace_worker(pool, slot)
                elif time.monotonic() >= deadline:  # stopped, starved, or stuck deaf to signals: kill
                    del busy[slot]
                    verdicts[index] = "timeout"
                    _replace_worker(pool, slot)
    return verdicts


def _verify_in_process(gold, prediction, timeout_s):
    """Fallback when no worker process can run: our CPU-time timer (SIGPROF) on the main thread, else refuse (None);
    "timeout" as in the workers."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGPROF, _on_alarm)
    try:
        verdict = _timed_verdict(gold, prediction, timeout_s)
    finally:
        signal.signal(signal.SIGPROF, previous)
    return verdict if isinstance(verdict, bool) or verdict == "timeout" else None


# ---------------------------------------------------------------------------- entry point, cache
_verdict_cache: OrderedDict = OrderedDict()  # (gold, prediction) -> bool, least recently used first
_cache_lock = threading.Lock()


def _verify(pairs, num_workers, timeout_s):
    """One round of verdicts (True/False/"timeout"/None) for distinct pairs, never raising."""
    try:
        return _verify_in_workers(pairs, num_workers, timeout_s)
    except (Exception, _SoftTimeout):  # noqa: BLE001  (_SoftTimeout: an alarm firing in a `finally`)
        logger.exception("math-verify workers failed; scoring 0")
        return [None] * len(pairs)


def verify_pairs(pairs, timeout_s, num_workers=0):
    """math-verify verdict for each (gold, prediction) pair: True/False, "timeout" where the comparison timed out
    twice (timeout_s, then RETRY_FACTOR x timeout_s seconds of the worker's CPU time), None where it crashed (out of
    memory, say). Uncached pairs go to max(1, num_workers) worker processes in parallel. Never raises."""
    verdicts, missing = {}, []
    with _cache_lock:
        for pair in pairs:
            if pair in _verdict_cache:
                _verdict_cache.move_to_end(pair)
                verdicts[pair] = _verdict_cache[pair]
            elif pair not in verdicts:
                verdicts[pair] = None
                missing.append(pair)
    if missing:
        fresh = dict(zip(missing, _verify(missing, num_workers, timeout_s)))
        again = [pair for pair in missing if fresh[pair] == "timeout"]  # a busy moment, or a hard pair: once more
        if again:
            fresh.update(zip(again, _verify(again, num_workers, RETRY_FACTOR * timeout_s)))
        verdicts.update(fresh)
        with _cache_lock:
            for pair, verdict in fresh.items():
                if isinstance(verdict, bool):  # a timed-out pair is not cached: it may be decided next time
                    _verdict_cache[pair] = verdict
            while len(_verdict_cache) > _CACHE_SIZE:
                _verdict_cache.popitem(last=False)
    return [verdicts[pair] for pair in pairs]
