"""engine/gpu_paths.py: the GPU's code paths taken on a CPU (`emulated("cpu")`) give what the plain path gives. The
update's fast path (the step's prefix and the fold, a replay plan made for the emulated card's memory, the fused
kernels' check and patching, TF32, the one read per optimizer step) gives the plain path's losses, metrics,
gradients and weights after two optimizer steps of torch's AdamW (foreach and fused) and bitsandbytes' 8-bit AdamW;
a bf16 base's adapter computed in bf16 stays within bf16's tolerance of peft's; the decode engine takes its fused ops
by itself there and decodes the plain step's tokens; --load-in-4bit loads (bitsandbytes NF4 on the CPU), updates and
decodes generate()'s tokens; the flags that need a GPU are refused without one and accepted where one is emulated."""

import contextlib
import math

import pytest
import torch

import engine
import engine.decode
import engine.ops as ops
import loss_options
import models
import update
from engine import gpu_paths
from engine import kernels
from policy import hf_model, token_logprobs
from run import config
from test_engine import EOS, eos_model, left_padded_prompts, run
from test_update import VOCAB, move_lora_b

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def adamw(params, fused):
    return torch.optim.AdamW(params, lr=1e-2, betas=update.ADAM_BETAS, fused=fused, foreach=None if fused else True)


OPTIMIZERS = {"adamw": lambda params: adamw(params, False), "adamw fused": lambda params: adamw(params, True),
              "adamw8bit": lambda params: __import__("bitsandbytes").optim.AdamW8bit(params, lr=1e-2)}


def policy(base_dtype=torch.float32, rank=64):
    """A tiny Llama with gradient checkpointing and a LoRA adapter of rank 64 (its A and B hold 4096 values:
    bitsandbytes keeps 8-bit state for them), B moved off zero."""
    torch.manual_seed(0)
    model = models.tiny_random_model("llama", vocab_size=VOCAB).to(base_dtype)
    model = models.prepare_for_training(model, lora_rank=rank, lora_alpha=rank, gradient_checkpointing=True)
    move_lora_b(model)
    return model.train()


def batches():
    """Two rollout batches of 3 prompts x 2 rows: the step's prefix (every prompt starts with it), left padding,
    completions of varied lengths (one empty), sampler log-probs off the policy's by noise."""
    result = []
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        prompts = torch.randint(3, VOCAB, (3, 9), generator=generator)
        prompts[:, 1:6] = torch.tensor([5, 6, 7, 8, 9])
        mask = torch.ones_like(prompts)
        mask[1, 0] = 0
        rows = torch.arange(3).repeat_interleave(2)
        completions = torch.randint(3, VOCAB, (6, 7), generator=generator)
        lengths = torch.tensor([7, 3, 0, 5, 7, 1])
        completion_mask = (torch.arange(7) < lengths[:, None]).long()
        batch = update.UpdateBatch(prompts[rows], mask[rows], completions.masked_fill(completion_mask == 0, EOS),
                                   completion_mask, torch.randn(6, generator=generator), lengths == 7)
        batch.sampler_logprobs = -torch.rand(6, 7, generator=generator) - 3.0
        result.append(batch)
    return result


def settings(**loss):
    return update.UpdateSettings(micro_batch_size=2, updates_per_batch=2, loss=loss_options.loss_settings(**loss))


def two_steps(model, optimizer_name, step_settings, memory_bytes=None, plans=None):
    """fill_logprobs + update_policy (mu = 2) -> (metrics, the trainable weights after); memory_bytes: on the GPU
    paths of an emulated card of that memory; plans: a list the replay plans made are appended to."""
    optimizer = OPTIMIZERS[optimizer_name]([p for p in model.parameters() if p.requires_grad])
    work = batches()
    plan = update.checkpoint_plan

    def recorded(*args):
        plans.append(plan(*args))
        return plans[-1]

    with pytest.MonkeyPatch.context() as patch:
        if plans is not None:
            patch.setattr(update, "checkpoint_plan", recorded)
        if memory_bytes is None:
            update.fill_logprobs(model, work, step_settings)
            metrics = update.update_policy(model, optimizer, work, step_settings)
        else:
            with gpu_paths.emulated("cpu", memory_bytes=memory_bytes):
                update.fill_logprobs(model, work, step_settings)
                metrics = update.update_policy(model, optimizer, work, step_settings)
    return metrics, torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


