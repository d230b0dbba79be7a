"""train.py, whole runs on a tiny random model: the metrics/config files and a loadable adapter, the completions
log (every rollout, what was kept and its advantage, the viewer), every variant flag, flags applied at resume, the
non-finite guard, impossible settings refused before allocation, one-line CLI errors, exact resume after SIGKILL,
and preemption (SIGTERM: a checkpoint at the step boundary, then an exact resume)."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from run import completions, signals
from run import config, loop
import eval as eval_module
import grpo_loss
import models
import rewards
import sampling
import train
import update
from run_helpers import ROOT, TIMING, fake_compute_rewards, read_lines, tiny_argv

pytestmark = pytest.mark.usefixtures("varied_rewards")

def test_run_writes_metrics_config_and_loadable_adapter(tiny_model_dir, tmp_path, monkeypatch):
    from peft import PeftModel
    from run import cpu_memory

    kept = []   # a CPU run keeps freed memory for its next step, once, after loading (run/cpu_memory.py)
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda device: kept.append(str(device)) or True)
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run"))
    assert kept == ["cpu"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["label"] == "PODS max_variance 4/2" and config["num_rollouts"] == 4 and config["seed"] == 0
    steps, evals = read_lines(run_dir, "train"), read_lines(run_dir, "eval")
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    assert all(math.isfinite(s["loss"]) and s["num_tokens"] > 0 and s["peak_mem_gib"] > 0 for s in steps)
    assert steps[1]["num_tokens"] > steps[0]["num_tokens"] and steps[1]["elapsed_s"] > steps[0]["elapsed_s"]
    assert 0 <= evals[-1]["eval/accuracy"] <= 1 and evals[-1]["eval/num_samples"] == 2
    latest = (run_dir / "checkpoints" / "latest.txt").read_text().strip()
    assert latest == "step_000002"
    model = PeftModel.from_pretrained(models.tiny_random_model("llama"), run_dir / "checkpoints" / latest / "adapter")
    assert max(float(p.abs().max()) for n, p in model.named_parameters() if "lora_B" in n) > 0  # LoRA moved
    with pytest.raises(ValueError, match="already holds a run"):
        train.main(tiny_argv(tiny_model_dir, run_dir))


@pytest.mark.parametrize("method", ["pods", "grpo"])
def test_the_completions_log_holds_every_rollout_and_what_the_loss_trained_on(method, tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """Per logged step: n rollouts per prompt with their texts and rewards, exactly m kept per prompt for PODS (all for
    GRPO), the kept ones with the advantages the update received; the viewer shows them; evaluations log a sample."""
    seen = []
    real_generate, real_update = sampling.generate_rollouts, update.update_policy
    monkeypatch.setattr(sampling, "generate_rollouts",
                        lambda *args, **kwargs: seen.append(real_generate(*args, **kwargs)) or seen[-1])

    def spy_update(model, optimizer, batches, settings, **kwargs):
        seen.append(batches[0])
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(update, "update_policy", spy_update)
    extra = ["--rule", "none", "-m", "4"] if method == "grpo" else []
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--log-completions-interval", "2", *extra))
    last = max(i for i, item in enumerate(seen) if isinstance(item, update.UpdateBatch))
    rollouts, batch = seen[last - 1], seen[last]  # step 2's (evaluations generate rollouts too)
    step, rows = completions.read_completions(run_dir)
    assert step == 2
    with pytest.raises(ValueError, match="logged steps: 2"):
        completions.read_completions(run_dir, 1)  # interval 2: step 1 is not logged
    prompts = [row for row in rows if row["type"] == "prompt"]
    logged = [row for row in rows if row["type"] == "rollout"]
    n, m = 4, 4 if method == "grpo" else 2
    assert len(prompts) == 2 and len(logged) == 2 * n and [row["completion"] for row in logged] == rollouts.texts
    assert [sum(row["kept"] for row in logged if row["prompt_id"] == i) for i in (0, 1)] == [m, m]
    width = batch.completion_ids.shape[1]
    trained = [next(r for r in range(2 * n) if torch.equal(rollouts.completion_ids[r, :width], ids))
               for ids in batch.completion_ids]  # the rollout row of each row the update received
    assert sorted(trained) == [r for r, row in enumerate(logged) if row["kept"]]
    assert [logged[r]["advantage"] for r in trained] == pytest.approx(batch.advantages.tolist())
    expected = fake_compute_rewards(None, rollouts.texts, None).total
    assert [row["reward"] for row in logged] == pytest.approx(expected.tolist())
    lines = eval_module.main(["rollouts", str(run_dir), "--prompt", "1"])
    assert sum("   *  " in line for line in lines) == m and len(lines) == 4 + n
    evaluations = sorted(p.name for p in (run_dir / completions.COMPLETIONS_DIR).glob("eval_*"))
    assert evaluations == ["eval_step_000000.jsonl", "eval_step_000002.jsonl"]
    assert len(completions.read_completions(run_dir, 2, "eval_step")[1]) == 2  # --eval-samples 2


def test_run_with_every_variant_flag_logs_the_new_counters(tiny_model_dir, tmp_path):
    report_to = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--loss-aggregation", "token", "--scale-rewards",
                                   "batch", "--clip-eps-high", "0.28", "--mask-truncated", "--drop-zero-variance",
                                   "--selection-scope", "batch", "--mu", "2", "--report-to", report_to))
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["label"] == ("PODS max_variance 4/2 + token loss, batch std, batch scope, clip-high 0.28, "
                              "truncated masked, zero-variance dropped")
    steps = read_lines(run_dir, "train")
    assert [s["step"] for s in steps] == [1, 2]
    for line in steps:
        assert all(isinstance(line[k], int) and line[k] >= 0 for k in ("num_zero_variance_dropped",
                                                                        "num_truncated_masked", "optimizer_steps"))
        assert line["update_rows"] <= 4 and math.isfinite(line["loss"]) and "clip_ratio/high_mean" in line
    assert sum(s["num_truncated_masked"] for s in steps) > 0  # 8 tokens: a random model rarely stops earlier
    if report_to == "tensorboard":
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_applies_the_new_learning_rate_and_weight_decay(tiny_model_dir, tmp_path, monkeypatch):
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--eval-samples", "0"))
    groups = []
    real_update = update.update_policy

    def spy_update(model, optimizer, batches, settings, **kwargs):
        groups.extend((g["lr"], g["weight_decay"]) for g in optimizer.param_groups)
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(update, "update_policy", spy_update)
    train.main(["--output-dir", str(run_dir), "--resume", "--max-steps", "3", "--learning-rate", "0.5",
                "--weight-decay", "0.01", "--no-progress"])
    assert groups and set(groups) == {(0.5, 0.01)}  # not the 1e-2 / 0.0 in the saved optimizer state
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["learning_rate"], saved["weight_decay"], saved["max_steps"]) == (0.5, 0.01, 3)
    assert read_lines(run_dir, "train")[-1]["learning_rate"] == 0.5
    # recorded where it happened, the budget's extension too
    change = {"step": 2, "learning_rate": [1e-2, 0.5], "weight_decay": [0.0, 0.01], "max_steps": [2, 3]}
    assert saved["changes"] == [change] and read_lines(run_dir, "resume") == [dict(type="resume", **change)]


def test_a_resumed_run_starts_no_step_past_its_budget(tiny_model_dir, tmp_path, monkeypatch):
    """The last step's duration is saved with the checkpoint: near --max-time-s a resumed run foresees its next step
    as the uninterrupted run would (no step starts that would likely end past the budget), and a reader that cuts
    runs to that budget (compare.within_budget) keeps the same steps and evaluations. Each step takes 1 s of a
    fake clock, so the uninterrupted run's stop is known: after step 2, as 2 s + 1 s > 2.25 s."""
    import itertools
    import types

    import compare

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=itertools.count(0.0, 1.0).__next__))
    argv = tiny_argv(tiny_model_dir, tmp_path / "run")
    train.main(argv)
    last = read_lines(tmp_path / "run", "train")[-1]
    assert (last["elapsed_s"], last["step_s"]) == (2.0, 1.0)
    budget = last["elapsed_s"] + 0.25 * last["step_s"]
    train.main(argv + ["--max-steps", "0", "--max-time-s", str(budget), "--resume"])
    assert [line["step"] for line in read_lines(tmp_path / "run", "train")] == [1, 2]
    run = compare.within_budget(compare.read_run(tmp_path / "run"), budget)
    assert len(run.step_durations_s) == 2 and run.eval_steps.tolist() == [0, 2]


