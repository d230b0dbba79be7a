"""A training step on a busy machine (not the paper's method: whether a CPU run of it survives sharing the machine).

    python -m bench load [--steps 3] [--busy 16] [--threads auto,1,2] [--tiny] [--out-dir bench_out]

Runs `python train.py` (the demo, no held-out evaluation) for a few steps with each --num-threads value, once on the
machine as it is and once beside --busy processes that spin on the CPU, the two interleaved, and prints each run's
median step (steps after the first) and the busy / quiet ratio. The busy processes run in a session of their own, as
another user's job or a `make -j` would: the scheduler then shares the cores between that session and the run's
(Linux's autogroups), so what remains is what the thread count itself costs. (Spinners in the run's own session take
a share per thread: one thread of 17 gets 2/17 of two cores, ~8.5x slower whatever the count.) The machine's load
average is recorded with each run; a quiet figure is only quiet when nothing else runs.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parent.parent
SPIN = """
import os
for _ in range({count} - 1):
    if os.fork() == 0:
        break
while True:
    pass
"""


def busy_processes(count):
    """`count` processes spinning on the CPU in one new session (a process group): returns its leader."""
    return subprocess.Popen([sys.executable, "-c", SPIN.format(count=count)], start_new_session=True)


def stop(leader):
    """Stop every process of the leader's group."""
    try:
        os.killpg(leader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    leader.wait()


def step_seconds(run_dir):
    """The step_s of each training step of a run folder's metrics.jsonl, in order."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [line["step_s"] for line in lines if line.get("type") == "train"], \
        [line.get("num_threads") for line in lines if line.get("type") == "train"]


def train_run(threads, steps, out_dir, extra):
    """One demo run of `steps` steps with --num-threads `threads` ("auto": 0): (step seconds, threads per step)."""
    command = [sys.executable, "train.py", "--max-steps", str(steps), "--eval-samples", "0",
               "--checkpoint-interval-s", "-1", "--num-threads", "0" if threads == "auto" else str(threads),
               "--output-dir", str(out_dir), "--no-progress", *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    seconds, counts = step_seconds(out_dir)
    return seconds, counts


def bench_load(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench load",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps a run (the first is not counted)")
    parser.add_argument("--busy", type=int, default=16, help="processes spinning beside the busy runs")
    parser.add_argument("--threads", default="auto,1,2", help="comma list of --num-threads values (auto: 0)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model instead of the demo's")
    parser.add_argument("--out-dir", default="bench_out", help="bench_load.json goes here")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.busy < 1:
        raise ValueError("--steps must be >= 2 (the first step is not counted) and --busy >= 1")
    threads = [value.strip() for value in args.threads.split(",") if value.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        extra = []
        if args.tiny:
            import models

            folder = Path(scratch) / "tiny"
            models.tiny_random_model("llama").save_pretrained(folder)
            models.load_tokenizer(models.SMOLLM2_ALIAS).save_pretrained(folder)
            extra = ["--model", str(folder), "--no-bf16"]
        rows = []
        print(f"# bench load: {'tiny model' if args.tiny else 'the demo'}, {args.steps} steps a run, {args.busy} busy "
              f"processes in their own session, {os.cpu_count()} cores")
        print("threads | busy | median step_s | threads per step | load average")
        for count in threads:
            for busy in (False, True):  # interleaved: each thread count's quiet and busy runs back to back
                leader = busy_processes(args.busy) if busy else None
                try:
                    time.sleep(1.0 if busy else 0.0)
                    seconds, counts = train_run(count, args.steps, Path(scratch) / f"{count}-{busy}", extra)
                finally:
                    if leader is not None:
                        stop(leader)
                row = dict(threads=count, busy=args.busy if busy else 0, step_s=statistics.median(seconds[1:]),
                           steps_s=seconds, threads_per_step=counts, load_average=os.getloadavg()[0])
                rows.append(row)
                print(f"{count} | {row['busy']} | {row['step_s']:.2f} | {counts} | {row['load_average']:.1f}",
                      flush=True)
    ratios = {count: next(r["step_s"] for r in rows if r["threads"] == count and r["busy"]) /
              next(r["step_s"] for r in rows if r["threads"] == count and not r["busy"]) for count in threads}
    for count, ratio in ratios.items():
        print(f"busy / quiet, --num-threads {count}: {ratio:.2f}x")
    result = dict(benchmark="load", busy=args.busy, steps=args.steps, tiny=args.tiny, cores=os.cpu_count(),
                  rows=rows, busy_over_quiet=ratios)
    common.save_json(args.out_dir, "load", result)
    return result
