"""train.py: flags/presets/errors, one step end to end on a tiny random model (every rule, mu > 1, beta > 0,
micro-batching = one batch), the metrics/config files, and exact resume after SIGKILL."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models
import rewards
import train

ROOT = Path(__file__).resolve().parents[1]
TIMING = set(train.TIMING_KEYS) | {"eval/eval_s"}


def fake_compute_rewards(prompts, completions, answers, **kwargs):
    """A reward that varies between any two different texts, so a random-weight model gets non-zero
    advantages (real rewards would all be 0 for its gibberish)."""
    values = torch.tensor([float(sum(map(ord, text)) % 101) / 100 for text in completions])
    return rewards.RewardResult(total=values, per_func={"char_sum": values})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama + the real SmolLM2 tokenizer saved as a local model folder."""
    folder = tmp_path_factory.mktemp("tiny_model")
    models.tiny_random_model("llama").save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def tiny_argv(model_dir, out_dir, *extra):
    return ["--model", str(model_dir), "--dataset", "arithmetic", "--num-train-rows", "64", "--num-rollouts", "4",
            "--update-size", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8", "--max-steps", "2",
            "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2", "--micro-batch-size", "2",
            "--eval-samples", "2", "--eval-interval", "2", "--checkpoint-interval-s", "0", "--no-progress",
            "--num-threads", "1",
            "--output-dir", str(out_dir), *extra]


def read_lines(run_dir, kind):
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["type"] == kind]


# ---------------------------------------------------------------------------------- flags and presets

@pytest.mark.filterwarnings("ignore:--bf16 on CPU")
def test_presets_baseline_and_overrides():
    a = train.parse_args(["--preset", "a"])
    assert (a.model, a.dataset, a.num_rollouts, a.update_size, a.rule) == (
        "Qwen/Qwen2.5-3B-Instruct", "gsm8k", 64, 16, "max_variance")
    assert (a.learning_rate, a.kl_coef, a.lora_rank, a.lora_alpha, a.weight_decay, a.max_grad_norm) == (
        5e-6, 0.0, 64, 64, 0.1, 1.0)
    assert a.max_prompt_tokens + a.max_completion_tokens == 1024 and a.bf16 and a.gradient_checkpointing
    base = train.parse_args(["--preset", "a", "--baseline"])
    assert (base.num_rollouts, base.update_size, base.rule) == (16, 16, "none")
    assert train.method_label(base) == "GRPO 16/16" and train.method_label(a) == "PODS max_variance 64/16"
    paper_baselines = {p: train.parse_args(["--preset", p, "--baseline"]) for p in "bcd"}
    assert {p: (x.num_rollouts, x.update_size) for p, x in paper_baselines.items()} == {
        "b": (8, 8), "c": (16, 16), "d": (16, 16)}
    b = train.parse_args(["--preset", "b", "--baseline", "--learning-rate", "1e-6", "-n", "16", "-m", "16"])
    assert (b.kl_coef, b.learning_rate, b.num_rollouts, b.rule) == (0.04, 1e-6, 16, "none")  # explicit flags win
    demo = train.parse_args([])
    assert demo.preset == "demo" and demo.model == models.SMOLLM2_ALIAS and demo.dataset == "arithmetic"
    assert demo.update_size < demo.num_rollouts and demo.max_time_s == 600


@pytest.mark.parametrize("argv, message", [
    (["-n", "4", "-m", "8"], "must be <= --num-rollouts"),
    (["--rule", "none", "-n", "8", "-m", "4"], "needs m == n"),
    (["--lora-rank", "0", "--kl-coef", "0.1"], "incompatible flags"),
    (["--load-in-4bit", "--device", "cpu"], "incompatible flags"),
    (["--optimizer", "adamw8bit", "--device", "cpu"], "adamw8bit"),
    (["--reward-weights", "accuracy=1,bogus=2"], "unknown reward function"),
    (["--resume"], "--output-dir"),
])
def test_bad_flags_fail_before_loading(argv, message):
    with pytest.raises(ValueError, match=message):
        train.parse_args(argv)


