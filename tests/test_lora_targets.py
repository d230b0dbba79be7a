"""LoRA adapts every linear projection of the decoder blocks of any family by default (fused ones such as Phi-3's
qkv_proj and gate_up_proj included), a named target that matches nothing is refused, one in some blocks only is said,
the trainable count printed is peft's; --bf16 auto on CUDA counts native bf16 only (compute capability >= 8.0)."""

import pytest
import torch

import models
import policy

NATIVE_BF16 = policy.native_bf16  # conftest's float32_demo replaces it in every test

EXPECTED = {"llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
            "qwen2": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
            "mistral": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
            "gemma2": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
            "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_the_default_adapts_every_projection_of_each_family(arch):
    base = models.tiny_random_model(arch, vocab_size=128)
    linear = sum(isinstance(module, torch.nn.Linear) for block in models.decoder_blocks(base) for module in
                 block.modules())
    model = models.prepare_for_training(base, lora_rank=4, lora_alpha=8)
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert sorted(adapted) == EXPECTED[arch]
    assert sum(hasattr(module, "lora_A") for module in model.modules()) == linear  # each one of every block
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert models.trainable_line(model) == f"LoRA r=4 on {','.join(EXPECTED[arch])}: {trainable:,} of {total:,} " \
        "parameters train"  # what train.py prints once the policy is loaded


def test_a_target_that_matches_nothing_is_refused_and_one_in_some_blocks_is_said():
    with pytest.raises(ValueError, match=r"--lora-target-modules q_proj matches no linear projection.*qkv_proj"):
        models.lora_targets(models.tiny_random_model("phi3", vocab_size=128), ("q_proj", "o_proj"))
    model = models.tiny_random_model("llama", vocab_size=128)
    model.model.layers[0].mlp.extra_proj = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"extra_proj \(1 of 2\) is in some decoder blocks only"):
        assert models.lora_targets(model, ("q_proj", "extra_proj")) == ["q_proj", "extra_proj"]


def test_bf16_auto_on_cuda_counts_native_bf16_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # True on T4/V100 too (emulated)
    for capability, native in (((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert NATIVE_BF16("cuda") is native and NATIVE_BF16("cuda:0") is native
