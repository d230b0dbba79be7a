"""eval.py: evaluate() on a tiny random model end to end, its bookkeeping, and the command line; reading a run
folder (checkpoint.py's "Reading a run folder", which eval.py uses)."""

import json
import os
import re
import runpy
import statistics
from pathlib import Path

import pytest
import torch

from run import checkpoint
from run import completions
import eval as eval_module
from run import report
import rewards
from sampling import GenerationSettings

PROMPTS = ["What is 2 + 3?", "Compute 7 * 6.", "What is 10 - 4?"]


def generation(temperature=0.9, max_new_tokens=256, batch_size=64, **options):
    """(eval's GenerationSettings from the command line's names, the other keywords)."""
    return GenerationSettings(max_new_tokens, temperature, 1.0, batch_size), options


def evaluate(model, tokenizer, prompts, answers, **kwargs):
    settings, options = generation(**kwargs)
    return eval_module.evaluate(model, tokenizer, prompts, answers, settings, **options)


def evaluate_repeats(model, tokenizer, prompts, answers, **kwargs):
    settings, options = generation(**kwargs)
    return eval_module.evaluate_repeats(model, tokenizer, prompts, answers, settings, **options)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny models, shared cores


def test_evaluate_tiny_model_end_to_end(tiny_model, smollm2_tokenizer):
    result = evaluate(tiny_model, smollm2_tokenizer, PROMPTS, ["5", "42", "6"], samples_per_prompt=2,
                                  repeats=2, max_new_tokens=6, batch_size=4, seed=1)
    assert result.num_samples == len(PROMPTS) * 2 * 2
    for value in (result.accuracy, result.format_accuracy, result.both_accuracy):
        assert 0.0 <= value <= 1.0
    assert result.both_accuracy <= min(result.accuracy, result.format_accuracy)
    assert 1.0 <= result.mean_completion_length <= 6.0  # tokens, first EOS included
    assert result.elapsed_s > 0


def test_rows_are_graded_against_their_own_prompt(tiny_model, smollm2_tokenizer, monkeypatch):
    # Grade by the answer alone, so the exact fraction follows from which prompt each row belongs to.
    monkeypatch.setattr(rewards, "accuracy_rewards",
                        lambda prompts, texts, answer, **kw: [float(a == "yes") for a in answer])
    monkeypatch.setattr(rewards, "format_rewards",
                        lambda prompts, texts, **kw: [float(t.startswith("<think>\n")) for t in texts])
    answers = ["yes", "no", "yes"]
    expected = answers.count("yes") / len(answers)
    for k, batch_size in ((1, 64), (3, 2), (2, 5)):  # chunks of 1-2 prompts: rows must not shift
        result = evaluate(tiny_model, smollm2_tokenizer, PROMPTS, answers, samples_per_prompt=k,
                                      max_new_tokens=2, batch_size=batch_size)
        assert result.accuracy == pytest.approx(expected)
        assert result.format_accuracy == 0.0 and result.both_accuracy == 0.0
    # A prompt that ends in the think prefill gets it back in front of the completion before grading.
    prefilled = [p + rewards.THINK_PREFILL for p in PROMPTS[:2]] + PROMPTS[2:]
    result = evaluate(tiny_model, smollm2_tokenizer, prefilled, answers, max_new_tokens=2)
    assert result.format_accuracy == pytest.approx(2 / 3) and result.both_accuracy == pytest.approx(1 / 3)


def test_reproducible_and_progress_does_not_change_results(tiny_model, smollm2_tokenizer):
    kwargs = dict(samples_per_prompt=2, repeats=2, max_new_tokens=3, batch_size=4, seed=3)
    first = evaluate_repeats(tiny_model, smollm2_tokenizer, PROMPTS, ["1"] * 3, **kwargs)
    again = evaluate_repeats(tiny_model, smollm2_tokenizer, PROMPTS, ["1"] * 3, progress=True, **kwargs)
    assert [r.mean_completion_length for r in first] == [r.mean_completion_length for r in again]
    assert [r.num_samples for r in first] == [6, 6]
    assert torch.is_grad_enabled()  # generation's no_grad does not leak out


