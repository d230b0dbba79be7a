"""sampling.generate_rollouts: row layout, first-EOS masks (pad == EOS), seeding, chunking, mode/grad hygiene,
the model's generation_config ignored, argument checks."""

import os

import pytest
import torch

import models
import policy
import sampling
from sampling import completion_mask_after_eos, derived_seed, eos_token_ids


def generate_rollouts(model, tokenizer, prompts, n, seed=0, **settings):
    """sampling.generate_rollouts with its GenerationSettings given as keywords."""
    return sampling.generate_rollouts(model, tokenizer, prompts, n, sampling.GenerationSettings(**settings), seed)

PROMPTS = ["Hello there, how are you?", "2+2=", "Name a prime number bigger than ten, please:"]
EOS = 2  # SmolLM2: eos == pad == 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def force_eos_at(model, stop_steps, eos_id=EOS, suppress=(EOS,)):
    """Make row r emit eos_id exactly at generated position stop_steps[r] (None: never); suppress the
    ids in `suppress` everywhere else so random EOS draws cannot interfere. One chunk only."""
    state = {"step": 0}

    def hook(module, inputs, logits):
        logits = logits.clone()
        logits[:, -1, list(suppress)] = -1e4
        for row, stop in enumerate(stop_steps):
            if stop == state["step"]:
                logits[row, -1, eos_id] = 1e4
        state["step"] += 1
        return logits

    return model.lm_head.register_forward_hook(hook)


def greedy(model, tokenizer, prompts, n=1, **kw):
    return generate_rollouts(model, tokenizer, prompts, n=n, max_new_tokens=kw.pop("max_new_tokens", 6),
                             temperature=0.0, **kw)


def test_shapes_and_row_layout(tiny_model, smollm2_tokenizer):
    n = 3
    out = greedy(tiny_model, smollm2_tokenizer, PROMPTS, n=n, rollout_batch_size=4)  # chunks split groups
    P = len(PROMPTS)
    assert out.prompt_ids.shape[0] == P and out.prompt_mask.shape == out.prompt_ids.shape
    assert out.completion_ids.shape == out.completion_mask.shape == (P * n, 6)
    assert len(out.texts) == P * n and out.lengths.shape == out.truncated.shape == (P * n,)
    assert out.prompt_index.tolist() == [i for i in range(P) for _ in range(n)]
    assert torch.equal(out.lengths, out.completion_mask.sum(1))
    lengths = out.prompt_mask.sum(1)
    assert lengths.min() < lengths.max() and (out.prompt_mask[:, -1] == 1).all()  # left padded
    # Greedy: row i*n + j must be exactly what prompt i alone produces.
    for i, prompt in enumerate(PROMPTS):
        alone = greedy(tiny_model, smollm2_tokenizer, [prompt])
        for j in range(n):
            assert torch.equal(out.completion_ids[i * n + j], alone.completion_ids[0])
            assert out.texts[i * n + j] == alone.texts[0]


def test_mask_cut_after_first_eos_when_pad_is_eos(tiny_model, smollm2_tokenizer):
    stops = [0, 2, None, 4]  # row 2 never ends
    handle = force_eos_at(tiny_model, stops)
    out = generate_rollouts(tiny_model, smollm2_tokenizer, ["a", "b"], n=2, max_new_tokens=6,
                            rollout_batch_size=4, seed=3)
    handle.remove()
    assert out.lengths.tolist() == [1, 3, 6, 5]
    assert out.truncated.tolist() == [False, False, True, False]
    for row, stop in enumerate(stops):
        if stop is not None:
            assert out.completion_ids[row, stop] == EOS and out.completion_mask[row, stop] == 1
            assert (out.completion_mask[row, stop + 1:] == 0).all()
            assert (out.completion_ids[row, stop + 1:] == smollm2_tokenizer.pad_token_id).all()
            assert (out.completion_ids[row, :stop] != EOS).all()
    assert out.texts[0] == "" and "<|im_end|>" not in "".join(out.texts)


def test_extra_eos_ids_from_generation_config(tiny_model, smollm2_tokenizer):
    tiny_model.generation_config.eos_token_id = [EOS, 7]  # e.g. Llama-3 <|eot_id|> next to <|end_of_text|>
    assert eos_token_ids(tiny_model, smollm2_tokenizer) == [EOS, 7]
    handle = force_eos_at(tiny_model, [1, None], eos_id=7, suppress=(EOS, 7))
    out = greedy(tiny_model, smollm2_tokenizer, ["x"], n=2, max_new_tokens=5)
    handle.remove()
    assert out.lengths.tolist() == [2, 5] and out.truncated.tolist() == [False, True]


