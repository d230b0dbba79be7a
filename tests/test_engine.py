"""engine/: greedy equality with HF generate (left padding, n > 1, EOS mid-batch, finished rows dropped), the
sampled distribution (chi-square, and a wrong temperature is rejected), no generation_config leak on either
backend, forced lengths, no EOS, one prefill per distinct prompt, merged-LoRA copies, the compile count over varying
prompt widths, the fallback."""

import copy
import warnings

import pytest
import torch

import engine
import engine.decode
import engine.graphs
import engine.step
import eval as heldout
import models
from engine import prefix
from sampling import GenerationSettings, completion_mask_after_eos, derived_seed, sample_completions

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB, EOS = 16, 2   # a tiny vocabulary: EOS comes up by itself, and 4096 draws pin a distribution down


def eos_model(arch, seed=4, logit_scale=1.0, **overrides):
    """Untied, tiny-vocabulary random model; seed 4 ends some greedy rows early and not others (asserted)."""
    model = models.tiny_random_model(arch, vocab_size=VOCAB, seed=seed, tie_word_embeddings=False, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def left_padded_prompts(widths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(widths), max(widths)), generator=generator)
    mask = (torch.arange(max(widths)) >= max(widths) - torch.tensor(widths)[:, None]).long()
    return ids.masked_fill(mask == 0, EOS), mask


