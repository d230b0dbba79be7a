"""kernels.fused_kernels: on CUDA the update runs RMSNorm, rotary embedding and SiLU x up through Liger-Kernel's
fused kernels, checked first against the plain path at the model's widths and in the dtypes the update gives them
(which runs everywhere else). On a CPU taking the GPU paths (engine/gpu_paths.py), with kernels planted in Liger's
place: kernels that agree run in the update (after fill_logprobs' no-grad pass, as in train.py) and give its result,
under gradient checkpointing and prefix sharing, and every module gets its own forward back; a planted fault (a wrong
value, an exception, one only at the model's head width or in bf16) is one warning line and the plain path; a kernel
failing later, at a shape the check did not try, is one warning line and the same update on the plain path."""

import collections
import warnings

import pytest
import torch

import loss_options
import models
from engine import gpu_paths
from engine import kernels as engine_kernels
import update
from test_update import lora_model, move_lora_b, random_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 256


def planted(fault=None):
    """The plain kernels, counted, as `engine_kernels.liger_kernels` would give Liger's; fault: (name, wrong function)."""
    calls, kernels = collections.Counter(), engine_kernels.plain_kernels()
    if fault is not None:
        kernels[fault[0]] = fault[1](kernels[fault[0]])

    def counted(name, kernel):
        def run(*args):
            calls[name] += 1
            return kernel(*args)
        return run

    return {name: counted(name, kernel) for name, kernel in kernels.items()}, calls


def gradients_of_an_update(monkeypatch, kernels, full_bf16=False):
    """The trainable parameters' gradients of one update (fill_logprobs, then update_policy, as train.py runs them)
    on the GPU paths of an emulated GPU, `kernels` in Liger's place. full_bf16: full fine-tuning under bf16 autocast
    (fp32 weights), else a LoRA model."""
    monkeypatch.setattr(engine_kernels, "liger_kernels", lambda device: kernels)
    if full_bf16:
        torch.manual_seed(0)
        model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=VOCAB),
                                            gradient_checkpointing=True).train()
    else:
        model = lora_model(checkpointing=True).train()
        move_lora_b(model)
    batch = random_batch(4, 6, 5, VOCAB)
    batch.prompt_ids[:, :5] = batch.prompt_ids[0, :5]   # a shared prefix: prefix sharing runs
    settings = update.UpdateSettings(micro_batch_size=2, autocast_dtype=torch.bfloat16 if full_bf16 else None,
                                     loss=loss_options.LossSettings(kl_coef=0.0))
    with gpu_paths.emulated("cpu"):
        update.fill_logprobs(model, [batch], settings)
        update.update_policy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                             [batch], settings)
    assert not any("forward" in module.__dict__ for module in model.modules() if "Linear" not in type(module).__name__)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def fused_update(monkeypatch, kernels, **options):
    """gradients_of_an_update with `kernels`, and the warning lines about fused kernels it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = gradients_of_an_update(monkeypatch, kernels, **options)
    return fused, [str(w.message) for w in caught if "fused kernels" in str(w.message)]


def test_kernels_that_agree_run_in_the_update_and_give_its_result(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    rotary = llama.apply_rotary_pos_emb
    plain = gradients_of_an_update(monkeypatch, {})
    kernels, calls = planted()
    fused, said = fused_update(monkeypatch, kernels)
    assert said == []   # the check passes, under fill_logprobs' no_grad too
    assert set(calls) == {"rms_norm", "rotary", "silu_mul"}
    assert calls["silu_mul"] >= 2 * 2 and calls["rms_norm"] >= 2 * calls["silu_mul"]   # 2 layers x micro-batches
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)
    assert llama.apply_rotary_pos_emb is rotary   # put back


def rotary_wrong_for_narrow_heads(kernel):
    """Right at head width 64 (the width a fixed-shape check would try), wrong at the model's 16."""
    def rotary(q, k, cos, sin):
        q_out, k_out = kernel(q, k, cos, sin)
        return (q_out, k_out) if q.shape[-1] == 64 else (q_out.flip(-1), k_out)
    return rotary


def silu_mul_wrong_in_bf16(kernel):
    """Right in float32, wrong in bf16: what autocast gives the MLP of a model fine-tuned in full with --bf16."""
    return lambda gate, up: kernel(gate, up) * (1.5 if gate.dtype == torch.bfloat16 else 1.0)


@pytest.mark.parametrize("fault, said, full_bf16", [
    (("rms_norm", lambda kernel: lambda x, w, eps: kernel(x, w, eps) * 1.05), "rms_norm differs from the plain path",
     False),
    (("rotary", lambda kernel: lambda *args: (_ for _ in ()).throw(RuntimeError("no kernel image"))),
     "rotary raised RuntimeError: no kernel image", False),
    (("rotary", rotary_wrong_for_narrow_heads), "rotary differs from the plain path", False),
    (("silu_mul", silu_mul_wrong_in_bf16), "silu_mul differs from the plain path", True)])
def test_a_planted_fault_is_one_warning_line_and_the_plain_path(monkeypatch, fault, said, full_bf16):
    plain = gradients_of_an_update(monkeypatch, {}, full_bf16)
    kernels, calls = planted(fault)
    fused, lines = fused_update(monkeypatch, kernels, full_bf16=full_bf16)
    assert len(lines) == 1 and said in lines[0] and "\n" not in lines[0], lines
    assert calls[fault[0]] == 1 and max(calls.values()) == 1   # the check ran each once at most; the update, never
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_a_kernel_failing_later_in_the_step_is_one_line_and_the_plain_path(monkeypatch):
    """A kernel that passes the check (24 tokens) and raises at the update's own token count: the update turns the
    fused kernels off with one warning line, runs that step again on the plain path (the same gradients), and keeps
    them off."""
    def fails_at_other_lengths(kernel):
        def rms_norm(x, weight, eps):
            if x.shape[-2] != 24:
                raise RuntimeError("out of shared memory")
            return kernel(x, weight, eps)
        return rms_norm

    plain = gradients_of_an_update(monkeypatch, {})
    kernels, calls = planted(("rms_norm", fails_at_other_lengths))
    fused, lines = fused_update(monkeypatch, kernels)
    assert len(lines) == 1 and "raised RuntimeError: out of shared memory" in lines[0] and "plain path" in lines[0]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    assert calls["rms_norm"] == 2   # the check, then the failure


def test_a_failure_with_no_fused_kernel_on_is_raised_as_it_is():
    """with_fallback runs the work again only where fused kernels were on: elsewhere the error is the work's own."""
    model = lora_model()

    def fails():
        raise RuntimeError("the model's own error")

    with engine_kernels.fused_kernels(model, "cpu") as fall_back, pytest.raises(RuntimeError, match="own error"):
        engine_kernels.with_fallback(fall_back, fails)


def test_no_fused_kernels_off_cuda_unless_a_gpu_is_emulated():
    assert engine_kernels.liger_kernels("cpu") == {}
    with gpu_paths.emulated("cpu"):
        assert set(engine_kernels.liger_kernels("cpu")) == {"rms_norm", "rotary", "silu_mul"}
