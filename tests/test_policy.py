"""Completion log-probabilities (policy.token_logprobs) of tiny real-architecture models (Llama, Qwen2, GPT-2)
with left padding: equal to an unpadded full softmax, the position ids, the gradient, chunking, bad sizes."""

import pytest
import torch

import policy
import models

VOCAB = 256


def tiny_gpt2():
    """Absolute position embeddings: the architecture where wrong left-pad positions are visible."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                        initializer_range=0.5)
    return GPT2LMHeadModel(config)


@pytest.fixture(params=["llama", "qwen2", "gpt2"])
def small_model(request):
    if request.param == "gpt2":
        return tiny_gpt2().eval()
    # A larger init scale than the default makes logits depend visibly on the context.
    return models.tiny_random_model(request.param, vocab_size=VOCAB, seed=0, initializer_range=0.5).eval()


def left_padded_batch(seed, prompt_lengths=(5, 2, 7), completion_len=4):
    """Rows [pad..., prompt, completion] plus the unpadded rows for the reference."""
    gen = torch.Generator().manual_seed(seed)
    width = max(prompt_lengths) + completion_len
    rows = [torch.randint(3, VOCAB, (p + completion_len,), generator=gen) for p in prompt_lengths]
    ids = torch.full((len(rows), width), 2)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask, rows


def naive_completion_logprobs(model, row, completion_len, temperature=1.0):
    logits = model(input_ids=row[None]).logits[0]  # every position, full vocabulary
    logprobs = torch.log_softmax(logits.double() / temperature, dim=-1)
    targets = row[-completion_len:]
    return logprobs[-completion_len - 1 : -1].gather(-1, targets[:, None]).squeeze(-1)


def test_token_logprobs_with_left_padding_match_unpadded_full_softmax(small_model):
    ids, mask, rows = left_padded_batch(0)
    for temperature in (1.0, 0.7):
        got = policy.token_logprobs(small_model, ids, mask, 4, temperature=temperature)
        assert got.shape == (3, 4) and got.dtype == torch.float32
        with torch.no_grad():
            for i, row in enumerate(rows):
                want = naive_completion_logprobs(small_model, row, 4, temperature).float()
                assert torch.allclose(got[i], want, atol=1e-4), (temperature, i, got[i], want)


def test_left_padding_position_ids_finding():
    # transformers 5 forward() falls back to arange(T) positions and ignores the mask. RoPE models
    # (Llama, Qwen2) only see position differences, so a constant left-pad shift changes logits by
    # float rounding only; absolute position embeddings (GPT-2) change visibly. token_logprobs passes
    # position_ids_from_mask, which is exact for both (and matches what generate() uses).
    ids, mask, rows = left_padded_batch(1)
    positions = policy.position_ids_from_mask(mask)
    assert positions[1].tolist() == [0] * 5 + list(range(6))
    rope = models.tiny_random_model("llama", vocab_size=VOCAB, initializer_range=0.5).eval()
    with torch.no_grad():
        for model, shift_matters in ((tiny_gpt2().eval(), True), (rope, False)):
            unpadded = model(input_ids=rows[1][None]).logits[0, -1]
            with_pos = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[1, -1]
            without = model(input_ids=ids, attention_mask=mask).logits[1, -1]
            assert torch.allclose(with_pos, unpadded, atol=1e-4)
            assert torch.allclose(without, unpadded, atol=1e-2) != shift_matters


def test_token_logprobs_gradient_matches_naive_and_requests_only_completion_logits(small_model):
    ids, mask, rows = left_padded_batch(2, prompt_lengths=(3, 6), completion_len=5)
    seen = {}
    original_forward = small_model.forward

    def recording_forward(*args, **kwargs):
        seen["logits_to_keep"] = kwargs.get("logits_to_keep")
        out = original_forward(*args, **kwargs)
        seen["logits_positions"] = out.logits.shape[1]
        return out

    small_model.forward = recording_forward
    policy.token_logprobs(small_model, ids, mask, 5).sum().backward()
    # The last C + 1 positions by index (a slice would be a strided view: kept_positions)
    assert seen["logits_to_keep"].tolist() == list(range(ids.shape[1] - 6, ids.shape[1]))
    assert seen["logits_positions"] == 6
    got = {name: p.grad.clone() for name, p in small_model.named_parameters()}
    small_model.zero_grad()
    small_model.forward = original_forward
    sum(naive_completion_logprobs(small_model, row, 5) for row in rows).sum().backward()
    for name, p in small_model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-4, rtol=1e-3), name
    assert any(g.abs().sum() > 0 for g in got.values())


def test_token_logprobs_chunking_does_not_change_results(small_model, monkeypatch):
    ids, mask, _ = left_padded_batch(3)
    with torch.no_grad():
        whole = policy.token_logprobs(small_model, ids, mask, 4)
        monkeypatch.setattr(policy, "_LOGSUMEXP_CHUNK_ELEMENTS", 1)  # one row per chunk
        chunked = policy.token_logprobs(small_model, ids, mask, 4)
    assert torch.equal(whole, chunked)


def test_token_logprobs_rejects_bad_sizes(small_model):
    ids, mask, _ = left_padded_batch(0)
    for bad in (0, ids.shape[1], 3.0):
        with pytest.raises(ValueError, match="num_completion_tokens"):
            policy.token_logprobs(small_model, ids, mask, bad)
    with pytest.raises(ValueError, match="attention_mask"):
        policy.token_logprobs(small_model, ids, mask[:, 1:], 2)
    with pytest.raises(ValueError, match="temperature"):
        policy.token_logprobs(small_model, ids, mask, 2, temperature=0.0)


def test_the_lm_head_reads_the_kept_positions_without_copying_its_weight():
    """Fewer positions than the row kept (a prompt's last position, a completion after its prompt): by index, so the
    LM head is one matrix product on [rows, hidden]; a slice is a strided view whose product copied the whole
    [vocabulary, hidden] weight once per row on a CPU (36x slower at the demo's sizes), forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine import prefix

    assert policy.kept_positions(6, 6) == 6 and policy.kept_positions(6, 9) == 9
    assert policy.kept_positions(10, 3).tolist() == [7, 8, 9]
    vocab, hidden = 49152, 64
    model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=vocab, hidden_size=hidden),
                                        lora_rank=4, lora_alpha=8)  # the LM head frozen, as in the update
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (4, 12), generator=gen).repeat_interleave(2, 0)  # 4 prompts, 2 rows each
    ids = torch.cat([prompts, torch.randint(3, vocab, (8, 4), generator=gen)], 1)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                Largest.numel = max(Largest.numel, out.numel())
            return out

    for logprobs in (policy.token_logprobs, prefix.completion_logprobs):
        Largest.numel = 0
        with Largest():
            logprobs(model, ids, torch.ones_like(ids), 4).sum().backward()
        assert Largest.numel < 2 * vocab * hidden, logprobs.__name__  # the logits [8, 4, V], no weight copies


