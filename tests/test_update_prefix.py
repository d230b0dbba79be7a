"""update.py with prefix sharing (prefix.py) on against off: update_policy gives the same loss, gradient of every
trainable parameter, weights after the step and metrics (token means, sampler gap, per-row sampler ratios) whichever
way the prompts are computed: LoRA and full fine-tuning, Llama and Qwen2, mu > 1 (old log-probs from fill_logprobs),
KL (the reference pass with the adapter off), every loss option, micro-batches that split a prompt's rows, rows of
several prompts mixed (--selection-scope batch), several rollout batches (--dynamic-sampling); --prefix-sharing
reaches the update; gradient checkpointing shares too; reentrant checkpointing falls back to every row in full, said
once."""

import dataclasses
import warnings

import pytest
import torch

from run import config
import models
from engine import prefix
from policy import hf_model
import update
from test_update_flags import flag_args, non_default_flag

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 256
PAD = 2


def policy(arch="llama", lora_rank=4, checkpointing=False):
    torch.manual_seed(0)
    model = models.tiny_random_model(arch, vocab_size=VOCAB, initializer_range=0.2)
    model = models.prepare_for_training(model, lora_rank=lora_rank, lora_alpha=8,
                                        gradient_checkpointing=checkpointing)
    with torch.no_grad():  # LoRA B starts at 0 (policy = reference): move it so the two differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.train()
    return model


def grouped_batch(rows_of_prompt, seed=0, width=6, prefix_tokens=6, prefix_seed=None):
    """An UpdateBatch whose row i belongs to prompt rows_of_prompt[i]: prompts share a `prefix_tokens` prefix and end
    in suffixes of 1-4 tokens (left padded); completions of 1..width tokens (full-length ones truncated), random
    advantages, and sampler log-probs near a policy's (so the sampler check and importance sampling have work).
    prefix_seed: the shared prefix drawn from this seed (batches of one step sharing it), else from `seed`."""
    g = torch.Generator().manual_seed(seed)
    count = max(rows_of_prompt) + 1
    shared = torch.randint(3, VOCAB, (prefix_tokens,), generator=g).tolist()
    if prefix_seed is not None:
        other = torch.Generator().manual_seed(prefix_seed)
        shared = torch.randint(3, VOCAB, (prefix_tokens,), generator=other).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (1 + i % 4,), generator=g).tolist() for i in range(count)]
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.full((count, longest), PAD)
    prompt_mask = torch.zeros(count, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, longest - len(p):], prompt_mask[i, longest - len(p):] = torch.tensor(p), 1
    rows = torch.tensor(rows_of_prompt)
    lengths = torch.randint(1, width + 1, (len(rows),), generator=g)
    completion_mask = (torch.arange(width) < lengths[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), torch.randint(3, VOCAB, (len(rows), width), generator=g), PAD)
    batch = update.UpdateBatch(prompt_ids[rows], prompt_mask[rows], completion_ids, completion_mask,
                               torch.randn(len(rows), generator=g), lengths == width)
    batch.sampler_logprobs = -3 * torch.rand(len(rows), width, generator=g)
    return batch