def run(model, ids, mask, n, max_new_tokens, seed=0, **settings):
    """sampling.sample_completions (the engine by default) with its GenerationSettings given as keywords."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, **settings)
    return sample_completions(model, ids, mask, n, [EOS], EOS, settings, seed)[:3]   # ids, mask, truncated


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_generate_with_eos_mid_batch(arch):
    model = eos_model(arch)
    ids, mask = left_padded_prompts([4, 7, 2, 5])
    before = engine.STATS.row_steps, engine.STATS.decode_steps
    fast = run(model, ids, mask, 2, 40, temperature=0.0, rollout_batch_size=8)
    steps = engine.STATS.row_steps - before[0], engine.STATS.decode_steps - before[1]
    reference = run(model, ids, mask, 2, 40, temperature=0.0, rollout_batch_size=8, backend="hf")
    for a, b in zip(fast, reference):
        assert torch.equal(a, b)
    lengths = fast[1].sum(1)
    assert lengths.min() < 16 and lengths.max() == 40 and fast[2].any() and not fast[2].all()  # EOS mid-batch
    assert steps[0] < 8 * steps[1]  # finished rows were dropped: fewer row-steps than 8 rows x every step


def test_compaction_and_forced_lengths_change_no_token():
    """Forced EOS at given lengths (the benchmarks' synthetic lengths): exact lengths, and dropping finished rows
    (check every 4 steps) gives every row the tokens it gets without dropping (check never), greedy and sampled."""
    model = eos_model("llama", seed=1)
    ids, mask = left_padded_prompts([3, 6, 5])
    forced = torch.tensor([3, 5, 40, 9, 17, 2])
    for temperature in (0.0, 1.0):
        outs, work = [], []
        for check_every in (4, 1000):
            before = engine.STATS.row_steps
            outs.append(engine.generate(model, ids, mask, torch.arange(3).repeat_interleave(2), 30, [EOS], EOS,
                                        temperature=temperature, seed=5, forced_lengths=forced, max_rows=8,
                                        check_every=check_every))
            work.append(engine.STATS.row_steps - before)
        assert torch.equal(outs[0], outs[1]) and work[0] < work[1]
    natural = run(model, ids, mask, 2, 30, temperature=1.0)[1].sum(1)  # chunk 0 of seed 0
    out = engine.generate(model, ids, mask, torch.arange(3).repeat_interleave(2), 30, [EOS], EOS, temperature=1.0,
                          seed=derived_seed(0, 0), forced_lengths=forced)
    completion_mask, truncated = completion_mask_after_eos(out, [EOS])
    assert completion_mask.sum(1).tolist() == torch.minimum(natural, forced.clamp(max=30)).tolist()
    assert truncated.tolist() == (completion_mask.sum(1) == 30).tolist()


def test_eager_decoding_runs_a_chunks_own_rows_and_drops_finished_ones_exactly():
    """Without recorded graphs a chunk of 5 rows in a process whose chunks reach 16 runs 5 rows, not a bucket of 8;
    finished rows leave once an eighth of them are done (8 -> 7 rows, where the buckets would wait for 4): the same
    tokens as a loop that never drops a row. The model never picks token 15 itself (its logit 0, the others
    scaled up), so only the forced lengths end rows."""
    model = eos_model("llama", seed=1, logit_scale=50.0)
    with torch.no_grad():
        model.lm_head.weight[15] = 0
    ids, mask = left_padded_prompts([3, 6, 5, 4, 2])
    before = engine.STATS.row_steps
    engine.generate(model, ids, mask, torch.arange(5), 30, [15], EOS, temperature=0.0, max_rows=16)
    assert engine.STATS.row_steps - before == 5 * 30
    rows, forced = torch.arange(4).repeat_interleave(2), torch.tensor([4] + [40] * 7)
    outs, work = [], []
    for check_every in (2, 1000):
        before = engine.STATS.row_steps
        outs.append(engine.generate(model, ids[:4], mask[:4], rows, 30, [15], EOS, temperature=0.0, max_rows=16,
                                    forced_lengths=forced, check_every=check_every))
        work.append(engine.STATS.row_steps - before)
    assert torch.equal(outs[0], outs[1]) and work == [8 * 4 + 7 * 26, 8 * 30]
    assert [engine.decode.next_size(alive, 36, 64, True) for alive in (36, 33, 31, 1)] == [36, 36, 31, 1]
    assert [engine.decode.next_size(alive, 64, 64, False) for alive in (64, 33, 32, 31)] == [64, 64, 32, 32]


def test_no_eos_ids_decode_every_row_to_the_limit():
    """eos_ids=[] (the benchmarks' fixed-length decoding): the same tokens up to each row's first EOS, then on."""
    model = eos_model("llama")
    ids, mask = left_padded_prompts([4, 7, 2, 5])
    rows = torch.arange(4)
    stopping = engine.generate(model, ids, mask, rows, 40, [EOS], EOS, temperature=0.0)
    endless = engine.generate(model, ids, mask, rows, 40, [], EOS, temperature=0.0)
    completion_mask, truncated = completion_mask_after_eos(stopping, [EOS])
    assert truncated.any() and not truncated.all()  # some rows did end early ...
    assert endless.shape == (4, 40) and torch.equal(endless[completion_mask == 1], stopping[completion_mask == 1])
    assert not torch.equal(endless, stopping)  # ... and went on without EOS ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_prefill_per_distinct_prompt_changes_no_token(temperature):
    """Prefilling each distinct prompt once and copying its cache to its rows equals prefilling every row."""
    model = eos_model("qwen2", seed=1)
    ids, mask = left_padded_prompts([3, 6, 5])
    rows = torch.arange(3).repeat_interleave(4)
    shared = engine.generate(model, ids, mask, rows, 10, [EOS], EOS, temperature=temperature, seed=11)
    per_row = engine.generate(model, ids[rows], mask[rows], torch.arange(12), 10, [EOS], EOS,
                              temperature=temperature, seed=11)
    assert torch.equal(shared, per_row)


def prompts_with_prefix(prefix_tokens, suffix_tokens, seed=0, pad_columns=1):
    """Left-padded prompts [len(suffix_tokens), W]: a common random prefix of `prefix_tokens` then suffixes of the
    given lengths (0: the prompt is the prefix), suffix i starting with token 3 + i (no two suffixes agree)."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (prefix_tokens,), generator=generator)
    prompts = [torch.cat([prefix, torch.tensor([3 + i] * min(k, 1), dtype=torch.long),
                          torch.randint(3, VOCAB, (max(k - 1, 0),), generator=generator)])
               for i, k in enumerate(suffix_tokens)]
    width = max(len(p) for p in prompts) + pad_columns
    ids, mask = torch.full((len(prompts), width), EOS), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    return ids, mask


def test_shared_prefix_layout_by_hand():
    """[prefix][suffix, left padded], the prefix found from the ids, capped so every prompt keeps its last token."""
    from engine.prefix import shared_prefix_layout

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 4, 3], [0, 0, 0, 5, 6, 7]])
    mask = (ids != 0).long()
    new_ids, new_mask, shared = shared_prefix_layout(ids, mask)
    assert shared == 2   # 5 6 7 is common, but the third prompt (5 6 7) keeps its 7 after the prefix
    assert new_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1]]
    assert new_ids[new_mask == 1].tolist() == ids[mask == 1].tolist()   # the same tokens, in order, per row
    no_prefix = torch.tensor([[0, 5, 6], [7, 5, 6]])
    assert shared_prefix_layout(no_prefix, (no_prefix != 0).long())[2] == 0
    assert torch.equal(shared_prefix_layout(no_prefix, (no_prefix != 0).long())[0], no_prefix)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("suffixes", [(0, 3, 7, 1), (5, 2, 6)], ids=["prompt-is-prefix", "different-lengths"])
