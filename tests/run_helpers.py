"""What the tests that run train.py on a tiny model share: a reward that varies between texts, the argv of a tiny
run, reading its metrics. (The model folder and the reward patch are fixtures in conftest.py.)"""

import json
from pathlib import Path

import torch

from run import report
import rewards

ROOT = Path(__file__).resolve().parents[1]
TIMING = set(report.TIMING_KEYS) | {"eval/eval_s"}  # the metrics that differ between two runs of the same steps


def fake_compute_rewards(prompts, completions, answers, **kwargs):
    """A reward that varies between any two different texts, so a random-weight model gets non-zero
    advantages (real rewards would all be 0 for its gibberish)."""
    values = torch.tensor([float(sum(map(ord, text)) % 101) / 100 for text in completions])
    return rewards.RewardResult(total=values, per_func={"char_sum": values})


def every_third_constant(prompts, completions, answers, **kwargs):
    """fake_compute_rewards, but every rollout of a prompt whose answer is a multiple of 3 gets 0.5: a group without a
    spread, which --dynamic-sampling sets aside (arithmetic answers are integers)."""
    result = fake_compute_rewards(prompts, completions, answers)
    total = torch.where(torch.tensor([int(a) % 3 == 0 for a in answers], dtype=torch.bool), 0.5, result.total)
    return rewards.RewardResult(total=total, per_func={"char_sum": total})


def tiny_argv(model_dir, out_dir, *extra):
    """A 2-step PODS 4/2 run of the tiny model on 2 prompts per step, a checkpoint after every step; float32 whatever
    the CPU (--no-bf16: a subprocess does not see conftest's float32_demo)."""
    return ["--model", str(model_dir), "--dataset", "arithmetic", "--num-train-rows", "64", "--num-rollouts", "4",
            "--update-size", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8", "--max-steps", "2",
            "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2", "--micro-batch-size", "2",
            "--eval-samples", "2", "--eval-interval", "2", "--checkpoint-interval-s", "0", "--no-progress",
            "--num-threads", "1", "--no-bf16", "--output-dir", str(out_dir), *extra]


def read_lines(run_dir, kind):
    """The metrics.jsonl lines of one type ("train" or "eval")."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["type"] == kind]
