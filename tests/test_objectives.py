"""The objectives of later work beside the paper's loss (grpo_loss.py; their parts: loss_options.py): GSPO's
sequence-level ratio (`importance_sampling_level="sequence"`), CISPO's clipped, detached weight
(`policy_loss="cispo"`) and the high-entropy token mask (`high_entropy_mask`, `picked_logprobs(...,
with_entropies=True)`), each against a hand computation of its reference (TRL 1.16's GRPOTrainer._compute_loss,
verl's core_algos.py) on a batch where it changes the loss, and each shown to leave the paper's gradient unchanged
where its reference says it must."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

import grpo_loss as gl
import loss_options
import policy

EPS = 0.2


def stale_batch(seed, batch=5, width=7):
    """Log-probs, older ones 0.4-noisy per token and 0.3 per row (many ratios outside [0.8, 1.2], rows whose mean
    ratio is outside too),
    advantages of both signs, rows of 7, 3, 0, 1 and 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(batch, width, generator=gen, dtype=torch.float64) * 0.4
    old = old + torch.randn(batch, 1, generator=gen, dtype=torch.float64) * 0.3   # whole rows drift too
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([width, 3, 0, 1, width - 2][:batch])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return logp, old, adv, mask


def loss_and_grad(logp, old, adv, mask, **options):
    x = logp.clone().requires_grad_(True)
    loss, metrics = gl.grpo_loss(x, old, adv, mask, **options)
    loss.backward()
    return loss.item(), x.grad, metrics


def naive_gspo(logp, old, adv, mask, aggregation, eps=EPS, eps_high=EPS):
    """TRL 1.16 grpo_trainer.py _compute_loss, importance_sampling_level="sequence", per row in a Python loop:
    log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  (lines 3086-3088),
    coef_1 = exp(that) (3095), coef_2 = clamp(coef_1, 1 - eps, 1 + eps_high) (3113), per_token_loss =
    -min(coef_1 A, coef_2 A) (3116-3118), a [B, 1] value broadcast over the row's tokens; loss_type "grpo" (3153-3154:
    each row's token mean, averaged over rows) or "dapo"/"bnpo" (the sum over tokens / the number of tokens).
    Gradient by hand: d s / d logp_t = s / |o| for each of the row's tokens; 0 where the clipped branch is the min."""
    rows, width = len(logp), len(logp[0])
    total, grad = 0.0, [[0.0] * width for _ in range(rows)]
    all_tokens = sum(sum(row) for row in mask)
    for i in range(rows):
        count = sum(mask[i])
        if count == 0:
            continue
        s = math.exp(sum(logp[i][t] - old[i][t] for t in range(width) if mask[i][t]) / count)
        clipped = min(max(s, 1 - eps), 1 + eps_high)
        term = -min(s * adv[i], clipped * adv[i])
        dterm = -adv[i] * s / count if s * adv[i] <= clipped * adv[i] else 0.0   # per token, d term / d logp_t
        share = 1 / rows if aggregation == "sequence" else count / all_tokens    # the row's weight in the mean
        total += term * share
        for t in range(width):
            if mask[i][t]:
                grad[i][t] = dterm * share
    return total, torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_gspo_is_trls_sequence_level_ratio(aggregation):
    logp, old, adv, mask = stale_batch(3)
    want, want_grad = naive_gspo(*[t.tolist() for t in (logp, old, adv, mask)], aggregation)
    loss, grad, metrics = loss_and_grad(logp, old, adv, mask, importance_sampling_level="sequence",
                                        aggregation=aggregation)
    assert loss == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-5)
    # The batch has power: some rows are clipped (zero gradient), others not, and the token-level loss differs.
    clipped_rows = [i for i in range(len(logp)) if mask[i].any() and not grad[i].any()]
    assert clipped_rows and metrics["clip_ratio/region_mean"] > 0
    token_loss, token_grad, _ = loss_and_grad(logp, old, adv, mask, aggregation=aggregation)
    assert abs(token_loss - loss) > 1e-3 and not torch.allclose(token_grad, grad)