def test_prefix_sharing_changes_no_token_and_prefills_the_prefix_once(arch, suffixes):
    """Prefix sharing on vs off: the same tokens and sampler log-probs to rounding, greedy and sampled (the per-row
    noise keys make a fixed seed comparable), n = 3 rollouts per prompt; the prefill runs the prefix once."""
    model = eos_model(arch, seed=3)
    ids, mask = prompts_with_prefix(9, suffixes, seed=1)
    rows, width = torch.arange(len(suffixes)).repeat_interleave(3), ids.shape[1]
    for temperature in (0.0, 1.0):
        outputs, tokens = [], []
        for sharing in (True, False):
            before = engine.STATS.prefill_tokens
            outputs.append(engine.generate(model, ids, mask, rows, 20, [EOS], EOS, temperature=temperature, seed=3,
                                           return_logprobs=True, prefix_sharing=sharing))
            tokens.append(engine.STATS.prefill_tokens - before)
        assert torch.equal(outputs[0][0], outputs[1][0])
        torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=0, atol=1e-5)
        truncated = completion_mask_after_eos(outputs[0][0], [EOS])[1]
        assert truncated.any() and not truncated.all() and (outputs[0][1][:, 0] < 0).all()   # EOS mid-batch
        longest_suffix = max(suffixes) if 0 not in suffixes else max(suffixes) + 1   # the prompt-is-prefix row
        shared = 9 if 0 not in suffixes else 8                                          # keeps its last token
        assert tokens == [shared + len(suffixes) * (longest_suffix - 1), len(suffixes) * (width - 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_sharing_with_no_common_prefix_is_the_plain_prefill(arch):
    """Prompts that share no first token: prefix length 0, the prefill of every prompt as before, same tokens."""
    model = eos_model(arch, seed=1)
    ids, mask = prompts_with_prefix(0, (4, 6, 2))
    assert prefix.shared_prefix_layout(ids, mask)[2] == 0
    for temperature in (0.0, 1.0):
        on, off = (engine.generate(model, ids, mask, torch.arange(3).repeat_interleave(2), 16, [EOS], EOS,
                                   temperature=temperature, seed=7, return_logprobs=True, prefix_sharing=sharing)
                   for sharing in (True, False))
        assert torch.equal(on[0], off[0])
        torch.testing.assert_close(on[1], off[1], rtol=0, atol=1e-5)   # (an all-pad column is dropped)


@pytest.mark.parametrize("length", [1, 3])
def test_attention_over_a_prefix_read_once_equals_attention_over_every_row(length):
    """step.attend_shared (eager decoding: the columns every row shares read once, from row 0) against step.attend
    over each row's full cache: 9 query heads on 3 KV heads, masked columns after the prefix, the same output."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, shared, columns = 5, 9, 3, 8, 6, 14
    q = torch.randn(batch, heads, length, head_dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, columns, head_dim, generator=generator) for _ in range(2))
    for cache in (keys, values):
        cache[:, :, :shared] = cache[:1, :, :shared]   # the prefix, the same in every row
    mask = torch.rand(batch, 1, length, columns, generator=generator) < 0.6
    mask[..., :shared] = True
    want = engine.step.attend(q, keys, values, mask, 0.3)
    torch.testing.assert_close(engine.step.attend_shared(q, keys, values, mask, 0.3, shared), want, rtol=1e-5,
                               atol=1e-6)
    keys[1:, :, :shared] += 1.0   # rows whose prefix differs from row 0's: not what it may be given
    assert not torch.allclose(engine.step.attend_shared(q, keys, values, mask, 0.3, shared),
                              engine.step.attend(q, keys, values, mask, 0.3))


@pytest.mark.parametrize("fault", ["prefix only in the last row", "prefix tokens reversed"])
def test_a_faulty_shared_prefix_is_caught_by_the_sampler_check(fault, monkeypatch):
    """The run-time guard covers prefix sharing: eval.measure_sampler_gap scores the rollouts with the plain forward
    pass over the whole prompts, so a shared prefix whose K/V reach only the last row (decoding reads them from the
    first, step.attend_shared), or were computed from its tokens in reverse order, raises the gap above the
    fallback limit (a tiny Llama with peaked logits, as a trained model's)."""
    import policy
    import sampling

    model = models.tiny_random_model("llama", seed=0, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.eval()
    ids, mask = prompts_with_prefix(12, (3, 5, 2), seed=2)
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, rollout_batch_size=12)

    def gap():
        cids, cmask, truncated, logprobs, backend = sample_completions(model, ids, mask, 4, [EOS], EOS, settings, 0)
        rollouts = sampling.Rollouts(ids, mask, cids, cmask, [], cmask.sum(1), truncated,
                                     torch.arange(3).repeat_interleave(4), logprobs, backend)
        return heldout.measure_sampler_gap(model, rollouts, 1.0)

    healthy, prefill, run_layers = gap(), engine.step.prefill, engine.step.run_layers

    def last_row_only(dec, prompt_ids, prompt_mask, shared=0):
        keys, values = prefill(dec, prompt_ids, prompt_mask, shared)
        for cache in keys + values:
            cache[:-1, :, :shared] = 0
        return keys, values

    def reversed_prefix(dec, hidden, *args):   # the prefix: the one call of one row and several tokens
        return run_layers(dec, hidden.flip(1) if hidden.shape[0] == 1 < hidden.shape[1] else hidden, *args)

    if fault == "prefix only in the last row":
        monkeypatch.setattr(engine.step, "prefill", last_row_only)
    else:
        monkeypatch.setattr(engine.step, "run_layers", reversed_prefix)
    assert healthy.mean < 1e-5 < policy.LOGPROB_GAP_LIMIT < gap().mean


def first_token_counts(model, temperature, top_p, draws=4096, **kw):
    ids, mask = torch.tensor([[5, 7, 9, 3]]), torch.ones(1, 4, dtype=torch.long)
    out = run(model, ids, mask, draws, 1, temperature=temperature, top_p=top_p, rollout_batch_size=512, seed=3, **kw)
    return torch.bincount(out[0][:, 0], minlength=VOCAB).double()


def expected_probs(model, temperature, top_p):
    """softmax(logits / T) restricted to the top-p nucleus, from a plain forward pass."""
    with torch.no_grad():
        probs = (model(torch.tensor([[5, 7, 9, 3]])).logits[0, -1].double() / temperature).softmax(-1)
    ordered, order = probs.sort(descending=True)
    kept = order[(ordered.cumsum(0) - ordered) < top_p]
    restricted = torch.zeros_like(probs)
    restricted[kept] = probs[kept]
    return restricted / restricted.sum()


def chi_square_p_value(counts, probs):
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token outside the support was drawn
    support = probs > 0
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc((support.sum() - 1) / 2.0, statistic / 2.0))


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.6)])
def test_sampling_follows_softmax_over_temperature_in_the_nucleus(temperature, top_p):
    model = eos_model("llama", logit_scale=6.0)
    counts = first_token_counts(model, temperature, top_p)
    assert (expected_probs(model, temperature, top_p) > 0.01).sum() >= 4  # a distribution worth testing
    assert chi_square_p_value(counts, expected_probs(model, temperature, top_p)) > 1e-3
    assert chi_square_p_value(counts, expected_probs(model, temperature * 1.3, top_p)) < 1e-6  # the test has power


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_model_generation_config_does_not_shape_the_rollouts(backend):
    model = eos_model("llama", logit_scale=6.0)
    ids, mask = left_padded_prompts([4, 6])
    greedy = run(model, ids, mask, 1, 12, temperature=0.0, backend=backend)[0]
    model.generation_config.update(do_sample=True, temperature=0.3, top_k=2, top_p=0.5, min_p=0.3,
                                   repetition_penalty=5.0)
    with torch.no_grad():  # the leak would be visible: generate() honouring these values differs
        honoured = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=EOS)[:, 6:]
    assert not torch.equal(honoured[:, :greedy.shape[1]], greedy)
    assert torch.equal(run(model, ids, mask, 1, 12, temperature=0.0, backend=backend)[0], greedy)
    counts = first_token_counts(model, 1.0, 1.0, backend=backend)
    assert chi_square_p_value(counts, expected_probs(model, 1.0, 1.0)) > 1e-3
    assert (counts > 0).sum() > 2  # top_k=2 did not leak