def test_greedy_collapses_samples_and_repeats(tiny_model, smollm2_tokenizer):
    with pytest.warns(UserWarning, match="greedy"):
        result = evaluate(tiny_model, smollm2_tokenizer, PROMPTS, ["1"] * 3, samples_per_prompt=4,
                                      repeats=3, temperature=0.0, max_new_tokens=3)
    assert result.num_samples == len(PROMPTS)


@pytest.mark.parametrize("prompts, answers, kwargs, message", [
    ([], [], {}, "no prompts"),
    (PROMPTS, ["1"], {}, "3 prompts but 1 answers"),
    (PROMPTS, ["1"] * 3, {"samples_per_prompt": 0}, "must be >= 1"),
    (PROMPTS, ["1"] * 3, {"temperature": -0.5}, "temperature"),
    (PROMPTS, ["1"] * 3, {"temperature": float("nan")}, "temperature"),
])
def test_bad_input_raises(prompts, answers, kwargs, message):
    with pytest.raises(ValueError, match=message):
        evaluate(None, None, prompts, answers, **kwargs)


def test_summarize_repeats_mean_and_sample_std():
    accuracies = [0.25, 0.5, 0.6]
    per_repeat = [eval_module.EvalResult(a, 1 - a, a / 2, 10.0 + i, 8, 1.5, i) for i, a in enumerate(accuracies)]
    summary = eval_module.summarize_repeats(per_repeat)
    assert summary["grader_timeouts"] == 3  # 0 + 1 + 2 samples scored incorrect for want of a verdict
    assert "1 scored 0 for a grader time-out" in report.eval_line(4, per_repeat[1])
    assert "time-out" not in report.eval_line(4, per_repeat[0])
    assert summary["accuracy"]["mean"] == pytest.approx(statistics.mean(accuracies))
    assert summary["accuracy"]["std"] == pytest.approx(statistics.stdev(accuracies))
    assert summary["accuracy"]["per_repeat"] == accuracies
    assert summary["num_samples"] == 24 and summary["eval_s"] == pytest.approx(4.5)
    assert eval_module.summarize_repeats(per_repeat[:1])["accuracy"]["std"] == 0.0


def _save_tiny(model_dir, model, tokenizer):
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def _add_checkpoint(run_dir, step, model_dir, config):
    """A checkpoint in train.py's layout (checkpoint.py): adapter/, trainer_state.pt, config.json."""
    from peft import LoraConfig, get_peft_model

    import models

    path = run_dir / "checkpoints" / f"step_{step:06d}"
    lora = get_peft_model(models.tiny_random_model(seed=step), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(path / "adapter")
    torch.save({"step": step, "elapsed_s": 1.5 * step, "rng": {"numpy": None}}, path / "trainer_state.pt")
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_cli_evaluates_every_checkpoint_and_appends(tmp_path, tiny_model, smollm2_tokenizer, capsys):
    pytest.importorskip("data")
    import compare

    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    _save_tiny(model_dir, tiny_model, smollm2_tokenizer)
    config = {"model": str(model_dir), "dataset": "arithmetic", "one_shot": False, "prefill_think": False,
              "max_completion_tokens": 4, "label": "PODS max_variance 16/4", "seed": 0}
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "metrics.jsonl").write_text("")
    for step in (0, 2):
        _add_checkpoint(run_dir, step, model_dir, config)
    flags = ["--num-prompts", "2", "--repeats", "2", "--batch-size", "8", "--no-progress"]
    eval_module.main(["--checkpoint", str(run_dir), *flags])
    out = run_dir / "eval_test.json"
    saved = json.loads(out.read_text())
    assert saved["config"]["repeats"] == 2 and saved["config"]["max_completion_tokens"] == 4
    assert sorted(saved["results"]) == ["step_000000", "step_000002"]
    entry = saved["results"]["step_000002"]
    assert entry["elapsed_s"] == 3.0 and entry["step"] == 2 and entry["num_samples"] == 4
    assert len(entry["accuracy"]["per_repeat"]) == 2 and 0 <= entry["accuracy"]["mean"] <= 1
    assert 1 <= entry["mean_completion_length"]["mean"] <= 4

    _add_checkpoint(run_dir, 4, model_dir, config)  # a new checkpoint: only it is evaluated and appended
    eval_module.main(["--checkpoint", str(run_dir), *flags])
    again = json.loads(out.read_text())
    assert sorted(again["results"]) == ["step_000000", "step_000002", "step_000004"]
    assert again["results"]["step_000002"] == entry
    capsys.readouterr()
    eval_module.main(["--checkpoint", str(run_dir), *flags])
    assert "all 3 checkpoints already" in capsys.readouterr().out
    with pytest.raises(ValueError, match="other settings.*temperature"):
        eval_module.main(["--checkpoint", str(run_dir), *flags, "--temperature", "0.5"])
    # compare can read these results instead of the training-time eval lines.
    data = compare.read_run(run_dir, eval_file="eval_test.json")
    assert list(data.eval_times_s) == [0.0, 3.0, 6.0]