def test_gspo_equals_verls_token_form_of_the_sequence_ratio():
    """verl core_algos.compute_policy_loss_gspo writes the ratio per token, exp(logp - sg(logp) + sg(seq mean)),
    clipped per token, with seq-mean-token-mean: the same value and the same gradient as TRL's [B, 1] ratio."""
    logp, old, adv, mask = stale_batch(5)
    m = mask.double()
    x = logp.clone().requires_grad_(True)
    seq = ((x - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(x - x.detach() + seq.detach())
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - EPS, 1 + EPS) * adv[:, None])
    verl = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    verl.backward()
    loss, grad, _ = loss_and_grad(logp, old, adv, mask, importance_sampling_level="sequence")
    assert loss == pytest.approx(verl.item(), abs=1e-6)
    torch.testing.assert_close(grad, x.grad, atol=1e-7, rtol=1e-5)


def naive_cispo(logp, old, adv, mask, aggregation, low, high):
    """verl core_algos.compute_policy_loss_cispo: w = clamp(ratio, 1 - low, 1 + high).detach(), pg_losses =
    -w A logp, aggregated; TRL 1.16 grpo_trainer.py lines 3109-3111: clamp(coef_1, max=epsilon_high).detach() x A x
    per_token_logps (no lower bound: low = 1 here). Gradient by hand: -w A per token (w is a constant)."""
    rows, width = len(logp), len(logp[0])
    total, grad = 0.0, [[0.0] * width for _ in range(rows)]
    all_tokens = sum(sum(row) for row in mask)
    for i in range(rows):
        count = sum(mask[i])
        for t in range(width):
            if not mask[i][t]:
                continue
            w = min(max(math.exp(logp[i][t] - old[i][t]), 1 - low), 1 + high)
            norm = rows * count if aggregation == "sequence" else all_tokens
            total += -w * adv[i] * logp[i][t] / norm
            grad[i][t] = -w * adv[i] / norm
    return total, torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("aggregation, low, high", [("token", 1.0, 4.0), ("token", EPS, EPS), ("sequence", EPS, 0.28)])
def test_cispo_is_the_clipped_detached_weight_times_the_log_prob(aggregation, low, high):
    """(token, 1, 4) is TRL's loss_type="cispo" at its recommended epsilon_high = 5 (its normaliser: the tokens);
    (., 0.2, 0.2) verl's loss_mode cispo at its default clip ratios."""
    logp, old, adv, mask = stale_batch(3)
    want, want_grad = naive_cispo(*[t.tolist() for t in (logp, old, adv, mask)], aggregation, low, high)
    high_option = None if high == EPS else high
    loss, grad, _ = loss_and_grad(logp, old, adv, mask, policy_loss="cispo", aggregation=aggregation,
                                  clip_eps=low, clip_eps_high=high_option)
    assert loss == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-5)
    # Unlike the clip, CISPO keeps every token's gradient: the tokens the clip zeroes have one here.
    _, ppo_grad, _ = loss_and_grad(logp, old, adv, mask, aggregation=aggregation, clip_eps=low,
                                   clip_eps_high=high_option)
    zeroed = mask.bool() & (ppo_grad == 0) & (adv[:, None] != 0)
    if low < 1:  # at [0.8, 1.2] the clip zeroes some tokens of this batch
        assert zeroed.any()
    assert torch.all(grad[mask.bool()] != 0)