def test_missing_model_path_and_unknown_choices(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train.parse_args(["--model", str(tmp_path / "nowhere")])
    for flag, value in (("--rule", "min_variance"), ("--preset", "z"), ("--dataset", "imagenet")):
        with pytest.raises(SystemExit):
            train.parse_args([flag, value])
        assert "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ one step

def step_args(**overrides):
    args = train.parse_args(["--model", models.SMOLLM2_ALIAS, "-n", "4", "-m", "2", "--max-completion-tokens", "6",
                             "--micro-batch-size", "3", "--learning-rate", "0.05"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


EXAMPLES = [{"text": "What is 2 + 3?", "prompt": [], "answer": "5"},
            {"text": "Add 10 and 7, then say hi:", "prompt": [], "answer": "17"}]


@pytest.fixture
def lora_model(tiny_model):
    torch.manual_seed(0)
    return models.prepare_for_training(tiny_model, lora_rank=4, lora_alpha=8)


@pytest.fixture(autouse=True)
def varied_rewards_one_thread(monkeypatch):
    monkeypatch.setattr(rewards, "compute_rewards", fake_compute_rewards)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield  # runs set --num-threads 1: far faster on a shared 2-core machine, and the same in subprocesses
    torch.set_num_threads(threads)


@pytest.mark.parametrize("rule", ["max_variance", "random", "percentile", "max_reward", "none"])
def test_every_rule_runs_one_step(rule, lora_model, smollm2_tokenizer):
    args = step_args(rule=rule, update_size=4 if rule == "none" else 2)
    optimizer = train.make_optimizer(lora_model, args)
    metrics = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES], args, step=1)
    assert metrics["update_rows"] == 2 * args.update_size
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/char_sum/mean", "completions/mean_length",
                "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "loss", "grad_norm", "learning_rate",
                "generate_s", "reward_s", "select_s", "update_s"):
        assert math.isfinite(metrics[key]), key
    assert metrics["grad_norm"] > 0  # varied rewards -> non-zero advantages -> a gradient reached LoRA


def test_micro_batches_give_the_full_batch_gradient(lora_model, smollm2_tokenizer):
    frozen = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.0)
    grads = []
    for micro in (8, 3, 1):
        train.train_step(lora_model, smollm2_tokenizer, frozen, [EXAMPLES], step_args(update_size=4, rule="none",
                                                                                       micro_batch_size=micro), step=1)
        grads.append(torch.cat([p.grad.flatten() for p in lora_model.parameters() if p.requires_grad]))
    assert grads[0].abs().max() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-7)


def test_mu_above_one_uses_old_logprobs_and_kl_uses_adapter_off(lora_model, smollm2_tokenizer):
    args = step_args(updates_per_batch=3, kl_coef=0.05)
    optimizer = train.make_optimizer(lora_model, args)
    lora_b = [p.detach().clone() for name, p in lora_model.named_parameters() if "lora_B" in name]
    metrics = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES], args, step=1)
    # Update 1 has pi = pi_old = pi_ref (LoRA B starts at 0); updates 2-3 moved away from both.
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6) and metrics["kl"] > 0
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "clip_ratio/region_mean"))
    after = [p for name, p in lora_model.named_parameters() if "lora_B" in name]
    assert any(not torch.equal(b, a) for b, a in zip(lora_b, after))


def test_grad_accum_rounds_use_every_round(lora_model, smollm2_tokenizer):
    args = step_args(grad_accum_steps=2)
    optimizer = train.make_optimizer(lora_model, args)
    metrics = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES, EXAMPLES[:1]], args, step=1)
    assert metrics["update_rows"] == 3 * args.update_size


# --------------------------------------------------------------------------------------- whole runs

def test_run_writes_metrics_config_and_loadable_adapter(tiny_dir, tmp_path):
    from peft import PeftModel

    run_dir = train.main(tiny_argv(tiny_dir, tmp_path / "run"))
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
        train.main(tiny_argv(tiny_dir, run_dir))


WRAPPER = """
import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
import rewards, train
from test_train import fake_compute_rewards
rewards.compute_rewards = fake_compute_rewards
original_step = train.train_step
def slow_step(*args, **kwargs):  # gives the test time to kill the run between steps
    out = original_step(*args, **kwargs)
    time.sleep({pause})
    return out
train.train_step = slow_step
train.main(sys.argv[1:])
"""


def test_sigkill_then_resume_matches_uninterrupted_run(tiny_dir, tmp_path):
    script = tmp_path / "run_train.py"
    script.write_text(WRAPPER.format(root=str(ROOT), tests=str(ROOT / "tests"), pause=0.5))
    argv = ["--max-steps", "3"]
    killed_dir, full_dir = tmp_path / "killed", tmp_path / "full"
    env = dict(os.environ, PYTHONHASHSEED="0")
    killed = subprocess.Popen([sys.executable, str(script), *tiny_argv(tiny_dir, killed_dir, *argv)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and killed.poll() is None:
        metrics = killed_dir / "metrics.jsonl"
        if metrics.exists() and '"step": 2, "elapsed_s"' in metrics.read_text():
            break
        time.sleep(0.02)
    assert killed.poll() is None, killed.stderr.read().decode()[-2000:]
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    # Uninterrupted reference, and the resumed run, in this process (same code path as the subprocess).
    train.main(tiny_argv(tiny_dir, full_dir, *argv))
    train.main(["--output-dir", str(killed_dir), "--resume", "--no-progress"])

    def comparable(run_dir):
        return [{k: v for k, v in line.items() if k not in TIMING}
                for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]

    resumed, full = comparable(killed_dir), comparable(full_dir)
    assert [line["step"] for line in resumed if line["type"] == "train"] == [1, 2, 3]
    assert resumed == full
    from safetensors.torch import load_file

    final = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = load_file(killed_dir / final), load_file(full_dir / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