def lora_llama(vocab=VOCAB, hidden=64):
    torch.manual_seed(0)
    model = models.tiny_random_model("llama", vocab_size=vocab, hidden_size=hidden, initializer_range=0.5)
    model = models.prepare_for_training(model, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # LoRA B starts at 0: move it so the adapter acts
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def test_the_fused_head_is_taken_only_where_the_logits_are_the_heads_product_and_it_does_not_train():
    model = lora_llama()
    assert policy.fused_head(model) is policy.hf_model(model).lm_head.weight
    assert policy.fused_head(models.tiny_random_model("llama", vocab_size=VOCAB)) is None   # the head trains
    assert policy.fused_head(tiny_gpt2().requires_grad_(False)) is None   # not a PLAIN_HEAD_FAMILIES model
    biased = models.tiny_random_model("qwen2", vocab_size=VOCAB).requires_grad_(False)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB), requires_grad=False)
    assert policy.fused_head(biased) is None


@pytest.mark.parametrize("family", policy.PLAIN_HEAD_FAMILIES)
def test_each_plain_head_familys_logits_are_the_heads_product(family):
    """What PLAIN_HEAD_FAMILIES claims of each family (a tiny random model, LoRA, its head frozen): the hidden states
    `kept_outputs` hands over with the fused head, times that head, are the model's own logits."""
    model = models.prepare_for_training(models.tiny_random_model(family, vocab_size=VOCAB), lora_rank=4,
                                        lora_alpha=8)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hidden, head = policy.kept_outputs(model, 4, **inputs)
        logits = model(**inputs).logits[:, -4:]
    assert head is policy.hf_model(model).lm_head.weight
    assert torch.allclose(hidden @ head.T, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_gives_the_logits_paths_log_probs_entropies_and_gradients(monkeypatch, temperature):
    """token_logprobs and prefix.completion_logprobs of a LoRA model, with the head fused (in chunks of 3 positions)
    and through the model's logits: the same log-probs and entropies, and the same gradients of every adapter."""
    from engine import prefix

    ids, mask, _ = left_padded_batch(1, prompt_lengths=(5, 5, 7, 3), completion_len=6)
    ids[1, -11:-6] = ids[0, -11:-6]  # rows 0 and 1 share a prompt
    weights = torch.randn(ids.shape[0], 6)
    results = {}
    for fused in (True, False):
        model = lora_llama()
        if not fused:
            monkeypatch.setattr(policy, "fused_head", lambda model: None)
        monkeypatch.setattr(policy, "_LOGSUMEXP_CHUNK_ELEMENTS", 3 * VOCAB)
        for logprobs in (policy.token_logprobs, prefix.completion_logprobs):
            values, entropies = logprobs(model, ids, mask, 6, temperature, with_entropies=True)
            model.zero_grad()
            (values * weights).sum().backward()
            results[fused, logprobs.__name__] = values.detach(), entropies, {
                name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        monkeypatch.undo()
    for name in ("token_logprobs", "completion_logprobs"):
        (fused_values, fused_entropies, fused_grads), (values, entropies, grads) = results[True, name], \
            results[False, name]
        # float32 rounding of log-probs of ~-20 and entropies of ~1 (other products, other orders)
        assert torch.allclose(fused_values, values, rtol=1e-6, atol=2e-5)
        assert torch.allclose(fused_entropies, entropies, rtol=1e-5, atol=5e-5)
        for key in grads:
            scale = float(grads[key].abs().max())  # gradients up to ~100 here: float32 rounding relative to that
            assert torch.allclose(fused_grads[key], grads[key], rtol=1e-4, atol=1e-5 * scale), (name, key)
        assert any(g.abs().sum() > 0 for g in fused_grads.values())


def test_the_fused_head_never_holds_more_than_a_chunk_of_logits(monkeypatch):
    """The update's log-probs of 8 rows x 6 tokens: with the head fused, no tensor of more than one chunk's rows of
    [rows, vocabulary] exists (here 8 positions a chunk); through the model's logits, all 56 kept positions'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ids, mask, _ = left_padded_batch(2, prompt_lengths=(5, 5, 7, 3, 4, 4, 6, 2), completion_len=6)
    monkeypatch.setattr(policy, "_LOGSUMEXP_CHUNK_ELEMENTS", 8 * VOCAB)

    class MostRows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == VOCAB:
                MostRows.rows = max(MostRows.rows, out.numel() // VOCAB)
            return out

    model = lora_llama(hidden=8)   # the head's weight [V, 8]: 8 rows of V too
    with MostRows():
        policy.token_logprobs(model, ids, mask, 6).sum().backward()
    assert MostRows.rows == 8
    monkeypatch.setattr(policy, "fused_head", lambda model: None)
    with MostRows():
        policy.token_logprobs(model, ids, mask, 6).sum().backward()
    assert MostRows.rows >= 8 * 7
