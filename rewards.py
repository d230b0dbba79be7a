"""Rule-based rewards of the PODS paper (Appendix A.1): accuracy, format and tag count, summed with weights.

accuracy: the final answer is the content of the last `<answer>...</answer>` block, else the last
`\\boxed{...}`, else the last number in the text (the fallback order of the authors' grader). It is
compared with the ground truth by Hugging Face's math-verify (sympy based), or as a letter when the ground
truth is a multiple-choice letter A-D. format: the whole completion is `<think>\\n...\\n</think>\\n<answer>\\n
...\\n</answer>`. tag count: 0.25 per tag string present exactly once (the open-r1 definition).

Grading never hangs and never raises. Three layers, cheapest first:
  1. fast paths in this process: letters, plain numbers compared exactly as fractions (GSM8K never needs
     sympy), a verdict cache (rollouts of one prompt repeat answers), and pre-filters that reject inputs
     able to stall sympy in C code (`9^9^9^9`, deep nesting, over-long answers);
  2. math-verify in worker processes with its signal timeouts off and our own soft timer (SIGALRM works
     there: it is the worker's main thread), so callers on any thread are fine; a timed-out item scores 0;
  3. a hard deadline for C code deaf to signals: a worker silent past the limit is SIGKILLed and replaced
     (and a kernel CPU limit ends such a worker even if we are gone).
Workers are forked by a small grader server (a fresh interpreter that imported and warmed math-verify
once), so a replacement is ready in milliseconds and the trainer process itself never forks (POSIX; where
no worker can start, math-verify runs in-process under SIGALRM on the main thread, else scores 0).
Simplification: completions longer than MAX_COMPLETION_CHARS are graded on their tail.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import wait as wait_for_connections

MAX_COMPLETION_CHARS = 100_000  # longer completions: only the tail (where the answer is) is graded
MAX_ANSWER_CHARS = 1_000  # longest MATH answer is 159 characters; longer "answers" score 0
MAX_NESTING_DEPTH = 8  # deeper brackets score 0: MATH answers nest <= 3; each level costs the parser ~0.1 s
VERIFY_TIMEOUT_S = 0.5  # per comparison (a MATH one takes ~5 ms, <0.3 s on a 3x-oversubscribed machine);
# the worker is killed _KILL_GRACE_S later. Raise it (rewards.VERIFY_TIMEOUT_S = 2.0) on a busy machine.
_KILL_GRACE_S = 0.25
_STARTUP_TIMEOUT_S = 60.0  # the grader server imports sympy and warms up once (~2 s; more when busy)
_WORKER_MEMORY_BYTES = 4 << 30  # RLIMIT_AS of a worker: a huge integer raises MemoryError there
_CACHE_SIZE = 1 << 16
THINK_PREFILL = "<think>\n"  # what data.render_prompts(prefill_think=True) appends to the prompt

DEFAULT_REWARD_WEIGHTS = {"accuracy": 1.0, "format": 1.0, "tag_count": 1.0}  # the paper; authors' code 1/.1/.1
logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------- extraction
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _last_tag_block(text, open_tag, close_tag):
    end = text.rfind(close_tag)
    start = text.rfind(open_tag, 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len(open_tag):end]


def _braced_content(text, open_pos):
    """Content of the `{...}` group opening at text[open_pos], or None if it does not close within
    MAX_ANSWER_CHARS (bounded scan: an unclosed brace in a 10^6-character text stays cheap)."""
    depth = 0
    for match in re.finditer(r"[{}]", text[open_pos:open_pos + MAX_ANSWER_CHARS + 2]):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[open_pos + 1:open_pos + match.start()]
    return None


def last_boxed_content(text):
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (nested braces), or `\\boxed 5` -> "5".
    Looks at the last 16 occurrences at most, so a text full of unclosed boxes stays cheap."""
    end = len(text)
    for _ in range(16):
        start = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if start < 0:
            return None
        end = start
        after = re.match(r"\\(?:boxed|fbox)(\s*)", text[start:start + 16])
        position = start + after.end()
        if text.startswith("{", position):
            content = _braced_content(text, position)
        elif after.group(1):  # unbraced form `\boxed 2`; `\boxed.` ends a sentence
            content = re.match(r"[^\s${}]*", text[position:position + MAX_ANSWER_CHARS]).group().rstrip(".,;")
        else:
            content = None  # e.g. `\boxeddot`
        if content and content.strip():
            return content.strip()
    return None


