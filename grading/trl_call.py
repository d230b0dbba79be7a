"""A reward function of one's own called exactly as TRL's GRPOTrainer calls it (TRL 1.16, `_calculate_rewards`).

Serves the rewards of the PODS paper's trainer (rewards.compute_rewards) when a user brings a function of their own
(`--reward-function FILE.py:NAME`): the same file must run unchanged here and in a TRL script. TRL calls a reward
function by keyword with
- `prompts`, and `completions` in the dataset's format: for a chat prompt (a list of messages) each completion is one
  assistant message, `[{"role": "assistant", "content": text}]`; for a plain-text prompt, the text (`trl_completions`);
- `completion_ids`, each completion's token ids;
- every column of the dataset but `prompt`, by its name;
- `trainer_state`, a `transformers.TrainerState` (global_step, epoch, max_steps), `log_extra(column, values)` (a
  column of the completions table) and `log_metric(name, value)` (a scalar beside the trainer's metrics): `RewardLog`;
and awaits an `async def` function. What TRL does not do and this module adds: a time limit on each call
(`time_limit`: the function is interrupted, the run stops in one line), and every failure as one line naming the
function (a raise says where and what the function was given; `sys.exit` inside a function is a failure too, not a
silent end of the run).

The time limit interrupts the main thread with a signal of its own (SIGUSR2, sent by a watchdog thread): it stops a
function that sleeps, waits on the network or loops in Python; one stuck in C code that ignores signals is ended with
the process, in one line, GRACE_S seconds later. Off the main thread (no signal can reach it) the limit cannot act.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TIMEOUT_S = 300.0  # seconds one call of one function may take (it scores a whole rollout batch)
GRACE_S = 10.0  # after the interrupt, seconds a function deaf to it has before the process ends
INTERRUPT = getattr(signal, "SIGUSR2", None)  # POSIX; elsewhere the limit cannot act
TIMEOUT_FLAG = "--reward-function-timeout-s"


class LogMisuse(ValueError):
    """log_extra or log_metric called with what TRL's table and plots cannot take (one line naming the function)."""


class RewardTimeout(BaseException):
    """The time limit of a reward function passed (BaseException: the function's own `except Exception` cannot swallow
    it)."""


def is_chat(prompt):
    """TRL's `is_conversational` of one prompt: a list of messages, each a dict with a role."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def trl_completions(prompts, texts):
    """The `completions` TRL passes for `prompts` (decided by the first, as TRL does): one assistant message each for
    chat prompts, the texts themselves for plain-text prompts."""
    if prompts and is_chat(prompts[0]):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)


def trainer_state(global_step=0, epoch=0.0, max_steps=0):
    """A transformers.TrainerState, what TRL passes as `trainer_state`: global_step (the optimizer steps done before
    the one being scored), epoch (passes over the training prompts done, a float), max_steps (0: no step limit)."""
    import models  # transformers' trainer module imports peft, which is quieted as a run's loading is

    with models.quiet_peft():
        from transformers.trainer_callback import TrainerState
    return TrainerState(global_step=global_step, epoch=epoch, max_steps=max_steps)


def advance(state, global_step, position, num_rows):
    """Keep a run's `trainer_state` current before a step (None: the run has no function to give it): the steps
    done, and the epochs done as TRL counts them (position: the (epoch, cursor) of the prompt order before the step
    draws its prompts, over num_rows prompts)."""
    if state is not None:
        state.global_step, state.epoch = global_step, position[0] + position[1] / max(num_rows, 1)


@dataclass
class RewardLog:
    """What the functions of one scoring call logged: `log_extra` columns (one value per completion, JSON-ready) and
    `log_metric` values as (function, name, value)."""
    count: int  # completions scored
    columns: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)

    def for_function(self, name):
        """(log_extra, log_metric) for function `name`: each checks what it is given, one ValueError line naming the
        function (TRL would put a misaligned column or a non-number into its table and plots)."""
        def log_extra(column, values):
            values = list(values)
            if not isinstance(column, str) or len(values) != self.count:
                raise LogMisuse(f"reward function {name!r} called log_extra({column!r}, ...) with {len(values)} "
                                 f"values for {self.count} completions: give the column name and one value per "
                                 "completion")
            self.columns[column] = [json_ready(value) for value in values]

        def log_metric(metric, value):
            number = float(value.item() if hasattr(value, "item") else value) if _is_number(value) else None
            if not isinstance(metric, str) or number is None or number != number or abs(number) == float("inf"):
                raise LogMisuse(f"reward function {name!r} called log_metric({metric!r}, {value!r}): give a metric "
                                 "name and a finite number")
            self.metrics.append((name, metric, number))
        return log_extra, log_metric


def _is_number(value):
    value = value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_ready(value):
    """A logged value as the completions log can hold it: numbers, text, booleans and None as they are, numpy and
    torch scalars as numbers, anything else as its text."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def call(name, func, kwargs, timeout_s=DEFAULT_TIMEOUT_S):
    """func(**kwargs), awaited if it is async, within timeout_s seconds (0 or None: no limit). A raise, a time-out or
    `sys.exit` in the function is one ValueError line naming it; a stop of the run itself (a subclass of SystemExit,
    KeyboardInterrupt) passes through."""
    try:
        with time_limit(timeout_s, name):
            return _awaited(func, kwargs, timeout_s) if is_async_callable(func) else func(**kwargs)
    except RewardTimeout:
        raise ValueError(f"reward function {name!r} gave no rewards within {timeout_s:g} s ({TIMEOUT_FLAG}); make it "
                         "faster or give it more time") from None
    except LogMisuse:
        raise
    except SystemExit as error:
        if type(error) is not SystemExit:  # the run's own stop (run/signals.py), not the function's
            raise
        raise ValueError(f"reward function {name!r} called sys.exit({error.code!r}){_where(error, func)}: a reward "
                         "function returns its rewards; raise an exception to stop the run") from None
    except Exception as error:  # noqa: BLE001  the user's code: one line, whatever it raised
        message = (str(error).splitlines() or [""])[0]
        raise ValueError(f"reward function {name!r} raised {type(error).__name__}: {message}{_where(error, func)}; "
                         f"it was given {described(kwargs)}") from error