# A card this small leaves the update room for some of the tiny model's activations only: the plan replays MLPs.
SMALL_CARD = 3_000_000


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_the_gpu_paths_give_the_plain_paths_update(optimizer_name):
    plain, plain_weights = two_steps(policy(), optimizer_name, settings(importance_sampling_correction="tis"))
    plans, model = [], policy()
    fast, fast_weights = two_steps(model, optimizer_name, settings(importance_sampling_correction="tis"),
                                   SMALL_CARD, plans)
    assert plans and plans[0] not in ((None, 0), (0, 0)), plans   # the plan replays less than every layer whole
    assert set(model.__dict__["_fused_kernels"]) == {"rms_norm", "rotary", "silu_mul"}   # checked and patched
    assert fast.optimizer_steps == plain.optimizer_steps == 2
    assert fast.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-7)
    assert fast.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    for key, value in plain.token_means.items():
        assert fast.token_means[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    moved = float((plain_weights - policy_weights()).abs().max())
    assert moved > 1e-3 and float((fast_weights - plain_weights).abs().max()) < 1e-3 * moved


def policy_weights():
    return torch.cat([p.detach().flatten() for p in policy().parameters() if p.requires_grad])


@pytest.mark.parametrize("option", [dict(top_entropy_quantile=0.5), dict(importance_sampling_correction="token_reject",
                                                                          aggregation="token"),
                                    dict(importance_sampling_level="sequence"), dict(policy_loss="cispo")],
                         ids=lambda option: next(iter(option)))
def test_every_loss_option_gives_the_same_update_on_the_gpu_paths(option):
    plain, plain_weights = two_steps(policy(rank=4), "adamw", settings(**option))
    fast, fast_weights = two_steps(policy(rank=4), "adamw", settings(**option), SMALL_CARD)
    assert fast.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-7) and math.isfinite(fast.loss)
    torch.testing.assert_close(fast_weights, plain_weights, rtol=1e-5, atol=1e-6)


def test_a_bf16_base_computes_its_adapter_in_bf16_within_tolerance_of_peft():
    """On the GPU paths a bf16 base's adapter runs as three bf16 products (models.lora_in_base_dtype): the update's
    loss and gradient stay within bf16's tolerance of peft's fp32 adapter over the same base (tests/
    test_lora_precision.py: within 0.12 of an fp32 model, relative L2)."""
    one_step = update.UpdateSettings(micro_batch_size=2, loss=loss_options.LossSettings())
    results = []
    for memory_bytes in (None, SMALL_CARD):
        model = policy(torch.bfloat16)
        frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        work = batches()
        with gpu_paths.emulated("cpu", memory_bytes=memory_bytes) if memory_bytes else contextlib.nullcontext():
            metrics = update.update_policy(model, frozen, work, one_step)
        results.append((metrics.loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])))
    (plain_loss, plain), (fast_loss, fast) = results
    assert fast_loss == pytest.approx(plain_loss, rel=0.05, abs=0.02)
    error = float((fast - plain).norm() / plain.norm())
    assert 0 < error < 0.12, error   # the bf16 product did run, within bf16's rounding of peft's


def test_the_replay_plan_follows_the_emulated_cards_memory():
    model = policy(rank=4)
    work = batches()
    with gpu_paths.emulated("cpu", memory_bytes=80 * 2 ** 30):
        assert update.checkpoint_plan(model, work, settings(), "cpu") == (0, 0)   # room for everything
    with gpu_paths.emulated("cpu", memory_bytes=SMALL_CARD):
        assert update.checkpoint_plan(model, work, settings(), "cpu") not in ((0, 0), (None, 0))
    with gpu_paths.emulated("cpu", memory_bytes=0):
        assert update.checkpoint_plan(model, work, settings(), "cpu") == (2, 0)   # every layer whole
    assert update.checkpoint_plan(model, work, settings(), "cpu") == (None, 0)   # no GPU: as built
    assert not update.on_gpu("cpu")


def test_tf32_is_switched_on_for_the_block_and_back():
    before = torch.backends.cuda.matmul.allow_tf32
    with gpu_paths.emulated("cpu"), kernels.tf32_matmuls("cpu"):
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_the_decode_engine_takes_its_fused_ops_where_a_gpu_is_emulated(monkeypatch):
    """With no kernel set forced, a CPU decodes with the plain step; on the GPU paths the engine picks the fused ops
    (each running its reference behind the op, without the interpreter) and decodes the same tokens."""
    monkeypatch.setattr(engine.decode, "KERNELS", None)
    monkeypatch.setattr(ops, "DISABLED", {})
    model = eos_model("llama")
    ids, mask = left_padded_prompts([4, 7])
    engine.release()
    plain = run(model, ids, mask, 2, 8, temperature=1.0, seed=3)
    assert not engine.decode.engine_for(model).kernels.fused
    engine.release()
    with gpu_paths.emulated("cpu"):
        fused = run(model, ids, mask, 2, 8, temperature=1.0, seed=3)
        assert engine.decode.engine_for(model).kernels.fused == frozenset(ops.OPS)
        assert not engine.decode.records_graphs(model, True, False)   # CUDA graphs: CUDA's alone
    engine.release()
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))