def nan_loss_on(steps, monkeypatch):
    """grpo_loss_sum returns NaN during the training steps in `steps` (1-based)."""
    current, real_loss, real_step = {"step": 0}, grpo_loss.grpo_loss_sum, train.train_step

    def step(model, tokenizer, optimizer, rounds, args, step, *ctx):
        current["step"] = step
        return real_step(model, tokenizer, optimizer, rounds, args, step, *ctx)

    def loss(*args, **kwargs):
        value, metrics = real_loss(*args, **kwargs)
        return (value * math.nan if current["step"] in steps else value), metrics

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(grpo_loss, "grpo_loss_sum", loss)


def test_a_non_finite_step_is_skipped_and_counted(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    nan_loss_on({2}, monkeypatch)
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--max-steps", "3", "--eval-samples", "0"))
    steps = read_lines(run_dir, "train")
    assert [s["skipped_steps"] for s in steps] == [0, 1, 1] and math.isnan(steps[1]["loss"])
    adapter = [load_file(run_dir / f"checkpoints/step_00000{i}/adapter/adapter_model.safetensors") for i in (1, 2, 3)]
    assert all(torch.equal(adapter[0][k], adapter[1][k]) for k in adapter[0])  # step 2 changed nothing
    assert any(not torch.equal(adapter[1][k], adapter[2][k]) for k in adapter[0])  # step 3 trained again


def test_three_non_finite_steps_in_a_row_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    nan_loss_on({2, 3, 4}, monkeypatch)
    with pytest.raises(update.TrainingError, match="3 steps in a row"):
        train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--max-steps", "6", "--eval-samples", "0"))
    steps = read_lines(tmp_path / "run", "train")
    assert [s["skipped_steps"] for s in steps] == [0, 1, 2, 3]
    assert (tmp_path / "run/checkpoints/latest.txt").read_text().strip() == "step_000003"  # finite weights only


def test_a_run_stopped_by_an_error_closes_its_progress_bar_before_the_error_is_printed(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """The error is the last line a run prints: the bar's closing redraw comes before train.main's caller (train.py's
    __main__) prints it, not when the bar is collected later."""
    events = []

    import tqdm

    class Bar(tqdm.tqdm):
        def close(self):
            if "bar closed" not in events:
                events.append("bar closed")
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Bar)  # report.progress_bar's
    nan_loss_on({1, 2, 3}, monkeypatch)
    with pytest.raises(update.TrainingError, match="3 steps in a row"):
        try:
            train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--max-steps", "5", "--eval-samples", "0",
                                 "--progress"))
        finally:
            events.append("error printed")
    assert events == ["bar closed", "error printed"]


