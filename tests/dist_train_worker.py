"""train.py's loop under 2 CPU ranks (torch's elastic launcher, what `torchrun --standalone --nproc-per-node 2
--max-restarts 1 -m multigpu ...` runs, with the ranks forked from this process once its imports are done), for
test_distributed.py, which runs the same argv in one process as the reference.

    python tests/dist_train_worker.py OUT_DIR MODEL_DIR

Attempt 0: runs "full" (full parameter, 2 steps), "lora" (3 steps), "dynamic" (as "lora" with --dynamic-sampling and
a reward without a spread for every third answer: the ranks refill unevenly) and "killed" (the same as "lora"; rank 1
SIGKILLs itself when step 3 starts, after the step-2 checkpoint). The launcher restarts both ranks; attempt 1:
"killed" again with the same argv, which resumes from its latest checkpoint (restart count > 0), then "preempted"
(as "lora"; rank 1 alone gets SIGTERM in step 2: both ranks stop after it with a checkpoint), then "fail", where
rank 1 raises in step 1 while rank 0 waits in a collective, which ends the launch. Each rank writes how many of its
update passes ran each distinct prompt once (prefix.completion_logprobs) to OUT_DIR/prefix_calls_<run>_rank<r>.txt,
and per step the FSDP all-gathers its rounds issued (from the step's start to its update) beside the model's FSDP units
and the step's generation rounds to OUT_DIR/gathers_<run>_rank<r>.json.
"""

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from multigpu import distributed, run  # noqa: E402
from engine import prefix  # noqa: E402
import rewards  # noqa: E402
from run_helpers import every_third_constant, fake_compute_rewards  # noqa: E402
import train  # noqa: E402
import update  # noqa: E402
from run.signals import Stopped  # noqa: E402

CURRENT = {}  # the run this rank is in
PREFIX_CALLS = []  # this rank's update passes that ran each distinct prompt once (prefix.completion_logprobs)
GATHERS = []  # per step: {"rounds_all_gathers", "fsdp_units", "generation_rounds"}


def run_argv(model_dir, out_dir, name):
    """The argv of run `name`: 2 prompts per rollout batch (1 per rank), n = 4, m = 2, chunks of 4 rows (one per
    rank and prompt: the rollouts of 1 and 2 processes share their seeds), greedy evaluation; checkpoints after
    every step for "killed" only (the others save their final state)."""
    lora = ["--lora-rank", "0"] if name == "full" else ["--lora-rank", "4", "--lora-alpha", "8"]
    return ["--model", str(model_dir), "--dataset", "arithmetic", "--num-train-rows", "64", "--num-rollouts", "4",
            "--update-size", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8", "--rollout-batch-size",
            "4", "--micro-batch-size", "2", "--max-steps", "2" if name == "full" else "3", "--learning-rate",
            "1e-3" if name == "full" else "1e-2", "--eval-samples", "2", "--eval-interval", "2",
            "--eval-temperature", "0", "--checkpoint-interval-s", "0" if name == "killed" else "3600",
            "--no-progress", "--num-threads", "1", "--no-bf16",
            "--device", "cpu", "--dist-timeout-s", "60", "--output-dir", str(Path(out_dir) / name), *lora,
            *(["--dynamic-sampling", "--log-completions-interval", "1"] if name == "dynamic" else [])]


def worker_rewards(prompts, completions, answers, **kwargs):
    """The run's reward: every_third_constant for "dynamic", fake_compute_rewards otherwise."""
    reward = every_third_constant if CURRENT.get("name") == "dynamic" else fake_compute_rewards
    return reward(prompts, completions, answers, **kwargs)


def faulty_step(real_step):
    def step(model, tokenizer, optimizer, rounds, settings, step, make_round, processes):
        attempt = distributed.restart_count()
        if processes.rank == 1 and CURRENT["name"] == "killed" and step == 3 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run; the launcher ends rank 0 and restarts both
        if processes.rank == 1 and CURRENT["name"] == "preempted" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption that reaches one rank first
        if processes.rank == 1 and CURRENT["name"] == "fail":
            (Path(CURRENT["out"]) / "raised_at.txt").write_text(repr(time.time()))
            raise RuntimeError("boom on purpose")
        GATHERS.append(dict(rounds_all_gathers=0, fsdp_units=len(distributed._fsdp_modules(model)), counting=True))
        metrics, scored = real_step(model, tokenizer, optimizer, rounds, settings, step, make_round, processes)
        GATHERS[-1].update(counting=False, generation_rounds=len(scored))   # every generation round's part
        return metrics, scored
    return step


def count_all_gathers():
    """FSDP's all-gathers from a step's start until its update fills the old log-probs: the rounds' share."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    real_gather, real_fill = _fsdp_param_group.foreach_all_gather, update.fill_logprobs

    def gather(*args, **kwargs):
        if GATHERS and GATHERS[-1]["counting"]:
            GATHERS[-1]["rounds_all_gathers"] += 1
        return real_gather(*args, **kwargs)

    def fill_logprobs(*args, **kwargs):
        GATHERS[-1]["counting"] = False
        return real_fill(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather, update.fill_logprobs = gather, fill_logprobs


def counted(real):
    def completion_logprobs(*args, **kwargs):
        PREFIX_CALLS.append(1)
        return real(*args, **kwargs)
    return completion_logprobs


def scenario(out, model_dir):
    names = ("full", "lora", "dynamic", "killed") if distributed.restart_count() == 0 else ("killed", "preempted",
                                                                                           "fail")
    for name in names:
        CURRENT.update(name=name, out=out)
        try:
            run.main(run_argv(model_dir, out, name))
        except Stopped:  # "preempted": every rank stops after the same step; the next scenario follows
            pass
        rank = os.environ["RANK"]
        (Path(out) / f"prefix_calls_{name}_rank{rank}.txt").write_text(str(len(PREFIX_CALLS)))
        (Path(out) / f"gathers_{name}_rank{rank}.json").write_text(json.dumps(GATHERS))
        PREFIX_CALLS.clear()
        GATHERS.clear()
    distributed.shutdown()


def rank_main(out, model_dir):
    # A forked rank inherits the launcher's signal handlers, which only raise once Python runs again: a rank
    # blocked in a collective would ignore the launcher's SIGTERM. Back to the defaults of a fresh process.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    distributed.run_main(scenario, out, model_dir)


def launch(out, model_dir):
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    torch.set_num_threads(1)
    rewards.compute_rewards = worker_rewards
    train.train_step = faulty_step(train.train_step)
    prefix.completion_logprobs = counted(prefix.completion_logprobs)
    count_all_gathers()
    import peft  # noqa: F401 (the imports a rank needs, done once before forking)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=1, start_method="fork")
    elastic_launch(config, rank_main)(str(out), str(model_dir))


if __name__ == "__main__":
    launch(Path(sys.argv[1]), Path(sys.argv[2]))
