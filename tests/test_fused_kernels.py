"""kernels.fused_kernels: on CUDA the update runs RMSNorm, rotary embedding and SiLU x up through Liger-Kernel's
fused kernels, checked first against the plain path (which runs everywhere else). On CPU, with kernels planted in
Liger's place: kernels that agree run in the update and give its result, under gradient checkpointing and prefix
sharing, and every module gets its own forward back; a planted fault (a wrong value, an exception) is one warning line
and the plain path."""

import collections
import warnings

import pytest
import torch

import models

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


def gradients_of_an_update(monkeypatch, kernels):
    monkeypatch.setattr(engine_kernels, "liger_kernels", lambda device: kernels)
    monkeypatch.setattr(update, "on_gpu", lambda device: True)  # the GPU path, on the CPU
    model = lora_model(checkpointing=True).train()
    move_lora_b(model)
    batch = random_batch(4, 6, 5, VOCAB)
    batch.prompt_ids[:, :5] = batch.prompt_ids[0, :5]   # a shared prefix: prefix sharing runs
    update.update_policy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0), [batch],
                         update.UpdateSettings(micro_batch_size=2))
    assert not any("forward" in module.__dict__ for module in model.modules() if "Linear" not in type(module).__name__)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def test_kernels_that_agree_run_in_the_update_and_give_its_result(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    rotary = llama.apply_rotary_pos_emb
    plain = gradients_of_an_update(monkeypatch, {})
    kernels, calls = planted()
    fused = gradients_of_an_update(monkeypatch, kernels)
    assert set(calls) == {"rms_norm", "rotary", "silu_mul"}
    assert calls["silu_mul"] >= 2 * 2 and calls["rms_norm"] >= 2 * calls["silu_mul"]   # 2 layers x micro-batches
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)
    assert llama.apply_rotary_pos_emb is rotary   # put back


@pytest.mark.parametrize("fault, said", [
    (("rms_norm", lambda kernel: lambda x, w, eps: kernel(x, w, eps) * 1.05), "rms_norm differs from the plain path"),
    (("rotary", lambda kernel: lambda *args: (_ for _ in ()).throw(RuntimeError("no kernel image"))),
     "rotary raised RuntimeError: no kernel image")])
def test_a_planted_fault_is_one_warning_line_and_the_plain_path(monkeypatch, fault, said):
    plain = gradients_of_an_update(monkeypatch, {})
    kernels, calls = planted(fault)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = gradients_of_an_update(monkeypatch, kernels)
    lines = [str(w.message) for w in caught if "fused kernels" in str(w.message)]
    assert len(lines) == 1 and said in lines[0] and "\n" not in lines[0], lines
    assert calls[fault[0]] == 1 and sum(calls.values()) <= 2   # the check ran them once; the update, never
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_no_fused_kernels_off_cuda():
    assert engine_kernels.liger_kernels("cpu") == {}
