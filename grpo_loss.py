"""The GRPO-PODS objective (paper §3.1-3.2): the clipped per-token loss of the kept rollouts, its options and its
normaliser. The log-probabilities it takes (of the policy, pi_old, the reference) are policy.py's `token_logprobs`.

Objective per kept rollout i with advantage A_i and tokens t = 1..|o_i| (paper eq. for GRPO-PODS):

    J = mean_i  1/|o_i| sum_t  min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i)  -  beta * KL_it
    rho_it = exp(log pi(o_it) - log pi_old(o_it)),  KL_it = exp(ref - logp) - (ref - logp) - 1   (k3)

`grpo_loss` returns -J. In the paper's setting (one gradient step per batch, pi_old = pi) call it with
old_logprobs = logprobs.detach(): then rho = 1 and grad(-J) = -mean_i 1/|o_i| sum_t A_i grad log pi(o_it)
(+ the KL gradient), the plain REINFORCE-with-baseline policy gradient; the clip only matters for
additional updates on the same batch.

Variants, each off by default (their references in `LossSettings`' help): `aggregation` "token" (DAPO: over all kept
tokens) or "fixed" (Dr. GRPO: sum / (rows x max completion tokens)); clip-higher (DAPO: [1 - eps, 1 + eps_high]);
`mask_truncated`; `importance_sampling_correction` against the sampler-trainer mismatch (`importance_weights` of
w = pi_old / pi_sampler per token: "tis" weights a token's policy-gradient term by min(w, C), "token_mask" by w where
w <= C, else 0, "token_reject" takes the tokens outside [1/C, C] out of the loss mask and its denominators,
`loss_tokens`). Two objectives of later work act on the ratio alone (with one update per batch their gradient is the
paper's): `importance_sampling_level` "sequence" (GSPO: one ratio per row, exp(mean_t (log pi - log pi_old)),
clipped like rho) and `policy_loss` "cispo" (CISPO: -sg(clip(rho)) A log pi, so a clipped token keeps its gradient).
`top_entropy_quantile` ("Beyond the 80/20 rule") trains only the tokens whose entropy is in the top fraction
(`high_entropy_mask`). The trainer accumulates micro-batches, so "token" and "fixed" normalise over the whole update
batch: `grpo_loss_sum` gives each micro-batch's numerator and `loss_denominator` the batch's normaliser.

Every option of the loss is a field of one record, `LossSettings`, which travels unchanged from the flags
(config.loss_settings) through update.update_policy to `grpo_loss_sum`, and a named part of the objective here: a new
option is a field (its flag, help and checks come from the field's metadata) plus its part (a function in one of the
registries `grpo_loss_sum` composes) and its test.

Simplification: the KL term is optional (paper and TRL default beta = 0) and uses TRL's k3 estimator.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): the flags read LossSettings without it
if TYPE_CHECKING:
    from collections.abc import Callable

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
    """Every option of the loss. Add one here and its part to the objective (`grpo_loss_sum`'s registries); its default
    must leave the paper's loss unchanged (the defaults are the paper; study.py pins a new option at its default)."""
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
    # Against the sampler-trainer mismatch (rollout_check.py); grpo_loss_sum then needs the sampler's log-probs.
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
    its rejected tokens also leave the loss mask (`loss_tokens`), which a weight alone cannot do."""
    _check_correction(correction, clip)
    ratio = torch.exp(old_logprobs.detach().float() - sampler_logprobs.float())
    if correction == "tis":
        return ratio.clamp(max=clip)
    if correction == "token_mask":
        return ratio.masked_fill(ratio > clip, 0.0)
    return ((ratio >= 1 / clip) & (ratio <= clip)).float()


def loss_tokens(completion_mask: Tensor, old_logprobs: Tensor | None, sampler_logprobs: Tensor | None,
                settings: "LossSettings") -> Tensor:
    """The tokens that count in the loss and in its denominators (`loss_denominator`): completion_mask, with the
    tokens "token_reject" rejects zeroed (as verl's rollout_rs changes response_mask); other corrections: unchanged.
    Per token, so a multi-process denominator is still the sum of each process's."""
    if settings.importance_sampling_correction != "token_reject" or not completion_mask.numel():
        return completion_mask
    if old_logprobs is None or sampler_logprobs is None:
        raise ValueError("importance_sampling_correction 'token_reject' needs pi_old's and the sampler's log-probs to "
                         "know which tokens count in the loss")
    accepted = importance_weights(old_logprobs, sampler_logprobs, "token_reject", settings.is_clip).bool()
    return completion_mask * accepted.to(completion_mask.dtype)   # all three on one device (no copy, no sync)


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


# ------------------------------------------------ the objective, each option a named part
# `grpo_loss_sum` is the paper's clipped objective; every LossSettings option is a part it composes, picked by the field
# of its name: the ratio at its level (LOG_RATIOS), its clip (`clip_range`), the policy loss (POLICY_LOSS_TERMS), the
# adjustments of each token's policy-gradient term (TOKEN_ADJUSTMENTS), the KL term (`kl_penalty`) and the aggregation
# (AGGREGATIONS); `mask_truncated` and `loss_tokens` shape the loss mask before it. A new option is a LossSettings
# field (its flag comes from the field) with its function here, an entry of one of these registries, and its test.


@dataclass(frozen=True)
class LossTerms:
    """What the parts of one `grpo_loss_sum` call read: its settings, what the objective derives first (the loss
    tokens, log pi there, the advantages, the ratio and its clip) and the tensors as given."""
    settings: LossSettings
    keep: Tensor                        # bool [B, C]: the tokens in the loss (`loss_tokens`)
    mask: Tensor                        # `keep` in float32
    logp: Tensor                        # log pi [B, C] in float32, 0 outside `keep`: the gradient flows through it
    advantages: Tensor                  # [B, 1] float32
    ratio: Tensor                       # rho = pi / pi_old: [B, C], or [B, 1] at the sequence level
    clip: tuple[float, float]           # rho's bounds (`clip_range`)
    old_logprobs: Tensor                # [B, C], as given
    generated: Tensor                   # bool [B, C]: the completion tokens, before token_reject's rejection
    ref_logprobs: Tensor | None         # [B, C] or None, as given
    sampler_logprobs: Tensor | None
    entropies: Tensor | None


def grpo_loss_sum(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
                  settings: LossSettings | None = None, ref_logprobs: Tensor | None = None,
                  sampler_logprobs: Tensor | None = None, entropies: Tensor | None = None,
                  **options) -> tuple[Tensor, dict[str, Tensor]]:
    """Numerator of the loss of these rows (divide by `loss_denominator` of the whole update batch): per token the
    paper's -min(rho A, clip(rho) A) + beta KL, with the parts its settings pick (above).

    settings: the LossSettings (None: the paper's); options: fields of it to replace (`loss_settings`). [B, C] each:
    logprobs, old_logprobs, completion_mask, ref_logprobs (the KL term), sampler_logprobs (an importance-sampling
    correction), entropies (top-entropy tokens); advantages: [B], finite (checked on the host by `grpo_loss` and
    update.update_policy: here it would be a sync). The rows' losses are summed (with the "sequence" aggregation each
    row's mean over its tokens), so micro-batches accumulate exactly: the sum over micro-batches of grpo_loss_sum /
    loss_denominator(all masks) is the full-batch loss. Metrics: `loss_metrics` and the adjustments' own, 0-dim
    tensors on the device: reading one is a host sync, which the update makes once per optimizer step.
    """
    settings = loss_settings(settings, **options)
    check_loss_inputs(settings, logprobs, old_logprobs, advantages, completion_mask, ref_logprobs, sampler_logprobs,
                      entropies)
    generated = completion_mask.bool()
    keep = loss_tokens(completion_mask, old_logprobs, sampler_logprobs, settings).bool()
    logp, mask = masked_float(logprobs, keep), keep.float()
    log_ratio = LOG_RATIOS[settings.importance_sampling_level](logp - masked_float(old_logprobs, keep), mask)
    terms = LossTerms(settings, keep, mask, logp, advantages.float()[:, None], torch.exp(log_ratio),
                      clip_range(settings), old_logprobs, generated, ref_logprobs, sampler_logprobs, entropies)
    per_token, clipped_sides = POLICY_LOSS_TERMS[settings.policy_loss](terms)
    metrics = {}
    for adjust in TOKEN_ADJUSTMENTS:  # each leaves per_token as it is at its field's default
        per_token = adjust(per_token, terms, metrics)
    per_token, kl = kl_penalty(per_token, terms)
    loss_sum = AGGREGATIONS[settings.aggregation].numerator((per_token * mask).sum(-1), mask).sum()
    return loss_sum, {**loss_metrics(terms, clipped_sides, kl), **metrics}


def masked_float(values: Tensor, keep: Tensor) -> Tensor:
    """`values` in float32, 0 outside `keep`: padded positions may hold anything (even inf or NaN), zeroed *before*
    exp so that neither the value nor the gradient (0 * inf) can turn into NaN."""
    return torch.where(keep, values.float(), 0.0)


def check_loss_inputs(settings: LossSettings, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                      completion_mask: Tensor, ref_logprobs: Tensor | None = None,
                      sampler_logprobs: Tensor | None = None, entropies: Tensor | None = None) -> None:
    """A ValueError line for what `grpo_loss_sum` cannot use, before any work: a shape, an option's value, or a tensor
    an option needs missing (ref_logprobs for kl_coef > 0, the sampler's log-probs for an importance-sampling
    correction, the entropies for top_entropy_quantile < 1)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, C], got shape {tuple(logprobs.shape)}")
    same_shape = {"old_logprobs": old_logprobs, "completion_mask": completion_mask, "ref_logprobs": ref_logprobs}
    for name, t in same_shape.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    clip_range(settings)  # both bounds > 0
    _check_aggregation(settings.aggregation)
    for name, value, allowed in (("importance_sampling_level", settings.importance_sampling_level,
                                  IMPORTANCE_SAMPLING_LEVELS), ("policy_loss", settings.policy_loss, POLICY_LOSSES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if settings.kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {settings.kl_coef}")
    if settings.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {settings.kl_coef} > 0 needs ref_logprobs")
    correction = settings.importance_sampling_correction
    if correction != "none" and (sampler_logprobs is None or sampler_logprobs.shape != logprobs.shape):
        raise ValueError(f"importance_sampling_correction {correction!r} needs the sampler's log-probs [B, C] "
                         "(sampling.Rollouts.sampler_logprobs)")
    if settings.top_entropy_quantile < 1 and (entropies is None or entropies.shape != logprobs.shape):
        raise ValueError(f"top_entropy_quantile {settings.top_entropy_quantile} needs the entropies [B, C] of the "
                         "policy at the completion tokens (token_logprobs(..., with_entropies=True))")


# --- the ratio rho at its level (importance_sampling_level)

def token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """"token" (the paper): one ratio per token, log rho_it = log pi(o_it) - log pi_old(o_it)."""
    return log_ratio


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """"sequence" (GSPO): one ratio per row, [B, 1], exp of its mean token log-ratio, shared by its tokens (TRL's form;
    verl writes it per token as exp(logp - sg(logp) + sg(mean)): the same value and gradient)."""
    return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


# importance_sampling_level -> (per-token log-ratios [B, C], the loss mask) -> the log-ratios at that level
LOG_RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


def clip_range(settings: LossSettings) -> tuple[float, float]:
    """rho's bounds (1 - clip_eps, 1 + clip_eps_high): clip-higher (DAPO) widens the upper one alone; clip_eps_high
    None: clip_eps, the paper's symmetric clip."""
    high = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    if not settings.clip_eps > 0 or not high > 0:
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {settings.clip_eps} and "
                         f"{settings.clip_eps_high}")
    return 1 - settings.clip_eps, 1 + high


# --- the policy loss (policy_loss): each token's loss, and the sides of the clip its clip_ratio metrics count

def ppo_clip(terms: LossTerms) -> tuple[Tensor, tuple]:
    """"ppo_clip" (the paper's): -min(rho A, clip(rho) A). Clipped (no policy gradient): rho below the clip with
    A < 0, above it with A > 0."""
    adv = terms.advantages
    return -torch.minimum(terms.ratio * adv, terms.ratio.clamp(*terms.clip) * adv), (adv < 0, adv > 0)


def cispo(terms: LossTerms) -> tuple[Tensor, tuple]:
    """"cispo" (MiniMax-M1's CISPO): -sg(clip(rho)) A log pi, the weight bounded and detached, so that every token keeps
    its gradient; clipped (verl's count): every rho outside the clip."""
    return -terms.ratio.clamp(*terms.clip).detach() * terms.advantages * terms.logp, (True, True)


# policy_loss -> terms -> (each token's loss [B, C], (below, above): where a ratio outside the clip counts as clipped)
POLICY_LOSS_TERMS = {"ppo_clip": ppo_clip, "cispo": cispo}


# --- adjustments of each token's policy-gradient term, before the KL term

def importance_sampling_correction(per_token: Tensor, terms: LossTerms, metrics: dict) -> Tensor:
    """importance_sampling_correction, against the sampler-trainer mismatch (rollout_check.py): each token's
    policy-gradient term weighted by `importance_weights` of pi_old / pi_sampler (the KL term is not); "token_reject"'s
    rejected tokens are already out of the loss mask (`loss_tokens`). Metric "importance_weight_mean": the mean weight
    over every completion token (token_reject: the fraction accepted; 0 without a token). "none": as it is."""
    correction = terms.settings.importance_sampling_correction
    if correction == "none":
        return per_token
    weights = importance_weights(terms.old_logprobs, terms.sampler_logprobs, correction, terms.settings.is_clip)
    with torch.no_grad():
        generated = terms.generated
        metrics["importance_weight_mean"] = (weights.float() * generated).sum() / generated.sum().clamp(min=1)
    return per_token * masked_float(weights.detach(), terms.keep)


def top_entropy_tokens(per_token: Tensor, terms: LossTerms, metrics: dict) -> Tensor:
    """top_entropy_quantile ("Beyond the 80/20 rule"; TRL: per_token_loss * entropy_mask, before the KL term): the
    policy-gradient term of the tokens of `high_entropy_mask` alone; the others keep their KL term and still count in
    the denominators. 1: every token (the paper)."""
    quantile = terms.settings.top_entropy_quantile
    return per_token * high_entropy_mask(terms.entropies, terms.keep, quantile) if quantile < 1 else per_token


# In this order: (per_token, terms, metrics) -> per_token, as it is at the field's default; metrics: what it measures
# (0-dim tensors, no gradient), by name.
TOKEN_ADJUSTMENTS = (importance_sampling_correction, top_entropy_tokens)


def kl_penalty(per_token: Tensor, terms: LossTerms) -> tuple[Tensor, Tensor | None]:
    """The paper's KL term, TRL's k3 estimator KL_it = exp(ref - logp) - (ref - logp) - 1 -> (per_token + beta KL_it,
    KL_it), beta = kl_coef: measured whenever ref_logprobs are given, added only with beta > 0 (the paper's and TRL's
    default is 0); no ref_logprobs: (per_token, None)."""
    if terms.ref_logprobs is None:
        return per_token, None
    log_ref_ratio = masked_float(terms.ref_logprobs, terms.keep) - terms.logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    return (per_token + terms.settings.kl_coef * kl if terms.settings.kl_coef > 0 else per_token), kl


def loss_metrics(terms: LossTerms, clipped_sides: tuple, kl: Tensor | None) -> dict[str, Tensor]:
    """TRL's metrics, token means over the loss tokens as 0-dim tensors on the device (the caller reads them when it
    reads the loss: one host sync): "clip_ratio/low_mean" (rho below the clip, on the side the policy loss counts),
    "clip_ratio/high_mean" (above), "clip_ratio/region_mean" (either), "ratio_mean", "kl" (k3; 0 without
    ref_logprobs)."""
    with torch.no_grad():
        num_tokens = terms.mask.sum().clamp(min=1)

        def masked_mean(x: Tensor) -> Tensor:
            return (x.float() * terms.mask).sum() / num_tokens

        low = (terms.ratio < terms.clip[0]) & clipped_sides[0]
        high = (terms.ratio > terms.clip[1]) & clipped_sides[1]
        return {"clip_ratio/low_mean": masked_mean(low), "clip_ratio/high_mean": masked_mean(high),
                "clip_ratio/region_mean": masked_mean(low | high), "ratio_mean": masked_mean(terms.ratio),
                "kl": masked_mean(kl) if kl is not None else terms.logp.new_zeros(())}


# --- the aggregation (aggregation): the numerator of each row, the normaliser of the update batch

@dataclass(frozen=True)
class Aggregation:
    """numerator: (the row sums [B] of the per-token losses, the loss mask [B, C]) -> each row's part of
    `grpo_loss_sum`; denominator: (the update batch's loss masks [B, C], max_completion_tokens) -> its normaliser
    (`loss_denominator`)."""
    numerator: Callable[[Tensor, Tensor], Tensor]
    denominator: Callable[[list, int | None], int]


def row_means(row_sums: Tensor, mask: Tensor) -> Tensor:
    """"sequence" (the paper): each row's mean over its own tokens; a row with none adds 0, not NaN."""
    return row_sums / mask.sum(-1).clamp(min=1)


def row_totals(row_sums: Tensor, mask: Tensor) -> Tensor:
    """"token" (DAPO) and "fixed" (Dr. GRPO): each row's sum; they differ only in the denominator."""
    return row_sums


def row_count(masks: list, max_completion_tokens: int | None) -> int:
    """"sequence": the number of rows, masked ones included (as in TRL: the normaliser does not depend on what the
    rows hold)."""
    return sum(mask.shape[0] for mask in masks)


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
    return row_count(masks, limit) * max_completion_tokens


# aggregation -> its numerator and denominator
AGGREGATIONS = {"sequence": Aggregation(row_means, row_count), "token": Aggregation(row_totals, token_count),
                "fixed": Aggregation(row_totals, rows_times_limit)}


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")


def loss_denominator(
    completion_masks: Tensor | list[Tensor],
    aggregation: str = "sequence",
    max_completion_tokens: int | None = None,
) -> int:
    """The normaliser of the whole update batch: `grpo_loss_sum` of every micro-batch / this = the loss.

    completion_masks: the [B, C] mask of the batch, or a list of masks (micro-batches, several rollout
    batches), after `mask_truncated` when truncated rows are masked. "sequence": number of rows;
    "token": number of kept tokens; "fixed": rows x max_completion_tokens (AGGREGATIONS). It is a sum over rows,
    so a distributed caller sums the local values over ranks. It is 0 only for "token" with no kept token (the
    numerator is then 0 too): divide by max(denominator, 1).
    """
    _check_aggregation(aggregation)
    masks = [completion_masks] if isinstance(completion_masks, torch.Tensor) else list(completion_masks)
    if any(mask.dim() != 2 for mask in masks):
        raise ValueError(f"completion masks must be [B, C]; got shapes {[tuple(m.shape) for m in masks]}")
    return AGGREGATIONS[aggregation].denominator(masks, max_completion_tokens)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    settings: LossSettings | None = None,
    ref_logprobs: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    entropies: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss -J of one whole batch (see module docstring) and TRL-named metrics.

    settings / options: as in `grpo_loss_sum`, e.g. grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1).

    logprobs/old_logprobs/ref_logprobs/completion_mask: [B, C]; advantages: [B]. Computed in float32.
    = grpo_loss_sum / max(loss_denominator, 1). With the default aggregation each sequence is averaged
    over its own masked tokens (a row with no tokens counts as 0), then the B sequences are averaged.
    With old_logprobs = logprobs.detach() the gradient is exactly the policy gradient
    -mean_i A_i/|o_i| sum_t grad log pi (tested). Tokens in the clipped region (rho > 1+eps_high with
    A > 0, rho < 1-eps with A < 0) get no policy-gradient term (only the KL term's, when kl_coef > 0).

    Metrics (masked token means): "clip_ratio/low_mean" (rho < 1-eps and A < 0), "clip_ratio/high_mean"
    (rho > 1+eps_high and A > 0), "clip_ratio/region_mean" (either), "ratio_mean", "kl" (k3, 0.0 when
    no ref_logprobs).
    """
    settings = loss_settings(settings, **options)
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(f"advantages contain non-finite values: {advantages.tolist()}")
    loss_sum, metrics = grpo_loss_sum(logprobs, old_logprobs, advantages, completion_mask, settings, ref_logprobs,
                                      sampler_logprobs, entropies)
    denominator = loss_denominator(loss_tokens(completion_mask, old_logprobs, sampler_logprobs, settings),
                                   settings.aggregation, settings.max_completion_tokens)
    return loss_sum / max(denominator, 1), {key: float(value) for key, value in metrics.items()}
