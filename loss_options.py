"""The options of the GRPO-PODS loss: `LossSettings`, the one record of every option (its defaults are the paper's
objective, §3.1-3.2), and the parts of the objective that only an option switched away from its default runs, each
from the later work it is named after. grpo_loss.py holds the paper's objective and composes these parts by the
option's value (its registries); the paper's loss runs none of them.

- `aggregation` "token" (DAPO: the sum over all kept tokens / their count) and "fixed" (Dr. GRPO: the sum / (rows x
  max completion tokens)): `row_totals` with `token_count` or `rows_times_limit`.
- `mask_truncated` (DAPO's overlong filtering): the rows that hit the length limit out of the loss mask.
- `importance_sampling_correction` against the sampler-trainer mismatch (TRL, verl): `importance_weights` of
  w = pi_old / pi_sampler per token: "tis" weights a token's policy-gradient term by min(w, C), "token_mask" by w where
  w <= C, else 0, "token_reject" takes the tokens outside [1/C, C] out of the loss mask and its denominators
  (grpo_loss.loss_tokens).
- `importance_sampling_level` "sequence" (GSPO: one ratio per row, exp(mean_t (log pi - log pi_old)), clipped like
  rho) and `policy_loss` "cispo" (CISPO: -sg(clip(rho)) A log pi, so a clipped token keeps its gradient): they act on
  the ratio alone, so with one update per batch their gradient is the paper's.
- `top_entropy_quantile` ("Beyond the 80/20 rule"): only the tokens whose entropy is in the top fraction train
  (`high_entropy_mask`).

Clip-higher (DAPO's `clip_eps_high`) and the KL term (`kl_coef`) are in the paper's clip and objective, so
grpo_loss.py computes them. Each option is a field of `LossSettings`, which travels unchanged from the flags
(config.loss_settings) through update.update_policy to grpo_loss.grpo_loss_sum: a new option is a field here (its
flag, help and checks come from the field's metadata), its part (here, and an entry of one of grpo_loss.py's
registries) and its test. This module loads without torch: the flags read `LossSettings`.
Simplification: each option is one reference's form (named in its help), not every variant of it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): the flags read LossSettings without it
if TYPE_CHECKING:
    from torch import Tensor

LOSS_AGGREGATIONS = ("sequence", "token", "fixed")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # sequence: GSPO
POLICY_LOSSES = ("ppo_clip", "cispo")
IS_CORRECTIONS = ("none", "tis", "token_mask", "token_reject")
# Modes of older versions, refused with what to use instead (a mapping would change what a resumed run trains).
REMOVED_IS_CORRECTIONS = {
    "mask": "'mask' (weight 1 where pi_old / pi_sampler <= --is-clip, else 0) matched neither TRL nor verl and was "
            "removed; use token_mask (TRL: the ratio where it is <= C, else 0) or token_reject (verl: weight 1 where "
            "1/C <= ratio <= C, rejected tokens out of the loss and its denominators) in a new run"}


def fraction(text: str) -> float:
    """argparse type of --top-entropy-quantile, a fraction in (0, 1] (one-line error otherwise): 0 would read as "train
    on no token", yet the mask at 0 keeps the highest-entropy token(s), as TRL's does."""
    import argparse

    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    if value == 0:
        raise argparse.ArgumentTypeError("0 would train on the highest-entropy token(s) alone, not on no token: give "
                                         "a fraction > 0 (e.g. 0.2, the paper's)")
    return value


