"""Reward functions in each signature TRL's GRPOTrainer documentation gives one ("Using a custom reward function",
examples 1-6, and `trainer_state`), written for a dataset of chat prompts with the columns `solution` and `task`: as a
user writes them for TRL, with nothing of pods in them. test_trl_rewards.py runs each, unchanged, through train.py,
eval.py's reward report, the TRL demo and PODSGRPOTrainer, and checks its rewards against TRL's own call.

TRL passes a chat prompt's completion as a list holding one assistant message, so a body reads
`completion[0]["content"]`; the `*_text` functions at the end are for plain-text prompts (TRL's standard format),
where a completion is its text."""

import asyncio
import re

CHAT = ("token_count", "reply_length", "think_then_answer", "states_solution", "sums_only", "replied",
        "solution_logged", "later_counts_more")


def token_count(completion_ids, **kwargs):
    """Example 1: longer completions score more, counted in tokens."""
    return [float(len(ids)) for ids in completion_ids]


def reply_length(completions, **kwargs):
    """Example 1.1: the same, counted in characters of the reply."""
    return [float(len(completion[0]["content"])) for completion in completions]


def think_then_answer(completions, **kwargs):
    """Example 2: 1 for a reply that reasons in <think> and then answers in <answer>."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    return [1.0 if re.match(pattern, completion[0]["content"].strip(), re.DOTALL) else 0.0 for completion in completions]


def states_solution(completions, solution, **kwargs):
    """Example 3: a dataset column by its name; 1 when the last number of the reply is the solution."""
    rewards = []
    for completion, expected in zip(completions, solution):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return rewards


def sums_only(prompts, completions, task, **kwargs):
    """Example 4: a function for one task of a mixed dataset; None (not applicable) for the rows of another task."""
    return [(1.0 if re.search(r"\d", completion[0]["content"]) else -1.0) if kind == "sums" else None
            for completion, kind in zip(completions, task)]


async def replied(prompts, completions, **kwargs):
    """Example 5: an async function (as one waiting on a remote service would be)."""
    await asyncio.sleep(0.001)
    return [1.0 if completion[0]["content"].strip() else 0.0 for completion in completions]


def solution_logged(completions, solution, log_extra=None, log_metric=None, **kwargs):
    """Example 6: columns for the completions table and a metric beside the trainer's, then the rewards."""
    found = [re.findall(r"-?\d+", completion[0]["content"]) for completion in completions]
    last = [numbers[-1] if numbers else None for numbers in found]
    rewards = [1.0 if value == str(expected) else 0.0 for value, expected in zip(last, solution)]
    if log_extra:
        log_extra("expected", [str(expected) for expected in solution])
        log_extra("last_number", [value or "[none]" for value in last])
    if log_metric:
        log_metric("solution_rate", sum(rewards) / len(rewards))
    return rewards


def later_counts_more(completions, trainer_state, **kwargs):
    """trainer_state (a transformers.TrainerState): a reward that grows with the training done, a curriculum."""
    progress = (trainer_state.global_step + 1) / (trainer_state.max_steps + 1) + trainer_state.epoch
    return [progress * min(len(completion[0]["content"]), 10) for completion in completions]


def reply_length_text(completions, **kwargs):
    """Example 1.1 for plain-text prompts (TRL's standard format): a completion is its text."""
    return [float(len(completion)) for completion in completions]


def boxed_solution_text(completions, solution, **kwargs):
    """Example 3 for plain-text prompts: the content of \\boxed{} against the column."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    return [1.0 if match and match.group(1) == expected else 0.0 for match, expected in zip(matches, solution)]
