"""Every update flag from the command line to the loss, the gradient and the weights: config.parse_args ->
config.update_settings -> update.update_policy, each against grpo_loss computed directly with that flag's value,
and each flag shown to matter for the input (so that dropping it anywhere on the way fails)."""

import pytest
import torch

from run import config
import grpo_loss
import loss_options
import policy
import models
import update
from test_update import grads, lora_model, move_lora_b, trainable, varied_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAG_BASE = ["--model", models.SMOLLM2_ALIAS, "--device", "cpu", "--lora-rank", "4", "--max-completion-tokens", "6",
             "--micro-batch-size", "2", "--learning-rate", "0.5"]


def flag_args(*argv):
    """Real command-line flags through config.parse_args, as train.py gets them (6 completion tokens = the width of
    `varied_batch`, so its full-length rows are the truncated ones)."""
    return config.parse_args([*FLAG_BASE, *argv])


def restore(model, weights):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
                p.grad = None


def stale_logprobs(model, batch, temperature):
    """Log-probs of an older policy than the current one (current ones at this temperature + fixed noise, spread so
    that the ratio leaves [1 - eps, 1 + eps] on many tokens in both directions): the clip acts with mu = 1."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.no_grad():
        current = policy.token_logprobs(model, ids, attention, ids.shape[1] - batch.prompt_ids.shape[1],
                                        temperature)
    return current + 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(7))


def direct_update(model, batch, args):
    """The update the flags describe, written out with grpo_loss alone on the whole batch at once: mu plain SGD steps
    (lr = args.learning_rate) on grpo_loss.grpo_loss with every flag's value, the gradient clipped to
    args.max_grad_norm. -> (mean loss, the last step's clipped gradient, the weights after)."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    width = batch.completion_ids.shape[1]
    mask = loss_options.mask_truncated(batch.completion_mask, batch.truncated) if args.mask_truncated \
        else batch.completion_mask
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        old = batch.old_logprobs if batch.old_logprobs is not None else \
            policy.token_logprobs(model, ids, attention, width, args.temperature)
        ref = None
        if args.kl_coef > 0:
            with model.disable_adapter():
                ref = policy.token_logprobs(model, ids, attention, width, args.temperature)
    losses = []
    for _ in range(args.updates_per_batch):
        for p in params:
            p.grad = None
        logprobs, entropies = policy.token_logprobs(model, ids, attention, width, args.temperature,
                                                    with_entropies=True)
        loss, _ = grpo_loss.grpo_loss(logprobs, old, batch.advantages, mask, config.loss_settings(args), ref,
                                      batch.sampler_logprobs, entropies)
        loss.backward()
        norm = float(torch.cat([p.grad.flatten() for p in params]).norm())
        scale = min(1.0, args.max_grad_norm / (norm + 1e-6)) if args.max_grad_norm > 0 else 1.0
        with torch.no_grad():
            for p in params:
                p.grad.mul_(scale)
                p.sub_(args.learning_rate * p.grad)
        losses.append(loss.item())
    return sum(losses) / len(losses), grads(model), trainable(model)


@pytest.fixture(scope="module")
def flag_model():
    model = lora_model()
    move_lora_b(model)  # policy != reference: the KL term is not 0
    return model, trainable(model)


def run_both(model, weights, batch_of, argv):
    """(update_policy's (loss, gradient, weights), direct_update's (loss, gradient, weights)) for these
    flags, both from the same weights and batch. update_policy runs as train.py runs it: settings from
    config.update_settings, then fill_logprobs, then update_policy with a plain SGD optimizer."""
    args = flag_args(*argv)
    restore(model, weights)
    batch = batch_of(model, args)
    expected = direct_update(model, batch, args)
    restore(model, weights)
    batch = batch_of(model, args)
    settings = config.update_settings(args)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    stale = batch.old_logprobs
    update.fill_logprobs(model, [batch], settings)
    if stale is not None:
        batch.old_logprobs = stale  # the rollouts came from an older policy than the one fill_logprobs saw
    metrics = update.update_policy(model, sgd, [batch], settings)
    assert metrics.optimizer_steps == args.updates_per_batch and metrics.skipped_steps == 0
    return (metrics.loss, grads(model), trainable(model)), expected


def fresh_batch(model, args):
    return varied_batch(6, seed=1)


def stale_batch(model, args):
    """Old log-probs of an older policy, and the sampler's further off (so that importance sampling acts)."""
    batch = varied_batch(6, seed=1)
    batch.old_logprobs = stale_logprobs(model, batch, args.temperature)
    batch.sampler_logprobs = batch.old_logprobs + 0.5 * torch.randn(batch.completion_ids.shape,
                                                                    generator=torch.Generator().manual_seed(3))
    return batch


def offpolicy_batch(model, args):
    """Rollouts from another sampler: its log-probs = the policy's + noise, so that pi / pi_sampler exceeds 2 on
    some tokens and not on others."""
    batch = varied_batch(6, seed=1)
    batch.sampler_logprobs = stale_logprobs(model, batch, args.temperature) + 0.5 * torch.randn(
        batch.completion_ids.shape, generator=torch.Generator().manual_seed(3))
    return batch


def assert_same_update(actual, expected):
    loss, gradient, weights = actual
    torch.testing.assert_close(gradient, expected[1], rtol=1e-4, atol=2e-5)  # mu steps of lr 0.5 widen rounding
    assert loss == pytest.approx(expected[0], rel=1e-4, abs=1e-6)
    for name, value in expected[2].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=2e-5)