def test_completion_mask_helper_by_hand():
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 2, 9], [5, 9, 3, 2]])
    mask, truncated = completion_mask_after_eos(ids, [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert truncated.tolist() == [False, True, False, False]


def test_seed_reproducible_and_caller_rng_untouched(tiny_model, smollm2_tokenizer):
    kw = dict(n=4, max_new_tokens=5, temperature=1.0, rollout_batch_size=3)
    rng_before = torch.get_rng_state()
    a = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS[:2], seed=11, **kw)
    assert torch.equal(torch.get_rng_state(), rng_before)
    b = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS[:2], seed=11, **kw)
    c = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS[:2], seed=12, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # rollouts of one prompt differ from each other (sampling, not n copies of one sample)
    assert len({tuple(row.tolist()) for row in a.completion_ids[:4]}) > 1
    assert len({derived_seed(11, c) for c in range(100)} | {derived_seed(12, c) for c in range(100)}) == 200


def test_derived_seeds_differ_by_every_part():
    seeds = {derived_seed(0, step, r) for step in range(1, 50) for r in range(3)}
    assert len(seeds) == 147 and derived_seed(1, 5) != derived_seed(5, 1)


def test_chunking_guarantees(tiny_model, smollm2_tokenizer):
    """Guaranteed: (1) a chunk's rows depend only on (seed, chunk index, its own prompts), so the first chunk of
    a longer call equals the same chunk generated alone; (2) greedy rows do not depend on the chunk size.
    Not guaranteed: sampled rows across different chunk sizes (chunk c draws from its own stream)."""
    n, size = 2, 4
    kw = dict(n=n, max_new_tokens=5, temperature=1.0, seed=5, rollout_batch_size=size)
    full = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS, **kw)
    head = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS[:2], **kw)
    assert torch.equal(full.completion_ids[:size], head.completion_ids[:size])
    one_chunk = greedy(tiny_model, smollm2_tokenizer, PROMPTS, n=n, rollout_batch_size=len(PROMPTS) * n)
    for size in (1, 4):
        chunked = greedy(tiny_model, smollm2_tokenizer, PROMPTS, n=n, rollout_batch_size=size)
        assert torch.equal(chunked.completion_ids, one_chunk.completion_ids)


def test_chunks_padded_to_common_width(tiny_model, smollm2_tokenizer):
    handle = force_eos_at(tiny_model, [0, 0, None, None])  # chunk 0 stops after 1 token, chunk 1 runs 6
    out = generate_rollouts(tiny_model, smollm2_tokenizer, ["a"], n=4, max_new_tokens=6, rollout_batch_size=2)
    handle.remove()
    assert out.completion_ids.shape == (4, 6)
    assert (out.completion_mask[:2, 1:] == 0).all() and (out.completion_ids[:2, 1:] == EOS).all()
    assert out.lengths.tolist() == [1, 1, 6, 6]


def test_eval_no_grad_inside_and_modes_restored(tiny_model, smollm2_tokenizer):
    tiny_model.train()
    tiny_model.model.layers[1].eval()  # a module deliberately in eval mode must stay so
    seen = []  # embed_tokens: called by both backends (the engine never calls tiny_model.model itself)
    handle = tiny_model.model.embed_tokens.register_forward_pre_hook(
        lambda module, args: seen.append((module.training, torch.is_grad_enabled())))
    out = generate_rollouts(tiny_model, smollm2_tokenizer, ["a"], n=2, max_new_tokens=3, temperature=1.0)
    handle.remove()
    assert seen and all(training is False and grad is False for training, grad in seen)
    assert tiny_model.training and tiny_model.model.layers[0].training and not tiny_model.model.layers[1].training
    assert not out.completion_ids.requires_grad
    assert all(p.grad is None for p in tiny_model.parameters())


def test_model_generation_config_defaults_do_not_leak(tiny_model, smollm2_tokenizer):
    base = greedy(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=8)
    tiny_model.generation_config.repetition_penalty = 50.0  # would break greedy repeats if it leaked
    tiny_model.generation_config.top_k = 1
    leaked = greedy(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=8)
    assert torch.equal(base.completion_ids, leaked.completion_ids)
    # top_p -> 0 keeps only the most likely token: sampling must reduce to greedy
    nucleus = generate_rollouts(tiny_model, smollm2_tokenizer, PROMPTS, n=1, max_new_tokens=8, top_p=1e-9)
    assert torch.equal(base.completion_ids, nucleus.completion_ids)


@pytest.mark.parametrize("bad", [dict(prompts=[]), dict(n=0), dict(max_new_tokens=0), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(rollout_batch_size=0), dict(backend="vllm"),
                                 dict(prompts=[""]), dict(prefix_sharing="on")])