def lora_model(seed=0, arch="llama"):
    from peft import LoraConfig, get_peft_model

    base = eos_model(arch)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=models.lora_targets(base)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # peft initialises B = 0 (a no-op adapter); make it matter
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def test_merged_lora_copy_equals_unmerged_and_leaves_the_adapter_alone():
    model = lora_model()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids, mask = left_padded_prompts([4, 6, 3])
    captured = []
    hook = model.get_base_model().lm_head.register_forward_hook(lambda m, i, o: captured.append(o[:, -1].clone()))
    fast = run(model, ids, mask, 1, 10, temperature=0.0)
    hook.remove()
    unmerged = run(model, ids, mask, 1, 10, temperature=0.0, backend="hf")
    assert torch.equal(fast[0], unmerged[0])
    assert torch.equal(run(model, ids, mask, 1, 10, temperature=0.0, generation_copy=False)[0], fast[0])
    # Engine logits of step t = the unmerged model's logits at prompt + t tokens.
    with torch.no_grad():
        full = model(input_ids=torch.cat([ids, fast[0]], 1), attention_mask=torch.cat([mask, fast[1]], 1)).logits
    for step, logits in enumerate(captured):
        torch.testing.assert_close(logits[:3], full[:, ids.shape[1] - 1 + step], rtol=1e-4, atol=1e-4)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    # An optimizer step changes the adapter in place: the next call must use the new weights.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.0)
    assert torch.equal(run(model, ids, mask, 1, 10, temperature=0.0)[0],
                       run(model, ids, mask, 1, 10, temperature=0.0, backend="hf")[0])
    with model.disable_adapter():  # the reference policy: base weights only
        assert torch.equal(run(model, ids, mask, 1, 10, temperature=0.0)[0],
                           run(model, ids, mask, 1, 10, temperature=0.0, backend="hf")[0])