def run(model, weights, batches_of, settings, stale=False):
    """update_policy (after fill_logprobs, as train.py) with plain SGD from `weights` -> (metrics, gradient of each
    trainable parameter, weights after), and how many prefix.completion_logprobs calls it made. stale: the old
    log-probs are the sampler's + noise (rollouts of an older policy), so that the ratio moves from 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
                p.grad = None
    batches = batches_of()
    calls = []
    real = prefix.completion_logprobs

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix, "completion_logprobs", counted)
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        update.fill_logprobs(model, batches, settings)
        for batch in batches if stale else ():
            batch.old_logprobs = batch.sampler_logprobs + 0.3 * torch.randn(
                batch.completion_ids.shape, generator=torch.Generator().manual_seed(7))
        metrics = update.update_policy(model, sgd, batches, settings)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return metrics, grads, after, len(calls)


def assert_same_update(on, off):
    (metrics, grads, weights, _), (expected, expected_grads, expected_weights, _) = on, off
    assert metrics.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-6)
    assert metrics.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4, abs=1e-6)
    assert (metrics.rows, metrics.tokens, metrics.optimizer_steps, metrics.skipped_steps) == (
        expected.rows, expected.tokens, expected.optimizer_steps, expected.skipped_steps)
    assert metrics.token_means.keys() == expected.token_means.keys()
    for key, value in expected.token_means.items():
        assert metrics.token_means[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    if expected.sampler_gap is not None:
        for key, value in dataclasses.asdict(expected.sampler_gap).items():
            assert getattr(metrics.sampler_gap, key) == pytest.approx(value, rel=1e-4, abs=1e-5), key
        for got, want in zip(metrics.sampler_ratios, expected.sampler_ratios, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert any(g.abs().max() > 0 for g in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(weights[name], expected_weights[name], rtol=1e-4, atol=2e-5)


def on_and_off(model, batches_of, settings):
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    on = run(model, weights, batches_of, dataclasses.replace(settings, prefix_sharing=True))
    off = run(model, weights, batches_of, dataclasses.replace(settings, prefix_sharing=False))
    assert on[3] > 0 and off[3] == 0  # the shared path ran, and only when on
    return on, off


FOUR_PROMPTS = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4  # PODS m = 4 kept rows of each of 4 prompts, in prompt order
CASES = {  # name: (model options, batches, update settings)
    "lora": ({}, lambda: [grouped_batch(FOUR_PROMPTS)], {}),
    "full fine-tuning": (dict(lora_rank=0), lambda: [grouped_batch(FOUR_PROMPTS)], {}),
    "qwen2": (dict(arch="qwen2"), lambda: [grouped_batch(FOUR_PROMPTS)], {}),
    "mu 3, old log-probs from fill_logprobs": ({}, lambda: [grouped_batch(FOUR_PROMPTS)], dict(updates_per_batch=3)),
    "kl, the reference with the adapter off": ({}, lambda: [grouped_batch(FOUR_PROMPTS)],
                                               dict(loss=update.loss_options.LossSettings(kl_coef=0.3))),
    "micro-batches that split prompts": ({}, lambda: [grouped_batch(FOUR_PROMPTS)], dict(micro_batch_size=3)),
    "batch scope: prompts mixed, uneven": ({}, lambda: [grouped_batch([2, 0, 2, 1, 0, 2, 3, 2, 0, 2, 1])],
                                           dict(micro_batch_size=5)),
    "GRPO-GA: one prompt per micro-batch, the step's prefix run once": (
        {}, lambda: [grouped_batch(FOUR_PROMPTS)], dict(micro_batch_size=4)),
    "the step's prefix with mu 2, KL and gradient checkpointing": (
        dict(checkpointing=True), lambda: [grouped_batch(FOUR_PROMPTS)],
        dict(micro_batch_size=4, updates_per_batch=2, loss=update.loss_options.LossSettings(kl_coef=0.3))),
    "one prompt per step in micro-batches of 2 (the paper's presets)": (
        {}, lambda: [grouped_batch([0] * 8)], dict(micro_batch_size=2)),
    "dynamic sampling: batches sharing the step's prefix": (
        {}, lambda: [grouped_batch([0, 0, 1, 1], seed=1, prefix_seed=9),
                     grouped_batch([0, 0, 0, 1, 1, 2], seed=2, width=4, prefix_seed=9)], dict(micro_batch_size=3)),
    "dynamic sampling: several rollout batches": (
        {}, lambda: [grouped_batch([0, 0, 1, 1], seed=1), grouped_batch([0, 0, 0, 1, 1, 2], seed=2, width=4),
                     grouped_batch([0], seed=3)], dict(micro_batch_size=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_sharing_gives_the_update_of_every_row_in_full(case):
    options, batches_of, changes = CASES[case]
    settings = dataclasses.replace(update.UpdateSettings(micro_batch_size=16, max_grad_norm=0.5), **changes)
    on, off = on_and_off(policy(**options), batches_of, settings)
    assert_same_update(on, off)
    assert off[0].sampler_gap.tokens > 0


@pytest.mark.parametrize("option", config.LOSS_FLAGS, ids=lambda option: option.name)
def test_every_loss_option_gives_the_same_update_with_prefix_sharing(option):
    """Each loss option (loss_options.LossSettings, a new one included with no edit) from the command line, mu = 2 on
    stale old log-probs: --prefix-sharing on and off reach UpdateSettings and give the same update."""
    argv, _ = non_default_flag(option)
    flags = ["--mu", "2", *option.metadata["acts_with"], *argv]
    on_settings = config.update_settings(flag_args(*flags))
    off_settings = config.update_settings(flag_args(*flags, "--prefix-sharing", "off"))
    assert on_settings.prefix_sharing and not off_settings.prefix_sharing
    assert dataclasses.replace(on_settings, prefix_sharing=False) == off_settings

    model = policy()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    on = run(model, weights, lambda: [grouped_batch(FOUR_PROMPTS, seed=5)], on_settings, stale=True)
    off = run(model, weights, lambda: [grouped_batch(FOUR_PROMPTS, seed=5)], off_settings, stale=True)
    assert on[3] > 0 and off[3] == 0
    assert_same_update(on, off)


def test_gradient_checkpointing_shares_too():
    settings = update.UpdateSettings(micro_batch_size=16, updates_per_batch=2,
                                     loss=update.loss_options.LossSettings(kl_coef=0.1))
    on, off = on_and_off(policy(checkpointing=True), lambda: [grouped_batch(FOUR_PROMPTS)], settings)
    assert on[3] == 2 + 2   # fill_logprobs (reference, old log-probs) and the 2 optimizer steps, one micro-batch
    assert_same_update(on, off)


def test_reentrant_checkpointing_falls_back_to_every_row_in_full_said_once():
    torch.manual_seed(0)
    model = models.tiny_random_model("llama", vocab_size=VOCAB, initializer_range=0.2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model = models.prepare_for_training(model, lora_rank=4, lora_alpha=8).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    settings = update.UpdateSettings(micro_batch_size=5, updates_per_batch=2,
                                     loss=update.loss_options.LossSettings(kl_coef=0.1))
    update.prefix._SAID.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on, off = on_and_off(model, lambda: [grouped_batch(FOUR_PROMPTS)], settings)
    said = [str(w.message) for w in caught if "prefix sharing" in str(w.message)]
    assert len(said) == 1 and "reentrant gradient checkpointing" in said[0]
    # fill_logprobs' no-grad passes share (nothing is checkpointed without gradients); the update's passes do not
    assert on[3] == 4 * 2 and off[3] == 0   # fill_logprobs only: 4 micro-batches x (reference, old log-probs)
    assert_same_update(on, off)


def test_the_prefix_every_prompt_of_a_step_shares_runs_once_per_pass():
    """Gradient accumulation over micro-batches (GRPO-GA: one prompt per micro-batch): the step's shared prefix goes
    through the model once per pass (reference, old log-probs, each optimizer step), not once per micro-batch, and
    each micro-batch runs only its prompt's own tokens and its completions (in one call where prefix.folds)."""
    model = policy()
    settings = update.UpdateSettings(micro_batch_size=4, updates_per_batch=2,
                                     loss=update.loss_options.LossSettings(kl_coef=0.3))
    batch = grouped_batch(FOUR_PROMPTS, prefix_tokens=6)
    suffixes = [int(batch.prompt_mask[row].sum()) - 6 for row in range(0, 16, 4)]
    completions = [max(int(batch.completion_mask[row:row + 4].sum(1).max()) - 1, 1) for row in range(0, 16, 4)]
    calls = []
    embed = hf_model(model).get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    update.fill_logprobs(model, [batch], settings)
    update.update_policy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                         [batch], settings)
    hook.remove()
    per_pass = [(1, 6)] + [call for suffix, width in zip(suffixes, completions) for call in (
        [(4, suffix + width)] if prefix.folds(4, 1, suffix, width + 1) else [(1, suffix), (4, width)])]
    assert calls == per_pass * 4   # reference, old log-probs, optimizer steps 1 and 2
    assert 1 + 4 < len(per_pass) < 1 + 2 * 4  # some micro-batches run in one call (folded), some in two


