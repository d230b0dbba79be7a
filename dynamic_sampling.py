"""Prompt filtering beside PODS's down-sampling: DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", §3.2), which the PODS paper places beside its own method: filtering selects
prompts, down-sampling selects rollouts within a prompt, and the two combine.

A group (one prompt's n rollouts) whose rewards are all equal has a zero advantage under every subset, so it adds no
policy gradient; late in training, when most prompts are solved, a step may hold few groups with a spread, or none.
With `--dynamic-sampling` a training step scores a generation round, sets such groups aside, draws as many more
prompts as groups are missing from the seeded prompt order and generates again, until the rollout batch holds
--prompts-per-step groups with a spread or --max-generation-rounds rounds were generated; it then trains on what it
has. The rule keeps m rollouts of each group that entered: pods.select runs once over all of them, so
--selection-scope batch and --scale-rewards batch see exactly the groups that entered.

- `Generated`: one generation round (its prompts, rollouts, rewards, and which groups were set aside).
- `without_spread`: the groups whose metric is equal for all n rollouts (the weighted total by default, or accuracy).
- `refill`: the generation rounds of one rollout batch.
- `entered_rewards` / `kept_batches`: what the selection sees, and its result mapped back onto each round's rows.
- `step_metrics`: groups generated, fraction set aside, generation rounds, groups missing.

Simplifications: a refill draws only the missing number of prompts (verl generates whole batches and drops the
surplus with a spread), and a step whose rounds ran out trains on fewer groups (verl stops with an error). One process
only: with several, each would hold a different number of groups (multigpu.run.check_args refuses it).
"""

from dataclasses import dataclass

import torch

import pods
import sampling
import update

METRICS = ("total", "accuracy")  # --dynamic-sampling-metric


@dataclass
class Generated:
    """One generation round of a rollout batch: P prompts x n rollouts, scored."""
    examples: list                  # [P] data.Example
    rollouts: sampling.Rollouts
    rewards: torch.Tensor           # [P, n] weighted total
    per_func: dict                  # reward function -> [P*n] (NaN: not applicable)
    first_chunk: int                # this process's first generation chunk (its rollouts' seeds)
    filtered: torch.Tensor = None   # [P] bool: set aside by `refill` (no spread); None: none

    def __post_init__(self):
        if self.filtered is None:
            self.filtered = torch.zeros(self.rewards.shape[0], dtype=torch.bool)


def without_spread(rewards, per_func, metric="total"):
    """Bool [P]: the groups whose `metric` is the same for all n rollouts (rewards: [P, n] weighted totals; per_func:
    name -> [P*n]). "total": exactly the groups with zero advantages under any subset; "accuracy" (DAPO's): also the
    groups whose rollouts differ in format only. A NaN accuracy (not applicable) counts as 0, as in the total."""
    if metric not in METRICS:
        raise ValueError(f"dynamic sampling metric must be one of {METRICS}, got {metric!r}")
    values = rewards
    if metric == "accuracy":
        if "accuracy" not in per_func:
            raise ValueError("--dynamic-sampling-metric accuracy needs the accuracy reward function")
        values = torch.nan_to_num(per_func["accuracy"].float(), nan=0.0).view(rewards.shape)
    return pods.zero_variance_prompts(values)


def entered(rounds):
    """The number of groups with a spread in `rounds`."""
    return sum(int((~part.filtered).sum()) for part in rounds)


def refill(first, generate, wanted, metric="total", max_rounds=1):
    """The generation rounds of one rollout batch: `first`, then `generate(count, index)` (round index 1, 2, ...:
    `count` more prompts from the prompt order, generated and scored) while fewer than `wanted` groups have a spread
    and fewer than `max_rounds` rounds were generated. Each round's `filtered` marks its groups without a spread."""
    rounds = [first]
    first.filtered = without_spread(first.rewards, first.per_func, metric)
    while entered(rounds) < wanted and len(rounds) < max_rounds:
        part = generate(wanted - entered(rounds), len(rounds))
        part.filtered = without_spread(part.rewards, part.per_func, metric)
        rounds.append(part)
    return rounds


def entered_rewards(rounds):
    """[P', n]: the rewards of the groups that entered, in draw order: what the selection rule sees."""
    return torch.cat([part.rewards[~part.filtered] for part in rounds])


def kept_batches(rounds, kept, advantages):
    """pods.select's (kept, advantages) over `entered_rewards(rounds)` mapped back onto each round: [(its
    update.UpdateBatch, its kept rows in sampling.Rollouts order)]. A round none of whose groups entered gives an
    empty batch; with one round and nothing set aside this is update.kept_batch(rollouts, kept, advantages)."""
    batches, start = [], 0
    for part in rounds:
        groups = (~part.filtered).nonzero().squeeze(1)
        n = part.rewards.shape[1]
        part_kept, part_advantages = kept[start:start + len(groups)], advantages[start:start + len(groups)]
        start += len(groups)
        rows = update.kept_rows(part_kept, n)  # rows of the entered groups only: group g is groups[g] here
        rows = groups[rows // n] * n + rows % n
        if part_kept.dtype == torch.bool:
            part_advantages = part_advantages[part_kept]
        batches.append((update.kept_batch(part.rollouts, rows, part_advantages.flatten()), rows))
    return batches


def step_metrics(scored, wanted):
    """A step's counters from its report.ScoredRounds (every generation round of every rollout batch); wanted:
    --prompts-per-step x --grad-accum-steps groups."""
    generated = sum(len(part.filtered) for part in scored)
    filtered = sum(int(part.filtered.sum()) for part in scored)
    return {"dynamic_sampling/groups_generated": generated, "dynamic_sampling/frac_filtered": filtered / generated,
            "dynamic_sampling/generation_rounds": len(scored),
            "dynamic_sampling/groups_missing": wanted - (generated - filtered)}
