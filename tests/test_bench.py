"""CPU smoke tests of bench_gpu.py (tiny config, toy shapes) and its memory-bandwidth arithmetic."""

import json

import pytest
import torch

import bench
import bench_gpu
import models

SMALL = ["--prompt-tokens", "4", "--completion-tokens", "4", "--device", "cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_kv_cache_and_decode_bound_by_hand():
    qwen, llama = bench_gpu.real_config("qwen2.5-3b"), bench_gpu.real_config("llama-3.2-3b")
    # Qwen2.5-3B: 36 layers x (K and V) x 2 kv heads x 128 dims x 2 bytes = 36864 bytes per token
    assert bench_gpu.kv_cache_bytes(qwen, 64, 1024) == 64 * 1024 * 36 * 2 * 2 * 128 * 2 == 2.25 * 2 ** 30
    # Llama-3.2-3B: 28 layers x 2 x 8 kv heads x 128 dims x 2 bytes = 114688 bytes per token
    assert bench_gpu.kv_cache_bytes(llama, 1, 1) == 114688
    assert bench_gpu.kv_cache_bytes(llama, 2, 3, bytes_per_element=4) == 114688 * 2 * 3 * 2
    # 6 GB of weights + 2 GB of cache over 2 TB/s: 4 ms per decode step
    assert bench_gpu.decode_bound_s(6e9, 2e9, 2e12) == pytest.approx(4e-3)


def test_shipped_configs_and_weight_bytes():
    assert bench_gpu.real_config("qwen2.5-3b").num_key_value_heads == 2
    llama = bench_gpu.real_config("llama-3.2-3b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.eos_token_id) == (3072, 28, [128001, 128008, 128009])
    model = models.tiny_random_model("llama", vocab_size=256)
    parameters = sum(p.numel() for p in model.parameters())  # tied lm_head / embedding counted once
    assert parameters == 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = model.to(dtype)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary frequencies
        assert bench_gpu.weight_bytes(model) == size * parameters + buffers
    assert bench_gpu.spec_bandwidth(torch.device("cpu")) is None


def test_asymmetry_tiny_prints_table_and_plot(tmp_path, capsys):
    plot = tmp_path / "fig1.png"
    result = bench.main(["asymmetry", *SMALL, "--rollouts", "2", "--out-dir", str(tmp_path), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "CPU smoke figures" in out and "4bit rows skipped" in out
    assert "| precision | rollouts | generate_s" in out and "PODS/GRPO step time" in out
    assert [row["rollouts"] for row in result["rows"]] == [2]
    assert all(row["generate_s"] > 0 and row["update_s"] > 0 and row["update_peak_gib"] is None
               for row in result["rows"])
    assert [step["method"] for step in result["steps"]] == ["GRPO-PODS n=8 m=2", "GRPO n=2 m=2"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench_asymmetry.json").read_text())["rows"][0]["rollouts"] == 2


def test_decode_tiny_reports_bound_and_same_logits(tmp_path, capsys):
    result = bench_gpu.main("decode", [*SMALL, "--batch", "4", "--out-dir", str(tmp_path), "--bandwidth-gbs", "10"])
    out = capsys.readouterr().out
    assert "x_bound" in out and "tokens_equal_frac" in out
    assert [row["path"] for row in result["rows"]] == ["generate() defaults", "sampling.py dynamic",
                                                       "sampling.py static"]
    assert [row["auto"] for row in result["rows"]] == [False, True, False]  # CPU default: dynamic cache
    # tiny model: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 rows x (4 prompt + 4/2 new) tokens x 4 bytes (fp32)
    assert result["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 6 * 4
    for row in result["rows"]:
        assert row["bound_ms"] == pytest.approx(1e3 * (result["weight_bytes"][0] + result["kv_bytes"]) / 10e9)
        assert row["x_bound"] == pytest.approx(row["step_ms"] / row["bound_ms"])
    check = result["logit_checks"][0]
    assert check["tokens_equal_frac"] == 1.0 and check["max_abs_logit_diff"] < 1e-4 < check["logit_std"]


def test_memory_tiny_reports_phases_and_analytic(tmp_path, capsys):
    result = bench_gpu.main("memory", [*SMALL, "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "whole-step peak n/a on cpu" in out and "running the phases in fp32" in out
    assert [p["phase"] for p in result["phases"]] == ["load", "generate n=8", "update fwd+bwd m=2", "optimizer step"]
    assert all(p["peak_gib"] is None for p in result["phases"])  # no fake CPU numbers
    analytic = result["analytic"]
    assert 3.0 < analytic["parameters_b"] < 3.2 and analytic["kv_cache_gib"] == 2.25


def test_bad_names_and_flags():
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench_gpu.main("throughput", [])
    with pytest.raises(ValueError, match="precision"):
        bench_gpu.main("decode", ["--precisions", "int8", "--device", "cpu"])