def test_cispo_weight_is_trls_clamp_with_no_lower_bound():
    """TRL's clamp(coef_1, max=epsilon_high) is pods' [1 - 1, 1 + (epsilon_high - 1)]: ratio >= 0 binds nothing."""
    logp, old, adv, mask = stale_batch(8)
    coef_1 = torch.exp(logp - old)
    weight = torch.clamp(coef_1, max=1.3).detach()
    m = mask.double()
    x = logp.clone().requires_grad_(True)
    trl = (-weight * adv[:, None] * x * m).sum() / m.sum()   # loss_type "cispo": over the tokens of the batch
    trl.backward()
    assert (coef_1[mask.bool()] > 1.3).any()
    loss, grad, metrics = loss_and_grad(logp, old, adv, mask, policy_loss="cispo", aggregation="token",
                                        clip_eps=1.0, clip_eps_high=0.3)
    assert loss == pytest.approx(trl.item(), abs=1e-6)
    torch.testing.assert_close(grad, x.grad, atol=1e-7, rtol=1e-5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(float((coef_1[mask.bool()] > 1.3).double().mean()))


def test_gspo_and_cispo_compose_as_in_trl():
    """TRL: with importance_sampling_level="sequence" and loss_type="cispo", the [B, 1] ratio is clamped, detached
    and multiplies each token's log-prob."""
    logp, old, adv, mask = stale_batch(4)
    m = mask.double()
    seq = torch.exp(((logp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))
    weight = seq.clamp(max=1.1).detach()
    x = logp.clone().requires_grad_(True)
    trl = (-weight * adv[:, None] * x * m).sum() / m.sum()
    trl.backward()
    loss, grad, _ = loss_and_grad(logp, old, adv, mask, policy_loss="cispo", importance_sampling_level="sequence",
                                  aggregation="token", clip_eps=1.0, clip_eps_high=0.1)
    assert loss == pytest.approx(trl.item(), abs=1e-6)
    torch.testing.assert_close(grad, x.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(importance_sampling_level="sequence"), dict(policy_loss="cispo"),
                                     dict(policy_loss="cispo", importance_sampling_level="sequence")])
@pytest.mark.parametrize("aggregation", ["sequence", "token", "fixed"])
def test_with_one_update_per_batch_each_gives_the_papers_gradient(options, aggregation):
    """pi_old = pi (ratio 1, the paper's mu = 1): GSPO's and CISPO's gradients are the plain policy gradient, which
    is why train.py warns that they cannot act with --updates-per-batch 1 (ratio_only)."""
    logp, _, adv, mask = stale_batch(6)
    settings = dict(aggregation=aggregation, max_completion_tokens=7)
    _, paper, _ = loss_and_grad(logp, logp, adv, mask, **settings)
    _, grad, _ = loss_and_grad(logp, logp, adv, mask, **settings, **options)
    torch.testing.assert_close(grad, paper, atol=1e-7, rtol=1e-5)
    assert paper.abs().sum() > 0
    fields = {field.name: field for field in dataclasses.fields(loss_options.LossSettings)}
    assert all(fields[name].metadata["ratio_only"] for name in options)


def test_unknown_levels_and_policy_losses_are_refused():
    logp, old, adv, mask = stale_batch(1)
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        gl.grpo_loss(logp, old, adv, mask, importance_sampling_level="row")
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        gl.grpo_loss(logp, old, adv, mask, policy_loss="ppo")


def test_every_option_is_a_named_part_and_a_new_adjustment_plugs_in(monkeypatch):
    """grpo_loss_sum composes named parts: each choice of a choice option is an entry of the registry that option
    picks from (a choice without its part, or a part without its choice, fails here); every adjustment of the
    policy-gradient term is made only where its option is on (the paper's loss makes none; each option switched on
    makes its own); and one more adjustment in TOKEN_ADJUSTMENTS acts on the loss with no other edit (here: the
    policy-gradient term doubled where kl_coef is on, the KL term not)."""
    fields = {field.name: field for field in dataclasses.fields(loss_options.LossSettings)}
    for name, registry in (("importance_sampling_level", gl.LOG_RATIOS), ("policy_loss", gl.POLICY_LOSS_TERMS),
                           ("aggregation", gl.AGGREGATIONS)):
        assert tuple(registry) == tuple(fields[name].metadata["argparse"]["choices"]), name
    logp, old, adv, mask = stale_batch(1)
    made = []
    recording = tuple((option, lambda per_token, terms, measured, option=option: made.append(option) or per_token)
                      for option, _ in gl.TOKEN_ADJUSTMENTS)
    monkeypatch.setattr(gl, "TOKEN_ADJUSTMENTS", recording)
    gl.grpo_loss(logp, old, adv, mask)
    assert made == []  # the paper's loss
    switched_on = dict(importance_sampling_correction=dict(importance_sampling_correction="tis",
                                                           sampler_logprobs=old),
                       top_entropy_quantile=dict(top_entropy_quantile=0.5, entropies=torch.rand_like(logp)))
    for option, _ in recording:
        made.clear()
        gl.grpo_loss(logp, old, adv, mask, **switched_on[option])
        assert made == [option]
    monkeypatch.undo()
    ref = old - 0.1
    options = dict(ref_logprobs=ref, kl_coef=0.1)
    loss, _, _ = loss_and_grad(logp, old, adv, mask, **options)
    policy_term, _, _ = loss_and_grad(logp, old, adv, mask)
    doubling = (*gl.TOKEN_ADJUSTMENTS, ("kl_coef", lambda per_token, terms, measured: 2 * per_token))
    monkeypatch.setattr(gl, "TOKEN_ADJUSTMENTS", doubling)
    doubled, _, _ = loss_and_grad(logp, old, adv, mask, **options)
    assert policy_term != 0 and doubled == pytest.approx(loss + policy_term, rel=1e-5)


# ------------------------------------------------------------------------------------------ high-entropy tokens

def trl_high_entropy_mask(entropies, mask, quantile):
    """TRL 1.16's own GRPOTrainer.get_high_entropy_mask (grpo_trainer.py lines 1380-1416) on one process: its
    accelerator's pad_across_processes and gather are the identity there."""
    from trl import GRPOTrainer

    one_process = SimpleNamespace(pad_across_processes=lambda tensor, dim, pad_index: tensor, gather=lambda x: x)
    return GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=one_process), entropies, mask,
                                             1 - quantile)


