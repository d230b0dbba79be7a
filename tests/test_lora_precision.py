"""models.lora_in_base_dtype: a bf16 base's LoRA adapter computed in bf16 (three matrix products per projection)
with fp32 master weights gives the log-probs and gradients of an fp32 reference within bf16's tolerance (no worse
than peft's fp32 adapter over the same bf16 base), under gradient checkpointing too; it falls back to peft where it
does not apply (float32, the adapter off); its bf16 copies of the adapter follow every change of the weights."""

import collections

import pytest
import torch

import models
from bench import census
from engine import gpu_paths
from policy import dropout_off, hf_model, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread", "bf16_lora_on_cpu")


@pytest.fixture
def bf16_lora_on_cpu():
    """The bf16 adapter product runs where the GPU paths do (engine/gpu_paths.py); here it is tested on the CPU."""
    with gpu_paths.emulated("cpu"):
        yield
VOCAB = 97
# bf16 keeps 8 bits of mantissa: log-probs of this random model move by ~0.06 nats from the bf16 base alone.
LOGPROB_TOLERANCE = 0.12
GRADIENT_TOLERANCE = 0.12   # relative L2 error of each parameter's gradient


def policy(base_dtype, ours=True, checkpointing=False):
    torch.manual_seed(0)
    model = models.tiny_random_model("qwen2", vocab_size=VOCAB, initializer_range=0.2)
    model = models.prepare_for_training(model, lora_rank=8, lora_alpha=16, gradient_checkpointing=checkpointing)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init: A would get no gradient
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
            elif "lora_" not in name:
                p.data = p.data.to(base_dtype)
    if ours:  # as a base loaded in bf16 gets it (models.load_policy, then prepare_for_training)
        models.lora_in_base_dtype(model)
    return model.train()  # else peft's own forward: the input cast to fp32, fp32 products, the cast back


def logprobs_and_grads(model):
    ids = torch.randint(3, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    with dropout_off(model, keep_checkpointing=True):
        logprobs = token_logprobs(model, ids, torch.ones_like(ids), 6)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def error(grads, reference):
    return {name: float((grads[name] - grad).norm() / grad.norm()) for name, grad in reference.items()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_bf16_adapter_is_within_bf16_tolerance_of_the_fp32_reference(checkpointing):
    want, want_grads = logprobs_and_grads(policy(torch.float32, checkpointing=checkpointing))
    model = policy(torch.bfloat16, checkpointing=checkpointing)
    got, got_grads = logprobs_and_grads(model)
    peft, peft_grads = logprobs_and_grads(policy(torch.bfloat16, ours=False, checkpointing=checkpointing))
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
               if p.requires_grad)   # fp32 master weights and gradients
    assert float((got - want).abs().max()) < LOGPROB_TOLERANCE
    ours, theirs = error(got_grads, want_grads), error(peft_grads, want_grads)
    assert max(ours.values()) < GRADIENT_TOLERANCE
    assert sum(ours.values()) < 2 * sum(theirs.values())   # bf16 products cost at most what the bf16 base costs
    assert not torch.equal(got, peft)   # the bf16 path did run


def projection_kernels(model, x):
    """The kernels of one q_proj forward (bias: Qwen2's), after a first one (which casts the adapter's weights, once
    per optimizer step)."""
    projection = hf_model(model).model.layers[0].self_attn.q_proj
    recorder = census.Census({}, every_tensor_on_device=True)
    with torch.no_grad():
        projection(x)
        with recorder:
            projection(x)
    kernels = collections.Counter()
    for (phase, op, dtype, nbytes, flops), count in recorder.ops.items():
        kernels[op, dtype] += count
    return dict(kernels)


def test_three_matrix_products_where_peft_runs_seven_kernels():
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    assert projection_kernels(policy(torch.bfloat16), x) == {("mm", "bfloat16"): 1, ("addmm", "bfloat16"): 2}
    peft = projection_kernels(policy(torch.bfloat16, ours=False), x)
    assert sum(peft.values()) == 7 and peft[("mm", "float32")] == 2


def test_its_backward_runs_seven_kernels():
    """dL/dx (2 products), dL/dA (the scaled dL/d(xA^T): 1 product, its scaling as the product's alpha; 1 product and
    the cast to the fp32 master's dtype) and dL/dB (1 product, scaled the same way, and the cast)."""
    projection = hf_model(policy(torch.bfloat16)).model.layers[0].self_attn.q_proj
    x = torch.randn(10, 64, dtype=torch.bfloat16, requires_grad=True)
    out = projection(x)
    recorder = census.Census({}, every_tensor_on_device=True)
    with recorder:
        out.backward(torch.ones_like(out))
    kernels = collections.Counter()
    for (phase, op, dtype, nbytes, flops), count in recorder.ops.items():
        if op not in ("ones_like", "add_"):   # the gradient given, and its accumulation into the fp32 masters
            kernels[op, dtype] += count
    assert dict(kernels) == {("mm", "bfloat16"): 2, ("addmm", "bfloat16"): 3, ("_to_copy", "float32"): 2}


def test_float32_and_the_adapter_off_run_pefts_forward_and_copies_follow_the_weights():
    model = policy(torch.bfloat16)
    projection = hf_model(model).model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        with model.disable_adapter():   # the KL reference: the base alone
            assert torch.equal(projection(x), projection.base_layer(x))
        before = projection(x)
        projection.lora_B["default"].weight.mul_(2)   # as an optimizer step changes it in place
        after = projection(x)
        expected = projection.base_layer(x) + 2 * (before - projection.base_layer(x))
        torch.testing.assert_close(after, expected, rtol=0.05, atol=0.05)
    fp32 = policy(torch.float32)
    layer = hf_model(fp32).model.layers[0].self_attn.q_proj
    with torch.no_grad():   # float32 throughout: peft's forward, exactly
        y = torch.randn(2, 5, 64)
        type(layer).forward(layer, y)
        assert torch.equal(layer(y), type(layer).forward(layer, y))


def torch_adamw(params, fused):
    return torch.optim.AdamW(params, lr=1e-2, fused=fused, foreach=None if fused else True)


OPTIMIZERS = {"adamw (foreach)": lambda params: torch_adamw(params, False),
              "adamw (fused)": lambda params: torch_adamw(params, True),
              "adamw8bit": lambda params: __import__("bitsandbytes").optim.AdamW8bit(params, lr=1e-2)}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_bf16_copies_follow_every_optimizer_step(name):
    """Fused AdamW and bitsandbytes' 8-bit AdamW write the fp32 masters without bumping their version counters: the
    bf16 copies the product computes with are refreshed by the step itself (update.OPTIMIZER_STEPS), so after each
    step the layer computes what peft computes over the moved masters, not what it computed at the start."""
    model = policy(torch.bfloat16)
    projection = hf_model(model).model.layers[0].self_attn.q_proj
    optimizer = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        start = projection(x)
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=ids).logits.float()[:, -1, :5].sum().backward()
        optimizer.step()
        with torch.no_grad():
            ours, peft = projection(x), type(projection).forward(projection, x)   # peft: from the fp32 masters
        assert float((ours - peft).abs().max()) < 0.05   # bf16 rounding of the copies
        assert float((ours - start).abs().max()) > 0.1   # the step moved what the update computes
        start = ours