def test_cli_base_model_and_full_checkpoint(tmp_path, tiny_model, smollm2_tokenizer):
    pytest.importorskip("data")
    model_dir = tmp_path / "model"
    _save_tiny(model_dir, tiny_model, smollm2_tokenizer)
    out = tmp_path / "base.json"
    eval_module.main(["--model", str(model_dir), "--dataset", "arithmetic", "--num-prompts", "2", "--repeats", "1",
                      "--max-new-tokens", "3", "--temperature", "0", "--out", str(out), "--no-progress"])
    base = json.loads(out.read_text())["results"]["base"]
    assert base["num_samples"] == 2 and base["accuracy"]["std"] == 0.0
    with pytest.raises(ValueError, match="exceed the model's 2048 positions: lower --batch-size"):  # before generating
        eval_module.main(["--model", str(model_dir), "--dataset", "arithmetic", "--num-prompts", "2",
                          "--max-new-tokens", "5000", "--out", str(tmp_path / "long.json"), "--no-progress"])
    # A full fine-tuning checkpoint (model/ instead of adapter/), evaluated on its own.
    full = tmp_path / "step_000001"
    tiny_model.save_pretrained(full / "model")
    (full / "config.json").write_text(json.dumps({"model": str(model_dir), "dataset": "arithmetic",
                                                  "max_completion_tokens": 3}))
    eval_module.main(["--checkpoint", str(full), "--num-prompts", "2", "--repeats", "1", "--no-progress"])
    entry = json.loads((full / "eval_test.json").read_text())["results"]["step_000001"]
    assert entry["step"] is None and entry["num_samples"] == 2


def test_cli_rejects_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(ValueError, match="neither a checkpoint"):
        eval_module.main(["--checkpoint", str(tmp_path)])
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ValueError, match="no checkpoint"):
        eval_module.main(["--checkpoint", str(tmp_path)])