def test_impossible_lengths_and_sizes_fail_before_anything_is_allocated(tiny_model_dir, tmp_path, monkeypatch):
    """Prompt + completion beyond the model's positions: refused while parsing the flags (the config is local);
    a generation whose KV cache and logits exceed the memory left: refused after loading, before generating."""
    with pytest.raises(ValueError, match="exceed the 2048 positions"):
        config.parse_args(tiny_argv(tiny_model_dir, tmp_path / "a", "--max-completion-tokens", "100000"))
    generated = []
    monkeypatch.setattr(sampling, "generate_rollouts", lambda *args, **kwargs: generated.append(1))
    with pytest.raises(ValueError, match=r"needs ~\d+\.\d GiB .* lower --rollout-batch-size \(now 100000\)"):
        train.main(tiny_argv(tiny_model_dir, tmp_path / "b", "--rollout-batch-size", "100000"))
    monkeypatch.setattr(models, "available_memory_bytes", lambda device: 2 ** 20)  # 1 MiB left
    with pytest.raises(ValueError, match="but 0.0 GiB are free on cpu: lower --rollout-batch-size"):
        train.main(tiny_argv(tiny_model_dir, tmp_path / "c"))
    assert not generated


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--reward-weights", "format=x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "train.py: error: --reward-weights: weight of 'format' is not a number: 'x'"]


