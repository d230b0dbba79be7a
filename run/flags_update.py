"""train.py's flags of the update (run/config.py assembles the parser): the batch each optimizer step trains on
(prompts per rollout batch, gradient accumulation, mu) and every loss option, both in the "PODS / GRPO" group (the
loss flags generated from loss_options.LossSettings' fields, `add_flags`), and the "optimizer" group
(`add_optimizer_flags`); their checks (`check_values`), and `loss_settings` / `update_settings`, the records the update
takes."""

import argparse
import dataclasses
import warnings

import loss_options
import models

# The choices of --optimizer, written here so that --help needs no torch (a test keeps them equal to
# update.OPTIMIZERS).
OPTIMIZERS = ("adamw", "adamw8bit")
LOSS_FLAGS = [option for option in dataclasses.fields(loss_options.LossSettings) if option.metadata["help"]]
POSITIVE_INTS = ("prompts_per_step", "grad_accum_steps", "updates_per_batch")
NON_NEGATIVE = ("weight_decay", "kl_coef")
RANGES = (("--learning-rate", "learning_rate", lambda value: value > 0, "> 0"),
          ("--clip-eps", "clip_eps", lambda value: value > 0, "> 0"),
          ("--is-clip", "is_clip", lambda value: value >= 1, ">= 1"))


def loss_flag(option):
    """The flag of a LossSettings field, e.g. "--loss-aggregation" for `aggregation`."""
    return loss_options.flag_name(option)


def flag_dest(option):
    """The argparse destination of a LossSettings field's flag, e.g. "loss_aggregation" for `aggregation`."""
    return loss_flag(option).removeprefix("--").replace("-", "_")


def add_flags(group):
    """The batch's flags and the loss options, in --help's order."""
    add = group.add_argument
    add("--prompts-per-step", type=int, help="prompts per rollout batch (P): P x n rollouts are generated")
    add("--grad-accum-steps", type=int, default=1, help="rollout batches per optimizer step (GRPO-GA)")
    add("--updates-per-batch", "--mu", type=int, default=1, help="optimizer steps per rollout batch (mu)")
    for option in LOSS_FLAGS:  # the loss options, from loss_options.LossSettings
        kind = option.metadata["argparse"] or dict(action=argparse.BooleanOptionalAction)  # a bool: --x / --no-x
        add(loss_options.flag_name(option), default=option.default, help=option.metadata["help"], **kind)


def add_optimizer_flags(group):
    """The optimizer's flags, in --help's order."""
    add = group.add_argument
    add("--learning-rate", "--lr", type=float, help="AdamW learning rate, constant")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=float, default=1.0, help="gradient norm clipped to this (<= 0: off)")
    add("--optimizer", choices=OPTIMIZERS, default="adamw",
        help="adamw: torch's AdamW; adamw8bit: bitsandbytes' 8-bit AdamW (CUDA)")


def inert_loss_options(args):
    """The loss options set away from their default whose `needs` field is at its default: they do nothing (e.g.
    --is-clip without --importance-sampling-correction)."""
    fields = {option.name: option for option in dataclasses.fields(loss_options.LossSettings)}
    return [option for option in LOSS_FLAGS if option.metadata["needs"]
            and getattr(args, flag_dest(option)) != option.default
            and getattr(args, flag_dest(fields[option.metadata["needs"]])) == fields[option.metadata["needs"]].default]


def check_values(args):
    """A loss mode of an older version refused (a resumed run's config.json value is not checked by argparse),
    clip-higher only widening the clip; a warning for each loss option that cannot act with the others given."""
    correction = args.importance_sampling_correction  # a resumed run's config.json value is not checked by argparse
    if correction in loss_options.REMOVED_IS_CORRECTIONS:
        raise ValueError(f"--importance-sampling-correction {loss_options.REMOVED_IS_CORRECTIONS[correction]}")
    if correction not in loss_options.IS_CORRECTIONS:
        raise ValueError(f"--importance-sampling-correction must be one of {loss_options.IS_CORRECTIONS}, got "
                         f"{correction!r}")
    fields = {option.name: option for option in dataclasses.fields(loss_options.LossSettings)}
    for option in inert_loss_options(args):
        needed = fields[option.metadata["needs"]]
        warnings.warn(f"{loss_options.flag_name(option)} {getattr(args, flag_dest(option))} does nothing with "
                      f"{loss_options.flag_name(needed)} {needed.default} (left out of the method label)")
    if args.clip_eps_high is not None and not args.clip_eps_high >= args.clip_eps:
        # Clip-higher (DAPO) widens the upper bound only; a narrower one clips the ratio of every improving token.
        raise ValueError(f"--clip-eps-high {args.clip_eps_high} must be >= --clip-eps {args.clip_eps} (clip-higher "
                         "only widens the upper clip; leave it unset for the symmetric clip)")
    if args.updates_per_batch == 1:  # the ratio is exactly 1: an option acting on it alone changes nothing
        inert = [f"{loss_options.flag_name(option)} {getattr(args, flag_dest(option))}" for option in LOSS_FLAGS
                 if option.metadata["ratio_only"] and getattr(args, flag_dest(option)) not in (None, option.default)]
        if inert:
            warnings.warn(f"{', '.join(inert)} cannot act with --updates-per-batch 1 (the ratio is exactly 1); "
                          "it acts with --mu > 1")


def loss_settings(args):
    """The flags of the loss as loss_options.LossSettings: each field from the flag of its name."""
    return loss_options.LossSettings(**{option.name: getattr(args, flag_dest(option))
                                        for option in dataclasses.fields(loss_options.LossSettings)})


def update_settings(args):
    """The flags of the update phase as update.UpdateSettings."""
    import update

    return update.UpdateSettings(
        micro_batch_size=args.micro_batch_size, temperature=args.temperature, updates_per_batch=args.updates_per_batch,
        max_grad_norm=args.max_grad_norm, autocast_dtype=models.compute_dtypes(args.bf16, args.lora_rank)[1],
        loss=loss_settings(args), prefix_sharing=args.prefix_sharing == "on")