class ComputeDtypeLinear(torch.nn.Linear):
    """A bitsandbytes 4-bit layer's dtypes on CPU: bf16 weights, input and bias cast to bf16, output cast back."""

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(self.weight.dtype)
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, bias).to(x.dtype)


def test_merged_copy_of_a_4bit_layout_decodes_in_the_copys_dtype():
    """A --load-in-4bit model after prepare_model_for_kbit_training: bf16 projections, float32 embeddings, norms,
    biases and adapter, so a float32 residual stream. The merged copy is bf16: the engine must run it as the 4-bit
    layer does (a plain F.linear raised "mat1 and mat2 must have the same dtype" on the GPU)."""
    model = lora_model(arch="qwen2")   # qwen2: biased q/k/v projections, kept float32 as prepare_model_for_kbit does
    for module in model.modules():
        if hasattr(module, "lora_A"):
            base = module.base_layer
            bf16 = ComputeDtypeLinear(base.in_features, base.out_features, bias=base.bias is not None)
            bf16.load_state_dict(base.state_dict())
            bf16.weight.data = bf16.weight.data.to(torch.bfloat16)
            module.base_layer = bf16
    ids, mask = left_padded_prompts([4, 6, 3])
    reference = run(model, ids, mask, 1, 10, temperature=0.0, backend="hf")
    merged = run(model, ids, mask, 1, 10, temperature=0.0, backend="engine", generation_copy=True)
    assert all(copy.dtype == torch.bfloat16 for _, copy in engine.decode.engine_for(model, True).copies)
    assert torch.equal(merged[0], reference[0])
    assert torch.equal(run(model, ids, mask, 1, 10, temperature=0.0, backend="engine", generation_copy=False)[0],
                       reference[0])