WRAPPER = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
import rewards, train
from run_helpers import fake_compute_rewards
rewards.compute_rewards = fake_compute_rewards
original_step = train.train_step
def slow_step(model, tokenizer, optimizer, rounds, args, step, *rest):
    Path({marker!r}).write_text(str(step))  # the step now running
    out = original_step(model, tokenizer, optimizer, rounds, args, step, *rest)
    time.sleep({pause})  # gives the test time to act between steps
    return out
train.train_step = slow_step
train.main(sys.argv[1:])
"""
RESUME_ARGV = ["--max-steps", "4", "--log-completions-interval", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The 4-step run that a killed or stopped and then resumed run must equal."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rewards, "compute_rewards", fake_compute_rewards)
        return train.main(tiny_argv(tiny_model_dir, tmp_path_factory.mktemp("full") / "run", *RESUME_ARGV))


def start_and_wait_for_step(script_dir, run_dir, tiny_model_dir, step):
    """train.py in a subprocess (the WRAPPER); returns it once training step `step` is running."""
    script, marker = script_dir / "run_train.py", script_dir / "running_step"
    script.write_text(WRAPPER.format(root=str(ROOT), tests=str(ROOT / "tests"), marker=str(marker), pause=0.5))
    process = subprocess.Popen([sys.executable, str(script), *tiny_argv(tiny_model_dir, run_dir, *RESUME_ARGV)],
                               env=dict(os.environ, PYTHONHASHSEED="0"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and not (marker.exists() and
                                                                      marker.read_text() == str(step)):
        time.sleep(0.02)
    assert process.poll() is None, process.stderr.read()[-2000:]
    return process


def assert_resumed_run_equals(run_dir, full_dir):
    """Every metrics line (timings aside), every completions file and the final adapter, bit for bit."""
    from safetensors.torch import load_file

    def comparable(run):
        return [{k: v for k, v in line.items() if k not in TIMING}
                for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    resumed, full = comparable(run_dir), comparable(full_dir)
    assert [line["step"] for line in resumed if line["type"] == "train"] == [1, 2, 3, 4]
    assert resumed == full
    logs = {run: {p.name: p.read_text() for p in (run / completions.COMPLETIONS_DIR).iterdir()} for run in (run_dir,
                                                                                                      full_dir)}
    assert logs[run_dir] == logs[full_dir] and len(logs[full_dir]) == 4 + 3  # steps 1-4, evaluations 0, 2, 4
    final = "checkpoints/step_000004/adapter/adapter_model.safetensors"
    a, b = load_file(run_dir / final), load_file(full_dir / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_then_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path, uninterrupted):
    killed_dir = tmp_path / "killed"
    killed = start_and_wait_for_step(tmp_path, killed_dir, tiny_model_dir, 3)
    os.kill(killed.pid, signal.SIGKILL)  # mid-step: checkpoints come after each step (--checkpoint-interval-s 0)
    killed.wait()
    train.main(["--output-dir", str(killed_dir), "--resume", "--no-progress"])
    assert_resumed_run_equals(killed_dir, uninterrupted)


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint_and_resume_continues_exactly(tiny_model_dir, tmp_path,
                                                                                           uninterrupted):
    """A cluster's preemption (SIGTERM during step 3): the step ends, its checkpoint is written, the run says how to
    resume and exits 128 + 15; --resume then gives the uninterrupted run's metrics, completions and weights."""
    stopped_dir = tmp_path / "stopped"
    stopped = start_and_wait_for_step(tmp_path, stopped_dir, tiny_model_dir, 3)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 128 + signal.SIGTERM
    message = stopped.stderr.read()
    assert "stopped by SIGTERM after step 3" in message and "--resume" in message and "Traceback" not in message
    latest = (stopped_dir / "checkpoints" / "latest.txt").read_text().strip()
    assert latest == "step_000003" and [e["step"] for e in read_lines(stopped_dir, "eval")] == [0, 2]  # none at 3
    train.main(["--output-dir", str(stopped_dir), "--resume", "--no-progress"])
    assert_resumed_run_equals(stopped_dir, uninterrupted)


