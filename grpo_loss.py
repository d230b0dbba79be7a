"""The GRPO-PODS objective (paper §3.1-3.2): the clipped per-token loss of the kept rollouts and its normaliser.

Per kept rollout i with advantage A_i and tokens t = 1..|o_i| (paper eq. for GRPO-PODS):

    J = mean_i  1/|o_i| sum_t  min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i)  -  beta * KL_it
    rho_it = exp(log pi(o_it) - log pi_old(o_it)),  KL_it = exp(ref - logp) - (ref - logp) - 1   (k3)

`grpo_loss` returns -J. With one gradient step per batch (the paper's setting) pi_old = pi: rho = 1 and the gradient
is the plain REINFORCE-with-baseline policy gradient; the clip only matters for further updates on the same batch.

`grpo_loss_sum` composes named parts: the ratio at its level (LOG_RATIOS), its clip (`clip_range`), the policy loss
(POLICY_LOSS_TERMS), adjustments of each token's term (TOKEN_ADJUSTMENTS), the KL term (`kl_penalty`) and the
aggregation (AGGREGATIONS). Every option is a field of loss_options.LossSettings (defaults: the paper's objective);
the parts of later work an option switches on (GSPO, CISPO, DAPO / Dr. GRPO aggregations, importance-sampling
corrections, high-entropy tokens) are loss_options.py's. A new option: a field, its part there, an entry in one
registry here, and its test. The trainer accumulates micro-batches, so `grpo_loss_sum` gives each one's numerator and
`loss_denominator` the whole batch's normaliser.

Simplification: the KL term is optional (paper and TRL default beta = 0) and uses TRL's k3 estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

import loss_options
from loss_options import (IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS, POLICY_LOSSES, LossSettings,
                          loss_settings)

PAPER = LossSettings()  # the paper's objective: every option at its default


def loss_tokens(completion_mask: Tensor, old_logprobs: Tensor | None, sampler_logprobs: Tensor | None,
                settings: LossSettings) -> Tensor:
    """The tokens that count in the loss and its denominator: completion_mask, with the tokens "token_reject"
    rejects zeroed (as verl's rollout_rs changes response_mask); per token, so processes' denominators still add up."""
    if settings.importance_sampling_correction != "token_reject" or not completion_mask.numel():
        return completion_mask
    if old_logprobs is None or sampler_logprobs is None:
        raise ValueError("importance_sampling_correction 'token_reject' needs pi_old's and the sampler's log-probs to "
                         "know which tokens count in the loss")
    accepted = loss_options.importance_weights(old_logprobs, sampler_logprobs, "token_reject", settings.is_clip).bool()
    return completion_mask * accepted.to(completion_mask.dtype)   # all three on one device (no copy, no sync)


@dataclass(frozen=True)
class LossTerms:
    """What the parts of one `grpo_loss_sum` call read: its settings, what the objective derives first and the
    tensors as given."""
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
    """Numerator of the loss of these rows (divide by `loss_denominator` of the whole update batch): per token
    the paper's -min(rho A, clip(rho) A) + beta KL, with the parts its settings pick.

    settings: a LossSettings (None: the paper's); options: fields of it to replace. [B, C] each: logprobs,
    old_logprobs, completion_mask, ref_logprobs (KL), sampler_logprobs (an importance-sampling correction), entropies
    (top-entropy tokens); advantages: [B], finite (checked on the host by the callers: here it would be a sync). Rows'
    losses are summed, so the sum over micro-batches of grpo_loss_sum / loss_denominator(all masks) is the full-batch
    loss. Metrics: 0-dim tensors on the device (reading one is a host sync, made once per optimizer step)."""
    if settings is None or options:  # the paper's, or some of its fields replaced
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
    for option, adjust in TOKEN_ADJUSTMENTS:  # only those whose option is on: the paper's loss makes none
        if getattr(settings, option) != getattr(PAPER, option):
            per_token = adjust(per_token, terms, metrics)
    per_token, kl = kl_penalty(per_token, terms)
    loss_sum = AGGREGATIONS[settings.aggregation].numerator((per_token * mask).sum(-1), mask).sum()
    return loss_sum, {**loss_metrics(terms, clipped_sides, kl), **metrics}


def masked_float(values: Tensor, keep: Tensor) -> Tensor:
    """`values` in float32, 0 outside `keep`, zeroed *before* exp: padding may hold inf or NaN, and neither the
    value nor the gradient (0 * inf) may turn into NaN."""
    return torch.where(keep, values.float(), 0.0)


def check_loss_inputs(settings: LossSettings, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                      completion_mask: Tensor, ref_logprobs: Tensor | None = None,
                      sampler_logprobs: Tensor | None = None, entropies: Tensor | None = None) -> None:
    """A ValueError line for what `grpo_loss_sum` cannot use, before any work: a shape, an option's value, or a
    tensor an option needs missing."""
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


# importance_sampling_level -> (per-token log-ratios [B, C], the loss mask) -> the log-ratios at that level
LOG_RATIOS = {"token": token_log_ratio, "sequence": loss_options.sequence_log_ratio}


def clip_range(settings: LossSettings) -> tuple[float, float]:
    """rho's bounds (1 - clip_eps, 1 + clip_eps_high): DAPO's clip-higher widens the upper one alone (None: the
    paper's symmetric clip)."""
    high = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    if not settings.clip_eps > 0 or not high > 0:
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {settings.clip_eps} and "
                         f"{settings.clip_eps_high}")
    return 1 - settings.clip_eps, 1 + high


# --- the policy loss (policy_loss): each token's loss, and the sides of the clip its clip_ratio metrics count

def ppo_clip(terms: LossTerms) -> tuple[Tensor, tuple]:
    """"ppo_clip" (the paper's): -min(rho A, clip(rho) A); clipped (no gradient): rho below the clip with A < 0,
    above it with A > 0."""
    adv = terms.advantages
    return -torch.minimum(terms.ratio * adv, terms.ratio.clamp(*terms.clip) * adv), (adv < 0, adv > 0)


# policy_loss -> terms -> (each token's loss [B, C], (below, above): where a ratio outside the clip counts as clipped)
POLICY_LOSS_TERMS = {"ppo_clip": ppo_clip, "cispo": loss_options.cispo}


# --- adjustments of each token's term before the KL term, made only where their option is on (loss_options.py):
# (option, adjustment (per_token, terms, metrics) -> per_token), in this order; metrics: 0-dim tensors, by name.
TOKEN_ADJUSTMENTS = (("importance_sampling_correction", loss_options.importance_sampling_correction),
                     ("top_entropy_quantile", loss_options.top_entropy_tokens))


def kl_penalty(per_token: Tensor, terms: LossTerms) -> tuple[Tensor, Tensor | None]:
    """TRL's k3 estimator KL_it = exp(ref - logp) - (ref - logp) - 1 -> (per_token + beta KL_it, KL_it): measured
    whenever ref_logprobs are given, added only with beta = kl_coef > 0 (the paper's default is 0)."""
    if terms.ref_logprobs is None:
        return per_token, None
    log_ref_ratio = masked_float(terms.ref_logprobs, terms.keep) - terms.logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    return (per_token + terms.settings.kl_coef * kl if terms.settings.kl_coef > 0 else per_token), kl


def loss_metrics(terms: LossTerms, clipped_sides: tuple, kl: Tensor | None) -> dict[str, Tensor]:
    """TRL's metrics, token means as 0-dim tensors on the device: "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean" (on the sides the policy loss counts), "ratio_mean", "kl" (0 without ref_logprobs)."""
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
    """numerator: (row sums [B] of the per-token losses, mask [B, C]) -> each row's part of `grpo_loss_sum`;
    denominator: (the batch's masks, max_completion_tokens) -> its normaliser (`loss_denominator`)."""
    numerator: Callable[[Tensor, Tensor], Tensor]
    denominator: Callable[[list, int | None], int]


def row_means(row_sums: Tensor, mask: Tensor) -> Tensor:
    """"sequence" (the paper): each row's mean over its own tokens; a row with none adds 0, not NaN."""
    return row_sums / mask.sum(-1).clamp(min=1)


def row_count(masks: list, max_completion_tokens: int | None) -> int:
    """"sequence": the number of rows, masked ones included (as TRL: the normaliser ignores what rows hold)."""
    return sum(mask.shape[0] for mask in masks)


# aggregation -> its numerator and denominator
AGGREGATIONS = {"sequence": Aggregation(row_means, row_count),
                "token": Aggregation(loss_options.row_totals, loss_options.token_count),
                "fixed": Aggregation(loss_options.row_totals, loss_options.rows_times_limit)}


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")


def loss_denominator(completion_masks: Tensor | list[Tensor], aggregation: str = "sequence",
                     max_completion_tokens: int | None = None) -> int:
    """The normaliser of the whole update batch: `grpo_loss_sum` of every micro-batch / this = the loss.

    completion_masks: one [B, C] mask or a list of them (micro-batches), after loss_options.mask_truncated where it
    applies. "sequence": rows; "token": kept tokens; "fixed": rows x max_completion_tokens. A sum over rows (several
    processes sum theirs); 0 only for "token" with no kept token (the numerator is 0 too): divide by max(it, 1)."""
    _check_aggregation(aggregation)
    masks = [completion_masks] if isinstance(completion_masks, torch.Tensor) else list(completion_masks)
    if any(mask.dim() != 2 for mask in masks):
        raise ValueError(f"completion masks must be [B, C]; got shapes {[tuple(m.shape) for m in masks]}")
    return AGGREGATIONS[aggregation].denominator(masks, max_completion_tokens)


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
              settings: LossSettings | None = None, ref_logprobs: Tensor | None = None,
              sampler_logprobs: Tensor | None = None, entropies: Tensor | None = None,
              **options) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss -J of one whole batch (module docstring) and TRL-named metrics, in float32:
    grpo_loss_sum / max(loss_denominator, 1). settings / options: as in `grpo_loss_sum`, e.g.
    grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1). [B, C] tensors, advantages [B]. With
    old_logprobs = logprobs.detach() the gradient is the policy gradient -mean_i A_i/|o_i| sum_t grad log pi
    (tested)."""
    settings = loss_settings(settings, **options)
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(f"advantages contain non-finite values: {advantages.tolist()}")
    loss_sum, metrics = grpo_loss_sum(logprobs, old_logprobs, advantages, completion_mask, settings, ref_logprobs,
                                      sampler_logprobs, entropies)
    denominator = loss_denominator(loss_tokens(completion_mask, old_logprobs, sampler_logprobs, settings),
                                   settings.aggregation, settings.max_completion_tokens)
    return loss_sum / max(denominator, 1), {key: float(value) for key, value in metrics.items()}