def test_compile_count_is_bounded_over_varying_prompt_widths():
    """20 calls, prompt widths 2..250, 3-4 rows, finished rows dropped every 2 steps: every graph comes from the
    bucket set (rows in {4, 2, 1} x cache length {256} x sampling on) -> at most 3 graphs, none after the first
    calls; the compiled step gives the eager step's tokens."""
    model = eos_model("llama", num_hidden_layers=1)
    eager_model = copy.deepcopy(model)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    generator = torch.Generator().manual_seed(0)
    counts = []
    for call in range(20):
        width, rows = int(torch.randint(2, 251, (1,), generator=generator)), int(torch.randint(3, 5, (1,)))
        ids, mask = left_padded_prompts([width], seed=call)
        kw = dict(temperature=1.0, seed=call, max_rows=4, check_every=2,
                  forced_lengths=torch.randint(1, 7, (rows,), generator=generator))
        out = engine.generate(model, ids, mask, torch.zeros(rows, dtype=torch.long), 6, [EOS], EOS,
                              compile_backend=counting_backend, **kw)
        assert torch.equal(out, engine.generate(eager_model, ids, mask, torch.zeros(rows, dtype=torch.long), 6,
                                                [EOS], EOS, **kw))
        counts.append(len(graphs))
    bound = len(engine.row_buckets(4)) * 1 * 1
    buckets_used = {key for runtime in engine.decode._ENGINES[model].values() for key in runtime.states}
    assert 1 <= counts[-1] == len(buckets_used) <= bound == 3 and counts[9] == counts[-1]  # one graph per bucket


