"""train.py's loop on several processes: the seams of train.OneProcess filled in for torchrun + FSDP2.

`torchrun --nproc-per-node W -m multigpu [train.py flags]` runs `main`: the flags are parsed and checked as in
train.py (plus what W processes need, `check_args`), the process group is joined, and train.train runs with
`Processes`, which differs from one process at these seams only:
- load_policy: each rank loads the policy on the CPU and FSDP2 shards it (distributed.shard_model);
- rounds: the round strategy's share: each rank takes P / W prompts of every rollout batch, with the generation
  seeds one process would use; counts: every rank's count of groups with a spread, from which all decide a
  --dynamic-sampling refill alike;
- full_weights: a step's rounds (every --grad-accum-steps round and --dynamic-sampling refill) and an evaluation
  generate on weights gathered once (no collective while ranks decode different lengths);
- total: the loss normaliser and the loss are summed over ranks (FSDP sums gradients), so the update is the
  global batch's, and a non-finite loss on any rank skips the step on every rank;
- merged: the step's metrics of every rank joined in rank order (the single-process order), evaluations pooled;
- agree: rank 0's step time, so stop, evaluation and checkpoint decisions are taken alike;
- save/load_checkpoint: sharded checkpoints (sharded_checkpoint.py), resumed exactly with as many processes.
"""

import dataclasses

import torch

import eval as heldout
import models
import policy
import train
from multigpu import distributed, sharded_checkpoint
from run import config
from variants import dynamic_sampling


