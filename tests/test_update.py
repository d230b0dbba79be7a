"""update.py: kept-row mapping (indices, masks, rows), micro-batch column trimming, the old/reference log-prob pass,
the loss normaliser of every aggregation (micro-batches = one batch) and summed over processes, the empty update,
dropout off during the update, the non-finite guard, fp32 master weights under bf16 autocast, and a random batch
through update_policy (as the benchmarks call it). Every update flag from the command line: test_update_flags.py."""

import math

import pytest
import torch

import grpo_loss
import loss_options
import policy
import models
from engine import gpu_paths
from engine import kernels
import sampling
import update
from loss_options import LossSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 256


def lora_model(dropout=0.0, checkpointing=False):
    torch.manual_seed(0)
    model = models.tiny_random_model("llama", vocab_size=VOCAB)
    return models.prepare_for_training(model, lora_rank=4, lora_alpha=8, lora_dropout=dropout,
                                       gradient_checkpointing=checkpointing)


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def random_batch(num_rows, prompt_tokens, completion_tokens, vocab_size, seed=0):
    """Random prompts, full-length random completions and random advantages: an UpdateBatch of a given shape."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab_size, (num_rows, prompt_tokens), generator=generator)
    completion_ids = torch.randint(3, vocab_size, (num_rows, completion_tokens), generator=generator)
    return update.UpdateBatch(prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids),
                              torch.randn(num_rows, generator=generator), torch.ones(num_rows, dtype=torch.bool))


def move_lora_b(model):
    with torch.no_grad():  # LoRA B starts at 0 (policy = reference): move it so the two differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)


def test_kept_batch_maps_prompt_i_column_j_to_row_i_times_n_plus_kept():
    P, n = 2, 4
    rollouts = sampling.Rollouts(
        prompt_ids=torch.tensor([[0, 10], [20, 21]]), prompt_mask=torch.tensor([[0, 1], [1, 1]]),
        completion_ids=torch.arange(P * n)[:, None].repeat(1, 3),
        completion_mask=torch.ones(P * n, 3, dtype=torch.long),
        texts=[str(i) for i in range(P * n)], lengths=torch.full((P * n,), 3),
        truncated=torch.arange(P * n) % 3 == 0, prompt_index=torch.arange(P).repeat_interleave(n))
    kept = torch.tensor([[3, 1], [0, 2]])
    advantages = torch.tensor([[1.0, -1.0], [0.5, -0.5]], dtype=torch.float64)
    batch = update.kept_batch(rollouts, kept, advantages)
    assert batch.completion_ids[:, 0].tolist() == [3, 1, 4, 6]  # i*n + kept[i, j], not i*m + j
    assert batch.prompt_ids.tolist() == [[0, 10], [0, 10], [20, 21], [20, 21]]
    assert batch.truncated.tolist() == [True, False, False, True]
    assert batch.advantages.dtype == torch.float32 and batch.advantages.tolist() == [1.0, -1.0, 0.5, -0.5]
    with pytest.raises(ValueError, match=r"\[0, n = 4\)"):
        update.kept_batch(rollouts, torch.tensor([[4, 1], [0, 2]]), advantages)


def test_micro_batches_cut_padding_columns():
    batch = update.UpdateBatch(
        prompt_ids=torch.tensor([[2, 2, 5, 6], [2, 7, 8, 9], [2, 2, 2, 4]]),
        prompt_mask=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]),
        completion_ids=torch.tensor([[11, 2, 2, 2], [12, 13, 2, 2], [14, 15, 16, 2]]),
        completion_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
        advantages=torch.tensor([1.0, -1.0, 0.0]), truncated=torch.zeros(3, dtype=torch.bool))
    first, second = update.micro_batches(batch, 2, "cpu")
    assert first.input_ids.tolist() == [[2, 5, 6, 11, 2], [7, 8, 9, 12, 13]] and first.width == 2
    assert second.input_ids.tolist() == [[4, 14, 15, 16, 2]] and second.width == 4
    assert second.attention_mask.tolist() == [[1, 1, 1, 1, 1]] and second.rows == slice(2, 4)


def test_fill_logprobs_old_and_reference_only_when_needed():
    model = lora_model()
    move_lora_b(model)
    batch = random_batch(3, 4, 5, VOCAB, seed=1)
    update.fill_logprobs(model, [batch], update.UpdateSettings(micro_batch_size=2))
    assert batch.old_logprobs is None and batch.ref_logprobs is None  # mu = 1, beta = 0: nothing to compute
    update.fill_logprobs(model, [batch], update.UpdateSettings(micro_batch_size=2, updates_per_batch=2, temperature=0.7,
                                                               loss=LossSettings(kl_coef=0.1)))
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    with torch.no_grad():
        current = policy.token_logprobs(model, ids, torch.ones_like(ids), 5, 0.7)
        with model.disable_adapter():
            reference = policy.token_logprobs(model, ids, torch.ones_like(ids), 5, 0.7)
    torch.testing.assert_close(batch.old_logprobs, current, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.ref_logprobs, reference, rtol=1e-5, atol=1e-5)
    assert (current - reference).abs().max() > 1e-3


def test_the_normaliser_and_the_loss_are_summed_over_processes():
    """sum_over_processes (multigpu's seam), here standing for two identical processes: the normaliser doubles (the
    gradient halves), the reported loss is the sum of both shares (the same), and a non-finite sum skips the step."""
    model = lora_model()
    move_lora_b(model)
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    batch = random_batch(4, 3, 5, VOCAB)
    settings = update.UpdateSettings(micro_batch_size=3, max_grad_norm=0)  # no clipping: the scale stays visible
    local = update.update_policy(model, frozen, [batch], settings)
    local_grads = grads(model)
    two = update.update_policy(model, frozen, [batch], settings, lambda value: 2 * value)
    torch.testing.assert_close(grads(model), local_grads / 2)
    assert two.loss == pytest.approx(local.loss) and two.optimizer_steps == 1
    assert local.rows == 4 and local.optimizer_steps == 1 and local.skipped_steps == 0
    peer_failed = update.update_policy(model, frozen, [batch], settings, lambda value: value + math.inf)
    assert peer_failed.optimizer_steps == 0 and peer_failed.skipped_steps == 1  # another process's loss was inf
    nobody = update.update_policy(model, frozen, [random_batch(0, 3, 5, VOCAB)], settings, lambda value: value)
    assert nobody.optimizer_steps == 0 and nobody.rows == 0


def test_dropout_is_off_during_the_update_and_modes_are_restored():
    model = lora_model(dropout=0.5, checkpointing=True)
    model.train()
    move_lora_b(model)
    layer = model.base_model.model.model.layers[0]
    dropout = layer.self_attn.q_proj.lora_dropout["default"]
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(("layer", module.training)))
    dropout.register_forward_pre_hook(lambda module, args: seen.append(("dropout", module.training)))
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    batch, settings = random_batch(4, 3, 5, VOCAB), update.UpdateSettings(micro_batch_size=4)
    update.update_policy(model, frozen, [batch], settings)
    first = grads(model)
    update.update_policy(model, frozen, [batch], settings)
    assert first.abs().max() > 0 and torch.equal(grads(model), first)  # no random dropout masks
    assert ("dropout", False) in seen and ("dropout", True) not in seen
    assert ("layer", True) in seen  # the checkpointed layer stays in training mode: checkpointing stays on
    assert all(module.training for module in model.modules())  # every flag restored


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_non_finite_step_is_skipped(poison, monkeypatch):
    model = lora_model()
    move_lora_b(model)
    optimizer = update.make_optimizer(model, 1e-2, weight_decay=0.1)  # decay alone would move the weights
    if poison == "loss":
        real = grpo_loss.grpo_loss_sum

        def nan_loss(*args, **kwargs):
            loss, metrics = real(*args, **kwargs)
            return loss * math.nan, metrics

        monkeypatch.setattr(grpo_loss, "grpo_loss_sum", nan_loss)
    else:
        next(p for p in model.parameters() if p.requires_grad).register_hook(lambda grad: grad * math.inf)
    before = trainable(model)
    batches, settings = [random_batch(4, 3, 5, VOCAB)], update.UpdateSettings(micro_batch_size=2,
                                                                                        updates_per_batch=2)
    with pytest.raises(ValueError, match="call fill_logprobs"):
        update.update_policy(model, optimizer, batches, settings)
    update.fill_logprobs(model, batches, settings)
    metrics = update.update_policy(model, optimizer, batches, settings)
    assert metrics.skipped_steps == 2 and metrics.optimizer_steps == 0
    assert not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm))
    assert all(torch.equal(before[n], p) for n, p in trainable(model).items())
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state


def test_full_fine_tuning_bf16_keeps_fp32_master_weights():
    """lr 5e-6 moves fp32 weights; bf16 weights (spacing ~1e-4 at 0.02) would round every such step away."""
    weights_dtype, autocast_dtype = models.compute_dtypes(bf16=True, lora_rank=0)
    assert models.compute_dtypes(bf16=True, lora_rank=8) == (torch.bfloat16, None)  # LoRA: frozen bf16 base
    model = models.tiny_random_model("llama", vocab_size=VOCAB).to(weights_dtype)
    optimizer = update.make_optimizer(model, 5e-6)
    before = trainable(model)
    update.update_policy(model, optimizer, [random_batch(4, 3, 5, VOCAB)],
                         update.UpdateSettings(micro_batch_size=4, autocast_dtype=autocast_dtype))
    layer = "model.layers.0.mlp.up_proj.weight"
    changed = (model.get_parameter(layer).detach() != before[layer]).float().mean()
    assert changed > 0.9


def test_a_random_batch_through_update_policy(tiny_model):
    model = models.prepare_for_training(tiny_model, lora_rank=4)
    optimizer = update.make_optimizer(model, 1e-3)
    batch = random_batch(6, 4, 8, tiny_model.config.vocab_size, seed=3)
    assert batch.prompt_ids.shape == (6, 4) and batch.completion_mask.sum() == 48
    metrics = update.update_policy(model, optimizer, [batch], update.UpdateSettings(micro_batch_size=4))
    assert math.isfinite(metrics.loss) and metrics.grad_norm > 0 and metrics.rows == 6
    assert set(metrics.token_means) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                                        "ratio_mean", "kl"}
    assert update.peak_memory_gib("cpu") > 0
    update.set_hyperparameters(optimizer, 0.5, 0.01)
    assert all((g["lr"], g["weight_decay"]) == (0.5, 0.01) for g in optimizer.param_groups)
    with pytest.raises(ValueError, match="unknown optimizer"):
        update.make_optimizer(model, 1e-3, optimizer_name="sgd")


def varied_batch(num_rows, seed):
    """A synthetic batch with completions of different lengths (one empty) and some truncated rows."""
    batch = random_batch(num_rows, 3, 6, VOCAB, seed=seed)
    lengths = torch.tensor([6, 2, 0, 4, 6, 1])[:num_rows]
    batch.completion_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    batch.truncated = lengths == 6
    return batch


@pytest.mark.parametrize("aggregation, mask_truncated", [("sequence", False), ("token", False), ("fixed", False),
                                                         ("token", True), ("fixed", True)])
def test_micro_batches_accumulate_to_the_full_batch_loss_gradient(aggregation, mask_truncated):
    """Two rollout batches cut into micro-batches of 1, 2 and 4 rows give the gradient of grpo_loss over all rows at
    once (one denominator for the whole step: rows, kept tokens or rows x max tokens)."""
    model = lora_model()
    move_lora_b(model)
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    batches = [varied_batch(6, seed=1), varied_batch(3, seed=2)]
    all_rows = {name: torch.cat([getattr(b, name) for b in batches]) for name in
                ("prompt_ids", "completion_ids", "completion_mask", "advantages", "truncated")}
    ids = torch.cat([all_rows["prompt_ids"], all_rows["completion_ids"]], 1)
    attention = torch.cat([torch.ones_like(all_rows["prompt_ids"]), all_rows["completion_mask"]], 1)
    mask = all_rows["completion_mask"]
    if mask_truncated:
        mask = loss_options.mask_truncated(mask, all_rows["truncated"])
    frozen.zero_grad()
    logprobs = policy.token_logprobs(model, ids, attention, 6)
    expected_loss, _ = grpo_loss.grpo_loss(logprobs, logprobs.detach(), all_rows["advantages"], mask,
                                           aggregation=aggregation, max_completion_tokens=8)
    expected_loss.backward()
    expected = grads(model)
    assert expected.abs().max() > 0
    for micro in (1, 2, 4):
        settings = update.UpdateSettings(micro_batch_size=micro, max_grad_norm=0, loss=LossSettings(
            aggregation=aggregation, max_completion_tokens=8, mask_truncated=mask_truncated))
        metrics = update.update_policy(model, frozen, batches, settings)
        torch.testing.assert_close(grads(model), expected, rtol=1e-4, atol=1e-6)
        assert metrics.loss == pytest.approx(expected_loss.item(), rel=1e-4, abs=1e-6)
    denominator = update.loss_denominator(batches, settings)
    assert denominator == {"sequence": 9, "token": int(mask.sum()), "fixed": 9 * 8}[aggregation]


def test_the_denominator_of_the_token_aggregation_counts_the_loss_mask():
    settings = update.UpdateSettings(loss=LossSettings(aggregation="token"))
    assert update.loss_denominator([varied_batch(6, seed=1)], settings) == 19
    empty = update.UpdateSettings(loss=LossSettings(aggregation="token", mask_truncated=True))
    assert update.loss_denominator([varied_batch(3, seed=1)], empty) == 2  # rows 0 (truncated) masked: 2 + 0
    assert update.loss_denominator([varied_batch(1, seed=1)], empty) == 0  # no token left ...
    model = lora_model()
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    metrics = update.update_policy(model, frozen, [varied_batch(1, seed=1)], empty)
    assert metrics.loss == 0.0 and math.isfinite(metrics.grad_norm)  # ... and no division by 0


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_token_reject_takes_the_rejected_tokens_out_of_the_step_denominator(aggregation):
    """verl's token rejection with --mu 1: fill_logprobs computes pi_old (the rejection must be known before the first
    backward), the step's "token" denominator counts the accepted tokens only (two processes: twice that), and
    micro-batches of 1 and 2 rows give grpo_loss's gradient over the whole batch."""
    model = lora_model()
    move_lora_b(model)
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    batch = varied_batch(6, seed=1)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([torch.ones_like(batch.prompt_ids), batch.completion_mask], 1)
    with torch.no_grad():
        current = policy.token_logprobs(model, ids, attention, 6)
    batch.sampler_logprobs = current + torch.randn(current.shape, generator=torch.Generator().manual_seed(3))
    loss = LossSettings(aggregation=aggregation, importance_sampling_correction="token_reject", is_clip=2.0)
    accepted = ((current - batch.sampler_logprobs).exp() - 1.25).abs() <= 0.75   # 1/2 <= ratio <= 2
    kept_tokens = int((batch.completion_mask.bool() & accepted).sum())
    assert 0 < kept_tokens < int(batch.completion_mask.sum())   # the rejection acts on some tokens, not all
    frozen.zero_grad()
    logprobs = policy.token_logprobs(model, ids, attention, 6)
    expected_loss, _ = grpo_loss.grpo_loss(logprobs, logprobs.detach(), batch.advantages, batch.completion_mask,
                                           loss, sampler_logprobs=batch.sampler_logprobs)
    expected_loss.backward()
    expected = grads(model)
    for micro in (1, 2):
        settings = update.UpdateSettings(micro_batch_size=micro, max_grad_norm=0, loss=loss)
        batch.old_logprobs = None
        update.fill_logprobs(model, [batch], settings)
        assert batch.old_logprobs is not None
        if aggregation == "token":
            assert update.loss_denominator([batch], settings) == kept_tokens
        metrics = update.update_policy(model, frozen, [batch], settings)
        torch.testing.assert_close(grads(model), expected, rtol=1e-4, atol=1e-6)
        assert metrics.loss == pytest.approx(expected_loss.item(), rel=1e-4, abs=1e-6)
    two = update.update_policy(model, frozen, [batch], settings, lambda value: 2 * value)
    torch.testing.assert_close(grads(model), expected / 2, rtol=1e-4, atol=1e-6)
    assert two.loss == pytest.approx(expected_loss.item(), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("correction", ["tis", "token_mask", "token_reject"])
def test_the_step_denominator_stays_on_the_device_where_pi_old_is(correction):
    """On a GPU the batch (and the sampler's log-probs) wait on the host while fill_logprobs leaves pi_old on the
    device: the denominator moves what it needs there, and token_reject's count of accepted tokens stays there (a
    0-dim tensor read with the loss: no sync of its own). `meta` stands for the GPU here."""
    model = lora_model()
    batch = varied_batch(6, seed=1)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    with torch.no_grad():
        current = policy.token_logprobs(model, ids, torch.cat([torch.ones_like(batch.prompt_ids),
                                                               batch.completion_mask], 1), 6)
    batch.sampler_logprobs = current + torch.randn(current.shape, generator=torch.Generator().manual_seed(3))
    settings = update.UpdateSettings(micro_batch_size=2, loss=LossSettings(
        aggregation="token", importance_sampling_correction=correction))
    update.fill_logprobs(model, [batch], settings)
    host = update.loss_denominator([batch], settings)
    if correction != "token_reject":
        assert batch.old_logprobs is None and host == int(batch.completion_mask.sum())
        return
    batch.old_logprobs = batch.old_logprobs.to("meta")
    on_device = update.loss_denominator([batch], settings)
    assert torch.is_tensor(on_device) and on_device.device.type == "meta" and on_device.dim() == 0
    assert torch.is_tensor(host) and 0 < int(host) <= int(batch.completion_mask.sum())


def test_kept_batch_takes_indices_a_mask_or_rows_alike():
    P, n = 2, 3
    rollouts = sampling.Rollouts(
        prompt_ids=torch.tensor([[5], [6]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.arange(P * n)[:, None], completion_mask=torch.ones(P * n, 1, dtype=torch.long),
        texts=[""] * 6, lengths=torch.ones(6), truncated=torch.zeros(6, dtype=torch.bool),
        prompt_index=torch.arange(P).repeat_interleave(n))
    mask = torch.tensor([[False, True, True], [True, False, False]])
    full_advantages = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    by_mask = update.kept_batch(rollouts, mask, full_advantages)
    by_rows = update.kept_batch(rollouts, torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0, 3.0]))
    for batch in (by_mask, by_rows):
        assert batch.completion_ids.flatten().tolist() == [1, 2, 3] and batch.prompt_ids.flatten().tolist() == [5, 5, 6]
        assert batch.advantages.tolist() == [1.0, 2.0, 3.0]
    assert update.kept_rows(torch.tensor([[2, 1], [0, 2]]), n).tolist() == [2, 1, 3, 5]  # i*n + kept[i, j], in order
    with pytest.raises(ValueError, match="do not match"):
        update.kept_batch(rollouts, mask, torch.ones(2))
    with pytest.raises(ValueError, match=r"\[0, P\*n = 6\)"):
        update.kept_batch(rollouts, torch.tensor([1, 6]), torch.ones(2))
    with pytest.raises(ValueError, match="bool mask"):
        update.kept_rows(torch.ones(2, 4, dtype=torch.bool), n)
    empty = update.kept_batch(rollouts, torch.zeros(P, n, dtype=torch.bool), torch.zeros(P, n))
    assert empty.completion_ids.shape == (0, 1) and empty.advantages.shape == (0,)


def test_an_update_with_no_rows_takes_no_step():
    model = lora_model()
    optimizer = update.make_optimizer(model, 1e-2, weight_decay=0.1)  # decay alone would move the weights
    before = trainable(model)
    empty = random_batch(0, 3, 5, VOCAB)
    settings = update.UpdateSettings(updates_per_batch=2, loss=LossSettings(aggregation="token"))
    update.fill_logprobs(model, [empty], settings)
    metrics = update.update_policy(model, optimizer, [empty], settings)
    assert (metrics.rows, metrics.optimizer_steps, metrics.skipped_steps, metrics.loss) == (0, 0, 0, 0.0)
    assert all(torch.equal(before[n], p) for n, p in trainable(model).items()) and not optimizer.state


def test_a_layer_keeps_what_its_backward_needs_per_token_measured_on_the_model():
    """kernels.saved_bytes_per_token: a wider MLP keeps 4 more vectors of its width per token (gate's output, SiLU's,
    up's, and their product: down's input), in float32 here, when it does not replay; replaying, nothing of its
    own; a layer replayed whole keeps its input alone."""
    measured = []
    for intermediate in (128, 256):
        torch.manual_seed(0)
        model = models.tiny_random_model("llama", vocab_size=VOCAB, intermediate_size=intermediate)
        model = models.prepare_for_training(model, lora_rank=4, gradient_checkpointing=True).train()
        measured.append(kernels.saved_bytes_per_token(model))
    (plain, mlp, whole), wider = measured
    assert wider[0] - plain == 4 * (256 - 128) * 4 and wider[1] == mlp and wider[2] == whole == 64 * 4
    assert whole < mlp < plain


def test_the_replay_plan_by_hand():
    """36 layers keeping 130 / 45 / 4 kB per token (plain / MLP replayed / replayed whole), 10 000 tokens."""
    per_token = (130e3, 45e3, 4e3)
    assert kernels.checkpoint_plan(36, per_token, 10_000, 47e9) == (0, 0)     # 46.8 GB fit
    assert kernels.checkpoint_plan(36, per_token, 10_000, 30e9) == (0, 20)    # 16.8 GB over, 0.85 GB per MLP
    assert kernels.checkpoint_plan(36, per_token, 10_000, 10e9) == (16, 20)   # every MLP: 6.2 GB over, 0.41 per layer
    assert kernels.checkpoint_plan(36, per_token, 10_000, 0) == (36, 0)


def test_the_update_replays_as_little_as_its_budget_needs(monkeypatch):
    """On CUDA the update plans its backward's replay from its activation budget (kernels.activation_budget: planted
    here) and the micro-batch's tokens and logits: nothing, then MLPs, then whole layers, as the budget shrinks."""
    model = lora_model(checkpointing=True)
    batch = random_batch(4, 5, 6, VOCAB)
    settings = update.UpdateSettings(micro_batch_size=2, prefix_sharing=False)
    seen, plan = [], kernels.checkpoint_plan
    monkeypatch.setattr(kernels, "checkpoint_plan", lambda *args: seen.append(args) or plan(*args))
    monkeypatch.setattr(kernels, "activation_budget", lambda device: 1e12)
    assert update.checkpoint_plan(model, [batch], settings, "cuda") == (0, 0)
    layers, per_token, tokens, budget = seen[-1]
    assert (layers, tokens) == (2, 2 * (5 + 6)) and per_token == kernels.saved_bytes_per_token(model)
    logits = 1e12 - budget   # the LoRA model's head is fused (policy.fused_head): its float32 chunks alone
    assert logits == 4 * 4 * policy._LOGSUMEXP_CHUNK_ELEMENTS
    with monkeypatch.context() as unfused:   # the model's own logits: 2 rows x 6 tokens x 256 x 2 (and gradient) x 4 B
        unfused.setattr(policy, "fused_head", lambda model: None)
        update.checkpoint_plan(model, [batch], settings, "cuda")
        assert 1e12 - seen[-1][3] == logits + 2 * 6 * VOCAB * 2 * 4
    plain, mlp, whole = per_token
    for planted, want in ((logits + 2 * plain * tokens, (0, 0)), (logits + (plain + mlp) * tokens, (0, 1)),
                          (logits + (mlp + whole) * tokens, (1, 1)), (0, (2, 0))):
        monkeypatch.setattr(kernels, "activation_budget", lambda device, planted=planted: planted)
        assert update.checkpoint_plan(model, [batch], settings, "cuda") == want
    assert update.checkpoint_plan(model, [batch], settings, "cpu") == (None, 0)   # off CUDA: every layer, as built


@pytest.mark.parametrize("plan", [(None, 0), (0, 0), (0, 2), (1, 1), (2, 0)])
def test_whatever_replays_the_gradient_is_the_same(plan, monkeypatch):
    """kernels.checkpointing: layers replayed whole, MLPs replayed, nothing replayed: each replays what it says in the
    backward (an MLP's forward runs twice) and the gradient is that of the model without checkpointing."""
    model = lora_model(checkpointing=True)
    move_lora_b(model)
    batch = random_batch(4, 5, 6, VOCAB)
    monkeypatch.setattr(update, "checkpoint_plan", lambda *args: plan)
    runs = []
    for layer in kernels.checkpointable_layers(model):
        layer.mlp.gate_proj.register_forward_pre_hook(lambda module, args: runs.append(1))  # a replay may stop early
    with gpu_paths.emulated("cpu"):   # the plan acts where the GPU paths run
        update.update_policy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                             [batch], update.UpdateSettings(micro_batch_size=2, prefix_sharing=False))
    replayed = 2 if plan[0] is None else plan[0] + plan[1]
    assert len(runs) == 2 * (2 + replayed)   # 2 micro-batches: every MLP once, each replayed once more
    assert all(layer.gradient_checkpointing for layer in kernels.checkpointable_layers(model))   # as built again
    assert not any("forward" in layer.mlp.__dict__ for layer in kernels.checkpointable_layers(model))
    reference = lora_model(checkpointing=False)
    move_lora_b(reference)
    update.update_policy(reference, torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.0),
                         [batch], update.UpdateSettings(micro_batch_size=2, prefix_sharing=False))
    torch.testing.assert_close(grads(model), grads(reference), rtol=1e-5, atol=1e-6)


def test_what_the_update_cannot_train_on_is_refused_in_one_line():
    """The KL reference needs a LoRA adapter; an importance-sampling correction needs the sampler's log-probs; a
    non-finite advantage is refused before any forward pass (it is checked on the host)."""
    batch = random_batch(2, 3, 4, VOCAB)
    with pytest.raises(ValueError, match="kl_coef > 0 needs a LoRA model"):
        update.fill_logprobs(models.tiny_random_model("llama", vocab_size=VOCAB), [batch],
                             update.UpdateSettings(loss=LossSettings(kl_coef=0.1)))
    model = lora_model()
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        update.update_policy(model, frozen, [batch], update.UpdateSettings(
            loss=LossSettings(importance_sampling_correction="tis")))
    batch.advantages[1] = math.nan
    with pytest.raises(ValueError, match="non-finite values"):
        update.update_policy(model, frozen, [batch], update.UpdateSettings())