def test_load_in_4bit_updates_and_decodes_on_an_emulated_gpu(tiny_model_dir, smollm2_tokenizer):
    """bitsandbytes' NF4 runs on a CPU too: with the GPU paths taken there, --load-in-4bit loads the tiny model as
    4-bit with a LoRA adapter, takes an update (finite, the adapter moves) and decodes HF generate's greedy tokens
    through the engine (the bitsandbytes modules run in the step, no merged copy)."""
    with pytest.raises(ValueError, match="--load-in-4bit needs a CUDA device"):
        models.load_policy(str(tiny_model_dir), device="cpu", load_in_4bit=True, lora_rank=4)
    with gpu_paths.emulated("cpu"):
        model = models.load_policy(str(tiny_model_dir), dtype=torch.bfloat16, device="cpu", load_in_4bit=True,
                                   lora_rank=4, lora_alpha=8, gradient_checkpointing=True)
        assert "Linear4bit" in type(hf_model(model).model.layers[0].self_attn.q_proj.base_layer).__name__
        for module in model.modules():   # bitsandbytes' own CPU layout (repacked in eval mode on AVX-512 BF16 CPUs,
            if hasattr(module, "support_avx512bf16_for_cpu"):   # read by no dequantization): off, as on a GPU
                module.support_avx512bf16_for_cpu = False
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        metrics = update.update_policy(model, update.make_optimizer(model, 1e-2, optimizer_name="adamw8bit"),
                                       [batch_of(hf_model(model).config.vocab_size)],
                                       update.UpdateSettings(micro_batch_size=2))
        assert metrics.optimizer_steps == 1 and math.isfinite(metrics.loss)
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
        model.eval()
        ids, mask = left_padded_prompts([4, 6])
        greedy = run(model, ids, mask, 1, 5, temperature=0.0)
        reference = run(model, ids, mask, 1, 5, temperature=0.0, backend="hf")
        engine.release()
        copied, logprobs = engine.generate(model, ids, mask, torch.arange(2), 5, [EOS], EOS, temperature=0.0,
                                           generation_copy=True, return_logprobs=True)   # dequantized into a copy
        assert engine.decode.engine_for(model, generation_copy=True).copies
        with torch.no_grad():   # the sampler's log-probs of its own tokens: the 4-bit model's, to bf16 rounding
            forward = token_logprobs(model, torch.cat([ids, copied], 1),
                                     torch.cat([mask, torch.ones_like(copied)], 1), 5)
    engine.release()
    assert all(torch.equal(a, b) for a, b in zip(greedy, reference))
    assert float((logprobs - forward).abs().max()) < 0.02   # bf16 rounding of the copy


def batch_of(vocab):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 11), generator=generator)
    return update.UpdateBatch(ids[:, :6], torch.ones(4, 6, dtype=torch.long), ids[:, 6:],
                              torch.ones(4, 5, dtype=torch.long), torch.randn(4, generator=generator),
                              torch.zeros(4, dtype=torch.bool))


def test_flags_that_need_a_gpu_are_refused_without_one_and_taken_where_one_is_emulated():
    flags = ["--optimizer", "adamw8bit", "--load-in-4bit", "--lora-rank", "4", "--device", "cpu"]
    with pytest.raises(ValueError, match="--load-in-4bit needs a CUDA device"):
        config.parse_args(flags)
    with gpu_paths.emulated("cpu"):
        args = config.parse_args(flags)
        assert models.available_memory_bytes("cpu") == gpu_paths.EMULATED.memory_bytes
    assert args.optimizer == "adamw8bit" and args.load_in_4bit
    with pytest.raises(ValueError, match="emulate 'cpu' or 'meta'"):
        with gpu_paths.emulated("cuda"):
            pass
    with gpu_paths.emulated("meta", memory_bytes=2 ** 30, multiprocessors=132):
        assert gpu_paths.memory("meta") == (2 ** 30, 2 ** 30, 0, 0)
        assert gpu_paths.multiprocessors("meta") == 132 and "meta" in gpu_paths.DEVICE_TYPES
    assert gpu_paths.DEVICE_TYPES == ("cuda",) and gpu_paths.multiprocessors("cpu") is None