class Processes(train.OneProcess):
    """This rank's view of the run (ctx: distributed.DistContext)."""

    def __init__(self, ctx):
        self.ctx, self.rank, self.world_size, self.is_main = ctx, ctx.rank, ctx.world_size, ctx.is_main

    def load_policy(self, args):
        # On the CPU (bf16 with --bf16): shard_model makes fp32 masters layer by layer, so the whole fp32 model is
        # never on the host at once (7B: 28 GB per rank).
        model = models.load_policy(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32, device="cpu",
                                   **config.model_options(args))
        return distributed.shard_model(model, self.ctx, mixed_precision=args.bf16)

    def rounds(self, make_round):
        def this_rank_round(model, tokenizer, examples, settings, seed, costs, sizes=None):
            mine, first_chunk = self.share(examples, settings.num_rollouts, settings.generation.rollout_batch_size,
                                           sizes)
            if mine:  # on weights train_step gathered once for all its rounds (full_weights)
                return make_round(model, tokenizer, mine, settings, seed, costs, first_chunk=first_chunk)
            # A --dynamic-sampling refill only other ranks needed: no rollouts, every reward term's column.
            return train.scored_round([], dynamic_sampling.no_rollouts(), settings, first_chunk)
        return this_rank_round

    def share(self, examples, rows_per_example, chunk_rows, sizes=None):
        # Equal shares (every rank runs the same passes, hence the same FSDP collectives). With chunk_rows dividing
        # a rank's rows, every rollout gets the chunk seed and row of the single-process run; otherwise the ranks'
        # chunk indices still never overlap (independent draws). sizes: a --dynamic-sampling refill, in which each
        # rank generates the groups it lacks (generation runs no collective), in rank order.
        if sizes is None:
            mine = distributed.rank_slice(examples, self.rank, self.world_size)
            return mine, self.rank * -(-len(mine) * rows_per_example // chunk_rows)
        start = sum(sizes[:self.rank])
        return examples[start:start + sizes[self.rank]], sum(-(-size * rows_per_example // chunk_rows)
                                                             for size in sizes[:self.rank])

    def counts(self, value):
        return distributed.all_gather(value)

    def eval_share(self, examples, chunk_prompts):
        # Whole chunks per rank, chunks small enough that every rank gets one; eval.py seeds chunk c with seed + c,
        # so a prompt's seed does not depend on the number of processes.
        size = max(1, min(chunk_prompts, -(-len(examples) // self.world_size)))
        chunks = distributed.rank_slice(range(-(-len(examples) // size)), self.rank, self.world_size, even=False)
        return examples[chunks[0] * size:(chunks[-1] + 1) * size], chunks[0], size

    def full_weights(self, model):
        return distributed.full_weights_for_generation(model)

    def total(self, value):
        return distributed.global_count(value)

    def merged(self, record):
        if isinstance(record, heldout.EvalResult):
            pooled = distributed.pooled_over_ranks(dataclasses.asdict(record), "num_samples", max_keys=("elapsed_s",),
                                                   sum_keys=("grader_timeouts",))
            return heldout.EvalResult(**pooled)
        return merge_ranks(distributed.all_gather(record))

    def agree(self, value):
        return distributed.agree(value)

    def save_checkpoint(self, run_dir, step, model, optimizer, state, run_config, keep_last):
        return sharded_checkpoint.save_sharded_checkpoint(run_dir, step, model, optimizer, state, run_config,
                                                          self.ctx, keep_last)

    def load_checkpoint(self, path, model, optimizer):
        return sharded_checkpoint.load_sharded_checkpoint(path, model, optimizer, self.ctx)


def merge_ranks(gathered):
    """[(rounds, update.UpdateMetrics, costs)] of every rank -> the same of the global batch: round g joins every
    rank's round g (tensors and lists concatenated, kept rows re-indexed, counts summed), rows summed, token means
    token-weighted, sampler gaps summed (policy.total), costs (timings, peak memory) the largest rank's. The
    loss (update_policy sums it over ranks), the gradient norm and the step counts are global already."""
    if len(gathered) == 1:
        return gathered[0]
    rounds = [merge_rounds(parts) for parts in zip(*(rank_rounds for rank_rounds, _, _ in gathered))]
    results = [result for _, result, _ in gathered]
    tokens = sum(r.tokens for r in results)
    keys = sorted({key for r in results for key in r.token_means})
    token_means = {key: sum(r.token_means.get(key, 0.0) * r.tokens for r in results) / max(tokens, 1) for key in keys}
    gaps = [r.sampler_gap for r in results if r.sampler_gap is not None]
    result = dataclasses.replace(results[0], rows=sum(r.rows for r in results), token_means=token_means,
                                 tokens=tokens, sampler_gap=policy.total(gaps) if gaps else None)
    costs = {key: max(rank_costs[key] for _, _, rank_costs in gathered) for key in gathered[0][2]}
    return rounds, result, costs


@dataclasses.dataclass
class MergedRound(train.Round):
    """Every rank's train.Round of one rollout batch as one. Its rollouts stay behind (the update has read them), so
    what the metrics line, the completions log and the sampler check read of them are fields here, in place of
    train.Round's properties."""
    lengths: torch.Tensor = None    # [P*n] completion tokens
    truncated: torch.Tensor = None  # [P*n] bool: no EOS within the budget
    texts: list = None              # [P*n] completions
    prompt_tokens: int = 0          # tokens of the P prompts, x n
    backends: list = None           # each rank's backend (none for a rank without prompts)


def merge_rounds(parts):
    """Every rank's train.Round of one rollout batch as one MergedRound, in rank order."""
    offsets = torch.tensor([0] + [int(p.rewards.numel()) for p in parts[:-1]]).cumsum(0).tolist()
    merged = {}
    for field in dataclasses.fields(MergedRound):
        values = [getattr(p, field.name) for p in parts]
        if field.name == "rollouts":
            merged[field.name] = None
        elif field.name == "first_chunk":
            merged[field.name] = values[0]
        elif field.name == "kept_rows":
            merged[field.name] = torch.cat([rows + offset for rows, offset in zip(values, offsets)])
        elif isinstance(values[0], torch.Tensor):
            merged[field.name] = torch.cat(values)
        elif isinstance(values[0], dict):
            merged[field.name] = {key: torch.cat([value[key] for value in values]) for key in values[0]}
        else:  # counts and lists
            merged[field.name] = sum(values[1:], values[0])
    return MergedRound(**merged)


def check_args(args, world_size):
    """What W processes need, checked before anything loads: equal prompt shares, shardable weights and optimizer,
    per-prompt statistics, a held-out chunk per rank."""
    if args.load_in_4bit or args.optimizer == "adamw8bit":
        raise ValueError("under torchrun the weights and optimizer state are sharded by FSDP2, which cannot shard "
                         "4-bit weights (--load-in-4bit) or 8-bit AdamW (--optimizer adamw8bit): drop them")
    if args.prompts_per_step % world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} cannot be split evenly over {world_size} "
                         f"processes: every rank takes P / {world_size} prompts of each rollout batch; make it a "
                         f"multiple of {world_size}")
    if world_size > 1 and (args.selection_scope == "batch" or args.scale_rewards == "batch" or args.drop_zero_variance):
        raise ValueError("--selection-scope batch, --scale-rewards batch and --drop-zero-variance need statistics "
                         "over every prompt of a rollout batch or change each rank's number of kept rows; with "
                         "several processes use the per-prompt defaults")
    if 0 < args.eval_samples < world_size:
        raise ValueError(f"--eval-samples {args.eval_samples} is fewer than the {world_size} processes, which "
                         "each evaluate a share: use 0 or at least one per process")


def main(argv=None):
    """One rank of `torchrun -m multigpu`: train.train with this rank's Processes; returns the run directory."""
    restarted = distributed.restart_count() > 0  # torchrun --max-restarts: resume from the latest checkpoint
    try:
        args = config.parse_args(argv, restarted=restarted)
        check_args(args, distributed.world_size_from_env())
    except (ValueError, FileNotFoundError) as error:  # a bad flag: one line per rank (as train.py), no traceback
        raise SystemExit(f"python -m multigpu: error: {error}") from None
    ctx = distributed.init_from_env(args.device, timeout_s=args.dist_timeout_s)
    args.device = str(ctx.device)  # this rank's GPU
    args.output_dir = distributed.agree(str(config.run_dir(args)))  # one folder, named by rank 0
    return train.train(args, Processes(ctx))