@pytest.mark.parametrize("quantile", [0.2, 0.5, 1.0, 0.0])
def test_high_entropy_mask_is_trls(quantile):
    gen = torch.Generator().manual_seed(0)
    entropies = torch.rand(4, 9, generator=gen) * 3
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 0, 7])[:, None]).long()
    entropies[mask == 0] = 100.0  # padding: never ranked, never kept
    ours = loss_options.high_entropy_mask(entropies, mask, quantile)
    assert torch.equal(ours, trl_high_entropy_mask(entropies, mask, quantile))
    kept = int(ours.sum())
    if 0 < quantile < 1:  # about the top quantile of the 20 tokens
        assert kept == math.ceil(quantile * 20) or kept == math.floor(quantile * 20) + 1
    assert kept == {1.0: 20, 0.0: 1}.get(quantile, kept) and not ours[mask == 0].any()
    assert not loss_options.high_entropy_mask(entropies, torch.zeros_like(mask), quantile).any()
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        loss_options.high_entropy_mask(entropies, mask, 1.5)


def test_the_entropy_mask_reads_nothing_back_from_the_device():
    """The quantile over the masked tokens is taken without selecting them (a boolean index makes the host wait for
    the device): no host sync in bench census's count, and on the meta device (shapes, no values: any read fails) it
    runs as it does on the host."""
    from bench import census

    entropies, mask = torch.rand(4, 9, generator=torch.Generator().manual_seed(0)), torch.ones(4, 9, dtype=torch.long)
    mask[1, 4:] = 0
    recorder = census.Census({})
    for tensor in (entropies, mask):
        recorder.device.add(tensor)
    with census.host_boundary(recorder, torch.device("cpu")), recorder:
        loss_options.high_entropy_mask(entropies, mask, 0.2)
    assert not recorder.syncs and sum(recorder.ops.values()) > 0
    on_meta = loss_options.high_entropy_mask(entropies.to("meta"), mask.to("meta"), 0.2)
    assert on_meta.device.type == "meta" and on_meta.shape == (4, 9) and on_meta.dtype == torch.bool


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropies_come_with_the_log_probs_at_no_gradient(temperature):
    """policy.picked_logprobs(..., with_entropies=True): the same log-probs, and TRL's entropy_from_logits of the logits at
    that temperature (TRL divides the logits by the temperature before both), detached; chunked alike."""
    from trl.trainer.utils import entropy_from_logits

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 5, 11, generator=gen) * 2).requires_grad_(True)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    logprobs, entropies = policy.picked_logprobs(logits, targets, temperature, with_entropies=True)
    torch.testing.assert_close(logprobs, policy.picked_logprobs(logits, targets, temperature))
    torch.testing.assert_close(entropies, entropy_from_logits(logits.detach() / temperature))
    assert logprobs.requires_grad and not entropies.requires_grad
    assert not torch.allclose(entropies, entropies.mean())  # positions differ: the ranking has something to rank


