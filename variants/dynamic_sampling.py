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

train.py plugs it in once, as its round strategy (`refilling`, chosen by train.round_strategy): the step then gets a
`Refilled` rollout batch where it would get one train.Round, read the same way (rewards, keep, update_batch,
record_sampler_ratios, parts, first_chunk), so the step itself has no --dynamic-sampling branch.
- `without_spread`: the groups whose metric is equal for all n rollouts (the weighted total by default, or accuracy).
- `refill`: the generation rounds of one rollout batch, each a train.Round whose `marks` it sets (`filtered`,
  `set_aside`: this module's own, written on each prompt's row of the completions log); with several processes each
  refills its own share and every process decides from every process's count (train.OneProcess.counts), so all
  agree on the rounds.
- `Refilled`: what the selection sees (the groups that entered, in draw order), its result mapped back onto each
  round's rows, and those rows as one update batch (`join`).
- `step_metrics`: groups generated, fraction without a spread, fraction set aside to even out the processes'
  rows, generation rounds, groups missing.

Simplifications: a refill draws only the missing number of prompts (verl generates whole batches and drops the
surplus with a spread), and a step whose rounds ran out trains on fewer groups (verl stops with an error); with
several processes, then on as many per process as the one with the fewest holds (`even_out`).
"""

from dataclasses import dataclass

import torch

import pods
import sampling
import update

METRICS = ("total", "accuracy")  # --dynamic-sampling-metric
ROUNDS_BETWEEN_NOTES = 10  # a rollout batch still short of groups with a spread says so every this many rounds


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


def groups_entered(part):
    """[P] bool: the groups of `part` (a marked train.Round) that enter the selection: with a spread, not set aside."""
    return ~(part.marks["filtered"] | part.marks["set_aside"])


def entered(rounds):
    """The number of groups of `rounds` that entered the selection."""
    return sum(int(groups_entered(part).sum()) for part in rounds)


def refill(first, generate, wanted, metric="total", max_rounds=1, counts=lambda value: [value], say=None):
    """The generation rounds of one rollout batch: `first`, then `generate(missing, index)` while some process holds
    fewer than `wanted` groups with a spread and fewer than `max_rounds` rounds were generated. missing: the groups
    each process lacks, in process order (one process: [P - groups with a spread]); round `index` (1, 2, ...) draws
    sum(missing) prompts from the prompt order and this process generates and scores its missing ones. counts(value):
    every process's value (one process: [value]). Each round's `filtered` marks its groups without a spread; when the
    rounds run out, `even_out` marks `set_aside` the groups with a spread beyond what the poorest process holds.
    say(line): told every ROUNDS_BETWEEN_NOTES rounds that the batch is still short (None: silent)."""
    rounds = [mark(first, metric)]
    while True:
        have = counts(entered(rounds))  # every process decides alike from every process's count
        missing = [max(wanted - count, 0) for count in have]
        if not any(missing) or len(rounds) >= max_rounds:
            break
        if say is not None and len(rounds) % ROUNDS_BETWEEN_NOTES == 0:
            say(f"dynamic sampling: {len(rounds)} generation rounds so far and {sum(have)} of {len(have) * wanted} "
                f"groups with a spread; at most {max_rounds} rounds (--max-generation-rounds), then the step trains "
                "on what it has")
        rounds.append(mark(generate(missing, len(rounds)), metric))
    even_out(rounds, min(have))
    return rounds


def mark(part, metric):
    """`part` (a train.Round) with its groups without a spread marked `filtered`, none yet `set_aside` (its `marks`:
    what the completions log writes on each prompt's row)."""
    filtered = without_spread(part.rewards, part.per_func, metric)
    part.marks = {"filtered": filtered, "set_aside": torch.zeros_like(filtered)}
    return part


def even_out(rounds, limit):
    """Mark `set_aside` the groups with a spread after the first `limit` (in draw order): several processes must train
    on as many rows each (their updates run the same collectives); one process: limit = what it has, nothing changes.
    They have a spread: they are not `filtered`, and are counted apart (`step_metrics`)."""
    for part in rounds:
        groups = groups_entered(part).nonzero().squeeze(1)
        part.marks["set_aside"][groups[limit:]] = True
        limit = max(limit - len(groups), 0)


def no_rollouts():
    """The sampling.Rollouts of no prompt: a process's share of a refill that only other processes needed."""
    empty = torch.zeros(0, 0, dtype=torch.long)
    return sampling.Rollouts(empty, empty, empty, empty, [], torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long))


