"""Train an LLM with GRPO or GRPO-PODS (paper Algorithm 1, §3.1-3.2) on one device.

    python train.py                          # offline CPU demo: SmolLM2-135M learns addition, PODS 16/4
    python train.py --baseline               # its GRPO baseline (n = m = 4)
    python train.py --preset a [--baseline]  # paper setting (a): Qwen2.5-3B-Instruct on GSM8K, PODS 64/16

One step (`train_step`): n rollouts per prompt -> rewards -> keep m per prompt, advantages over the kept ones ->
clipped GRPO update -> the step's metrics line. The run around it (loop, flags, checkpoints): run/, docs/training.md;
several GPUs (settings (e), (f)): `torchrun ... -m multigpu`, the same loop through the seams of `OneProcess`.
Simplifications: a constant learning rate; rule-based rewards only; our own decode engine or HF generate (no vLLM).
"""

import os
import sys

from run import config  # the flags; importing it loads no torch
from run import threads

CPU_AT_START = threads.sample()  # the other work the imports below run beside: the thread count is chosen from it

if __name__ == "__main__":  # the flags parsed and checked before the imports below, which take seconds
    if "RANK" in os.environ:  # started by torchrun
        sys.exit("train.py: error: train.py runs one process; under torchrun run the multigpu package instead, "
                 "e.g. torchrun --nproc-per-node 8 -m multigpu --preset e")
    ARGS = config.parse_args_or_exit("train.py")

import contextlib
import math
from dataclasses import dataclass

import torch

import data
import eval as heldout
import models
import pods
import policy
import rewards
import sampling
import update
from run import checkpoint, loop
from run.report import PHASE_KEYS
from stopwatch import timed
from variants import dynamic_sampling

SELECTION_STREAM = 0x5E1EC7  # the random rule's seed stream (selection_seed)


class OneProcess:
    """The seams where a run on several processes (multigpu/: torchrun + FSDP2) differs; here each does nothing."""
    is_main = True  # the process that writes the run folder and prints

    def load_policy(self, args):
        """The policy the flags describe (multigpu: loaded on the CPU, then sharded with FSDP2)."""
        return models.load_policy(args.model, dtype=models.compute_dtypes(args.bf16, args.lora_rank)[0],
                                  device=args.device, **config.model_options(args))

    def rounds(self, make_round):
        """The round strategy of this process (multigpu: each process generates its share of the prompts)."""
        return make_round

    def counts(self, value):
        """Every process's value, in process order: the groups with a spread each holds (--dynamic-sampling)."""
        return [value]

    def eval_share(self, examples, chunk_prompts):
        """(this process's held-out examples, the index of its first chunk, prompts per chunk)."""
        return examples, 0, chunk_prompts

    def full_weights(self, model):
        """The block generates: a step's rounds, an evaluation (multigpu: the full weights gathered once for it)."""
        return contextlib.nullcontext()

    def total(self, value):
        """A number summed over processes: the loss normaliser and the loss (update.update_policy), stop signals."""
        return value

    def merged(self, record):
        """A step's (rounds, update metrics, costs), or an evaluation result, of every process as one."""
        return record

    def agree(self, value):
        """Process 0's value: the step time that the budget, evaluation and checkpoint decisions follow."""
        return value

    def save_checkpoint(self, run_dir, step, model, optimizer, state, run_config, keep_last):
        with models.quiet_loading():  # no "Writing model shards" bar at every checkpoint of full fine-tuning
            return checkpoint.save_checkpoint(run_dir, step, model, optimizer, state, run_config, keep_last)

    def load_checkpoint(self, path, model, optimizer):
        return checkpoint.load_checkpoint(path, model, optimizer)


ONE_PROCESS = OneProcess()


# ------------------------------------------------------------------------------------------ one step

@dataclass(frozen=True)
class StepSettings:
    """Everything a training step reads, built once per run from the flags (`step_settings`)."""
    seed: int
    num_rollouts: int                       # n
    generation: sampling.GenerationSettings
    rewards: rewards.RewardSettings
    select: pods.SelectSettings             # m, the rule, the advantages' normalisation
    update: update.UpdateSettings           # micro-batches, mu, the loss's options
    device: str = "cpu"


