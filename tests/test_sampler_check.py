"""The sampler check (policy.py's SamplerGap, LOGPROB_GAP_LIMIT, off_policy) and what feeds it: the sampler's
log-probs of both backends equal the trainer's (Llama, Qwen2, Qwen3, n > 1, left padding, EOS mid-batch, top-p < 1,
chunks splitting a prompt's rollouts); planted faults (a wrong temperature inside the engine, a stale merged copy, a
perturbed copy) raise the gap above the limit; a failing CUDA-graph recording falls back to eager decoding with the
same tokens, a failing engine to Hugging Face generate(); --backend engine turns each fallback into an error.
Slow (-m slow): the real demo model in fp32. Whole training runs and eval.py's guard: tests/test_train_sampler.py.
"""

import warnings

import pytest
import torch

import engine
import engine.decode
import engine.graphs
import engine.step
import eval as heldout
import policy
import models
import sampling
from sampling import GenerationSettings, sample_completions

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB, EOS = 16, 2


def eos_model(arch="llama", seed=4):
    """Untied tiny-vocabulary random model: EOS comes up by itself (seed 4 ends some rows early, not others)."""
    return models.tiny_random_model(arch, vocab_size=VOCAB, seed=seed, tie_word_embeddings=False).eval()


def peaked_lora_model(seed=0):
    """A tiny Llama with the real vocabulary, logits scaled x10 (a peaked distribution, as a trained model's) and a
    LoRA adapter whose merged copy the engine decodes from: faults in the copy show in the log-probs."""
    model = models.tiny_random_model("llama", seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return models.prepare_for_training(model, lora_rank=4, lora_alpha=8,
                                       lora_target_modules=models.DEFAULT_LORA_TARGETS).eval()


def left_padded_prompts(widths, seed=0, vocab=VOCAB):
    ids = torch.randint(3, vocab, (len(widths), max(widths)), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(max(widths)) >= max(widths) - torch.tensor(widths)[:, None]).long()
    return ids.masked_fill(mask == 0, EOS), mask


def rollouts_of(model, ids, mask, n, settings, seed=0):
    """sample_completions as a sampling.Rollouts (what update.kept_batch and eval.measure_sampler_gap read)."""
    cids, cmask, truncated, logprobs, backend = sample_completions(model, ids, mask, n, [EOS], EOS, settings, seed)
    return sampling.Rollouts(ids, mask, cids, cmask, [], cmask.sum(1), truncated,
                             torch.arange(len(ids)).repeat_interleave(n), logprobs, backend)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_sampler_logprobs_equal_the_trainers(arch, backend):
    """softmax(logits / T) before the top-p cut, per generated token, 0 after the first EOS: the trainer's
    policy.token_logprobs of the same tokens to float rounding; chunks of 5 rows split the prompts' 3 rollouts."""
    model = eos_model(arch)
    ids, mask = left_padded_prompts([4, 7, 2, 5])
    settings = GenerationSettings(max_new_tokens=24, temperature=0.8, top_p=0.9, rollout_batch_size=5,
                                  backend=backend)
    rollouts = rollouts_of(model, ids, mask, 3, settings, seed=5)
    assert rollouts.backend == backend
    assert len(set(rollouts.lengths.tolist())) > 2   # rows end (EOS) at different steps
    rows, keep = rollouts.prompt_index, rollouts.completion_mask.bool()
    with torch.no_grad():
        trainer = policy.token_logprobs(model, torch.cat([ids[rows], rollouts.completion_ids], 1),
                                        torch.cat([mask[rows], rollouts.completion_mask], 1),
                                        rollouts.completion_ids.shape[1], 0.8)
    assert (rollouts.sampler_logprobs[~keep] == 0).all() and (rollouts.sampler_logprobs[keep] < 0).all()
    assert (trainer - rollouts.sampler_logprobs)[keep].abs().max() < 1e-5
    gap = heldout.measure_sampler_gap(model, rollouts, 0.8, rows_checked=None)
    assert gap.tokens == int(keep.sum()) and gap.mean < 1e-5 and gap.ratio_max == pytest.approx(1, abs=1e-4)


def test_evaluation_checks_rows_spread_over_the_chunk():
    """rows_checked=4 of 12 rows: rows 0, 4, 7 and 11 (first and last included), their tokens alone; a sampler fault in
    the chunk's last row alone moves the gap past the fallback limit."""
    model = eos_model("qwen2")
    ids, mask = left_padded_prompts([4, 7, 2, 5])
    rollouts = rollouts_of(model, ids, mask, 3, GenerationSettings(max_new_tokens=12, temperature=0.9,
                                                                   rollout_batch_size=12), seed=1)
    keep = rollouts.completion_mask.bool()
    gap = heldout.measure_sampler_gap(model, rollouts, 0.9, rows_checked=4)
    assert gap.tokens == int(keep[[0, 4, 7, 11]].sum()) < int(keep.sum()) and gap.mean < 1e-5
    rollouts.sampler_logprobs[11] -= 5.0 * keep[11]   # the last row's tokens scored 5 nats off
    assert heldout.measure_sampler_gap(model, rollouts, 0.9, rows_checked=4).mean > policy.LOGPROB_GAP_LIMIT


def test_measure_with_prefix_sharing_is_the_full_forward_and_runs_the_prefix_once(monkeypatch):
    """Prompts that share a 6-token prefix: the gap measured with each distinct prompt and the shared prefix run once
    (prefix.completion_logprobs, the default) is the gap of every row in full, and the sharing path is the one taken."""
    from engine import prefix

    model = eos_model("qwen2")
    ids, mask = left_padded_prompts([9, 7, 11, 8], seed=3)
    lengths = mask.sum(1)
    for row in range(len(ids)):  # the same first 6 real tokens in every prompt
        ids[row, -int(lengths[row]):][:6] = torch.arange(3, 9)
    rollouts = rollouts_of(model, ids, mask, 3, GenerationSettings(max_new_tokens=10, temperature=0.9,
                                                                   rollout_batch_size=12), seed=2)
    calls = []
    shared = prefix.completion_logprobs
    monkeypatch.setattr(prefix, "completion_logprobs", lambda *a, **k: calls.append(a[1].shape) or shared(*a, **k))
    on = heldout.measure_sampler_gap(model, rollouts, 0.9, micro_batch_size=6)
    assert len(calls) == 2  # two micro-batches of 6 rows, both through the sharing path
    off = heldout.measure_sampler_gap(model, rollouts, 0.9, micro_batch_size=6, prefix_sharing=False)
    assert len(calls) == 2 and on.tokens == off.tokens > 0
    assert on.mean == pytest.approx(off.mean, abs=1e-6) and on.ratio_max == pytest.approx(off.ratio_max, abs=1e-5)
    assert on.mean < 1e-5


def test_greedy_logprobs_are_at_temperature_one():
    model = eos_model("qwen2")
    ids, mask = left_padded_prompts([3, 6])
    for backend in ("engine", "hf"):
        rollouts = rollouts_of(model, ids, mask, 1, GenerationSettings(max_new_tokens=12, temperature=0.0,
                                                                       backend=backend))
        assert heldout.measure_sampler_gap(model, rollouts, 0.0).mean < 1e-5


def test_gap_sums_add_and_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    sampler = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = policy.SamplerGap.of(trainer, sampler, mask)
    halves = policy.total([policy.SamplerGap.of(trainer[i:i + 1], sampler[i:i + 1], mask[i:i + 1])
                                  for i in range(2)])
    delta = torch.tensor([0.5, 0.0, -2.0, 0.0])
    expected = {"sampler/logprob_diff_mean": 2.5 / 4, "sampler/logprob_diff_max": 2.0,
                "sampler/kl": float((delta.exp() - delta - 1).mean()), "sampler/ratio_max": float(torch.exp(
                    torch.tensor(0.5)))}
    for gap in (whole, halves):
        assert gap.metrics() == pytest.approx(expected)
    ratios = policy.row_mean_ratios(trainer, sampler, torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert ratios[0] == pytest.approx(float(delta[:3].exp().mean())) and ratios[1].isnan()


FAULTS = ("wrong temperature", "stale copy", "perturbed copy")


def plant(fault, model, monkeypatch):
    """One fault in the engine: sampling (and recording) at 1.5 T; a merged copy made once and never refreshed
    while the adapter moves by an optimizer-sized step (0.05 per B entry); noise of the weights' std in the copy."""
    if fault == "wrong temperature":
        generate = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, temperature, **k: generate(*a, temperature=1.5 * temperature,
                                                                                        **k))
    elif fault == "stale copy":
        engine.engine_for(model)
        monkeypatch.setattr(engine.step, "refresh_copies", lambda copies: None)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1))
                                   .sign())
    else:
        refresh = engine.step.refresh_copies

        def noisy(copies):
            refresh(copies)
            for _, weight in copies:
                weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(2)) * weight.std())

        monkeypatch.setattr(engine.step, "refresh_copies", noisy)


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_faults_raise_the_gap_above_the_limit(fault, monkeypatch):
    model = peaked_lora_model()
    ids, mask = left_padded_prompts([5, 3], vocab=1000)
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, rollout_batch_size=8)
    healthy = heldout.measure_sampler_gap(model, rollouts_of(model, ids, mask, 4, settings), 1.0)
    plant(fault, model, monkeypatch)
    faulty = heldout.measure_sampler_gap(model, rollouts_of(model, ids, mask, 4, settings), 1.0)
    assert healthy.mean < 1e-5 < policy.LOGPROB_GAP_LIMIT < faulty.mean
    engine.release(model)