def refilling(make_round, draw, metric="total", max_rounds=1, counts=lambda value: [value], say=None):
    """The round strategy of --dynamic-sampling: make_round (train.rollout_round, or each process's share of it), then
    `refill` with draw(count), the next `count` examples of the prompt order -> a Refilled rollout batch."""
    def refilled_round(model, tokenizer, examples, settings, seed, costs):
        def more(missing, index):  # `missing`: the groups each process still lacks
            return make_round(model, tokenizer, draw(sum(missing)), settings, sampling.derived_seed(seed, index),
                              costs, sizes=missing)
        first = make_round(model, tokenizer, examples, settings, seed, costs)
        return Refilled(refill(first, more, len(first.examples), metric, max_rounds, counts, say),
                        tokenizer.pad_token_id or 0)
    return refilled_round


@dataclass
class Refilled:
    """A rollout batch of several generation rounds (train.Round each), which the step treats as one round."""
    parts: list
    pad_id: int = 0

    @property
    def first_chunk(self):
        return self.parts[0].first_chunk

    @property
    def rewards(self):
        """[P', n]: the rewards of the groups that entered, in draw order: what the selection rule sees."""
        return torch.cat([part.rewards[groups_entered(part)] for part in self.parts])

    def keep(self, kept, advantages, zero_variance_dropped=0):
        """pods.select's (kept, advantages) over `rewards` mapped back onto each round's rows."""
        start = 0
        for part in self.parts:
            groups = groups_entered(part).nonzero().squeeze(1)
            mine, mine_advantages = kept[start:start + len(groups)], advantages[start:start + len(groups)]
            n = part.rewards.shape[1]
            rows = update.kept_rows(mine, n)  # rows of the entered groups: group g is groups[g] of this round
            part.keep(groups[rows // n] * n + rows % n,
                      mine_advantages[mine] if mine.dtype == torch.bool else mine_advantages, zero_variance_dropped)
            start, zero_variance_dropped = start + len(groups), 0  # counted once per rollout batch

    def update_batch(self):
        return join([part.update_batch() for part in self.parts], self.pad_id)

    def record_sampler_ratios(self, ratios):
        for part, part_ratios in zip(self.parts, ratios.split([len(part.kept_rows) for part in self.parts])):
            part.record_sampler_ratios(part_ratios)


def join(batches, pad_id):
    """One update.UpdateBatch of a rollout batch's rounds (prompts padded on the left, completions on the right, as
    generated): every process then runs as many micro-batches as the others."""
    if len(batches) == 1:
        return batches[0]
    prompt_width = max(batch.prompt_ids.shape[1] for batch in batches)
    completion_width = max(batch.completion_ids.shape[1] for batch in batches)

    def padded(tensors, width, value, left):
        return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                                  value=value) for t in tensors])

    # The sampler's log-probs (checked every step): a round without rows may lack them (another process's refill).
    sampler = [b.sampler_logprobs if b.sampler_logprobs is not None or len(b.advantages) else
               torch.zeros(0, completion_width) for b in batches]
    return update.UpdateBatch(padded([b.prompt_ids for b in batches], prompt_width, pad_id, True),
                              padded([b.prompt_mask for b in batches], prompt_width, 0, True),
                              padded([b.completion_ids for b in batches], completion_width, pad_id, False),
                              padded([b.completion_mask for b in batches], completion_width, 0, False),
                              torch.cat([b.advantages for b in batches]), torch.cat([b.truncated for b in batches]),
                              sampler_logprobs=None if any(s is None for s in sampler) else
                              padded(sampler, completion_width, 0.0, False),
                              engine_made=any(b.engine_made for b in batches))


def step_metrics(scored, wanted):
    """A step's counters from its train.Rounds (every generation round of every rollout batch); wanted:
    --prompts-per-step x --grad-accum-steps groups. frac_filtered: groups without a spread; frac_set_aside: groups
    with a spread left out so that every process trains on as many rows (several processes, rounds out)."""
    generated = sum(len(part.rewards) for part in scored)
    filtered = sum(int(part.marks["filtered"].sum()) for part in scored)
    set_aside = sum(int(part.marks["set_aside"].sum()) for part in scored)
    return {"dynamic_sampling/groups_generated": generated, "dynamic_sampling/frac_filtered": filtered / generated,
            "dynamic_sampling/frac_set_aside": set_aside / generated,
            "dynamic_sampling/generation_rounds": len(scored),
            "dynamic_sampling/groups_missing": wanted - (generated - filtered - set_aside)}