@dataclass
class Round:
    """One generation round: P prompts x n rollouts, filled in as the step goes (rewards, kept rows and advantages,
    sampler ratios); the metrics line and the completions log read it."""
    examples: list                  # [P] data.Example
    rollouts: sampling.Rollouts     # row i*n + j: rollout j of prompt i
    rewards: torch.Tensor           # [P, n] weighted total: what the selection rule sees
    per_func: dict                  # reward term -> [P*n] (NaN: not applicable)
    grader_timeouts: torch.Tensor | None  # [P*n] bool: accuracy scored 0, its comparison timed out twice
    first_chunk: int = 0            # this process's first generation chunk (its rollouts' seeds)
    kept_rows: torch.Tensor = None  # [R] rows trained on
    advantages: torch.Tensor = None  # [P*n] the advantage the loss used (NaN: not kept)
    zero_variance_dropped: int = 0  # prompts left out by --drop-zero-variance
    sampler_ratios: torch.Tensor = None  # [P*n] a kept row's mean pi / pi_sampler over its tokens (NaN: not kept)
    logged_columns: list = None     # [P*n] {column: value} the reward functions gave log_extra
    logged_metrics: list = None     # (function, name, value) the reward functions gave log_metric
    marks: dict = None              # name -> [P] bool, on each prompt's row of the completions log (--dynamic-sampling)

    def __post_init__(self):
        num_prompts, n = self.rewards.shape
        self.kept_rows = torch.zeros(0, dtype=torch.long) if self.kept_rows is None else self.kept_rows
        if self.grader_timeouts is None:  # a reward function of no answer comparison
            self.grader_timeouts = torch.zeros(num_prompts * n, dtype=torch.bool)
        for name in ("advantages", "sampler_ratios"):
            if getattr(self, name) is None:
                setattr(self, name, torch.full((num_prompts * n,), math.nan))
        self.logged_columns = self.logged_columns or [{} for _ in range(num_prompts * n)]
        self.logged_metrics, self.marks = self.logged_metrics or [], self.marks or {}

    @property
    def prompts(self):
        return [e.text for e in self.examples]

    @property
    def answers(self):
        return [e.answer for e in self.examples]

    @property
    def lengths(self):  # [P*n] completion tokens
        return self.rollouts.lengths

    @property
    def truncated(self):  # [P*n] bool: no EOS within the budget
        return self.rollouts.truncated

    @property
    def texts(self):  # [P*n] completions
        return self.rollouts.texts

    @property
    def prompt_tokens(self):  # tokens of the P prompts, x n (each rollout re-reads its prompt)
        return int(self.rollouts.prompt_mask.sum()) * self.rewards.shape[1]

    @property
    def backends(self):  # the backend that generated the rollouts (none: no prompt)
        return [self.rollouts.backend] if self.examples else []

    @property
    def parts(self):
        """The generation rounds this round is made of: itself."""
        return [self]

    def keep(self, kept, advantages, zero_variance_dropped=0):
        """Record pods.select's choice: kept [P, m] indices, a [P, n] mask or a row list [R], advantages one per kept
        rollout ([P, m] or [R]), or [P, n] read at the mask."""
        self.kept_rows = update.kept_rows(kept, self.rewards.shape[1])
        kept_advantages = advantages[kept] if kept.dtype == torch.bool else advantages
        self.advantages[self.kept_rows] = kept_advantages.flatten().float().cpu()
        self.zero_variance_dropped = zero_variance_dropped

    def update_batch(self):
        """The kept rollouts as an update.UpdateBatch."""
        return update.kept_batch(self.rollouts, self.kept_rows, self.advantages[self.kept_rows])

    def record_sampler_ratios(self, ratios):
        """The update's [R] mean pi / pi_sampler of each kept row, for the completions log."""
        self.sampler_ratios[self.kept_rows] = ratios


def rollout_round(model, tokenizer, examples, settings, seed, costs, sizes=None, first_chunk=0):
    """n rollouts per prompt of `examples`, scored, as a Round (sizes: each process's share, multigpu; unused here)."""
    with timed(costs, "generate_s"):
        rollouts = sampling.generate_rollouts(model, tokenizer, [e.text for e in examples], settings.num_rollouts,
                                              settings.generation, seed, first_chunk)
    with timed(costs, "reward_s"):  # accuracy, format and tag count, weighted (paper Appendix A.1)
        return scored_round(examples, rollouts, settings, first_chunk)


