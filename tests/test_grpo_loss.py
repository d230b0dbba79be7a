"""GRPO-PODS objective (grpo_loss.py): loss and gradient vs a naive per-token loop, clipping, masking, KL, the loss
aggregations, clip-higher, truncated rows and importance-sampling weights. Completion log-probabilities:
test_policy.py."""

import math

import pytest
import torch

import grpo_loss as gl
import loss_options

EPS = 0.2


def naive_loss_and_grad(logp, old, adv, mask, ref=None, beta=0.0, eps=EPS, eps_high=None,
                        aggregation="sequence", max_tokens=None, weights=None):
    """Per-token Python loop with hand-derived gradient d(-J)/d logp; each token's term is divided by
    its aggregation's normaliser: |o_i| x B (sequence), all kept tokens (token), B x max_tokens (fixed)."""
    batch, width = len(logp), len(logp[0])
    eps_high = eps if eps_high is None else eps_high
    total, grad = 0.0, [[0.0] * width for _ in range(batch)]
    all_tokens = sum(sum(row) for row in mask)
    for i in range(batch):
        count = sum(mask[i])
        if count == 0:
            continue
        norm = {"sequence": count * batch, "token": all_tokens, "fixed": batch * (max_tokens or 0)}[aggregation]
        for t in range(width):
            if not mask[i][t]:
                continue
            rho = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(rho, 1 - eps), 1 + eps_high)
            unclipped_term, clipped_term = rho * adv[i], clipped * adv[i]
            term = -min(unclipped_term, clipped_term)
            # d/dlogp of -min(...): -rho*A when the unclipped branch is active, 0 when clipped.
            dterm = -rho * adv[i] if unclipped_term <= clipped_term else 0.0
            if weights is not None:  # importance sampling: the policy-gradient term only
                term, dterm = term * weights[i][t], dterm * weights[i][t]
            if ref is not None and beta > 0:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
                dterm += beta * (1 - math.exp(d))
            total += term / norm
            grad[i][t] = dterm / norm
    return total, torch.tensor(grad, dtype=torch.float64)


