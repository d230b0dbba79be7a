"""CPU smoke tests of the benchmarks (the bench/ package, run as `python -m bench <name> --tiny`: tiny config, toy
shapes) and their memory-bandwidth arithmetic. Figures are printed, never asserted: only structure and
deterministic values (arithmetic, row counts, token agreement, verdict lines) are."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.__main__ as cli
import engine.step
import models
import pods
from bench import common, decode, grading, phases, sampler, selector, show
from bench import prefix as prefix_bench

SMALL = ["--prompt-tokens", "4", "--completion-tokens", "4", "--device", "cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm2_tokenizer):
    """The SmolLM2 tokenizer saved by `python -m bench save-tokenizer`, as it is carried to a GPU machine."""
    folder = tmp_path_factory.mktemp("tokenizer")

    def load_tokenizer(name):  # the session's copy: reading the GGUF file again costs ~4 s
        assert name == models.SMOLLM2_ALIAS
        return smollm2_tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_tokenizer", load_tokenizer)
        assert cli.main(["save-tokenizer", str(folder)]) == folder
    return folder


def test_kv_cache_and_decode_bound_by_hand():
    qwen, llama = common.real_config("qwen2.5-3b"), common.real_config("llama-3.2-3b")
    # Qwen2.5-3B: 36 layers x (K and V) x 2 kv heads x 128 dims x 2 bytes = 36864 bytes per token
    assert common.kv_cache_bytes(qwen, 64, 1024) == 64 * 1024 * 36 * 2 * 2 * 128 * 2 == 2.25 * 2 ** 30
    # Llama-3.2-3B: 28 layers x 2 x 8 kv heads x 128 dims x 2 bytes = 114688 bytes per token
    assert common.kv_cache_bytes(llama, 1, 1) == 114688
    assert common.kv_cache_bytes(llama, 2, 3, bytes_per_element=4) == 114688 * 2 * 3 * 2
    # 6 GB of weights + 2 GB of cache over 2 TB/s: 4 ms per decode step
    assert decode.decode_bound_s(6e9, 2e9, 2e12) == pytest.approx(4e-3)


def test_shipped_configs_and_weight_bytes_without_lora():
    assert common.real_config("qwen2.5-3b").num_key_value_heads == 2
    llama = common.real_config("llama-3.2-3b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.eos_token_id) == (3072, 28, [128001, 128008, 128009])
    model = models.tiny_random_model("llama", vocab_size=256)
    parameters = sum(p.numel() for p in model.parameters())  # tied lm_head / embedding counted once
    assert parameters == 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    buffers = sum(b.numel() for b in model.buffers())  # rotary frequencies
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = model.to(dtype)
        assert decode.weight_bytes(model) == size * (parameters + buffers)
    assert decode.weight_bytes(model, bytes_per_element=4) == 4 * (parameters + buffers)
    # The LoRA adapter is not read by a merged decode: it is not counted
    adapted = models.prepare_for_training(model, lora_rank=4)
    assert sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) > 0
    assert decode.weight_bytes(adapted) == 2 * (parameters + buffers)
    assert decode.spec_bandwidth(torch.device("cpu")) is None
    assert phases.held_bytes({"a": [torch.zeros(3), (torch.zeros(2, dtype=torch.long),)], "b": 1}) == 12 + 16


def test_asymmetry_tiny_prints_rows_and_plot(tmp_path, capsys):
    plot = tmp_path / "fig1.png"
    result = cli.main(["asymmetry", *SMALL, "--rollouts", "2,4", "--out-dir", str(tmp_path), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "CPU smoke figures" in out and "fp32: warm-up" in out
    assert len(re.findall(r"^\| fp32 \| [24] \| ", out, re.M)) == 2  # one printed row per point
    assert [row["rollouts"] for row in result["rows"]] == [2, 4]
    assert all(row["generate_s"] > 0 and row["update_s"] > 0 and row["update_peak_gib"] is None
               for row in result["rows"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench_asymmetry.json").read_text())["rows"][1]["rollouts"] == 4


def test_decode_tiny_reports_bound_targets_and_greedy_agreement(tmp_path, capsys):
    result = cli.main(["decode", *SMALL, "--batch", "4", "--new-tokens", "6", "--out-dir", str(tmp_path),
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


def test_sampler_tiny_measures_the_gap_of_every_path_and_fault(capsys):
    result = cli.main(["sampler", "--tiny", "--prompts", "2", "--new-tokens", "4", "--precisions", "fp32"])
    assert "| precision | sampler |" in capsys.readouterr().out
    rows = {row["sampler"]: row for row in result["rows"]}
    assert list(rows) == ["engine, merged copy", "engine, LoRA unmerged", "generate()",
                          *(f"engine, {fault}" for fault in sampler.FAULTS)]
    for name, row in rows.items():
        assert row["tokens"] == 2 * 4 * 4   # no EOS ids: 2 prompts x 4 rollouts x 4 tokens
        healthy = "," not in name or name.startswith("engine, merged") or name.startswith("engine, LoRA")
        assert (row["logprob_diff_mean"] < 1e-5) == healthy and row["falls_back"] is False   # tiny: flat logits


def test_evalprefix_tiny_times_the_three_modes_interleaved(tmp_path, smollm2_tokenizer, monkeypatch, capsys):
    """The demo's held-out prompts through eval.evaluate, before / off / on in a rotating order: the same completions,
    fewer prefilled positions with sharing, the "before" mode decoding over the whole cache (and only it), the ratio
    on / before printed and saved."""
    monkeypatch.setattr(models, "load_tokenizer", lambda name: smollm2_tokenizer)   # reading the GGUF costs ~4 s
    windows, step = [], engine.step.decode_step

    def recording(dec, state):
        windows.append(state.attend_len)
        return step(dec, state)

    monkeypatch.setattr(engine.step, "decode_step", recording)   # what a new engine steps with (engine_for)
    result = cli.main(["evalprefix", "--tiny", "--num-prompts", "5", "--rounds", "2", "--max-completion-tokens", "2",
                       "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| run | mode |" in out and "ratio on / before" in out and result["same_completions"] is True
    assert [row["mode"] for row in result["rows"]] == ["before", "off", "on", "off", "on", "before"]
    before, off, on = result["rows"][:3]
    # 5 prompts of equal length in chunks of 4 (tiny --batch-size): off prefills every prompt's tokens but the last
    assert before["prefill_tokens"] == off["prefill_tokens"] == result["prompt_tokens"] - 5 > 2 * on["prefill_tokens"]
    assert 0 in windows and any(windows)   # "before" reads the whole cache (0), the others a window
    assert result["ratio"] == min(r["seconds"] for r in result["rows"] if r["mode"] == "on") / min(
        r["seconds"] for r in result["rows"] if r["mode"] == "before")
    assert json.loads((tmp_path / "bench_evalprefix.json").read_text())["num_prompts"] == 5
    recomputed = cli.main(["evalprefix", "--from-json", str(tmp_path / "bench_evalprefix.json")])
    assert recomputed == {key: result[key] for key in ("best_s", "ratio", "same_completions")}
    assert "ratio on / before" in capsys.readouterr().out
    with_bf16 = cli.main(["evalprefix", "--tiny", "--num-prompts", "5", "--rounds", "1", "--max-completion-tokens", "2",
                          "--modes", "before,on,bf16", "--out-dir", str(tmp_path)])
    assert [row["mode"] for row in with_bf16["rows"]] == ["before", "on", "bf16"] and with_bf16["same_completions"]
    assert 0 <= with_bf16["bf16_same_share"] <= 1 and with_bf16["ratio_bf16"] > 0 and "bf16 / before" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match="with before and on"):
        cli.main(["evalprefix", "--tiny", "--modes", "off,on"])


def test_memory_tiny_reports_phases_and_analytic(tmp_path, capsys):
    result = cli.main(["memory", *SMALL, "--out-dir", str(tmp_path)])
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
    result = cli.main(["step", "--device", "cpu", "--tokenizer", str(tokenizer_dir), "--steps", "1",
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
    result = cli.main(["step", "--device", "cpu", "--tokenizer", str(tokenizer_dir), "--vary-widths",
                                     "--steps", "2", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    widths = [row["prompt_tokens"] for row in result["rows"]]
    assert len(widths) == 3 and len(set(widths)) > 1 and all(40 <= w <= 64 for w in widths)
    assert {row["method"] for row in result["rows"]} == {"GRPO-PODS 8/2"} and "prompt widths over the run" in out
    assert result["summary"]["GRPO-PODS 8/2"]["recompiles"] == 0
    assert (tmp_path / "bench_step_widths.json").is_file()


def test_bad_names_and_flags(tmp_path):
    with pytest.raises(SystemExit, match="usage"):
        cli.main(["throughput"])
    with pytest.raises(ValueError, match="precision"):
        cli.main(["decode", "--precisions", "int8", "--device", "cpu"])
    with pytest.raises(ValueError, match="new-tokens"):
        cli.main(["decode", *SMALL, "--new-tokens", "1", "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown method"):
        cli.main(["step", "--device", "cpu", "--methods", "ppo"])
    with pytest.raises(FileNotFoundError, match="save-tokenizer"):
        cli.main(["step", "--device", "cpu", "--tokenizer", str(tmp_path / "missing")])


def test_help_lists_every_benchmark(capsys):
    cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["rewards", "--help"])
    assert exit_info.value.code == 0 and "$PODS_DATA_DIR" in capsys.readouterr().out


def test_python_m_bench_is_the_entry_point():
    """`python -m bench` from the repository root: the package's __main__ (its help imports no benchmark)."""
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=common.CONFIG_DIR.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "python -m bench <name>" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "bench", "throughput"], cwd=common.CONFIG_DIR.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "usage: python -m bench {selector," in done.stderr