def scored_round(examples, rollouts, settings, first_chunk=0):
    """The Round of `rollouts` (n per prompt of `examples`) with their rewards."""
    scores = rewards.score_rollouts(rollouts, examples, settings.rewards)
    logged_columns = [{column: values[row] for column, values in scores.logged_columns.items()}
                      for row in range(len(rollouts.texts))]
    return Round(examples, rollouts, scores.total.view(len(examples), settings.num_rollouts), scores.per_func,
                 scores.grader_timeouts, first_chunk, logged_columns=logged_columns,
                 logged_metrics=scores.logged_metrics)


def train_step(model, tokenizer, optimizer, rounds, settings, step, make_round=rollout_round, processes=ONE_PROCESS):
    """One training step on `rounds`: G lists of data.Example (G = --grad-accum-steps, usually 1), each generated,
    scored and down-sampled, then one update (mu optimizer steps) on every kept rollout -> (the step's metrics, its
    Rounds). settings: a StepSettings. make_round: the round strategy (`rollout_round`; --dynamic-sampling and
    several processes wrap it: `round_strategy`). The update checks the sampler's log-probs before its optimizer
    step: off-policy engine rollouts are not trained on, and generation switches to HF (policy.py's sampler check)."""
    costs, made = dict.fromkeys(PHASE_KEYS, 0.0), []
    with processes.full_weights(model):  # several processes: the weights gathered once for all the step's rounds
        for index, examples in enumerate(rounds):
            seed = sampling.derived_seed(settings.seed, step, index)  # a resumed step draws what it drew before
            round_ = make_round(model, tokenizer, examples, settings, seed, costs)  # n rollouts per prompt, scored
            with timed(costs, "select_s"):  # PODS: keep m of n, advantages over the kept subset (§3.2)
                generator = torch.Generator().manual_seed(selection_seed(seed, round_.first_chunk))
                round_.keep(*pods.select(round_.rewards, **vars(settings.select), generator=generator))
            made.append(round_)
    with timed(costs, "update_s"):  # the clipped GRPO loss, mu optimizer steps
        batches = [round_.update_batch() for round_ in made]
        update.fill_logprobs(model, batches, settings.update)
        result = update.update_policy(model, optimizer, batches, settings.update, sum_over_processes=processes.total,
                                      max_sampler_gap=policy.LOGPROB_GAP_LIMIT)
    for round_, ratios in zip(made, result.sampler_ratios or []):  # for the completions log
        round_.record_sampler_ratios(ratios)
    costs["peak_mem_gib"] = update.peak_memory_gib(settings.device)
    scored, result, costs = processes.merged(([part for round_ in made for part in round_.parts], result, costs))
    metrics = step_metrics(scored, result, optimizer, costs, settings.update.loss.mask_truncated)
    # Did the rollouts come from the policy? The update's log-probs against the sampler's: else fall back to HF.
    metrics.update(sampling.after_step(model, result, scored, settings.generation.backend, f"step {step}"))
    return metrics, scored


# ------------------------------------------------------------------------------------------ the step's metrics line
# Paper §4's curves under TRL's names, plus this trainer's counters and the phases' timings (written by run/report.py).