def extract_final_answer(completion):
    """Last <answer> block, else last \\boxed{}, else last number; None when the text has none."""
    if not isinstance(completion, str):
        return None
    text = completion[-MAX_COMPLETION_CHARS:]
    block = _last_tag_block(text, "<answer>", "</answer>")
    if block is not None:
        return block.strip()
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------------------- fast paths
# Possessive `\s*+` keeps these linear on long runs of spaces.
_ANSWER_PREFIX = re.compile(r"^(?:the\s++)?(?:final\s++)?answer\s*+(?:is|:)\s*+:?\s*+", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_UNIT_WORDS = re.compile(r"(?:\s+[A-Za-z]+\.?)+")
_LETTER_AT_START = re.compile(r"^(?:(?i:option|choice)\s*)?\(?([A-D])\)?(?=$|[\s.:,)\]])")
_LETTER_ANSWER_IS = re.compile(r"(?i:answer)\s*+(?:(?i:is)\s*+)?(?::\s*+)?(?:(?i:option)\s*+)?"
                               r"\(?([A-D])\)?(?![A-Za-z])")


def _unwrap(text):
    """Strip whitespace, markdown bold, `$`, a trailing period and one \\boxed/\\text wrapper (repeatedly)."""
    for _ in range(4):
        before = text
        text = text.strip().strip("*").strip().removesuffix(".").strip()
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$")
        wrapper = re.match(r"\\(?:boxed|text|textbf|mathrm)\s*\{", text)
        if wrapper and _braced_content(text, wrapper.end() - 1) == text[wrapper.end():-1]:
            text = text[wrapper.end():-1]
        if text == before:
            break
    return text


def _plain_number(text, allow_words=False):
    """Fraction for '1,234', '$72', '72.', '72 dollars' (allow_words), 'The answer is 72'; else None."""
    text = _unwrap(_ANSWER_PREFIX.sub("", _unwrap(text)))
    text = text.removeprefix("\\$").removeprefix("$").strip()
    match = _PLAIN_NUMBER.match(text)
    if not match:
        return None
    rest = text[match.end():]
    if rest and not (allow_words and _UNIT_WORDS.fullmatch(rest)):
        return None
    return Fraction(match.group().replace(",", "").rstrip("."))


def _choice_letter(text, whole_completion=False):
    """'B', '(B)', 'B.', 'B) text', '**B**', '\\boxed{B}', 'The answer is B' -> 'B'. In a whole completion
    (no <answer> block, no \\boxed) only 'answer is B' or a bare letter counts, not a leading 'A ...'."""
    text = _unwrap(text.replace("**", ""))
    said = list(_LETTER_ANSWER_IS.finditer(text[-MAX_ANSWER_CHARS:]))
    if said:
        return said[-1].group(1)
    match = _LETTER_AT_START.match(text)
    return match.group(1) if match and (not whole_completion or len(text) <= 3) else None


def _nesting_depth(text):
    depth = deepest = 0
    for char in re.findall(r"[{}()\[\]]", text):
        depth = depth + 1 if char in "{([" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


# Numeric towers (9^9^9, 10**10**10, (10^{10})^{10^{10}}), any three nested exponent groups (e^{e^{e^{x}}}),
# exponents of 6+ digits (10^{1234567}, 1e1234567) and factorials of 5+ digits: numbers no answer needs.
_POWER_TOWER = re.compile(r"\d\s*[})]*\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d+(?:\.\d+)?\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d"
                          r"|\^\s*\{[^{}]*\^\s*\{[^{}]*\^")
_HUGE_EXPONENT = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{6,}|\d[eE][-+]?\d{6,}|\d{5,}\s*!")


def _pathological(text):
    """Inputs that can stall sympy inside C code (huge integers) or its recursion: graded 0 up front."""
    return (len(text) > MAX_ANSWER_CHARS or bool(_POWER_TOWER.search(text))
            or bool(_HUGE_EXPONENT.search(text)) or _nesting_depth(text) > MAX_NESTING_DEPTH)


_LATEX_REPLACEMENTS = (("\u2212", "-"), ("\u00b0", "^\\circ"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                       ("{,}", ","), ("\\!", ""), ("\\,", ""))  # unicode minus/degree; MATH's `32,\!348`


def _normalize_latex(text):
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    return text.strip()


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


def _worker_loop(conn):
    """Answer (gold, prediction, timeout_s) requests until EOF with True/False, "timeout" (soft timer:
    we stay usable and warm), or None (MemoryError, RecursionError: the parent replaces us)."""
    import resource
    import signal

    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        try:
            gold, prediction, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        try:  # kernel backstop for C code deaf to SIGALRM, which also ends an orphaned worker
            used_s = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            resource.setrlimit(resource.RLIMIT_CPU, (int(used_s + timeout_s) + 2, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass
        verdict = None
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            verdict = bool(_math_verify_equal(gold, prediction))
        except (MemoryError, RecursionError):
            verdict = None
        except Exception:  # noqa: BLE001  sympy/parser errors: an ordinary "not equal"
            verdict = False
        except _SoftTimeout:
            verdict = "timeout"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send(verdict)


def _zygote_main(control_fd):
    """Grader server (a fresh interpreter): import and warm math-verify once, then fork one worker per
    request and pass its socket (and pidfd) to the parent. Forking from this single-threaded warm process
    makes a replacement worker cost milliseconds, and the trainer (threads, CUDA) itself never forks."""
    import os
    import resource
    import signal
    import socket
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole inputs on failures
    warnings.simplefilter("ignore")  # sympy/parser warnings about model text are noise on the trainer's stderr
    try:  # inherited by workers: a huge integer raises MemoryError instead of eating the machine
        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    for gold, prediction in _WARMUP:  # fills parser caches once; every worker inherits them
        _math_verify_equal(gold, prediction)
    control = socket.socket(fileno=control_fd)
    try:
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
            try:
                fds.append(os.pidfd_open(pid))  # race-free kill for the parent (Linux >= 5.3)
            except (AttributeError, OSError):
                pass
            socket.send_fds(control, [str(pid).encode()], fds)
            for fd in fds[1:]:
                os.close(fd)
            parent_end.close()
    except OSError:
        pass


@dataclass
class _Worker:
    pid: int
    conn: object  # multiprocessing.connection.Connection
    pidfd: int | None = None


_workers: list[_Worker] = []
_workers_lock = threading.Lock()
_zygote = {}  # "process": Popen, "control": socket, "owner_pid": pid that started it
_workers_broken = False  # True once no worker could be started: grade in-process from then on


def _start_zygote():
    import socket
    import subprocess
    import sys

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
    import socket
    from multiprocessing.connection import Connection

    for attempt in range(2):  # a dead grader server is restarted once
        if not _zygote or _zygote["process"].poll() is not None:
            _stop_zygote()
            _start_zygote()
        try:
            _zygote["control"].sendall(b"f")
            message, fds, _, _ = socket.recv_fds(_zygote["control"], 64, 2)
            if message and fds:
                return _Worker(int(message), Connection(fds[0]), fds[1] if len(fds) > 1 else None)
        except OSError:
            pass
        _stop_zygote()
    raise RuntimeError("the math-verify grader server did not start")


def _kill_worker(worker):
    import signal

    try:
        if worker.pidfd is not None:
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
        else:
            os.kill(worker.pid, signal.SIGKILL)
    except OSError:  # already gone
        pass
    worker.conn.close()
    if worker.pidfd is not None:
        os.close(worker.pidfd)


def _stop_zygote():
    if _zygote:
        _zygote["control"].close()
        try:
            _zygote["process"].kill()
            _zygote["process"].wait(timeout=5)
        except (OSError, ValueError):
            pass
        _zygote.clear()


@atexit.register
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
    """True/False per (gold, prediction) item from max(1, num_workers) workers, each under a hard deadline;
    None where it timed out (a worker silent past timeout_s + grace is killed and replaced) or crashed."""
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
                    busy[slot] = (pending.popleft(), time.monotonic() + timeout_s + _KILL_GRACE_S)
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
                    verdicts[index] = verdict if isinstance(verdict, bool) else None
                    if verdict is None:  # crashed or ran out of memory: start afresh
                        _replace_worker(pool, slot)
                elif time.monotonic() >= deadline:  # stuck in C code or swallowed the alarm: kill
                    del busy[slot]
                    _replace_worker(pool, slot)
    return verdicts


def _verify_in_process(gold, prediction, timeout_s):
    """Fallback when no worker process can run: SIGALRM timer on the main thread, else refuse (0)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        return _math_verify_equal(gold, prediction)
    except Exception:  # noqa: BLE001
        return False
    except BaseException:  # noqa: BLE001
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------------ grading
_verdict_cache: OrderedDict = OrderedDict()
_cache_lock = threading.Lock()


def _grade_cheaply(completion, answer):
    """(score, None) when decided without sympy, else (None, (gold, prediction)) for math-verify."""
    if not isinstance(completion, str) or not isinstance(answer, (str, int, float)):
        return 0.0, None
    gold = str(answer).strip()
    prediction = extract_final_answer(completion)
    if len(gold) == 1 and gold in "ABCD":  # multiple choice: compare letters
        text = prediction if prediction is not None else completion[-MAX_COMPLETION_CHARS:]
        return float(_choice_letter(text, whole_completion=prediction is None) == gold), None
    if not prediction or not gold or _pathological(prediction) or _pathological(gold):
        return 0.0, None
    gold, prediction = _normalize_latex(gold), _normalize_latex(prediction)
    gold_number = _plain_number(gold)
    if gold_number is not None:
        predicted_number = _plain_number(prediction, allow_words=True)
        if predicted_number is not None:
            return float(predicted_number == gold_number), None
    with _cache_lock:
        if (gold, prediction) in _verdict_cache:
            _verdict_cache.move_to_end((gold, prediction))
            return _verdict_cache[(gold, prediction)], None
    return None, (gold, prediction)


def grade_accuracy(completions, answers, num_workers=0, timeout_s=None):
    """Accuracy (1.0/0.0) of each completion against its ground truth; math-verify items go to
    max(1, num_workers) worker processes in parallel. Never raises on model output, never waits past the
    deadlines; a timed-out item scores 0 and is not cached (a busy machine must not fix a wrong 0)."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    timeout_s = VERIFY_TIMEOUT_S if timeout_s is None else timeout_s  # read at call time: settable
    scores, slow = [], {}
    for completion, answer in zip(completions, answers):
        try:
            score, item = _grade_cheaply(completion, answer)
        except Exception:  # noqa: BLE001  a grader bug must not stop training
            logger.exception("grading failed; scoring 0")
            score, item = 0.0, None
        scores.append(score)
        if item is not None:
            slow.setdefault(item, []).append(len(scores) - 1)
    if slow:
        try:
            verdicts = _verify_in_workers(list(slow), num_workers, timeout_s)
        except (Exception, _SoftTimeout):  # noqa: BLE001
            logger.exception("math-verify workers failed; scoring 0")
            verdicts = [None] * len(slow)
        with _cache_lock:
            for item, verdict in zip(slow, verdicts):
                if verdict is not None:
                    _verdict_cache[item] = float(verdict)
                for position in slow[item]:
                    scores[position] = float(verdict is True)
            while len(_verdict_cache) > _CACHE_SIZE:
                _verdict_cache.popitem(last=False)
    return [float(score or 0.0) for score in scores]


def accuracy_reward(completion: str, answer: str, *, timeout_s: float | None = None) -> float:
    """1.0 if the completion's final answer equals the ground truth, else 0.0 (also on any failure)."""
    return grade_accuracy([completion], [answer], timeout_s=timeout_s)[0]


def format_reward(completion: str) -> float:
    """1.0 iff completion.strip() is `<think>\\n{A}\\n</think>\\n<answer>\\n{B}\\n</answer>` with each of the
    four tags exactly once (A, B may be empty). Whitespace at the two ends is ignored: decoded text can
    carry a leading space or a trailing newline; everything between must be exact."""
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    if not (text.startswith("<think>\n") and text.endswith("\n</answer>")):
        return 0.0
    if any(text.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0
    separator = "\n</think>\n<answer>\n"
    middle = text.find(separator)  # A = text[8:middle], B = text[middle + 19:-10]; the regex's bounds
    return float(middle >= len("<think>\n") and middle + len(separator) <= len(text) - len("\n</answer>"))


def tag_count_reward(completion: str) -> float:
    """0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` occurring exactly once."""
    if not isinstance(completion, str):
        return 0.0
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return 0.25 * sum(completion.count(tag) == 1 for tag in tags)


# -------------------------------------------------------------------------------- TRL-shaped batch API
def completion_text(completion):
    """Text of a completion given as a string or as TRL conversational messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        return "".join(m.get("content") or "" if isinstance(m, dict) else str(m) for m in completion)
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return ""


def accuracy_rewards(prompts, completions, answer, num_workers=0, timeout_s=None, **kwargs) -> list[float]:
    """TRL reward function: `answer` is the dataset column of ground truths (one per completion)."""
    if answer is None:
        raise ValueError("the accuracy reward needs the dataset's 'answer' column (one per completion)")
    return grade_accuracy([completion_text(c) for c in completions], list(answer), num_workers, timeout_s)


def format_rewards(prompts, completions, answer=None, **kwargs) -> list[float]:
    return [format_reward(completion_text(c)) for c in completions]


def tag_count_rewards(prompts, completions, answer=None, **kwargs) -> list[float]:
    return [tag_count_reward(completion_text(c)) for c in completions]


REWARD_FUNCS = {"accuracy": accuracy_rewards, "format": format_rewards, "tag_count": tag_count_rewards}


@dataclass
class RewardResult:
    total: "torch.Tensor"  # [N] float32, weighted sum over functions (NaN entries of a function skipped)
    per_func: dict = field(default_factory=dict)  # name -> [N] float32

    def metrics(self) -> dict[str, float]:
        """TRL-named means: "reward" and "rewards/<fn>/mean"."""
        out = {"reward": float(self.total.mean())}
        for name, values in self.per_func.items():
            out[f"rewards/{name}/mean"] = float(values.nanmean())
        return out


def compute_rewards(prompts, completions, answers, reward_funcs=REWARD_FUNCS, weights=DEFAULT_REWARD_WEIGHTS,
                    num_workers=0) -> RewardResult:
    """Every reward function on every completion, and their weighted sum (paper: 1/1/1).

    reward_funcs: name -> TRL-shaped f(prompts, completions, answer, **kwargs) -> list[float | None];
    they also get num_workers. A None from a user function (TRL: "not applicable") is NaN in per_func and
    counts 0 in total. weights must name every function, and only those (weight 0: logged, not summed);
    anything else is a ValueError, since a silently defaulted weight would change the objective."""
    import torch

    unknown, unweighted = set(weights) - set(reward_funcs), set(reward_funcs) - set(weights)
    if unknown:
        raise ValueError(f"weights given for unknown reward functions {sorted(unknown)}; "
                         f"functions are {sorted(reward_funcs)}")
    if unweighted:
        raise ValueError(f"no weight for reward functions {sorted(unweighted)}: give each a weight "
                         "(0.0 to log it without adding it to the total)")
    if len(answers) != len(completions) or len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers: "
                         "give one prompt and one answer per completion")
    per_func, total = {}, torch.zeros(len(completions), dtype=torch.float32)
    for name, func in reward_funcs.items():
        try:
            values = func(prompts=list(prompts), completions=list(completions), answer=list(answers),
                          num_workers=num_workers)
        except Exception as error:
            error.add_note(f"(in reward function {name!r})")
            raise
        if len(values) != len(completions):
            raise ValueError(f"reward function {name!r} returned {len(values)} values for "
                             f"{len(completions)} completions")
        try:
            tensor = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise ValueError(f"reward function {name!r} returned a non-number: {error}") from None
        per_func[name] = tensor
        total += weights[name] * torch.nan_to_num(tensor, nan=0.0)
    return RewardResult(total=total, per_func=per_func)