def test_reading_a_run_folder(tmp_path):
    run = tmp_path / "run"
    config = {"model": "m", "max_completion_tokens": 8}
    for step in (4, 2):
        _add_checkpoint(run, step, tmp_path, config)
    (run / "checkpoints" / "step_000006").mkdir()  # not a checkpoint (no adapter/, no config.json): ignored
    found = checkpoint.find_checkpoints(run)
    assert [p.name for p in found] == ["step_000002", "step_000004"]
    assert checkpoint.find_checkpoints(found[0]) == [found[0]] and checkpoint.run_dir_of(found[1]) == run
    assert checkpoint.run_dir_of(run) == run
    assert checkpoint.checkpoint_progress(found[1]) == {"step": 4, "elapsed_s": 6.0}
    assert checkpoint.checkpoint_progress(tmp_path) == {"step": None, "elapsed_s": None}
    # A run folder without config.json reads its newest checkpoint's copy; an old run's max_new_tokens is
    # folded into the one key.
    (run / "checkpoints" / "step_000004" / "config.json").write_text(json.dumps({"model": "m", "max_new_tokens": 5}))
    assert checkpoint.read_run_config(run) == {"model": "m", "max_completion_tokens": 5}
    (run / "config.json").write_text(json.dumps({"max_completion_tokens": 7, "max_new_tokens": 7}))
    assert checkpoint.read_run_config(run) == {"max_completion_tokens": 7}
    assert checkpoint.read_run_config(found[0]) == config
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.find_checkpoints(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        checkpoint.read_run_config(tmp_path / "model")
    (run / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="malformed JSON"):
        checkpoint.read_run_config(run)


def test_results_written_under_the_old_key_are_still_appended_to(tmp_path):
    eval_config = {"model": "m", "max_completion_tokens": 4}
    path = tmp_path / "eval_test.json"
    path.write_text(json.dumps({"config": {"model": "m", "max_new_tokens": 4}, "results": {"step_000001": {}}}))
    assert eval_module.load_results(path, eval_config)["results"] == {"step_000001": {}}
    with pytest.raises(ValueError, match="other settings \\(max_completion_tokens\\)"):
        eval_module.load_results(path, dict(eval_config, max_completion_tokens=8))


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{tmp}/missing"], "--checkpoint .*missing: no such file or folder"),
    (["--checkpoint", "{tmp}"], "neither a checkpoint"),
    (["--model", "m", "--dataset", "math", "--data-dir", "{tmp}"], "data file not found: .*test500.jsonl"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr("sys.argv", ["eval.py", *(a.format(tmp=tmp_path) for a in argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(Path(eval_module.__file__)), run_name="__main__")
    text = str(exit_info.value.code)
    assert text.startswith("eval.py: error: ") and "\n" not in text and re.search(message, text)


def test_preset_evaluates_a_base_model_exactly_as_the_run_evaluates_its_policy(tiny_model_dir, tmp_path, monkeypatch):
    """A base model under --preset demo gets the very completions the demo run's step-0 evaluation got (its LoRA
    adapter starts at zero): the same prompts (one-shot, the demo's system prompt), sample, temperature, lengths."""
    import train
    from run_helpers import fake_compute_rewards, read_lines, tiny_argv

    monkeypatch.setattr(rewards, "compute_rewards", fake_compute_rewards)
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--max-steps", "1", "--eval-samples", "3"))
    step0 = read_lines(run_dir, "eval")[0]
    logged = completions.read_completions(run_dir, 0, "eval_step")[1]
    real, samples = eval_module.evaluate_repeats, []
    monkeypatch.setattr(eval_module, "evaluate_repeats",
                        lambda *args, **kwargs: real(*args, **dict(kwargs, samples_out=samples)))
    out = tmp_path / "base.json"
    eval_module.main(["--preset", "demo", "--model", str(tiny_model_dir), "--num-prompts", "3", "--repeats", "1",
                      "--max-completion-tokens", "8", "--out", str(out), "--no-progress"])
    assert [(s["prompt"], s["completion"]) for s in samples] == [(r["prompt"], r["completion"]) for r in logged]
    assert "Reply in the format" in samples[0]["prompt"] and "23 + 45" in samples[0]["prompt"]  # demo, one-shot
    saved = json.loads(out.read_text())
    assert saved["config"]["temperature"] == 0.0 and saved["config"]["one_shot"] is True  # the demo's: greedy
    base = saved["results"]["base"]
    assert base["accuracy"]["mean"] == step0["eval/accuracy"]
    assert base["mean_completion_length"]["mean"] == step0["eval/mean_completion_length"]


def test_preset_supplies_the_runs_settings_and_flags_still_win(monkeypatch, capsys):
    args = eval_module.parse_args(["--preset", "a"])
    assert eval_module.run_settings(args, [])["max_completion_tokens"] == 512
    assert (args.model, args.num_prompts, args.temperature, args.batch_size, args.dtype) == (
        "Qwen/Qwen2.5-3B-Instruct", 200, 0.9, 64, "bfloat16")
    demo = eval_module.parse_args(["--preset", "demo", "--num-prompts", "7", "--model", "other"])
    assert (demo.model, demo.num_prompts, demo.dtype) == ("other", 7, "float32")
    settings = eval_module.run_settings(demo, [])
    assert settings["one_shot"] and settings["dataset"] == "arithmetic" and settings["max_completion_tokens"] == 32
    for argv, message in ((["--preset", "demo", "--checkpoint", "runs/x"], "--preset is for --model"),
                          ([], "one of the arguments --checkpoint --model --preset is required")):
        monkeypatch.setattr("sys.argv", ["eval.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(Path(eval_module.__file__)), run_name="__main__")
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and error.count("\n") == 1 and message in error


def run_main_as_a_command(monkeypatch, capsys, argv):
    """(exit status, the error line) of `python eval.py ARGV`: argparse's errors (status 2) and the ValueErrors
    __main__ turns into one line (status 1) alike; (0, "") when it ran through."""
    monkeypatch.setattr("sys.argv", ["eval.py", *argv])
    try:
        runpy.run_path(str(Path(eval_module.__file__)), run_name="__main__")
    except SystemExit as exit_info:
        code = exit_info.code
        return (code, capsys.readouterr().err) if isinstance(code, int) else (1, code + "\n")
    return 0, ""


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--samples-per-prompt", "0"], "--samples-per-prompt must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--max-completion-tokens", "0"], "--max-completion-tokens must be >= 1, got 0"),  # was silently 256
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--top-p", "2"], "--top-p must be in \\(0, 1\\], got 2.0"),
    (["--num-threads", "-1"], "--num-threads must be >= 0 .*got -1"),
    (["--dataset", "bogus"], "--dataset 'bogus': not a registered dataset"),
    (["--model", "{tmp}/missing"], "--model: .*missing' does not exist"),
    (["--checkpoint", "{tmp}/missing", "--model", None], "--checkpoint .*missing: no such"),
    (["--checkpoint", "{tmp}", "--model", None], "--checkpoint: .* is neither a checkpoint"),
])
def test_every_cli_error_names_the_flag_to_fix(tiny_model_dir, tmp_path, monkeypatch, capsys, flags, message):
    argv = ["--model", str(tiny_model_dir), "--dataset", "arithmetic", "--num-prompts", "2", "--repeats", "1",
            "--max-completion-tokens", "4", "--out", str(tmp_path / "out.json"), "--no-progress", "--num-threads", "1"]
    if None in flags:  # a flag that excludes --model
        argv, flags = argv[2:], flags[:2]
    code, error = run_main_as_a_command(monkeypatch, capsys, argv + [flag.format(tmp=tmp_path) for flag in flags])
    assert code != 0 and error.startswith("eval.py: error: ") and error.count("\n") == 1
    assert re.search(message, error), error
    assert not (tmp_path / "out.json").exists()


def test_a_run_without_a_readable_checkpoint_names_the_flag(tmp_path, monkeypatch, capsys):
    path = _add_checkpoint(tmp_path / "run", 1, tmp_path, {"model": "m"})
    (path / "adapter" / "adapter_model.safetensors").write_bytes(b"")  # cut short
    code, error = run_main_as_a_command(monkeypatch, capsys, ["--checkpoint", str(tmp_path / "run")])
    assert code == 1 and re.search("^eval.py: error: --checkpoint .*run: no readable checkpoint", error), error


def test_help_lists_the_rollouts_command(capsys):
    with pytest.raises(SystemExit):
        eval_module.main(["--help"])
    assert "python eval.py rollouts RUN" in capsys.readouterr().out


def _logged_run(tmp_path, steps=(), eval_steps=(0,)):
    """A run folder as train.py leaves it, with completions logged at these training and evaluation steps."""
    from test_report import scored_round

    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"log_completions_interval": 5, "eval_interval": 5}))
    (run / checkpoint.METRICS_FILE).write_text('{"type": "train", "step": 1}\n')
    for step in steps:
        completions.write_completions(run, completions.completions_record(step, [scored_round()]))
    for step in eval_steps:
        completions.write_completions(run, completions.eval_completions_record(step, [
            {"prompt": "Q", "answer": "7", "completion": "<answer>7</answer>", "correct": True, "formatted": True}]))
    return run


def test_rollouts_of_a_run_that_logged_no_step_yet_say_so_and_show_the_evaluation(tmp_path, capsys):
    run = _logged_run(tmp_path)  # a 2-step run logging every 5th step: only its evaluations are logged
    lines = eval_module.main(["rollouts", str(run)])
    assert "no training step's rollouts logged yet" in lines[0] and "--log-completions-interval 5" in lines[0]
    assert any("<answer>7</answer>" in line for line in lines) and "evaluation at step 0" in "\n".join(lines)
    nothing = _logged_run(tmp_path / "other", eval_steps=())  # nothing logged at all
    lines = eval_module.main(["rollouts", str(nothing)])
    assert len(lines) == 1 and "nothing logged yet" in lines[0]
    (nothing / "config.json").write_text(json.dumps({"log_completions_interval": 0}))  # e.g. a TRL demo run
    assert "--log-completions-interval 0 (never)" in eval_module.main(["rollouts", str(nothing)])[0]


@pytest.mark.parametrize("flags, message", [
    (["--step", "7"], "--step 7: .*logged at steps 2"),
    (["--prompt", "5"], "--prompt 5: step 2 has prompts 0-1"),
    (["--width", "0"], "--width must be >= 10"),
    (["--eval", "--step", "3"], "--step 3: .*logged at steps 0"),
])
def test_rollouts_errors_name_the_flag_to_fix(tmp_path, monkeypatch, capsys, flags, message):
    run = _logged_run(tmp_path, steps=(2,))
    code, error = run_main_as_a_command(monkeypatch, capsys, ["rollouts", str(run), *flags])
    assert code == 1 and error.startswith("eval.py: error: ") and re.search(message, error), error
    code, error = run_main_as_a_command(monkeypatch, capsys, ["rollouts", str(tmp_path / "missing")])
    assert code == 1 and "is not a run folder" in error


def test_prefix_sharing_flag_reaches_generation_and_changes_no_result(tiny_model_dir, tmp_path, monkeypatch):
    """--prefix-sharing on (the default) / off reaches GenerationSettings; the demo's one-shot prompts share a long
    prefix, and both give the same completions, hence the same results."""
    real, seen = eval_module.evaluate_repeats, []

    def recording(*args, **kwargs):
        seen.append((args[4].prefix_sharing, samples := []))
        return real(*args, **dict(kwargs, samples_out=samples))

    monkeypatch.setattr(eval_module, "evaluate_repeats", recording)
    results = []
    for flags in ([], ["--prefix-sharing", "off"], ["--prefix-sharing", "on"]):
        out = tmp_path / f"eval{len(results)}.json"
        eval_module.main(["--preset", "demo", "--model", str(tiny_model_dir), "--num-prompts", "5", "--repeats", "1",
                          "--temperature", "0", "--max-completion-tokens", "6", "--batch-size", "4", "--out", str(out),
                          "--no-progress", *flags])
        results.append({k: v for k, v in json.loads(out.read_text())["results"]["base"].items() if k != "eval_s"})
    assert [sharing for sharing, _ in seen] == [True, False, True]
    assert results[0] == results[1] == results[2] and seen[0][1] == seen[1][1] and len(seen[0][1]) == 5
    prompts = [sample["prompt"] for sample in seen[0][1]]
    assert len(os.path.commonprefix(prompts)) > 100   # the one-shot example and system prompt: a prefix to share


def test_evaluate_shares_the_prefix_by_default(tiny_model, smollm2_tokenizer):
    """evaluate() with GenerationSettings' default (what train.py's held-out evaluation builds) prefills the prompts'
    common prefix once: fewer prefilled positions than with prefix_sharing=False, the same results."""
    import engine

    prompts = ["You are a careful assistant; answer with a number. " + p for p in PROMPTS]
    work, results = [], []
    for settings in (GenerationSettings(4, 0.0, 1.0, 64), GenerationSettings(4, 0.0, 1.0, 64, prefix_sharing=False)):
        before = engine.STATS.prefill_tokens
        results.append(eval_module.evaluate(tiny_model, smollm2_tokenizer, prompts, ["5", "42", "6"], settings))
        work.append(engine.STATS.prefill_tokens - before)
    assert 0 < work[0] < work[1] - 10 and results[0].accuracy == results[1].accuracy
    assert results[0].mean_completion_length == results[1].mean_completion_length


def test_greedy_decoding_collapses_the_repeats_in_one_line_and_reports_no_spread(tmp_path, tiny_model,
                                                                                  smollm2_tokenizer, capsys):
    """At temperature 0 every repeat is the same: one line says so (not a Python warning with its source line) and
    the result line says there is no spread, not "± 0.0000"."""
    import warnings

    model_dir = tmp_path / "model"
    _save_tiny(model_dir, tiny_model, smollm2_tokenizer)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = eval_module.main(["--model", str(model_dir), "--dataset", "arithmetic", "--num-prompts", "2",
                                  "--repeats", "5", "--max-new-tokens", "2", "--temperature", "0",
                                  "--out", str(tmp_path / "greedy.json"), "--no-progress"])
    out, err = capsys.readouterr()
    assert err == ("eval.py: temperature 0 is greedy decoding: every sample would be the same, so "
                   "--samples-per-prompt 1 and --repeats 5 are 1\n")
    assert "(1 repeat: no spread)" in out and "±" not in out and saved["config"]["repeats"] == 1