def random_batch(seed, batch=5, width=7):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(batch, width, generator=gen, dtype=torch.float64) * 0.3  # some clipped
    ref = logp + torch.randn(batch, width, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([width, 3, 0, 1, width - 2][:batch])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_and_gradient_match_naive_loop(beta):
    for seed in range(3):
        logp, old, ref, adv, mask = random_batch(seed)
        lists = [t.tolist() for t in (logp, old, adv, mask, ref)]
        want, want_grad = naive_loss_and_grad(*lists, beta=beta)
        x = logp.clone().requires_grad_(True)
        loss, metrics = gl.grpo_loss(x, old, adv, mask, ref_logprobs=ref, kl_coef=beta)
        loss.backward()
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert abs(loss.item() - want) < 1e-5
        assert torch.allclose(x.grad, want_grad, atol=1e-6)


# The worked example: ratios pi_old / pi_sampler [0.5, 3, 1, 0.056] with C = 2, each mode against its reference.
EXAMPLE_OLD, EXAMPLE_SAMPLER = [0.5, 0.9, 0.9, 0.05], [1.0, 0.3, 0.9, 0.9]   # probabilities of the 4 tokens
EXAMPLE_WEIGHTS = {
    "tis": [0.5, 2.0, 1.0, 0.05 / 0.9],            # TRL token_truncate: min(ratio, C)
    "token_mask": [0.5, 0.0, 1.0, 0.05 / 0.9],     # TRL token_mask: ratio.masked_fill(ratio > C, 0)
    "token_reject": [1.0, 0.0, 1.0, 0.0],          # verl rollout_rs token_k1: 1 iff 1/C <= ratio <= C
}


@pytest.mark.parametrize("correction", sorted(EXAMPLE_WEIGHTS))
def test_importance_weights_equal_the_reference_each_mode_is_named_after(correction):
    old, sampler = torch.tensor([EXAMPLE_OLD]).log(), torch.tensor([EXAMPLE_SAMPLER]).log()
    weights = loss_options.importance_weights(old, sampler, correction, 2.0)
    assert torch.allclose(weights, torch.tensor([EXAMPLE_WEIGHTS[correction]]), atol=1e-6)


@pytest.mark.parametrize("aggregation", loss_options.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("correction", sorted(EXAMPLE_WEIGHTS))
def test_the_example_loss_and_its_denominator_per_mode(correction, aggregation):
    """A = 1, pi_old = pi (ratio 1), one row of 4 tokens and one of 2 (both with the example's weights, the second
    cut to its first 2 tokens), max 4 tokens. TRL's modes weight the policy-gradient term and keep every token in
    every denominator; verl's rejection takes the rejected tokens out of the loss mask, so out of each row's token
    count ("sequence") and of the "token" denominator; "fixed" stays rows x max tokens (verl: a constant)."""
    old = torch.tensor([EXAMPLE_OLD, EXAMPLE_OLD]).log()
    sampler = torch.tensor([EXAMPLE_SAMPLER, EXAMPLE_SAMPLER]).log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    w = EXAMPLE_WEIGHTS[correction]
    if correction == "token_reject":    # verl: response_mask *= accepted; weight 1 on what is left
        rows = [[1.0, 1.0], [1.0]]      # accepted weights of row 0 (tokens 0, 2) and row 1 (token 0)
    else:
        rows = [w, w[:2]]
    want = {"sequence": -(sum(rows[0]) / len(rows[0]) + sum(rows[1]) / len(rows[1])) / 2,
            "token": -(sum(rows[0]) + sum(rows[1])) / (len(rows[0]) + len(rows[1])),
            "fixed": -(sum(rows[0]) + sum(rows[1])) / (2 * 4)}[aggregation]
    logp = old.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(logp, old, torch.ones(2), mask, aggregation=aggregation, max_completion_tokens=4,
                                 importance_sampling_correction=correction, is_clip=2.0, sampler_logprobs=sampler)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    denominator = gl.loss_denominator(gl.loss_tokens(mask, old, sampler, loss_options.loss_settings(
        importance_sampling_correction=correction, is_clip=2.0)), aggregation, 4)
    kept_tokens = 3 if correction == "token_reject" else 6
    assert denominator == {"sequence": 2, "token": kept_tokens, "fixed": 8}[aggregation]
    assert metrics["importance_weight_mean"] == pytest.approx((sum(w) + sum(w[:2])) / 6, rel=1e-5)


@pytest.mark.parametrize("correction, clip", [(correction, clip) for correction in loss_options.IS_CORRECTIONS[1:]
                                              for clip in (2.0, 1.2)])
def test_importance_weights_match_a_per_token_reference(correction, clip):
    """tis: min(w, C); token_mask: w where w <= C, else 0; token_reject: 1 where 1/C <= w <= C, else 0, with the
    rejected tokens out of the mask (loss, KL term and denominators); detached; the weights scale each token's
    policy-gradient term and leave the KL term alone (loss and gradient against the naive loop)."""
    logp, old, ref, adv, mask = random_batch(4)
    sampler = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.6

    def reference(o, s):
        w = math.exp(o - s)
        return {"tis": min(w, clip), "token_mask": w if w <= clip else 0.0,
                "token_reject": float(1 / clip <= w <= clip)}[correction]

    want = [[reference(o, s) for o, s in zip(old_row, sampler_row)]
            for old_row, sampler_row in zip(old.tolist(), sampler.tolist())]
    weights = loss_options.importance_weights(old.requires_grad_(True), sampler, correction, clip)
    assert not weights.requires_grad and torch.allclose(weights.double(), torch.tensor(want, dtype=torch.float64))
    bound = weights[mask.bool()] == (clip if correction == "tis" else 0.0)
    assert 0 < float(bound.double().mean()) < 1   # the cap (or the mask) binds on some tokens, not on all
    old = old.detach()
    naive_mask = mask.tolist()
    if correction == "token_reject":   # verl: rejected tokens leave the mask itself
        naive_mask = [[m * int(w) for m, w in zip(mask_row, w_row)] for mask_row, w_row in zip(naive_mask, want)]
    expected, expected_grad = naive_loss_and_grad(*[t.tolist() for t in (logp, old, adv)], naive_mask,
                                                  ref.tolist(), beta=0.1, weights=weights.tolist())
    x = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, old, adv, mask, ref_logprobs=ref, sampler_logprobs=sampler, kl_coef=0.1,
                                 importance_sampling_correction=correction, is_clip=clip)
    loss.backward()
    assert abs(loss.item() - expected) < 1e-5 and torch.allclose(x.grad, expected_grad, atol=1e-6)
    assert metrics["importance_weight_mean"] == pytest.approx(float(weights[mask.bool()].double().mean()))
    with pytest.raises(ValueError, match="clip must be >= 1"):
        loss_options.importance_weights(old, sampler, correction, 0.5)
    with pytest.raises(ValueError, match="one of"):
        loss_options.importance_weights(old, sampler, "none", 2.0)
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        gl.grpo_loss(x, old, adv, mask, importance_sampling_correction=correction)


def test_the_removed_mask_mode_is_refused_naming_its_replacements():
    old = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="'mask'.*token_mask.*token_reject"):
        loss_options.importance_weights(old, old, "mask", 2.0)


