"""How a run stops: on SIGTERM (a cluster preempting the job) or SIGINT (Ctrl-C) at the next step boundary with a
checkpoint (`stop_on_signal`, `Stopped`), and a CUDA out-of-memory error turned into the flags that bound the memory
(`cuda_oom_hint`). train.py's loop uses them between steps; none of it is the paper's method."""

import contextlib
import signal
import sys
import threading

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py)


class Stopped(SystemExit):
    """The run stopped on SIGTERM or SIGINT after checkpointing its last completed step; exit status 128 + signal."""


class StoppedNow(SystemExit):
    """A second SIGTERM or SIGINT: the run ends at once (exit status 128 + signal), wherever it was, a reward function
    of one's own included (which tells it from a sys.exit of its own by this class)."""


@contextlib.contextmanager
def cuda_oom_hint(args, phase):
    """Re-raise CUDA OOM naming the flags that bound the memory of each phase."""
    import update

    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        raise update.TrainingError(f"CUDA out of memory during {phase}. Lower --rollout-batch-size (now "
                                   f"{args.rollout_batch_size}) for generation/evaluation or --micro-batch-size (now "
                                   f"{args.micro_batch_size}) for the update; --gradient-checkpointing and "
                                   "--load-in-4bit also help.") from error


@contextlib.contextmanager
def stop_on_signal():
    """SIGTERM or SIGINT asks the run to stop at the next step boundary: the yielded dict gets the signal's number; a
    second signal exits at once (the last checkpoint stays intact). The previous handlers come back afterwards.
    Outside the main thread no handler can be set: nothing is caught."""
    requested = {}

    def handler(signum, frame):
        if requested:
            raise StoppedNow(128 + signum)
        requested["signal"] = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint (again: stop now)",
              file=sys.stderr, flush=True)

    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