def test_selector_tiny_agrees_with_the_authors_loop(capsys):
    result = cli.main(["selector", "--tiny"])
    assert [(row["prompts"], row["n"], row["m"]) for row in result["rows"]] == [(4, 32, 8), (4, 32, 8), (1, 16, 4)]
    for row in result["rows"]:
        for key in ("max_variance_s", "sort_s", "stable_sort_s", "authors_loop_s"):
            median_s, best_s = row[key]
            assert 0 < best_s <= median_s
    rewards = torch.randint(0, 3, (3, 12), generator=torch.Generator().manual_seed(1)).float()
    ours, theirs = pods.max_variance_indices(rewards, 4), selector.authors_loop(rewards, 4)
    assert torch.allclose(rewards.gather(-1, ours).var(-1), rewards.gather(-1, theirs).var(-1))


def test_rewards_tiny_finds_the_data_folder_as_train_does(data_dir, monkeypatch, capsys):
    monkeypatch.setenv("PODS_DATA_DIR", str(data_dir))
    result = cli.main(["rewards", "--tiny"])
    out = capsys.readouterr().out
    assert result["args"]["data_dir"] == data_dir and "GSM8K-style, 64 completions (100.0% decided" in out
    assert set(result["gsm8k_per_s"]) == {"accuracy", "format", "tag_count", "all three (compute_rewards)"}
    assert list(result["math_per_s"]) == ["num_workers=0"] and result["adversarial_worst_s"] < 1.0
    completions, answers = grading.gsm8k_completions([{"answer": "3 + 4 = <<3+4=7>>7\n#### 7"}], 8)
    assert answers == ["7"] * 8 and completions[0].endswith("<answer>\n7\n</answer>") and "<<" not in completions[0]