def test_a_second_signal_stops_at_once_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signal() as signalled:
        os.kill(os.getpid(), signal.SIGINT)
        assert signalled == {"signal": signal.SIGINT}
        with pytest.raises(SystemExit) as exited:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_demo_preset_two_steps(tmp_path, monkeypatch):
    """The real demo (SmolLM2-135M from the GGUF, arithmetic, real rewards) for two steps."""
    monkeypatch.undo()  # real rewards
    run_dir = train.main(["--max-steps", "2", "--eval-samples", "8", "--output-dir", str(tmp_path / "demo"),
                          "--no-progress"])
    steps = read_lines(run_dir, "train")
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    assert all(0 <= s["rewards/accuracy/mean"] <= 1 for s in steps)
    assert len(read_lines(run_dir, "eval")) == 2


class OneSecondSteps(train.OneProcess):
    """Every step counts as 1 s of training (train.py takes the step time from `agree`): a clock a test can read."""

    def agree(self, value):
        return 1.0


def test_eval_interval_s_evaluates_where_the_training_seconds_cross_each_multiple_and_a_resume_keeps_it(
        tiny_model_dir, tmp_path, capsys):
    """--eval-interval-s 3 with 1 s steps: evaluations at step 0, after the steps that cross 3 s and 6 s, and at the
    end. A run stopped at step 4 (its end evaluation) and resumed evaluates next at 6 s, as the run that was not
    stopped did: not at 5 s (3 s after the last evaluation) nor at 7 s (3 s after the resume)."""
    def run(out, steps, *extra):
        argv = tiny_argv(tiny_model_dir, out, "--eval-interval", "0", "--eval-interval-s", "3", "--max-steps",
                         str(steps), "--log-completions-interval", "0", *extra)
        return train.train(config.parse_args(argv), OneSecondSteps())

    whole = run(tmp_path / "whole", 8)
    assert [(e["step"], e["elapsed_s"]) for e in read_lines(whole, "eval")] == [(0, 0), (3, 3), (6, 6), (8, 8)]
    assert "held-out evaluation of 2 prompts at step 0, every 3 s of training and the end" in capsys.readouterr().out
    resumed = run(tmp_path / "resumed", 4)
    assert [e["step"] for e in read_lines(resumed, "eval")] == [0, 3, 4]
    run(resumed, 8, "--resume")
    assert [e["step"] for e in read_lines(resumed, "eval")] == [0, 3, 4, 6, 8]
    with pytest.raises(ValueError, match="--eval-interval-s must be >= 0"):
        config.parse_args(tiny_argv(tiny_model_dir, tmp_path / "bad", "--eval-interval-s", "-1"))
