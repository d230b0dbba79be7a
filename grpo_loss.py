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
(config.loss_settings) through update.update_policy to `grpo_loss_sum`: a new option is a field (its flag, help and
checks come from the field's metadata) plus its use here.

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
    """Every option of the loss. Add one here and use it in `grpo_loss_sum`; its default must leave the paper's loss
    unchanged (the defaults are the paper; study.py pins a new option at its default)."""
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
    "token": number of kept tokens; "fixed": rows x max_completion_tokens (the generation limit, not the
    padded width). Masked rows still count as rows for "sequence" and "fixed" (as in TRL: those
    normalisers do not depend on what the rows hold). It is a sum over rows, so a distributed caller
    sums the local values over ranks. It is 0 only for "token" with no kept token (the numerator is
    then 0 too): divide by max(denominator, 1).
    """
    _check_aggregation(aggregation)
    masks = [completion_masks] if isinstance(completion_masks, torch.Tensor) else list(completion_masks)
    if any(mask.dim() != 2 for mask in masks):
        raise ValueError(f"completion masks must be [B, C]; got shapes {[tuple(m.shape) for m in masks]}")
    rows = sum(mask.shape[0] for mask in masks)
    if aggregation == "sequence":
        return rows
    lengths = [mask.bool().sum(-1) for mask in masks]
    if aggregation == "token":
        return int(sum(int(length.sum()) for length in lengths))
    limit = max_completion_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"aggregation 'fixed' needs max_completion_tokens >= 1, got {max_completion_tokens!r}")
    longest = max((int(length.max()) for length in lengths if length.numel()), default=0)
    if longest > max_completion_tokens:
        raise ValueError(f"a completion has {longest} tokens > max_completion_tokens = {max_completion_tokens}")
    return rows * max_completion_tokens


def grpo_loss_sum(
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
    """Numerator of the loss of these rows: divide by `loss_denominator` of the whole update batch.

    settings: the LossSettings (None: the paper's); options: fields of it to replace (`loss_settings`).

    "sequence": sum_i 1/|o_i| sum_t loss_it (a row with no tokens adds 0); "token" and "fixed":
    sum_it loss_it (they differ only in the denominator). Micro-batches therefore accumulate exactly:
    sum over micro-batches of grpo_loss_sum / loss_denominator(all masks) = the full-batch loss.
    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO clip-higher; None = clip_eps).
    importance_sampling_level "sequence" (GSPO): the ratio is exp of the row's mean token log-ratio, one per row, shared
    by its tokens (TRL's [B, 1]; verl writes it per token as exp(logp - sg(logp) + sg(mean)): the same value and
    gradient). policy_loss "cispo": each token's term is -sg(clipped ratio) A log pi instead of the min.
    With importance_sampling_correction, the weights (`importance_weights` of old_logprobs and sampler_logprobs
    [B, C], the sampler's) multiply each token's policy-gradient term, not its KL term; "token_reject" takes its
    rejected tokens out of the mask instead (`loss_tokens`: their KL term too, and out of their row's token count).
    Metrics: token means over this call's kept tokens, see `grpo_loss` (plus "importance_weight_mean", over every
    completion token: the mean weight, for "token_reject" the fraction accepted), as 0-dim tensors on the device:
    reading one is a host sync, which the update makes once per optimizer step. Advantages must be finite (checked
    on the host by `grpo_loss` and update.update_policy: a check here would be a sync).
    """
    settings = loss_settings(settings, **options)
    clip_eps, clip_eps_high, kl_coef, aggregation = (settings.clip_eps, settings.clip_eps_high, settings.kl_coef,
                                                     settings.aggregation)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, C], got shape {tuple(logprobs.shape)}")
    same_shape = {
        "old_logprobs": old_logprobs, "completion_mask": completion_mask, "ref_logprobs": ref_logprobs
    }
    for name, t in same_shape.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not clip_eps > 0 or not clip_high > 0:
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps} and {clip_eps_high}")
    _check_aggregation(aggregation)
    for name, value, allowed in (("importance_sampling_level", settings.importance_sampling_level,
                                  IMPORTANCE_SAMPLING_LEVELS), ("policy_loss", settings.policy_loss, POLICY_LOSSES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {kl_coef} > 0 needs ref_logprobs")

    token_weights = None  # importance sampling against the sampler-trainer mismatch (rollout_check.py)
    if settings.importance_sampling_correction != "none":
        if sampler_logprobs is None or sampler_logprobs.shape != logprobs.shape:
            raise ValueError(f"importance_sampling_correction {settings.importance_sampling_correction!r} needs the "
                             "sampler's log-probs [B, C] (sampling.Rollouts.sampler_logprobs)")
        token_weights = importance_weights(old_logprobs, sampler_logprobs, settings.importance_sampling_correction,
                                           settings.is_clip)
    generated = completion_mask.bool()  # before token_reject's rejection: what importance_weight_mean is over

    # Padded positions may hold anything (even inf/NaN): zero them *before* exp so that neither the
    # value nor the gradient (0 * inf) can turn into NaN.
    keep = loss_tokens(completion_mask, old_logprobs, sampler_logprobs, settings).bool()
    mask = keep.float()

    def tokens(x: Tensor) -> Tensor:
        return torch.where(keep, x.float(), 0.0)

    logp = tokens(logprobs)
    adv = advantages.float()[:, None]
    log_ratio = logp - tokens(old_logprobs)
    if settings.importance_sampling_level == "sequence":  # GSPO: [B, 1], the row's mean log-ratio (TRL's form)
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_eps, 1 + clip_high)
    if settings.policy_loss == "cispo":  # the weight bounded and detached: every token keeps grad log pi
        per_token = -clipped_ratio.detach() * adv * logp
    else:
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if token_weights is not None:
        per_token = per_token * tokens(token_weights.detach())
    if settings.top_entropy_quantile < 1:  # TRL: per_token_loss * entropy_mask, before the KL term
        if entropies is None or entropies.shape != logprobs.shape:
            raise ValueError(f"top_entropy_quantile {settings.top_entropy_quantile} needs the entropies [B, C] of the "
                             "policy at the completion tokens (token_logprobs(..., with_entropies=True))")
        per_token = per_token * high_entropy_mask(entropies, keep, settings.top_entropy_quantile)
    if ref_logprobs is not None:
        log_ref_ratio = tokens(ref_logprobs) - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    row_sums = (per_token * mask).sum(-1)
    if aggregation == "sequence":
        row_sums = row_sums / mask.sum(-1).clamp(min=1)  # empty completions contribute 0, not NaN
    loss_sum = row_sums.sum()

    with torch.no_grad():  # on the device: the caller reads them when it reads the loss (one host sync)
        num_tokens = mask.sum().clamp(min=1)

        def masked_mean(x: Tensor) -> Tensor:
            return (x.float() * mask).sum() / num_tokens

        # ppo_clip: the tokens the clip takes the gradient from; cispo: those whose weight is bounded (verl's).
        signs = (adv < 0, adv > 0) if settings.policy_loss == "ppo_clip" else (True, True)
        low = (ratio < 1 - clip_eps) & signs[0]
        high = (ratio > 1 + clip_high) & signs[1]
        metrics = {
            "clip_ratio/low_mean": masked_mean(low),
            "clip_ratio/high_mean": masked_mean(high),
            "clip_ratio/region_mean": masked_mean(low | high),
            "ratio_mean": masked_mean(ratio),
            "kl": masked_mean(kl) if ref_logprobs is not None else logp.new_zeros(()),
        }
        if token_weights is not None:  # token_reject: the fraction of tokens accepted (0 without a token)
            metrics["importance_weight_mean"] = (token_weights.float() * generated).sum() / generated.sum().clamp(min=1)
    return loss_sum, metrics


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