def test_generation_runs_every_completion_to_full_length():
    """No EOS ids: completions are new_tokens long on both backends, whatever tokens the random model picks."""
    trainer = common.trainer_args(torch.device("cpu"), tiny=True, lora_rank=4)
    model = common.build_policy("qwen2.5-3b", tiny=True, device=torch.device("cpu"), precision="fp32", args=trainer)
    prompt_ids = common.random_prompts(common.TINY_VOCAB, 2, 3, seed=0)
    for backend in ("engine", "hf"):
        completions = common.generate(model, prompt_ids, 3, 5, trainer, seed=0, backend=backend)
        assert completions.shape == (6, 5)
    batch = common.synthetic_batch(3, 4, 5, common.TINY_VOCAB, seed=0)
    assert batch.completion_mask.all() and batch.truncated.all() and batch.prompt_ids.shape == (3, 4)


def test_prefix_tiny_times_the_update_off_and_on_with_the_same_loss(tmp_path, smollm2_tokenizer, monkeypatch,
                                                                     capsys):
    """`python -m bench prefix --tiny`: every mode of each shape trains on the same rows (the same loss); the modes
    that share feed the model fewer tokens (groups: each distinct prompt once; on: also the shared prefix once)."""
    monkeypatch.setattr(models, "load_tokenizer", lambda name: smollm2_tokenizer)  # the session's copy
    result = cli.main(["prefix", "--tiny", "--repeats", "1", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| shape | mode |" in out and out.count("losses agree: PASS") == 2
    part = result["update"]
    assert part["shared_prefix_tokens"] > 50   # the demo's system prompt and worked example
    rows = part["rows"]
    assert [(row["shape"], row["mode"]) for row in rows[:6]] == [(shape, mode) for shape in prefix_bench.TINY_SHAPES
                                                                 for mode in prefix_bench.MODES]
    assert len(rows) == 2 * 2 * 3   # a warm-up and a timed repeat, 2 shapes, 3 modes
    for shape in prefix_bench.TINY_SHAPES:
        tokens = {row["mode"]: row["tokens"] for row in rows if row["shape"] == shape}
        assert tokens["on"] < tokens["groups"] < tokens["off"]
        assert set(part["ratios"][shape]) == {"groups", "on"} and all(r > 0 for r in part["ratios"][shape].values())
    assert json.loads((tmp_path / "bench_prefix.json").read_text())["update"]["shared_prefix_tokens"] == \
        part["shared_prefix_tokens"]
    assert cli.main(["prefix", "--from-json", str(tmp_path / "bench_prefix.json")]) == \
        {key: part[key] for key in ("ratios", "cpu_ratios")}   # the figures, recomputed from the saved rows


def test_prefix_presets_table_from_token_counts(tmp_path, smollm2_tokenizer, data_dir, monkeypatch, capsys):
    """`python -m bench prefix --presets`: the paper's presets' expected saving from their real prompts' lengths; with
    one prompt per step and m rows of it the update's ratio is (P + m C) / (m (P + C)), checked by hand. Reads the
    presets' datasets from the data folder (skipped without one: never the Hub)."""
    monkeypatch.setattr(models, "load_tokenizer", lambda name: smollm2_tokenizer)
    monkeypatch.setenv("PODS_DATA_DIR", str(data_dir))
    result = cli.main(["prefix", "--presets", "--out-dir", str(tmp_path)])
    assert "| preset | dataset |" in capsys.readouterr().out
    rows = {row["preset"]: row for row in result["presets"]}
    assert set(rows) == set("abcd")
    for row in rows.values():
        p, m = row["prompt_tokens"], row["m"]
        assert 0 < row["shared_prefix_tokens"] < p and row["prompts_per_step"] == 1
        for c in prefix_bench.PRESET_COMPLETION_TOKENS:
            assert row[f"update_on_off_C{c}"] == pytest.approx((p + m * c) / (m * (p + c)), abs=1e-3)
        assert row["update_on_off_C128"] < row["update_on_off_C512"] < 1 and 0 < row["eval_prefill_on_off"] < 1
    assert prefix_bench.common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert json.loads((tmp_path / "bench_prefix_presets.json").read_text())["rows"][0]["preset"] == "a"


def test_the_committed_prefix_figures_are_recomputed_from_their_runs(capsys):
    """BENCHMARKS' table of "each distinct token computed once" is what `--from-json` recomputes from the committed
    runs (results/prefix-bench): the medians, the ratios and the evaluation's best times."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "BENCHMARKS.md").read_text()
    update = cli.main(["prefix", "--from-json", str(root / "results/prefix-bench/bench_prefix.json")])
    lines = capsys.readouterr().out
    for shape, (off, on) in {"PODS 16/4": ("6.63", "2.59"), "GRPO-GA 16/16": ("30.32", "9.05")}.items():
        assert f"median update off {off} s, on {on} s" in lines and f"{off} → {on} |" in text
        assert f"**{update['ratios'][shape]['on']:.2f}×**" in text
    evaluation = cli.main(["evalprefix", "--from-json", str(root / "results/prefix-bench/bench_evalprefix.json")])
    best = evaluation["best_s"]
    assert f"{best['before']:.1f} → {best['on']:.1f} (" in text and f"**{evaluation['ratio']:.2f}×**" in text
    assert f"{best['before']:.1f} → {best['bf16']:.1f} (" in text and f"**{evaluation['ratio_bf16']:.2f}×**" in text
    assert evaluation["same_completions"] is True and f"{evaluation['bf16_same_share']:.0%} of its 256" in text


def test_the_committed_gpu_figures_are_recomputed_from_their_runs(capsys):
    """Every table row `bench show` prints from the committed GPU runs (results/gpu-h200) is in BENCHMARKS.md, as
    printed: the GPU figures are recomputed from the repository on any machine."""
    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "results/gpu-h200").glob("bench_*.json"))
    assert {path.name for path in files} == {"bench_decode.json", "bench_memory.json", "bench_step.json"}
    shown = cli.main(["show", *map(str, files)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == sum(len(table) + 1 for saved in shown.values()
                            for table in show.row_tables(saved).values())
    text = (root / "BENCHMARKS.md").read_text()
    assert [row for row in rows if row not in text] == []
    with pytest.raises(SystemExit, match="no file"):
        cli.main(["show", str(root / "results/gpu-h200/absent.json")])


def test_the_coverage_command_measures_what_a_part_of_the_suite_runs(tmp_path, capsys):
    """`python -m bench coverage -- ARGS` runs those tests under coverage.py (in a fresh process) and counts the GPU
    paths' files: the lines the part ran, each exclusion naming lines that exist; a passing suite says so."""
    from bench import gpu_coverage

    out = tmp_path / "coverage.json"
    saved = cli.main(["coverage", "--json", "--out", str(out), "--", "tests/test_gpu_paths.py", "-k", "tf32", "-n",
                      "0"])
    rows = {row["file"]: row for row in saved["rows"]}
    assert saved["suite_passed"] and json.loads(out.read_text())["rows"] == saved["rows"]
    assert set(rows) == {*gpu_coverage.FILES, "total"} and 0 < rows["total"]["executed"] < rows["total"]["lines"]
    assert rows["engine/gpu_paths.py"]["executed"] > 0 and all(entry["lines"] > 0 for entry in saved["excluded"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"percent": saved["percent"],
                                                                    "suite_passed": True}


def test_the_coverage_in_benchmarks_is_the_committed_record(capsys):
    """BENCHMARKS.md's coverage table is what `python -m bench show` prints of results/coverage (a passing default
    suite, >= 95 % of the lines)."""
    root = Path(__file__).resolve().parents[1]
    record = root / "results" / "coverage" / "bench_coverage.json"
    saved = json.loads(record.read_text())
    assert saved["suite_passed"] and saved["percent"] >= 95 and saved["command"] == "python -m bench coverage"
    cli.main(["show", str(record)])
    printed = capsys.readouterr().out.split("## rows\n")[1].split("\n\n")[0].strip()
    section = (root / "BENCHMARKS.md").read_text().split("(`python -m bench coverage`)")[1].split("\n## ")[0]
    assert printed in section


def test_products_tiny_compares_the_engines_laid_out_products_with_f_linear(tmp_path, capsys):
    """`python -m bench products`: each shape's F.linear and laid-out product timed for both dtypes; the bf16 numbers
    are F.linear's bit for bit (the engine's bf16 decode is unchanged by the layout), float32 ones within rounding."""
    from engine import step as weights

    result = cli.main(["products", "--tiny", "--threads", "1", "--repeats", "2", "--out-dir", str(tmp_path)])
    rows = result["results"]
    assert [(row["dtype"], tuple(row["shape"])) for row in rows] == [
        (dtype, shape) for dtype in ("float32", "bfloat16") for shape in ((8, 32, 48), (8, 48, 32))]
    assert all(row["linear_ms"] > 0 for row in rows)
    if weights.CPU_LAYOUT["usable"]:
        assert all(row["laid_out_ms"] > 0 and row["ratio"] > 0 for row in rows)
        assert all(row["equal"] for row in rows if row["dtype"] == "bfloat16")
    assert json.loads((tmp_path / "bench_products.json").read_text()) == result
    assert "F.linear ms" in capsys.readouterr().out


def test_benchmarks_quotes_the_committed_products_run():
    """BENCHMARKS.md's table of `python -m bench products` is the committed record's, row by row."""
    root = Path(__file__).resolve().parents[1]
    record = json.loads((root / "results" / "products" / "bench_products.json").read_text())
    benchmarks = (root / "BENCHMARKS.md").read_text()
    for row in record["results"]:
        assert (f"| {row['dtype']} | {row['threads']} | {' x '.join(map(str, row['shape']))} | {row['linear_ms']} | "
                f"{row['laid_out_ms']} | {row['ratio']}x |") in benchmarks, row
    assert all(row["equal"] for row in record["results"] if row["dtype"] == "bfloat16")