def test_a_micro_batch_that_does_not_start_with_the_steps_prefix_is_refused():
    model = policy()
    batch = grouped_batch(FOUR_PROMPTS)
    micro = next(update.micro_batches(batch, 4, "cpu"))
    with torch.no_grad():
        step = prefix.step_prefix(model, torch.tensor([5, 6, 7]))
        with pytest.raises(ValueError, match="do not all start with the step's 3-token prefix"):
            prefix.completion_logprobs(model, micro.input_ids, micro.attention_mask, micro.width, step=step)


def test_one_prompt_per_step_runs_once_whatever_the_micro_batches():
    """The paper's presets: m rows of one prompt, micro-batches of a few rows. The prompt but its last token runs
    once per optimizer step; each micro-batch, in one model call, runs that last token and its completions."""
    model = policy()
    batch = grouped_batch([0] * 8, prefix_tokens=6)
    length = int(batch.prompt_mask[0].sum())
    calls = []
    embed = hf_model(model).get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    update.update_policy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), [batch],
                         update.UpdateSettings(micro_batch_size=2))
    hook.remove()
    widths = [max(int(batch.completion_mask[row:row + 2].sum(1).max()), 1) for row in range(0, 8, 2)]
    assert calls == [(1, length - 1)] + [(2, 1 + width - 1) for width in widths]