def test_metrics_match_naive_counts():
    logp, old, ref, adv, mask = random_batch(7)
    _, metrics = gl.grpo_loss(logp, old, adv, mask, ref_logprobs=ref)
    m = mask.bool()
    rho = torch.exp(logp - old)[m]
    a = adv[:, None].expand_as(logp)[m]
    low, high = (rho < 1 - EPS) & (a < 0), (rho > 1 + EPS) & (a > 0)
    d = (ref - logp)[m]
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low.double().mean().item())
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high.double().mean().item())
    assert metrics["clip_ratio/region_mean"] == pytest.approx((low | high).double().mean().item())
    assert metrics["clip_ratio/region_mean"] > 0  # the fixture does exercise clipping
    assert metrics["ratio_mean"] == pytest.approx(rho.mean().item(), rel=1e-6)
    assert metrics["kl"] == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-5)
    assert set(metrics) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                            "ratio_mean", "kl"}


def test_clipped_tokens_get_zero_gradient_and_others_do_not():
    logp, old, _, adv, mask = random_batch(11)
    x = logp.clone().requires_grad_(True)
    gl.grpo_loss(x, old, adv, mask)[0].backward()
    rho, a = torch.exp(logp - old), adv[:, None].expand_as(logp)
    clipped = ((rho > 1 + EPS) & (a > 0)) | ((rho < 1 - EPS) & (a < 0))
    live = mask.bool() & ~clipped
    assert clipped[mask.bool()].any() and live.any()
    assert torch.all(x.grad[clipped] == 0)
    assert torch.all(x.grad[live] != 0)


def test_masked_tokens_contribute_nothing():
    logp, old, ref, adv, mask = random_batch(4)
    pad = mask == 0
    # Padded positions full of overflowing, infinite and NaN values must change nothing.
    garbage = logp.masked_fill(pad, 500.0)
    old_garbage = old.masked_fill(pad, -float("inf")).masked_fill(pad & (torch.arange(7) % 2 == 0), math.nan)
    ref_garbage = ref.masked_fill(pad, 1e9)
    x = garbage.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, old_garbage, adv, mask.bool(), ref_logprobs=ref_garbage, kl_coef=0.1)
    loss.backward()
    reference, ref_metrics = gl.grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert metrics == pytest.approx(ref_metrics)
    assert torch.all(x.grad[pad] == 0) and torch.isfinite(x.grad).all()