def test_bad_arguments_raise(tiny_model, smollm2_tokenizer, bad):
    kw = dict(prompts=["a"], n=1, max_new_tokens=2)
    kw.update(bad)
    with pytest.raises(ValueError):
        generate_rollouts(tiny_model, smollm2_tokenizer, **kw)


def test_generation_beyond_positions_or_memory_is_refused_naming_the_flags(tiny_model, monkeypatch):
    """KV cache of the tiny Llama (2 layers, 2 KV heads x 16 dims, fp32): 512 bytes per token and row."""
    flags = "--rollout-batch-size or --max-completion-tokens"
    with pytest.raises(ValueError, match="up to 2049 tokens exceed the model's 2048 positions: lower --rollout"):
        models.check_generation_fits(tiny_model, 4, 2049, flags)
    monkeypatch.setattr(models, "available_memory_bytes", lambda device: 2 ** 30)
    models.check_generation_fits(tiny_model, 64, 2048, flags)  # 64 MiB of cache + 48 MiB of logits: fits
    with pytest.raises(ValueError, match=r"1024 sequences of 2048 tokens needs ~1\.8 GiB \(KV cache 1\.0 GiB\)"):
        models.check_generation_fits(tiny_model, 1024, 2048, flags)
    monkeypatch.setattr(models, "available_memory_bytes", lambda device: None)  # unknown: not refused
    models.check_generation_fits(tiny_model, 1024, 2048, flags)


# A shared system prompt, then prompts of different lengths; the last one is a prefix of the second.
SHARED = "<|im_start|>system\nYou are a careful assistant. Answer briefly.<|im_end|>\n<|im_start|>user\n"
PREFIXED = [SHARED + "What is 12 + 30?", SHARED + "Name a prime number bigger than ten, please.", SHARED + "Name",
            SHARED + "Hi"]


def count_embedded_tokens(model):
    """A hook counting the rows x tokens every forward pass embeds (prompt processing and decode steps)."""
    counted = []
    handle = policy.hf_model(model).model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: counted.append(inputs[0].numel()))
    return counted, handle


@pytest.mark.parametrize("backend", ["engine", "hf"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_sharing_changes_no_rollout_and_computes_the_prefix_once(smollm2_tokenizer, backend, arch):
    """generate_rollouts with prefix sharing on vs off, both backends: the same completion ids and sampler log-probs
    to rounding, greedy and sampled (fixed seed), n = 2, chunks that split a prompt's rollouts; and the prefix runs
    once per chunk: (prompts - 1) x prefix fewer tokens, the engine's prompts being the distinct ones, HF's every
    row (the decode steps are the same on and off)."""
    model = models.tiny_random_model(arch, seed=2).eval()
    tokens = [smollm2_tokenizer(p, add_special_tokens=False)["input_ids"] for p in PREFIXED]
    for temperature in (0.0, 1.0):
        runs, work = [], []
        for sharing in (True, False):
            counted, handle = count_embedded_tokens(model)
            runs.append(generate_rollouts(model, smollm2_tokenizer, PREFIXED, 2, seed=4, max_new_tokens=8,
                                          temperature=temperature, rollout_batch_size=6, backend=backend,
                                          prefix_sharing=sharing))
            handle.remove()
            work.append(sum(counted))
        on, off = runs
        assert torch.equal(on.completion_ids, off.completion_ids) and on.texts == off.texts
        torch.testing.assert_close(on.sampler_logprobs, off.sampler_logprobs, rtol=0, atol=1e-5)
        assert on.backend == off.backend == backend and len(set(on.texts)) > 1
        saved = 0
        for rows in ([0, 0, 1, 1, 2, 2], [3, 3]):   # the two chunks' prompts
            shared = min(len(os.path.commonprefix([tokens[i] for i in rows])), *(len(tokens[i]) - 1 for i in rows))
            saved += (len(rows if backend == "hf" else set(rows)) - 1) * shared
        assert work[1] - work[0] == saved > 0


def test_prefix_sharing_keeps_absolute_positions_on_hf(smollm2_tokenizer):
    """GPT-2 (absolute position embeddings, HF backend only): the pads between prefix and suffix must shift no
    position, or the tokens would change: the same rollouts on and off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(smollm2_tokenizer),
                                       n_positions=128, eos_token_id=EOS, bos_token_id=EOS)).eval()
    runs = [generate_rollouts(model, smollm2_tokenizer, PREFIXED, 2, seed=1, max_new_tokens=6, temperature=1.0,
                              backend="hf", prefix_sharing=sharing) for sharing in (True, False)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    torch.testing.assert_close(runs[0].sampler_logprobs, runs[1].sampler_logprobs, rtol=0, atol=1e-5)
