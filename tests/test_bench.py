"""CPU smoke tests of the model-shape benchmarks (bench_gpu, bench_phases, bench_decode, bench_step: tiny config,
toy shapes) and their memory-bandwidth arithmetic. Figures are printed, never asserted: only structure and
deterministic values (arithmetic, row counts, token agreement, verdict lines) are."""

import json
import re

import pytest
import torch

import bench
import bench_decode
import bench_gpu
import models

SMALL = ["--prompt-tokens", "4", "--completion-tokens", "4", "--device", "cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm2_tokenizer):
    """The SmolLM2 tokenizer saved by `bench.py save-tokenizer`, as it is carried to a GPU machine."""
    folder = tmp_path_factory.mktemp("tokenizer")
    bench.main(["save-tokenizer", str(folder)])
    return folder


def test_kv_cache_and_decode_bound_by_hand():
    qwen, llama = bench_gpu.real_config("qwen2.5-3b"), bench_gpu.real_config("llama-3.2-3b")
    # Qwen2.5-3B: 36 layers x (K and V) x 2 kv heads x 128 dims x 2 bytes = 36864 bytes per token
    assert bench_gpu.kv_cache_bytes(qwen, 64, 1024) == 64 * 1024 * 36 * 2 * 2 * 128 * 2 == 2.25 * 2 ** 30
    # Llama-3.2-3B: 28 layers x 2 x 8 kv heads x 128 dims x 2 bytes = 114688 bytes per token
    assert bench_gpu.kv_cache_bytes(llama, 1, 1) == 114688
    assert bench_gpu.kv_cache_bytes(llama, 2, 3, bytes_per_element=4) == 114688 * 2 * 3 * 2
    # 6 GB of weights + 2 GB of cache over 2 TB/s: 4 ms per decode step
    assert bench_decode.decode_bound_s(6e9, 2e9, 2e12) == pytest.approx(4e-3)


def test_shipped_configs_and_weight_bytes_without_lora():
    assert bench_gpu.real_config("qwen2.5-3b").num_key_value_heads == 2
    llama = bench_gpu.real_config("llama-3.2-3b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.eos_token_id) == (3072, 28, [128001, 128008, 128009])
    model = models.tiny_random_model("llama", vocab_size=256)
    parameters = sum(p.numel() for p in model.parameters())  # tied lm_head / embedding counted once
    assert parameters == 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    buffers = sum(b.numel() for b in model.buffers())  # rotary frequencies
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = model.to(dtype)
        assert bench_decode.weight_bytes(model) == size * (parameters + buffers)
    assert bench_decode.weight_bytes(model, bytes_per_element=4) == 4 * (parameters + buffers)
    # The LoRA adapter is not read by a merged decode: it is not counted
    adapted = models.prepare_for_training(model, lora_rank=4)
    assert sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) > 0
    assert bench_decode.weight_bytes(adapted) == 2 * (parameters + buffers)
    assert bench_decode.spec_bandwidth(torch.device("cpu")) is None
    assert bench_gpu.held_bytes({"a": [torch.zeros(3), (torch.zeros(2, dtype=torch.long),)], "b": 1}) == 12 + 16


def test_asymmetry_tiny_prints_rows_and_plot(tmp_path, capsys):
    plot = tmp_path / "fig1.png"
    result = bench.main(["asymmetry", *SMALL, "--rollouts", "2,4", "--out-dir", str(tmp_path), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "CPU smoke figures" in out and "fp32: warm-up" in out
    assert len(re.findall(r"^\| fp32 \| [24] \| ", out, re.M)) == 2  # one printed row per point
    assert [row["rollouts"] for row in result["rows"]] == [2, 4]
    assert all(row["generate_s"] > 0 and row["update_s"] > 0 and row["update_peak_gib"] is None
               for row in result["rows"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench_asymmetry.json").read_text())["rows"][1]["rollouts"] == 4


def test_decode_tiny_reports_bound_targets_and_greedy_agreement(tmp_path, capsys):
    result = bench_gpu.main("decode", [*SMALL, "--batch", "4", "--new-tokens", "6", "--out-dir", str(tmp_path),
                                       "--bandwidth-gbs", "10", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "4bit rows skipped" in out and "| precision | path |" in out
    assert [row["path"] for row in result["rows"]] == ["generate() defaults", "engine, LoRA unmerged",
                                                       "engine, merged copy"]
    # tiny qwen2: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 rows x (4 prompt + 6/2 new) tokens x 4 bytes (fp32)
    assert result["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 7 * 4
    for row in result["rows"]:
        assert row["bound_ms"] == pytest.approx(1e3 * (result["weight_bytes"][0] + result["kv_bytes"]) / 10e9)
        assert row["graphs"] == 0  # CUDA graphs are recorded on CUDA only, and nothing is compiled by default
        if row["step_ms"] is not None:
            assert row["x_bound"] == pytest.approx(row["step_ms"] / row["bound_ms"])
    assert re.search(r"^fp32: (n/a|[\d.]+x bound \((PASS|FAIL)\), [\d.]+x vs generate\(\) defaults \((PASS|FAIL)\))",
                     out, re.M)
    check = result["checks"][0]
    assert check["tokens_equal_hf_frac"] == 1.0 and check["engine_is_argmax_frac"] == 1.0
    assert check["max_logit_gap"] == 0.0 < check["logit_std"]
    never, dropped = result["lengths"]   # 4 rows, EOS forced at lengths drawn from 2..48
    assert "## Finished rows" in out and not never["rows_dropped"] and dropped["rows_dropped"]
    assert never["row_steps"] == 4 * 48 and 1.0 <= dropped["x_ideal_work"] < never["x_ideal_work"]


def test_memory_tiny_reports_phases_and_analytic(tmp_path, capsys):
    result = bench_gpu.main("memory", [*SMALL, "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "whole-step peak n/a on cpu" in out and "running the phases in fp32" in out
    assert [p["phase"] for p in result["phases"]] == ["load", "generate n=8 (merged copy)",
                                                      "update m=2 (fill_logprobs + update_policy)"]
    assert all(p["peak_gib"] is None for p in result["phases"])  # no fake CPU numbers
    assert result["phases"][1]["engine_held_gib"] > 0  # the merged copy and KV buffers the engine keeps
    analytic = result["analytic"]
    assert 3.0 < analytic["parameters_b"] < 3.2 and analytic["kv_cache_gib"] == 2.25
    assert 2 * 2.5e9 / 2 ** 30 < analytic["generation_copy_bf16_gib"] < analytic["weights_bf16_gib"]


def test_step_tiny_runs_train_step_for_pods_and_grpo(tmp_path, tokenizer_dir, capsys):
    assert (tokenizer_dir / "tokenizer.json").is_file()
    result = bench.main(["step", "--device", "cpu", "--tokenizer", str(tokenizer_dir), "--steps", "1",
                         "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "vocabulary 49152 (SmolLM2 tokenizer)" in out
    assert [(row["method"], row["phase"]) for row in result["rows"]] == [
        ("GRPO-PODS 8/2", "warm-up"), ("GRPO-PODS 8/2", "steady"), ("GRPO 2/2", "warm-up"), ("GRPO 2/2", "steady")]
    assert len(re.findall(r"^\| GRPO", out, re.M)) == 4  # each step printed as it completes
    for row in result["rows"]:
        assert row["prompt_tokens"] == 48 and row["mean_length"] <= 8 and row["new_graphs"] == 0
        assert row["step_s"] >= row["generate_s"] + row["update_s"] > 0
    assert re.search(r"^PODS/GRPO step time = [\d.]+x \((PASS|FAIL) vs <= 1.35x\)", out, re.M)
    assert len(re.findall(r"graphs recorded or compiled after warm-up: 0 \(PASS vs 0\)", out)) == 2
    assert set(result["summary"]) == {"GRPO-PODS 8/2", "GRPO 2/2", "ratio"}


def test_step_vary_widths_counts_graphs_after_warm_up(tmp_path, tokenizer_dir, capsys):
    result = bench_gpu.main("step", ["--device", "cpu", "--tokenizer", str(tokenizer_dir), "--vary-widths",
                                     "--steps", "2", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    widths = [row["prompt_tokens"] for row in result["rows"]]
    assert len(widths) == 3 and len(set(widths)) > 1 and all(40 <= w <= 64 for w in widths)
    assert {row["method"] for row in result["rows"]} == {"GRPO-PODS 8/2"} and "prompt widths over the run" in out
    assert result["summary"]["GRPO-PODS 8/2"]["recompiles"] == 0
    assert (tmp_path / "bench_step_widths.json").is_file()


def test_bad_names_and_flags(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench_gpu.main("throughput", [])
    with pytest.raises(SystemExit, match="usage"):
        bench.main(["throughput"])
    with pytest.raises(ValueError, match="precision"):
        bench_gpu.main("decode", ["--precisions", "int8", "--device", "cpu"])
    with pytest.raises(ValueError, match="new-tokens"):
        bench_gpu.main("decode", [*SMALL, "--new-tokens", "1", "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown method"):
        bench_gpu.main("step", ["--device", "cpu", "--methods", "ppo"])
    with pytest.raises(FileNotFoundError, match="save-tokenizer"):
        bench_gpu.main("step", ["--device", "cpu", "--tokenizer", str(tmp_path / "missing")])