def loss_option(default, help=None, flag=None, ratio_only=False, example=None, acts_with=(), needs=None,
                **argparse_options):
    """A LossSettings field. help: it gets a train.py flag (--field-name, or `flag`) with this help, these argparse
    options and the field's default (config.py builds it); no help: the value comes from the flag of that name
    declared elsewhere. ratio_only: it acts on the ratio rho only, which is exactly 1 with --mu 1 (a warning).
    example: a valid value other than the default, for the tests that run every option (None: they pick one).
    acts_with: the flags without which it does nothing (those tests give them to both sides). needs: the field that
    must differ from its default for this one to act (config.py warns and leaves it out of the method label)."""
    metadata = dict(help=help, flag=flag, ratio_only=ratio_only, example=example, acts_with=tuple(acts_with),
                    needs=needs, argparse=argparse_options)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class LossSettings:
    """Every option of the loss. Add one here and its part to the objective (grpo_loss.grpo_loss_sum's registries);
    its default must leave the paper's loss unchanged (the defaults are the paper; study.py pins a new option at its
    default)."""
    clip_eps: float = loss_option(0.2, "ratio clipped to [1 - this, 1 + --clip-eps-high]", ratio_only=True, type=float)
    clip_eps_high: float | None = loss_option(
        None, "upper clip of the ratio, 1 + this (DAPO clip-higher; default --clip-eps; acts only with "
        "--updates-per-batch > 1, where the ratio differs from 1)", ratio_only=True, type=float)
    aggregation: str = loss_option(
        "sequence", "sequence: mean over rows of each row's token mean (paper); token: over all kept tokens (DAPO); "
        "fixed: sum / (rows x --max-completion-tokens) (Dr. GRPO)", flag="--loss-aggregation",
        choices=LOSS_AGGREGATIONS)
    # mask_truncated is used by update.loss_mask: the mask grpo_loss_sum receives has those rows zeroed.
    mask_truncated: bool = loss_option(
        False, "completions that hit --max-completion-tokens contribute no loss (counted: num_truncated_masked)")
    kl_coef: float = loss_option(0.0, "KL beta (needs LoRA: the reference is the adapter switched off)", type=float)
    max_completion_tokens: int | None = loss_option(None)  # the generation limit: the "fixed" aggregation's denominator
    # Against the sampler-trainer mismatch (policy.py's sampler check); grpo_loss_sum then needs the sampler's
    # log-probs.
    importance_sampling_correction: str = loss_option(
        "none", "per-token ratio w = pi_old / pi_sampler, C = --is-clip. tis: weight each token's policy gradient by "
        "min(w, C) (TRL token_truncate, verl rollout_is token); token_mask: by w where w <= C, else 0 (TRL "
        "token_mask); token_reject: drop the tokens with w outside [1/C, C] from the loss and its denominators "
        "(verl rollout_rs token_k1); none: the paper", choices=IS_CORRECTIONS, example="tis")
    is_clip: float = loss_option(2.0, "C of --importance-sampling-correction (default 2, verl's rollout_is_threshold; "
                                 "TRL's default is 3 with its sequence-level mask)", type=float,
                                 example=1.5, acts_with=("--importance-sampling-correction", "tis"),
                                 needs="importance_sampling_correction")
    importance_sampling_level: str = loss_option(
        "token", "GSPO (Zheng et al. 2025; TRL importance_sampling_level, verl loss_mode gspo): sequence = one ratio "
        "per completion, the geometric mean of its token ratios, clipped to [1 - --clip-eps, 1 + --clip-eps-high] (the "
        "GSPO paper clips at 3e-4 / 4e-4); token: per token (the paper); acts only with --updates-per-batch > 1",
        ratio_only=True, choices=IMPORTANCE_SAMPLING_LEVELS)
    policy_loss: str = loss_option(
        "ppo_clip", "cispo (MiniMax-M1's CISPO; verl loss_mode cispo, TRL loss_type cispo): -sg(clip(ratio, 1 - "
        "--clip-eps, 1 + --clip-eps-high)) x advantage x log-prob, so no token loses its gradient to the clip "
        "(MiniMax: no lower bound, i.e. --clip-eps 1; TRL recommends a weight <= 5, i.e. --clip-eps-high 4); "
        "ppo_clip: the paper's min(ratio A, clip(ratio) A); acts only with --updates-per-batch > 1",
        ratio_only=True, choices=POLICY_LOSSES)
    top_entropy_quantile: float = loss_option(
        1.0, "train only on the top fraction of each micro-batch's completion tokens by the policy's entropy at them "
        "(Beyond the 80/20 rule: 0.2; TRL top_entropy_quantile); the others keep only their KL term and still count "
        "in the denominators; 1: every token (the paper)", type=fraction, example=0.2,
        acts_with=("--micro-batch-size", "6"))  # per micro-batch: the flag tests' 6 rows in one, as their direct loss