def test_after_gap_falls_back_to_hf_once_or_raises_with_backend_engine():
    model = eos_model()
    healthy = policy.SamplerGap(10, 1e-5, 0.0, 1e-5, 1.0)
    broken = policy.SamplerGap(10, 5.0, 1.0, 2.0, 7.0)
    assert policy.off_policy(healthy, "step 1") is None   # the verdict alone: no model, no state
    assert policy.off_policy(broken, "step 1", rejected=True).endswith("the step's update is not applied")
    assert sampling.after_gap(model, healthy, "engine", None, "step 1") is None
    assert sampling.after_gap(model, broken, "hf", None, "step 1") is None   # nothing to fall back to
    with pytest.raises(sampling.SamplerError, match=r"step 1: mean \|log-prob difference\| 0.5 > .*--backend engine"):
        sampling.after_gap(model, broken, "engine", "engine", "step 1")
    assert sampling.resolve_backend(model, None) == "engine"
    with pytest.warns(UserWarning, match="generating with Hugging Face generate"):
        reason = sampling.after_gap(model, broken, "engine", None, "step 1")
    assert "step 1" in reason and sampling.fallback_reason(model) == reason
    assert sampling.resolve_backend(model, None) == "hf" and sampling.resolve_backend(model, "engine") == "engine"