def test_one_update_per_batch_gives_the_plain_policy_gradient():
    logp, _, _, adv, mask = random_batch(5)
    x = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, x.detach(), adv, mask)
    loss.backward()
    lengths = mask.sum(-1).clamp(min=1).double()
    policy_gradient = -(adv / lengths)[:, None] * mask / len(adv)  # d/dlogp of -mean_i A_i/|o_i| sum_t logp
    assert torch.allclose(x.grad, policy_gradient, atol=1e-7)
    has_tokens = (mask.sum(-1) > 0).double()
    assert loss.item() == pytest.approx(-(adv * has_tokens).mean().item(), rel=1e-6)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_ratio/region_mean"] == 0.0


def test_zero_advantages_and_empty_rows_give_zero_gradient_without_nan():
    logp, old, _, _, mask = random_batch(2)
    x = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, old, torch.zeros(len(logp)), mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)
    empty = torch.zeros_like(mask)
    y = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(y, old, torch.ones(len(logp)), empty)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(y.grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_kl_term_value_and_gradient():
    logp, _, ref, _, mask = random_batch(9)
    x = logp.clone().requires_grad_(True)
    beta = 0.04
    loss, metrics = gl.grpo_loss(x, x.detach(), torch.zeros(len(logp)), mask, ref_logprobs=ref, kl_coef=beta)
    loss.backward()
    d = ref - logp
    lengths = mask.sum(-1).clamp(min=1)[:, None]
    want = beta * ((d.exp() - d - 1) * mask / lengths).sum(-1).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(x.grad, beta * (1 - d.exp()) * mask / lengths / len(logp), atol=1e-7)
    kl_only, metrics_no_beta = gl.grpo_loss(logp, logp, torch.zeros(len(logp)), mask, ref_logprobs=ref)
    assert kl_only.item() == 0.0 and metrics["kl"] > 0
    assert metrics_no_beta["kl"] == pytest.approx(metrics["kl"])  # reported even when beta = 0


def test_bfloat16_logprobs_are_computed_in_float32():
    logp, old, ref, adv, mask = random_batch(3)
    low = [t.bfloat16() for t in (logp, old, adv, ref)]
    loss, _ = gl.grpo_loss(*low[:3], mask, ref_logprobs=low[3], kl_coef=0.1)
    upcast = [t.float() for t in low]
    want, _ = gl.grpo_loss(*upcast[:3], mask, ref_logprobs=upcast[3], kl_coef=0.1)
    assert loss.dtype == torch.float32 and loss.item() == want.item()


def test_grpo_loss_rejects_bad_input():
    logp, old, ref, adv, mask = random_batch(1)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        gl.grpo_loss(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \[5\]"):
        gl.grpo_loss(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match=r"old_logprobs shape \(5, 6\)"):
        gl.grpo_loss(logp, old[:, :6], adv, mask)
    with pytest.raises(ValueError, match="non-finite"):
        gl.grpo_loss(logp, old, adv * float("nan"), mask)


# --- variants: loss aggregation, clip-higher, truncated completions ---------------------------------

@pytest.mark.parametrize("aggregation", loss_options.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_each_aggregation_matches_naive_loop_with_empty_and_truncated_rows(aggregation, eps_high):
    for seed in range(3):
        logp, old, ref, adv, mask = random_batch(seed)  # row 2 is an empty completion
        for truncated in (torch.zeros(5, dtype=torch.bool), torch.tensor([True, False, False, False, True])):
            kept = loss_options.mask_truncated(mask, truncated)
            lists = [t.tolist() for t in (logp, old, adv, kept, ref)]
            want, want_grad = naive_loss_and_grad(*lists, beta=0.1, eps_high=eps_high, aggregation=aggregation,
                                                  max_tokens=9)
            x = logp.clone().requires_grad_(True)
            loss, _ = gl.grpo_loss(x, old, adv, kept, ref_logprobs=ref, kl_coef=0.1, clip_eps_high=eps_high,
                                   aggregation=aggregation, max_completion_tokens=9)
            loss.backward()
            assert abs(loss.item() - want) < 1e-5, (aggregation, seed, truncated)
            assert torch.allclose(x.grad, want_grad, atol=1e-6)
            assert torch.all(x.grad[truncated] == 0)


def test_aggregations_differ_and_sequence_is_the_default():
    logp, old, ref, adv, mask = random_batch(6)
    losses = {a: gl.grpo_loss(logp, old, adv, mask, aggregation=a, max_completion_tokens=7)[0].item()
              for a in loss_options.LOSS_AGGREGATIONS}
    assert losses["sequence"] == gl.grpo_loss(logp, old, adv, mask)[0].item()
    assert len(set(losses.values())) == 3
    # Same numerator for token and fixed; only the normaliser differs.
    assert losses["token"] * int(mask.sum()) == pytest.approx(losses["fixed"] * 5 * 7, rel=1e-6)


@pytest.mark.parametrize("aggregation", loss_options.LOSS_AGGREGATIONS)
def test_micro_batch_numerators_over_global_denominator_equal_the_full_batch(aggregation):
    logp, old, ref, adv, mask = random_batch(8)
    mask = loss_options.mask_truncated(mask, torch.tensor([False, False, False, True, False]))
    kwargs = dict(kl_coef=0.05, clip_eps_high=0.3, aggregation=aggregation)
    full_x = logp.clone().requires_grad_(True)
    full, _ = gl.grpo_loss(full_x, old, adv, mask, ref_logprobs=ref, max_completion_tokens=7, **kwargs)
    full.backward()
    micro = [slice(0, 2), slice(2, 4), slice(4, 5)]
    # Trim each micro-batch's columns to its longest completion, as the trainer does.
    widths = [max(1, int(mask[rows].sum(-1).max())) for rows in micro]
    denominator = gl.loss_denominator([mask[rows, :w] for rows, w in zip(micro, widths)], aggregation, 7)
    assert denominator == gl.loss_denominator(mask, aggregation, 7)
    x = logp.clone().requires_grad_(True)
    accumulated = 0.0
    for rows, w in zip(micro, widths):
        part, _ = gl.grpo_loss_sum(x[rows, :w], old[rows, :w], adv[rows], mask[rows, :w],
                                   ref_logprobs=ref[rows, :w], **kwargs)
        (part / max(denominator, 1)).backward()
        accumulated += part.item() / max(denominator, 1)
    assert accumulated == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(x.grad, full_x.grad, atol=1e-7)


def clip_case():
    """Hand-made tokens, old log-prob 0: row 0 has A = +1 and ratios 1.25, 1.35; row 1 has A = -1 and
    ratios 0.75, 1.25. With eps = 0.2: 1.25 (A > 0) is clipped unless eps_high >= 0.25, 1.35 is clipped
    at 1.3 with eps_high = 0.3, 0.75 (A < 0) is always clipped low, 1.25 with A < 0 is never clipped."""
    ratios = torch.tensor([[1.25, 1.35], [0.75, 1.25]], dtype=torch.float64)
    return ratios.log(), torch.zeros(2, 2, dtype=torch.float64), torch.tensor([1.0, -1.0]), torch.ones(2, 2)


@pytest.mark.parametrize("eps_high,want_loss,want_grad,high_mean", [
    (None, (-1.2 + 1.025) / 2, [[0.0, 0.0], [0.0, 0.3125]], 0.5),
    (0.3, (-1.275 + 1.025) / 2, [[-0.3125, 0.0], [0.0, 0.3125]], 0.25),
])
def test_clip_higher_widens_the_upper_bound_for_positive_advantages(eps_high, want_loss, want_grad, high_mean):
    logp, old, adv, mask = clip_case()
    x = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert torch.allclose(x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-6)
    assert metrics["clip_ratio/high_mean"] == high_mean and metrics["clip_ratio/low_mean"] == 0.25
    assert metrics["clip_ratio/region_mean"] == high_mean + 0.25


def test_clip_higher_with_clipping_on_one_side_only():
    logp, old, adv, mask = clip_case()
    # Row 0 alone (A > 0): only the upper bound acts; eps_high = 0.3 frees 1.25 and caps 1.35 at 1.3.
    for eps_high, want_value, want_grad in ((None, -1.2, [0.0, 0.0]), (0.3, -1.275, [-0.625, 0.0])):
        x = logp[:1].clone().requires_grad_(True)
        loss, metrics = gl.grpo_loss(x, old[:1], adv[:1], mask[:1], clip_eps_high=eps_high)
        loss.backward()
        assert loss.item() == pytest.approx(want_value, rel=1e-6) and metrics["clip_ratio/low_mean"] == 0
        assert torch.allclose(x.grad[0], torch.tensor(want_grad, dtype=torch.float64), atol=1e-6)
    # Row 1 alone (A < 0): only the lower bound acts, so eps_high changes nothing.
    results = []
    for eps_high in (None, 0.3, 5.0):
        x = logp[1:].clone().requires_grad_(True)
        loss, metrics = gl.grpo_loss(x, old[1:], adv[1:], mask[1:], clip_eps_high=eps_high)
        loss.backward()
        results.append((loss.item(), x.grad.tolist(), metrics))
    assert results[0] == results[1] == results[2]
    assert results[0][0] == pytest.approx((0.8 + 1.25) / 2) and results[0][2]["clip_ratio/high_mean"] == 0
    assert results[0][1][0] == pytest.approx([0.0, 0.625])


def test_mask_truncated_zeroes_rows_and_shrinks_only_the_token_denominator():
    _, _, _, _, mask = random_batch(0)
    truncated = torch.tensor([True, False, False, True, False])
    for dtype in (torch.long, torch.bool, torch.float32):
        kept = loss_options.mask_truncated(mask.to(dtype), truncated)
        assert kept.dtype == dtype and not kept[truncated].any()
        assert torch.equal(kept[~truncated], mask[~truncated].to(dtype))
    kept = loss_options.mask_truncated(mask, truncated)
    assert gl.loss_denominator(kept, "token") == int(mask.sum()) - int(mask[truncated].sum())
    assert gl.loss_denominator(kept, "sequence") == gl.loss_denominator(mask, "sequence") == 5
    assert gl.loss_denominator(kept, "fixed", 7) == 35
    with pytest.raises(ValueError, match="truncated must be a bool"):
        loss_options.mask_truncated(mask, truncated.long())
    with pytest.raises(ValueError, match=r"\[B\] = \[5\]"):
        loss_options.mask_truncated(mask, truncated[:3])


def test_loss_denominator_is_additive_and_rejects_bad_input():
    _, _, _, _, mask = random_batch(0)
    for aggregation in loss_options.LOSS_AGGREGATIONS:
        parts = [mask[:2], mask[2:4, :4], mask[4:]]
        assert gl.loss_denominator(parts, aggregation, 7) == gl.loss_denominator(mask, aggregation, 7)
    assert gl.loss_denominator(torch.zeros(3, 4), "token") == 0
    with pytest.raises(ValueError, match="needs max_completion_tokens"):
        gl.loss_denominator(mask, "fixed")
    with pytest.raises(ValueError, match="7 tokens > max_completion_tokens = 6"):
        gl.loss_denominator(mask, "fixed", 6)
    with pytest.raises(ValueError, match="loss aggregation must be one of"):
        gl.loss_denominator(mask, "mean")
    logp, old, _, adv, _ = random_batch(0)
    with pytest.raises(ValueError, match="loss aggregation must be one of"):
        gl.grpo_loss_sum(logp, old, adv, mask, aggregation="seq")
    with pytest.raises(ValueError, match="clip_eps_high must be > 0"):
        gl.grpo_loss(logp, old, adv, mask, clip_eps_high=0.0)