def differs(one, other):
    """Loss, gradient or weights apart by clearly more than the tolerance of `assert_same_update`."""
    return abs(one[0] - other[0]) > 1e-3 or not torch.allclose(one[1], other[1], rtol=1e-2, atol=1e-4) or \
        any(not torch.allclose(one[2][k], other[2][k], rtol=1e-2, atol=1e-4) for k in one[2])


UPDATE_FLAG_CASES = [  # (flags, the flags they are compared with (power), batch: stale old log-probs or none)
    (["--clip-eps", "0.1"], [], stale_batch),
    (["--clip-eps-high", "0.5"], [], stale_batch),
    (["--clip-eps", "0.1", "--clip-eps-high", "0.3"], ["--clip-eps", "0.1"], stale_batch),
    (["--kl-coef", "0.5"], [], fresh_batch),
    (["--kl-coef", "0.5", "--temperature", "0.6"], ["--temperature", "0.6"], fresh_batch),
    (["--loss-aggregation", "token"], [], stale_batch),
    (["--loss-aggregation", "fixed"], [], stale_batch),
    (["--loss-aggregation", "fixed", "--max-completion-tokens", "9"], ["--loss-aggregation", "fixed"], fresh_batch),
    (["--mask-truncated"], [], stale_batch),
    (["--mask-truncated", "--loss-aggregation", "token"], ["--loss-aggregation", "token"], fresh_batch),
    (["--temperature", "0.6"], [], fresh_batch),
    (["--temperature", "0.6", "--mu", "2"], ["--mu", "2"], fresh_batch),
    (["--max-grad-norm", "0.2"], [], fresh_batch),
    (["--max-grad-norm", "0"], [], fresh_batch),
    (["--mu", "3"], [], fresh_batch),
    (["--updates-per-batch", "2"], [], stale_batch),
    (["--importance-sampling-correction", "tis"], [], offpolicy_batch),
    (["--importance-sampling-correction", "tis", "--is-clip", "1.5"], ["--importance-sampling-correction", "tis"],
     offpolicy_batch),
    (["--importance-sampling-correction", "token_mask"], [], offpolicy_batch),
    (["--importance-sampling-correction", "token_mask", "--is-clip", "1.5"],
     ["--importance-sampling-correction", "token_mask"], offpolicy_batch),
    (["--importance-sampling-correction", "token_reject"], [], offpolicy_batch),
    (["--importance-sampling-correction", "token_reject", "--is-clip", "1.5"],
     ["--importance-sampling-correction", "token_reject"], offpolicy_batch),
    (["--importance-sampling-correction", "token_reject", "--loss-aggregation", "token", "--mu", "2"],
     ["--loss-aggregation", "token", "--mu", "2"], stale_batch),
    (["--importance-sampling-level", "sequence"], [], stale_batch),
    (["--importance-sampling-level", "sequence", "--loss-aggregation", "token", "--mu", "2"],
     ["--loss-aggregation", "token", "--mu", "2"], stale_batch),
    (["--policy-loss", "cispo"], [], stale_batch),
    (["--policy-loss", "cispo", "--clip-eps", "1", "--clip-eps-high", "4", "--loss-aggregation", "token", "--mu", "2"],
     ["--clip-eps", "1", "--clip-eps-high", "4", "--loss-aggregation", "token", "--mu", "2"], stale_batch),
    (["--policy-loss", "cispo", "--importance-sampling-level", "sequence", "--mu", "2"],
     ["--policy-loss", "cispo", "--mu", "2"], stale_batch),
    # the quantile is over each micro-batch's tokens (TRL's): one micro-batch of the 6 rows, as the direct update
    (["--top-entropy-quantile", "0.2", "--micro-batch-size", "6"], ["--micro-batch-size", "6"], fresh_batch),
    (["--top-entropy-quantile", "0.5", "--micro-batch-size", "6", "--kl-coef", "0.5", "--mu", "2"],
     ["--micro-batch-size", "6", "--kl-coef", "0.5", "--mu", "2"], stale_batch),
    (["--clip-eps", "0.15", "--clip-eps-high", "0.25", "--kl-coef", "0.2", "--loss-aggregation", "token",
      "--mask-truncated", "--temperature", "0.8", "--max-grad-norm", "0.5", "--mu", "2"], [], stale_batch),
]