def flag_name(option: dataclasses.Field) -> str:
    """The train.py flag of a LossSettings field, e.g. "--loss-aggregation" for `aggregation`."""
    return option.metadata.get("flag") or "--" + option.name.replace("_", "-")


def loss_settings(settings: LossSettings | None = None, **options) -> LossSettings:
    """`settings` (None: the paper's) with the given fields replaced, e.g. loss_settings(clip_eps_high=0.28)."""
    base = LossSettings() if settings is None else settings
    names = {option.name for option in dataclasses.fields(LossSettings)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown loss option(s) {unknown}; LossSettings has {sorted(names)}")
    return dataclasses.replace(base, **options)


# ------------------------------------------------ the loss mask: mask_truncated, importance_sampling_correction

def mask_truncated(completion_mask: Tensor, truncated: Tensor) -> Tensor:
    """`completion_mask` [B, C] with the rows of truncated completions (`truncated` [B] bool: they hit
    the length limit) zeroed, so they contribute no loss and no tokens to the "token" denominator (DAPO's
    overlong filtering, TRL's mask_truncated_completions). Same dtype as the mask."""
    if truncated.dtype != torch.bool or truncated.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"truncated must be a bool [B] = [{completion_mask.shape[0]}] tensor, got "
            f"{truncated.dtype} {tuple(truncated.shape)}"
        )
    return completion_mask.masked_fill(truncated[:, None].to(completion_mask.device), 0)


def _check_correction(correction: str, clip: float) -> None:
    if correction in REMOVED_IS_CORRECTIONS:
        raise ValueError(f"importance sampling correction {REMOVED_IS_CORRECTIONS[correction]}")
    if correction not in IS_CORRECTIONS[1:]:
        raise ValueError(f"importance sampling correction must be one of {IS_CORRECTIONS[1:]}, got {correction!r}")
    if not clip >= 1:
        raise ValueError(f"the importance ratio's clip must be >= 1, got {clip}")


def importance_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, correction: str, clip: float) -> Tensor:
    """Detached per-token weights [B, C] of the policy-gradient term for rollouts sampled by another sampler than
    pi_old: ratio = exp(old - sampler), C = clip.
    "tis" (TRL token_truncate, verl rollout_is="token"): min(ratio, C);
    "token_mask" (TRL token_mask, clip_min unset): the ratio where ratio <= C, else 0;
    "token_reject" (verl rollout_rs="token_k1", threshold C: bounds [1/C, C]): 1 where 1/C <= ratio <= C, else 0;
    its rejected tokens also leave the loss mask (grpo_loss.loss_tokens), which a weight alone cannot do."""
    _check_correction(correction, clip)
    ratio = torch.exp(old_logprobs.detach().float() - sampler_logprobs.float())
    if correction == "tis":
        return ratio.clamp(max=clip)
    if correction == "token_mask":
        return ratio.masked_fill(ratio > clip, 0.0)
    return ((ratio >= 1 / clip) & (ratio <= clip)).float()


# ------------------------------------------------ the ratio's level, the policy loss (grpo_loss.py's registries)

def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """importance_sampling_level "sequence" (GSPO): one ratio per row, [B, 1], exp of its mean token log-ratio, shared
    by its tokens (TRL's form; verl writes it per token as exp(logp - sg(logp) + sg(mean)): the same value and
    gradient)."""
    return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def cispo(terms) -> tuple[Tensor, tuple]:
    """policy_loss "cispo" (MiniMax-M1's CISPO) of grpo_loss.LossTerms `terms`: -sg(clip(rho)) A log pi, the weight
    bounded and detached, so that every token keeps its gradient; clipped (verl's count): every rho outside the
    clip."""
    return -terms.ratio.clamp(*terms.clip).detach() * terms.advantages * terms.logp, (True, True)


