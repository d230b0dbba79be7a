"""prefix.py: groups of identical prompts and the prefix every prompt shares, found from the token ids; the completion
log-probs and their gradient with each distinct prompt run once (and the shared prefix once) equal
policy.token_logprobs' per-row computation for Llama and Qwen2, LoRA included; the forward calls really see fewer
tokens; gradient checkpointing replays the cache writes exactly; where it cannot run (reentrant checkpointing, a cache
that is not plain tensors) it says why."""

import pytest
import torch

import policy
import models
from engine import prefix

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 256
PAD = 2


def left_padded(rows):
    """[B, T] ids and mask of token lists, left padded with PAD."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def grouped_rows(seed=0, prefix_tokens=5, suffix_tokens=(2, 4, 1), rows=(0, 0, 1, 2, 1, 0), lengths=(4, 2, 3, 1, 4, 4),
                 width=4):
    """[left-padded prompt | right-padded completion] rows: distinct prompts (a common prefix + suffixes of the given
    lengths) repeated as `rows` says, completions of `lengths` tokens (the rest pads) -> (ids, mask, C)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (prefix_tokens,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in suffix_tokens]
    prompt_ids, prompt_mask = left_padded([prompts[i] for i in rows])
    completion_ids = torch.randint(3, VOCAB, (len(rows), width), generator=g)
    completion_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), completion_ids, PAD)
    return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), width


def small_model(arch, lora=False):
    # A larger init scale than the default makes logits depend visibly on the context.
    model = models.tiny_random_model(arch, vocab_size=VOCAB, seed=0, initializer_range=0.5)
    if lora:
        torch.manual_seed(0)
        model = models.prepare_for_training(model, lora_rank=4, lora_alpha=8)
        with torch.no_grad():  # B = 0 at init would leave A without gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return model.eval()