@pytest.mark.parametrize("argv, baseline, batch_of", UPDATE_FLAG_CASES,
                         ids=[" ".join(case[0]) for case in UPDATE_FLAG_CASES])
def test_every_update_flag_reaches_the_loss_and_the_step(argv, baseline, batch_of, flag_model):
    """Each update-phase flag, parsed from the command line and carried by config.update_settings (train.py's path),
    changes update_policy's loss, last gradient and weights exactly as grpo_loss computed directly with that flag's
    value does, over micro-batches of 2, mu SGD steps and gradient clipping; and the flag matters for this input:
    the direct update with the compared flags (the defaults) differs. So a flag dropped anywhere between the
    command line and the loss (parser, update_settings, fill_logprobs, micro_batch_loss, the step loop) fails."""
    model, weights = flag_model
    actual, expected = run_both(model, weights, batch_of, argv)
    assert_same_update(actual, expected)
    restore(model, weights)
    without = direct_update(model, batch_of(model, flag_args(*baseline)), flag_args(*baseline))
    assert differs(expected, without), f"{argv} does not change the update of this batch: the test has no power"


@pytest.mark.parametrize("correction", loss_options.IS_CORRECTIONS[1:])
def test_importance_sampling_does_nothing_when_the_sampler_is_exact(correction, flag_model):
    """Sampler log-probs equal to the policy's: every ratio is 1, inside [1/C, C], so every correction gives the
    update of the paper's objective exactly."""
    model, weights = flag_model

    def exact_batch(model, args):
        batch = varied_batch(6, seed=1)
        batch.sampler_logprobs = stale_logprobs(model, batch, args.temperature) - 0.3 * torch.randn(
            batch.completion_ids.shape, generator=torch.Generator().manual_seed(7))   # the current log-probs
        return batch

    corrected, _ = run_both(model, weights, exact_batch, ["--importance-sampling-correction", correction])
    plain, _ = run_both(model, weights, exact_batch, [])
    assert_same_update(corrected, plain)


def non_default_flag(option):
    """(argv, value): a LossSettings field's flag set to a value other than its default."""
    flag, kind = loss_options.flag_name(option), option.metadata["argparse"]
    if option.metadata["example"] is not None:
        return [flag, str(option.metadata["example"])], option.metadata["example"]
    if not kind:  # a bool flag
        return [flag if not option.default else "--no-" + flag[2:]], not option.default
    if "choices" in kind:
        value = [choice for choice in kind["choices"] if choice != option.default][-1]
        return [flag, value], value
    value = kind["type"](0.35 if option.default is None else option.default + 0.05)
    return [flag, str(value)], value


@pytest.mark.parametrize("option", config.LOSS_FLAGS, ids=lambda option: option.name)
def test_every_loss_option_reaches_the_loss_the_update_and_the_label(option, flag_model):
    """Each field of loss_options.LossSettings that has a flag (a new loss option is tested here with no edit): a value
    other than its default, given on the command line, is that field of config.update_settings(args).loss, changes
    the method label, and changes update_policy's loss, gradient and weights exactly as grpo_loss called directly
    does (mu = 2 on stale old log-probs, so ratio-only options act), and it matters for this input."""
    argv, value = non_default_flag(option)
    context = ["--mu", "2", *option.metadata["acts_with"]]   # e.g. --is-clip acts with a correction on
    args = flag_args(*context, *argv)
    assert getattr(config.update_settings(args).loss, option.name) == value
    assert config.method_label(args) != config.method_label(flag_args(*context))
    model, weights = flag_model
    actual, expected = run_both(model, weights, stale_batch, [*context, *argv])
    assert_same_update(actual, expected)
    restore(model, weights)
    without = direct_update(model, stale_batch(model, flag_args(*context)), flag_args(*context))
    assert differs(expected, without), f"{argv} does not change the update of this batch: the test has no power"