def test_recorded_graphs_cover_every_bucket_on_first_use_and_replay_the_step(monkeypatch):
    """The CUDA-graph path on CPU, with a stand-in graph whose replay() runs the recorded step in place (what a
    CUDA graph does): the first call records every row bucket of its cache length at once, so 20 later calls with
    varying prompt widths (one cache length through cache_tokens) and rows dropped at varying steps record none;
    tokens equal the plain eager loop."""
    recorded = []

    class ReplayStep:
        def __init__(self, runtime, state):
            self.runtime, self.state = runtime, state

        def replay(self):
            self.runtime.step(self.runtime, self.state)

    def fake_record(runtime, state, stats):
        recorded.append((len(state.tokens), state.keys[0].shape[2]))
        return ReplayStep(runtime, state)

    model, eager_model = eos_model("llama", seed=1), eos_model("llama", seed=1)
    engine.engine_for(model).capture = True   # what engine_for sets on a CUDA device
    monkeypatch.setattr(engine.graphs, "record_graph", fake_record)
    generator = torch.Generator().manual_seed(0)
    counts = []
    for call in range(21):
        width = int(torch.randint(2, 400, (1,), generator=generator))   # needs 256 or 512 cache tokens alone
        ids, mask = left_padded_prompts([width, max(1, width // 2)], seed=call)
        kw = dict(temperature=1.0, seed=call, max_rows=8, check_every=2, cache_tokens=400 + 12,
                  forced_lengths=torch.randint(1, 12, (8,), generator=generator))
        out = engine.generate(model, ids, mask, torch.arange(2).repeat_interleave(4), 12, [EOS], EOS, **kw)
        assert torch.equal(out, engine.generate(eager_model, ids, mask, torch.arange(2).repeat_interleave(4), 12,
                                                [EOS], EOS, **kw))
        counts.append(len(recorded))
    assert sorted(recorded) == [(rows, 512) for rows in engine.row_buckets(8)]   # 1, 2, 4, 8 rows; one length
    assert counts[0] == counts[-1] == 4


def test_unsupported_architecture_falls_back_to_hf_with_a_warning():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64)).eval()
    ids, mask = left_padded_prompts([3, 5])
    with pytest.warns(UserWarning, match="generating with Hugging Face generate"):
        out = run(model, ids, mask, 2, 6, temperature=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per reason, not per call
        assert torch.equal(out[0], run(model, ids, mask, 2, 6, temperature=0.0, backend="hf")[0])
    assert engine.unsupported_reason(model) is not None and engine.unsupported_reason(eos_model("qwen2")) is None


def test_bad_inputs_raise():
    model = eos_model("llama")
    ids, mask = left_padded_prompts([3, 5])
    with pytest.raises(ValueError, match="left padded"):
        engine.generate(model, ids, mask.flip(1), torch.arange(2), 4, [EOS], EOS)
    with pytest.raises(ValueError, match="forced_lengths"):
        engine.generate(model, ids, mask, torch.arange(2), 4, [], EOS, forced_lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="backend"):
        run(model, ids, mask, 1, 4, backend="vllm")


@pytest.mark.slow
def test_greedy_engine_equals_hf_generate_on_the_real_demo_model(smollm2_tokenizer):
    """SmolLM2-135M-Instruct (the offline demo model): the engine's greedy completions are HF generate's, text for
    text, on chat prompts of different lengths (left padding) with two rows each."""
    import data
    import sampling

    model = models.load_policy(models.SMOLLM2_ALIAS)
    prompts = data.render_prompts(smollm2_tokenizer, [[{"role": "user", "content": question}] for question in (
        "What is 2 + 3?", "Name three prime numbers larger than ten, and explain how you checked each one.",
        "Write the word hello backwards.")])
    runs = [sampling.generate_rollouts(model, smollm2_tokenizer, prompts, 2, sampling.GenerationSettings(
        max_new_tokens=32, temperature=0.0, backend=backend)) for backend in ("engine", "hf")]
    assert runs[0].texts == runs[1].texts and torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert len(set(runs[0].texts)) == 3  # three different answers, not one degenerate string


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpus_weight_layout_follows_every_refresh_and_agrees_with_f_linear(dtype, monkeypatch):
    """On a CPU the merged copies and the LM head are laid out for oneDNN's products (engine/step.cpu_layout),
    refreshed with the copies after an optimizer step: the sampler's log-probs equal the F.linear engine's (bf16:
    the same numbers; float32: within rounding) before and after the adapter moves. A layout that fails its check
    is one warning line and F.linear."""
    model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=VOCAB, seed=4), lora_rank=4,
                                        lora_alpha=8).to(dtype).eval()
    ids, mask = left_padded_prompts([5, 3, 4])

    def logprobs():
        return engine.decode.generate(model, ids, mask, torch.arange(3).repeat(2), 6, [EOS], EOS, seed=1,
                                      return_logprobs=True)

    tolerance = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    laid_out = [logprobs()]   # the engine made, its weights laid out
    with torch.no_grad():     # an optimizer step's change: the same engine refreshes copies and layouts
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=dtype), alpha=0.3)
    laid_out.append(logprobs())
    runtime = engine.decode.engine_for(model, refresh_weights=False)
    assert len(runtime.layouts) == 4 * 2 + 1 and all(slot[0] is not None for _, slot in runtime.layouts)
    engine.decode.release(model)
    with monkeypatch.context() as plain_products:
        plain_products.setitem(engine.step.CPU_LAYOUT, "usable", False)   # every product through F.linear
        plain = logprobs()
        assert all(slot[0] is None for _, slot in engine.decode.engine_for(model, refresh_weights=False).layouts)
    engine.decode.release(model)
    assert torch.equal(laid_out[1][0], plain[0]) and torch.allclose(laid_out[1][1], plain[1], **tolerance)
    assert not torch.equal(laid_out[0][1], laid_out[1][1])   # the adapter moved the sampler
    monkeypatch.setitem(engine.step.CPU_LAYOUT, "usable", None)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, b, *rest: torch.zeros(()))  # planted
    with pytest.warns(UserWarning, match="oneDNN's weight layout is not used"):
        assert engine.step.cpu_layout(torch.ones(8, 4)) is None
    assert engine.step.CPU_LAYOUT["usable"] is False and engine.step.cpu_layout(torch.ones(8, 4)) is None