def logprobs_and_grads(fn, model, ids, mask, width, weights):
    """fn's log-probs [B, C] (masked) and the gradient of sum(weights * log-probs) for every trainable parameter."""
    model.zero_grad(set_to_none=True)
    logprobs = fn(model, ids, mask, width)
    completion_mask = mask[:, -width:]
    (logprobs * weights * completion_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logprobs.detach() * completion_mask, grads


def test_groups_are_identical_prompts_in_order_of_first_appearance():
    ids, mask = left_padded([[5, 6, 7], [9, 7], [5, 6, 7], [9, 7], [4, 9, 7], [5, 6, 7]])
    first, group = prefix.prompt_groups(ids, mask)
    assert first.tolist() == [0, 1, 4] and group.tolist() == [0, 1, 0, 1, 2, 0]
    # a pad id equal to a real token does not merge prompts of different lengths
    same_ids = torch.tensor([[PAD, 7], [PAD, 7]])
    assert prefix.prompt_groups(same_ids, torch.tensor([[0, 1], [1, 1]]))[1].tolist() == [0, 1]


def test_the_common_prefix_is_found_from_the_real_tokens():
    ids, mask = left_padded([[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 6, 7]])
    assert prefix.common_prefix_length(ids, mask) == 3
    # each prompt keeps at least its last token: a prompt that is all prefix leaves it out
    ids, mask = left_padded([[1, 2, 3], [1, 2, 3, 4]])
    assert prefix.common_prefix_length(ids, mask) == 2
    ids, mask = left_padded([[1, 2], [3, 2]])
    assert prefix.common_prefix_length(ids, mask) == 0
    assert prefix.common_prefix_length(*left_padded([[1, 2, 3]])) == 2  # one prompt: all but its last token
    assert prefix.is_left_padded(mask) and not prefix.is_left_padded(torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_completion_logprobs_and_gradients_equal_the_per_row_computation(arch, shared_prefix, lora):
    model = small_model(arch, lora)
    ids, mask, width = grouped_rows()
    weights = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(1))
    want, want_grads = logprobs_and_grads(policy.token_logprobs, model, ids, mask, width, weights)
    for temperature in (1.0, 0.7):
        got = prefix.completion_logprobs(model, ids, mask, width, temperature, shared_prefix=shared_prefix)
        expected = policy.token_logprobs(model, ids, mask, width, temperature)
        assert got.shape == expected.shape and got.dtype == torch.float32
        torch.testing.assert_close(got * mask[:, -width:], expected * mask[:, -width:], rtol=1e-5, atol=5e-5)
    got, got_grads = logprobs_and_grads(lambda *a: prefix.completion_logprobs(*a, shared_prefix=shared_prefix),
                                        model, ids, mask, width, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    assert set(got_grads) == set(want_grads) and all(g.abs().max() > 0 for g in want_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fold", [False, True])
def test_rows_folded_or_not_equal_the_per_row_computation(arch, fold, monkeypatch):
    """Folded (prefix.folds): after the shared prefix, one model call runs every row's own prompt tokens and its
    completion; not folded: one call for the distinct prompts' own tokens, one for the completions. The same
    log-probs and gradients either way."""
    monkeypatch.setattr(prefix, "folds", lambda *args: fold)
    model = small_model(arch, lora=True)
    ids, mask, width = grouped_rows()
    weights = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(1))
    want, want_grads = logprobs_and_grads(policy.token_logprobs, model, ids, mask, width, weights)
    calls = []
    embed = policy.hf_model(model).get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    got, got_grads = logprobs_and_grads(prefix.completion_logprobs, model, ids, mask, width, weights)
    hook.remove()
    assert calls == ([(1, 5), (6, 4 + 3)] if fold else [(1, 5), (3, 4), (6, 3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


def test_a_row_repeats_its_prompts_own_tokens_only_when_that_is_cheap():
    assert prefix.folds(16, 1, 1, 512)             # the paper's presets: the prompt's last token, 16 rows
    assert prefix.folds(4, 1, 1, 2)                # one token per row: always
    assert not prefix.folds(16, 4, 30, 32)         # the demo: 4 prompts' 30-token questions, 32-token completions
    assert prefix.folds(16, 4, 80, 512) and not prefix.folds(16, 4, 90, 512)  # 12 x 85 ~ 1/8 of 16 x 511


@pytest.mark.parametrize("case", ["one token completions", "one prompt", "all distinct", "no common prefix",
                                  "a prompt that is all prefix"])
@pytest.mark.parametrize("fold", [False, True])
def test_edge_layouts_equal_the_per_row_computation(case, fold, monkeypatch):
    monkeypatch.setattr(prefix, "folds", lambda *args: fold)
    model = small_model("llama")
    kwargs = {"one token completions": dict(width=1, lengths=(1,) * 6),
              "one prompt": dict(suffix_tokens=(3,), rows=(0, 0, 0), lengths=(4, 1, 3)),
              "all distinct": dict(suffix_tokens=(2, 3, 1), rows=(0, 1, 2), lengths=(4, 1, 3)),
              "no common prefix": dict(prefix_tokens=0),
              "a prompt that is all prefix": dict(suffix_tokens=(0, 2, 3))}[case]
    ids, mask, width = grouped_rows(seed=4, **kwargs)
    with torch.no_grad():
        want = policy.token_logprobs(model, ids, mask, width) * mask[:, -width:]
        for shared_prefix in (False, True):
            got = prefix.completion_logprobs(model, ids, mask, width, shared_prefix=shared_prefix)
            torch.testing.assert_close(got * mask[:, -width:], want, rtol=1e-5, atol=5e-5)


def test_each_distinct_prompt_token_goes_through_the_model_once():
    """Tokens per forward call (the embedding's input): per row, every row's prompt; groups: each distinct prompt
    once; with the shared prefix: the prefix once, then each prompt's own suffix. Completions once per row, without
    their last token (it predicts nothing scored)."""
    model = small_model("llama")
    ids, mask, width = grouped_rows(prefix_tokens=5, suffix_tokens=(2, 4, 1), rows=(0, 0, 1, 2, 1, 0))
    calls = []
    embed = policy.hf_model(model).get_input_embeddings()
    embed.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    with torch.no_grad():
        policy.token_logprobs(model, ids, mask, width)
        per_row, calls[:] = list(calls), []
        prefix.completion_logprobs(model, ids, mask, width, shared_prefix=False)
        groups, calls[:] = list(calls), []
        prefix.completion_logprobs(model, ids, mask, width, shared_prefix=True)
    assert per_row == [(6, 9 + 4)]
    assert groups == [(3, 9), (6, 3)]         # 3 distinct prompts of <= 9 tokens, then 6 completions less the last
    assert calls == [(1, 5), (3, 4), (6, 3)]  # the 5-token prefix once, suffixes of <= 4 tokens, completions


def checkpointed_model(arch="llama", reentrant=False):
    torch.manual_seed(0)
    model = models.tiny_random_model(arch, vocab_size=VOCAB, seed=0, initializer_range=0.5)
    if reentrant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
        return models.prepare_for_training(model, lora_rank=4).train()
    return models.prepare_for_training(model, lora_rank=4, gradient_checkpointing=True).train()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gradient_checkpointing_replays_the_cache_writes_and_stays_exact(arch):
    """Checkpointed layers keep the cache (prefix._PastLayer: writing the same keys twice gives the same), and the
    backward really replays them: every layer's cache write happens again in the backward."""
    model = checkpointed_model(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids, mask, width = grouped_rows()
    weights = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(1))
    writes = []
    real = prefix._PastLayer.update

    def counted(self, *args, **kwargs):
        writes.append(torch.is_grad_enabled())
        return real(self, *args, **kwargs)

    with policy.dropout_off(model, keep_checkpointing=True):
        assert prefix.unsupported_reason(model) is None
        want, want_grads = logprobs_and_grads(policy.token_logprobs, model, ids, mask, width, weights)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prefix._PastLayer, "update", counted)
            got, got_grads = logprobs_and_grads(prefix.completion_logprobs, model, ids, mask, width, weights)
    assert len(writes) == 2 * 3 * 2   # 2 layers x 3 forward calls (prefix, suffixes, completions), each replayed
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


def test_unsupported_models_are_named():
    model = small_model("llama", lora=True)
    assert prefix.unsupported_reason(model) is None
    reentrant = checkpointed_model(reentrant=True)
    assert "reentrant" in prefix.unsupported_reason(reentrant)
    with torch.no_grad():  # no backward to replay: nothing is checkpointed (fill_logprobs' passes)
        assert prefix.unsupported_reason(reentrant) is None
    sliding = models.tiny_random_model("qwen2", vocab_size=VOCAB, use_sliding_window=True, sliding_window=4,
                                       max_window_layers=0)
    assert "DynamicSlidingWindowLayer" in prefix.unsupported_reason(sliding)
    assert "not a transformers causal LM" in prefix.unsupported_reason(torch.nn.Linear(2, 2))


def test_several_processes_make_the_same_calls_whatever_their_prompts(monkeypatch):
    """Under FSDP every rank must run the same forward calls: with several processes the prefix level (used or not
    by each rank's own prompts) is off, and every call is one prompt pass + one completion pass, still exact."""
    model = small_model("llama")
    ids, mask, width = grouped_rows()
    calls = []
    policy.hf_model(model).get_input_embeddings().register_forward_hook(
        lambda module, args, out: calls.append(tuple(args[0].shape)))
    monkeypatch.setattr(prefix, "several_processes", lambda: True)
    with torch.no_grad():
        got = prefix.completion_logprobs(model, ids, mask, width, shared_prefix=True)
        assert calls == [(3, 9), (6, 3)]
        want = policy.token_logprobs(model, ids, mask, width)
    torch.testing.assert_close(got * mask[:, -width:], want * mask[:, -width:], rtol=1e-5, atol=5e-5)
    monkeypatch.undo()
    assert not prefix.several_processes()  # this test process: one process, no process group


def test_absolute_position_models_see_the_positions_of_the_full_rows():
    """GPT-2 adds absolute position embeddings: a prefix, suffix or completion at a wrong position changes the
    numbers visibly (RoPE models would hide a constant shift), so this checks the positions of every call."""
    from test_policy import tiny_gpt2

    model = tiny_gpt2().eval()
    ids, mask, width = grouped_rows(seed=2)
    with torch.no_grad():
        want = policy.token_logprobs(model, ids, mask, width) * mask[:, -width:]
        for shared_prefix in (False, True):
            got = prefix.completion_logprobs(model, ids, mask, width, shared_prefix=shared_prefix)
            torch.testing.assert_close(got * mask[:, -width:], want, rtol=1e-5, atol=5e-5)
