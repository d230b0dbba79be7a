"""train.py's flags of the method (the "PODS / GRPO" group's first flags; run/config.py assembles the parser):
rollouts generated and kept per prompt, the down-sampling rule, the advantages, which prompts train (zero-variance
groups, DAPO's dynamic sampling); their checks (`check_values`)."""

import argparse

import pods

# The choices of --dynamic-sampling-metric, written here so that --help needs no torch (a test keeps them equal to
# dynamic_sampling.METRICS).
DYNAMIC_SAMPLING_METRICS = ("total", "accuracy")
MAX_GENERATION_ROUNDS = 100  # --max-generation-rounds is refused above (DAPO's, verl's default: 10)
POSITIVE_INTS = ("num_rollouts", "update_size", "max_generation_rounds")


def add_flags(group):
    """The method's flags, in --help's order."""
    add = group.add_argument
    add("--num-rollouts", "-n", type=int, help="rollouts generated per prompt (n)")
    add("--update-size", "-m", type=int, help="rollouts per prompt kept for the update (m <= n)")
    add("--rule", choices=list(pods.RULES), help="down-sampling rule (pods.RULES); 'none' (m = n) is plain GRPO")
    add("--advantage-normalization", choices=pods.NORMALIZE_MODES, default="selected",
        help="selected: stats of the m kept rewards (paper); group: stats of all n")
    add("--scale-rewards", choices=pods.SCALE_MODES, default="group",
        help="divide advantages by the group std (paper), the batch std (TRL 'batch') or nothing (Dr. GRPO)")
    add("--selection-scope", choices=pods.SELECTION_SCOPES, default="prompt",
        help="prompt: m per prompt (paper); batch: m x P from each rollout batch of P prompts, balanced across "
             f"prompts ({' or '.join(pods.batch_scope_rules())} only, pods.select_across_prompts)")
    add("--drop-zero-variance", action=argparse.BooleanOptionalAction, default=False,
        help="leave prompts whose n rewards are all equal out of the update (counted: num_zero_variance_dropped)")
    add("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
        help="DAPO: set groups with all-equal rewards aside, draw more prompts until --prompts-per-step have a spread")
    add("--dynamic-sampling-metric", choices=DYNAMIC_SAMPLING_METRICS, default="total",
        help="the reward that must vary within a group: the weighted total (what the advantages use) or accuracy")
    add("--max-generation-rounds", type=int, default=10, help="--dynamic-sampling: generation rounds per rollout "
        f"batch at most (<= {MAX_GENERATION_ROUNDS})")


def check_values(args):
    """n and m (m <= n; m = n for plain GRPO), a rule the batch scope can balance, and dynamic sampling's groups."""
    if args.update_size > args.num_rollouts:
        raise ValueError(f"--update-size m = {args.update_size} must be <= --num-rollouts n = {args.num_rollouts}")
    if args.rule == "none" and args.update_size != args.num_rollouts:
        raise ValueError(f"rule 'none' (plain GRPO) trains on every rollout: needs m == n, got m = "
                         f"{args.update_size}, n = {args.num_rollouts}; pick a PODS rule or set m = n")
    if args.selection_scope == "batch" and args.rule not in pods.batch_scope_rules():
        raise ValueError(f"incompatible flags: --selection-scope batch balances a rule across prompts; it needs "
                         f"--rule {' or '.join(pods.batch_scope_rules())}, got --rule {args.rule}")
    _check_dynamic_sampling(args)


def _check_dynamic_sampling(args):
    """--dynamic-sampling needs groups that can have a spread, and a bound on the rounds looking for them."""
    if args.max_generation_rounds > MAX_GENERATION_ROUNDS:
        raise ValueError(f"--max-generation-rounds must be <= {MAX_GENERATION_ROUNDS}, got "
                         f"{args.max_generation_rounds}: a step that finds too few groups with a spread trains on "
                         "what it has after that many rounds")
    if not args.dynamic_sampling:
        return
    if args.num_rollouts < 2:
        raise ValueError(f"--dynamic-sampling with --num-rollouts {args.num_rollouts}: a group of one rollout never "
                         "has a reward spread, so every group would be set aside; use -n >= 2")
    if args.dynamic_sampling_metric == "total" and not any(args.reward_weights.values()):
        raise ValueError("--dynamic-sampling with every --reward-weights weight 0: the weighted total is 0 for every "
                         "rollout, so no group can have a spread; give a reward a weight or use "
                         "--dynamic-sampling-metric accuracy")