def is_async_callable(func):
    """TRL's test (trl.trainer.utils.is_async_callable): calling func returns a coroutine (a partial unwrapped, a
    callable object's `__call__` included)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _awaited(func, kwargs, timeout_s):
    """An async function's result (time_limit bounds it on the main thread). In a thread whose event loop runs
    already (a notebook), on a loop in a thread of its own, waited for timeout_s at most."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(func(**kwargs))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(asyncio.run, func(**kwargs)).result(timeout=timeout_s or None)
    except concurrent.futures.TimeoutError:
        raise RewardTimeout from None
    finally:
        pool.shutdown(wait=False)


@contextlib.contextmanager
def time_limit(timeout_s, name):
    """The block is interrupted (RewardTimeout) after timeout_s seconds: a watchdog thread signals the main thread;
    if the block has not ended GRACE_S seconds later, the process ends with one line naming the function. No limit
    off the main thread or without SIGUSR2 (Windows)."""
    if not timeout_s or INTERRUPT is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    armed, lock, finished = [True], threading.Lock(), threading.Event()

    def interrupted(signum, frame):
        if armed[0]:
            armed[0] = False
            raise RewardTimeout

    def watch(main_thread):
        if finished.wait(timeout_s):
            return
        with lock:
            if not armed[0]:
                return
            signal.pthread_kill(main_thread, INTERRUPT)
        if not finished.wait(GRACE_S):
            print(f"{Path(sys.argv[0]).name}: error: reward function {name!r} gave no rewards within {timeout_s:g} s "
                  f"({TIMEOUT_FLAG}) and did not stop when interrupted", file=sys.stderr, flush=True)
            os._exit(1)

    previous = signal.signal(INTERRUPT, interrupted)
    watcher = threading.Thread(target=watch, args=(threading.get_ident(),), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            armed[0] = False
        finished.set()
        signal.signal(INTERRUPT, previous)


def _where(error, func):
    """" at FILE:LINE": the innermost line of the function's own file in the error's traceback, else ""."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if code is not None and frame.filename == code.co_filename]
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def described(kwargs):
    """What a function was given, in a few words per keyword: the count and type of each list's items and a sample
    of the first (the error line of a function that raised)."""
    def kind(value):
        if is_chat(value):
            return "list of chat messages"
        if isinstance(value, list):
            return f"list[{type(value[0]).__name__}]" if value else "empty list"
        return type(value).__name__

    def sample(value):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    parts = []
    for key, value in kwargs.items():
        if key in ("log_extra", "log_metric"):
            continue
        if key == "trainer_state":
            parts.append(f"trainer_state ({type(value).__name__}, global_step {getattr(value, 'global_step', '?')})")
        elif isinstance(value, list) and value:
            parts.append(f"{key} ({len(value)} x {kind(value[0])}, e.g. {sample(value[0])})")
        else:
            parts.append(f"{key} ({kind(value)})")
    return ", ".join(parts) + ", log_extra, log_metric" if "log_extra" in kwargs else ", ".join(parts)