def test_capture_failure_falls_back_to_eager_with_the_same_tokens(monkeypatch):
    """Recording a CUDA graph fails (simulated on CPU: recording switched on, the recorder raising): one warning,
    the chunk is decoded eagerly with the tokens and log-probs of an eager run; later calls stay eager."""
    model, eager_model = eos_model(seed=1), eos_model(seed=1)
    ids, mask = left_padded_prompts([4, 6])
    settings = GenerationSettings(max_new_tokens=10, temperature=1.0, rollout_batch_size=4)
    expected = sample_completions(eager_model, ids, mask, 2, [EOS], EOS, settings, 3)
    monkeypatch.setattr(engine.decode, "records_graphs", lambda *args: True)
    recorded = []

    def failing_record(runtime, state, stats):
        recorded.append(1)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.graphs, "record_graph", failing_record)
    with pytest.raises(sampling.SamplerError, match="stream is capturing.*--backend engine allows no fallback"):
        sample_completions(model, ids, mask, 2, [EOS], EOS, GenerationSettings(**{**vars(settings),
                                                                                 "backend": "engine"}), 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = sample_completions(model, ids, mask, 2, [EOS], EOS, settings, 3)
        second = sample_completions(model, ids, mask, 2, [EOS], EOS, settings, 3)
    assert [str(w.message) for w in caught] == [
        "the decode engine failed (RuntimeError: CUDA error: operation not permitted when stream is capturing); "
        "generating with the decode engine without CUDA graphs from now on"]
    assert first[4] == second[4] == "eager" and len(recorded) == 2   # the explicit call, then the first one
    for got, want in zip(first[:4], expected[:4]):
        assert torch.equal(got, want)


def test_an_engine_failing_eagerly_too_falls_back_to_hf(monkeypatch):
    model = eos_model(seed=1)
    ids, mask = left_padded_prompts([4, 6])
    settings = GenerationSettings(max_new_tokens=10, temperature=1.0, rollout_batch_size=4)
    expected = sample_completions(model, ids, mask, 2, [EOS], EOS, GenerationSettings(**{**vars(settings),
                                                                                         "backend": "hf"}), 3)
    engine.release(model)

    def broken_step(dec, state):
        raise NotImplementedError("no kernel for this GPU")

    monkeypatch.setattr(engine.decode.decode_step, "decode_step", broken_step)
    with pytest.warns(UserWarning) as caught:
        got = sample_completions(model, ids, mask, 2, [EOS], EOS, settings, 3)
    assert [str(w.message).split(";")[1] for w in caught] == [
        " generating with the decode engine without CUDA graphs from now on",
        " generating with Hugging Face generate() from now on"]
    assert got[4] == "hf" and all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4]))


@pytest.mark.slow
def test_the_real_demo_model_samples_on_policy_in_fp32(smollm2_tokenizer):
    """SmolLM2-135M-Instruct with a LoRA adapter moved off zero, fp32, T = 0.9 and top-p 0.95: both backends' gaps
    are float rounding, far below the limit (the bf16 figures are bench sampler's)."""
    import data

    model = models.load_policy(models.SMOLLM2_ALIAS, lora_rank=8, lora_alpha=16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    prompts = [e.text for e in data.build_prompt_set("arithmetic", "train", smollm2_tokenizer, num_rows=3)]
    for backend in ("engine", "hf"):
        rollouts = sampling.generate_rollouts(model, smollm2_tokenizer, prompts, 2, GenerationSettings(
            max_new_tokens=24, temperature=0.9, top_p=0.95, backend=backend))
        gap = heldout.measure_sampler_gap(model, rollouts, 0.9)
        assert rollouts.backend == backend and gap.tokens > 50 and gap.mean < 1e-4 and gap.abs_max < 1e-3