def step_metrics(scored, result, optimizer, costs, mask_truncated=False):
    """Metrics over all n rollouts per prompt of every Round; "reward_selected" over the kept ones
    (absent when nothing was kept); num_truncated_masked: kept rows whose loss --mask-truncated zeroed."""
    rewards_all = torch.cat([s.rewards for s in scored])
    kept_rewards = torch.cat([s.rewards.flatten()[s.kept_rows] for s in scored])
    lengths = torch.cat([s.lengths for s in scored]).float()
    group_std = rewards_all.std(dim=1) if rewards_all.shape[1] > 1 else torch.zeros(len(rewards_all))  # -n 1: 0
    kept_std = [rewards.std() for s in scored for rewards in kept_groups(s) if len(rewards) > 1]
    metrics = {"reward": float(rewards_all.mean()), "reward_std": float(group_std.mean()),
               "reward_min": float(rewards_all.min()), "reward_max": float(rewards_all.max()),
               **({"reward_selected": float(kept_rewards.mean())} if len(kept_rewards) else {}),
               # what max-variance maximises: the spread of the kept rewards within each prompt
               **({"reward_std_selected": float(torch.stack(kept_std).mean())} if kept_std else {}),
               # all n rewards equal (a group of one rollout too, whose std is NaN)
               "frac_reward_zero_std": float((rewards_all.amax(dim=1) == rewards_all.amin(dim=1)).float().mean())}
    for name in scored[0].per_func:
        metrics[f"rewards/{name}/mean"] = float(torch.cat([s.per_func[name] for s in scored]).nanmean())
    metrics["rewards/grader_timeouts"] = sum(int(s.grader_timeouts.sum()) for s in scored)  # accuracy 0, unverified
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio":
                    float(torch.cat([s.truncated for s in scored]).float().mean())})
    metrics.update(result.token_means)
    if result.sampler_gap is not None:  # the sampler's log-probs against the update's (policy.py's sampler check)
        metrics.update(result.sampler_gap.metrics())
    step_tokens = sum(s.prompt_tokens + int(s.lengths.sum()) for s in scored)
    masked = sum(int(s.truncated[s.kept_rows].sum()) for s in scored) if mask_truncated else 0
    metrics.update(loss=result.loss, grad_norm=result.grad_norm, learning_rate=optimizer.param_groups[0]["lr"],
                   step_tokens=step_tokens, update_rows=result.rows, optimizer_steps=result.optimizer_steps,
                   num_zero_variance_dropped=sum(s.zero_variance_dropped for s in scored), num_truncated_masked=masked,
                   step_skipped=result.skipped_steps, **costs)
    metrics.update(logged_metrics(scored, metrics))
    return metrics


def logged_metrics(scored, metrics):
    """{name: mean of the step's values} of what the reward functions gave log_metric (as TRL); ValueError for a name
    the step's line has already."""
    values = {}
    for function, name, value in (entry for s in scored for entry in s.logged_metrics):
        if name in metrics:
            raise ValueError(f"reward function {function!r} logged {name!r} with log_metric, a name the step's metrics "
                             "line has already: log it under another name")
        values.setdefault(name, []).append(value)
    return {name: sum(logged) / len(logged) for name, logged in values.items()}


def kept_groups(scored_round):
    """[each prompt's kept rewards] of a Round (prompts with none kept: empty)."""
    num_prompts, n = scored_round.rewards.shape
    kept = scored_round.kept_rows
    return [scored_round.rewards.flatten()[kept[kept // n == i]] for i in range(num_prompts)]


def selection_seed(batch_seed, first_chunk):
    """The seed of the random rule's generator for a rollout batch: apart from every generation chunk's stream, yet
    fixed by the batch (a resumed step redraws the same subset)."""
    return sampling.derived_seed(batch_seed, SELECTION_STREAM, first_chunk)


def step_settings(args):
    """The StepSettings of the flags, built once per run."""
    return StepSettings(
        seed=args.seed, num_rollouts=args.num_rollouts, generation=config.generation_settings(args),
        rewards=config.reward_settings(args),
        select=pods.SelectSettings(args.update_size, args.rule, args.advantage_normalization, args.scale_rewards,
                                   args.selection_scope, args.drop_zero_variance),
        update=config.update_settings(args), device=args.device)


def round_strategy(args, processes=ONE_PROCESS, draw=None, say=None):
    """The loop's round strategy, chosen once: `rollout_round` (each process's share of it), refilled with
    --dynamic-sampling by `draw(count)` until enough groups have a spread (say(line): a note above the progress bar)."""
    make_round = processes.rounds(rollout_round)
    if not args.dynamic_sampling:
        return make_round
    return dynamic_sampling.refilling(make_round, draw, args.dynamic_sampling_metric, args.max_generation_rounds,
                                      processes.counts, say)


# ------------------------------------------------------------------------------------------ the run

def train(args, processes=ONE_PROCESS):
    """The run of `args` (config.parse_args): run/loop.py's loop around `train_step`; returns the run folder."""
    return loop.train(args, processes, train_step=train_step, step_settings=step_settings,
                      round_strategy=round_strategy, evaluate=heldout.evaluate, cpu_at_start=CPU_AT_START)


def main(argv=None):
    return train(config.parse_args(argv))


if __name__ == "__main__":
    try:
        train(ARGS)
    except (ValueError, OSError, update.TrainingError, data.HubUnavailable,
            sampling.SamplerError) as error:  # one line (OSError: the disk)
        sys.exit(f"train.py: error: {error}")