# ------------------------------------------------------------------------------------------ the study's plan

@pytest.mark.parametrize("native_bf16", [False, True])
def test_the_objectives_studys_plan_is_todays_demo_with_one_objective_changed(native_bf16, tmp_path):
    """python study.py objectives: 4 arms x 3 seeds, seed-major; every arm at --updates-per-batch 2 (the baseline
    too); each run is the demo preset's settings, every flag given explicitly, and differs from the baseline's only
    in its objective, which train.py's label names; bf16 follows the machine."""
    import warnings

    from run import config
    from run.presets import PRESETS
    import study
    from studies import studyrun
    from test_study import UNPINNED_OK

    runs = study.objectives_plan([0, 1, 2])
    assert list(runs)[:4] == ["paper-n16-m4-s0", "gspo-n16-m4-s0", "cispo-n16-m4-s0", "entropy-n16-m4-s0"]
    assert len(runs) == 12
    settings = study.objectives_train_args(native_bf16=native_bf16)
    parser = config.build_parser()
    unset = object()
    parser.set_defaults(**{action.dest: unset for action in parser._actions if action.dest != "help"})
    demo = config.preset_defaults("demo")
    parsed = {}
    for name, flags in runs.items():
        argv = studyrun.train_flags(tmp_path / name, flags, 0, settings=settings)
        unpinned = {dest for dest, value in vars(parser.parse_args(argv)).items() if value is unset}
        assert unpinned <= UNPINNED_OK, f"pin these: {sorted(unpinned - UNPINNED_OK)}"
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            parsed[name] = args = config.parse_args(argv)
        assert not [w for w in said if "cannot act" in str(w.message) or "does nothing" in str(w.message)]
        assert args.updates_per_batch == 2 and args.bf16 is native_bf16 and args.max_steps == 16
        for key in ("learning_rate", "prompts_per_step", "eval_samples", "eval_interval", "eval_temperature",
                    "system_prompt", "num_rollouts", "update_size", "rule", "temperature", "max_completion_tokens",
                    "lora_rank", "lora_alpha", "micro_batch_size", "max_prompt_tokens", "one_shot", "dataset",
                    "clip_eps", "loss_aggregation", "prefix_sharing"):
            assert getattr(args, key) == demo[key] or (key == "prefix_sharing" and args.prefix_sharing == "on"), key
        assert args.seed == int(name[-1])
    paper = loss_options.LossSettings(clip_eps_high=0.2, max_completion_tokens=32)  # the paper's loss, as pinned
    assert config.loss_settings(parsed["paper-n16-m4-s1"]) == paper
    assert config.method_label(parsed["paper-n16-m4-s1"]) == study.OBJECTIVES_BASELINE
    for arm, field, value in (("gspo", "importance_sampling_level", "sequence"), ("cispo", "policy_loss", "cispo"),
                              ("entropy", "top_entropy_quantile", 0.2)):
        args = parsed[f"{arm}-n16-m4-s1"]
        changed = {key for key, val in vars(args).items() if val != vars(parsed["paper-n16-m4-s1"])[key]}
        assert changed == {field, "output_dir"}, changed
        assert getattr(config.loss_settings(args), field) == value
        label = config.method_label(args)
        assert label.startswith(study.OBJECTIVES_BASELINE + " + ") and str(value) in label
    assert PRESETS["demo"]["max_steps"] == study.OBJECTIVES_STEPS


def test_the_objectives_command_prints_its_runs_and_trains_nothing_on_a_dry_run(tmp_path, capsys):
    import study

    study.main(["objectives", "--out", str(tmp_path / "out"), "--seeds", "0", "1", "--dry-run"])
    printed = capsys.readouterr().out  # the system prompt's line breaks are inside each command's quotes
    commands = printed.split("\n[")
    assert len(commands) == 8 and commands[0].startswith("[1/8]") and "paper-n16-m4-s0" in commands[0]
    assert commands[1].rstrip().endswith("--importance-sampling-level sequence")
    assert commands[2].rstrip().endswith("--policy-loss cispo") and "--updates-per-batch 2" in commands[2]
    assert "--max-steps 16" in commands[0] and not (tmp_path / "out").exists()