# ------------------------------------------------ adjustments of each token's policy-gradient term
# grpo_loss.TOKEN_ADJUSTMENTS makes each only where its option is on: (per_token, grpo_loss.LossTerms, metrics) ->
# per_token; metrics: what it measures (0-dim tensors, no gradient), by name.

def importance_sampling_correction(per_token: Tensor, terms, metrics: dict) -> Tensor:
    """importance_sampling_correction, against the sampler-trainer mismatch (policy.py's sampler check): each token's
    policy-gradient term weighted by `importance_weights` of pi_old / pi_sampler (the KL term is not); "token_reject"'s
    rejected tokens are already out of the loss mask (grpo_loss.loss_tokens). Metric "importance_weight_mean": the
    mean weight over every completion token (token_reject: the fraction accepted; 0 without a token)."""
    settings = terms.settings
    weights = importance_weights(terms.old_logprobs, terms.sampler_logprobs, settings.importance_sampling_correction,
                                 settings.is_clip)
    with torch.no_grad():
        generated = terms.generated
        metrics["importance_weight_mean"] = (weights.float() * generated).sum() / generated.sum().clamp(min=1)
    return per_token * torch.where(terms.keep, weights.detach().float(), 0.0)  # 0 (never NaN) outside the loss tokens


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, quantile: float) -> Tensor:
    """bool [B, C]: the tokens of `completion_mask` whose entropy is at or above the (1 - quantile) quantile of the
    masked tokens' entropies (torch.quantile, linear interpolation), i.e. about the top `quantile` fraction by entropy
    ("Beyond the 80/20 rule": 0.2; TRL's get_high_entropy_mask with threshold 1 - top_entropy_quantile). Over the
    tokens given (TRL: the local batch gathered over processes); no token given: all False."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"the entropy quantile must be in [0, 1], got {quantile}")
    if entropies.shape != completion_mask.shape:
        raise ValueError(f"entropies shape {tuple(entropies.shape)} != mask shape {tuple(completion_mask.shape)}")
    keep = completion_mask.bool()
    values = entropies.detach().float()
    # The masked tokens' quantile without selecting them (a boolean index is a host sync): the others are NaN, which
    # nanquantile leaves out; no token at all gives NaN, and no entropy is >= NaN.
    threshold = torch.nanquantile(values.masked_fill(~keep, math.nan).flatten(), 1.0 - quantile)
    return (values >= threshold) & keep


def top_entropy_tokens(per_token: Tensor, terms, metrics: dict) -> Tensor:
    """top_entropy_quantile ("Beyond the 80/20 rule"; TRL: per_token_loss * entropy_mask, before the KL term): the
    policy-gradient term of the tokens of `high_entropy_mask` alone; the others keep their KL term and still count in
    the denominators. 1 (or more): every token (the paper)."""
    quantile = terms.settings.top_entropy_quantile
    return per_token * high_entropy_mask(terms.entropies, terms.keep, quantile) if quantile < 1 else per_token


# ------------------------------------------------ the aggregations "token" and "fixed" (grpo_loss.AGGREGATIONS)

def row_totals(row_sums: Tensor, mask: Tensor) -> Tensor:
    """"token" (DAPO) and "fixed" (Dr. GRPO): each row's sum; they differ only in the denominator."""
    return row_sums


def token_count(masks: list, max_completion_tokens: int | None) -> int:
    """"token": the number of kept tokens (0 with none: the numerator is 0 too)."""
    return int(sum(int(mask.bool().sum(-1).sum()) for mask in masks))


def rows_times_limit(masks: list, max_completion_tokens: int | None) -> int:
    """"fixed": rows x max_completion_tokens, the generation limit (not the padded width); masked rows count."""
    limit = max_completion_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"aggregation 'fixed' needs max_completion_tokens >= 1, got {max_completion_tokens!r}")
    longest = max((int(length.max()) for length in (mask.bool().sum(-1) for mask in masks) if length.numel()),
                  default=0)
    if longest > max_completion_tokens:
        raise ValueError(f"a completion has {longest} tokens > max_completion_tokens = {max_completion_tokens}")
    return sum(mask.shape[0] for mask in masks) * max_completion_tokens
