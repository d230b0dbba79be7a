"""train.py's loop under torchrun (multigpu.run on 2 CPU ranks, dist_train_worker.py): 2 ranks log and train what
1 process does (full-parameter and LoRA, the completions log too), a killed run restarted by the launcher resumes
exactly, a SIGTERM on one rank stops both after the same step, a rank's exception ends the run naming it; the
launch checks, the entry points, and the engine over FSDP-gathered weights."""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from run import completions
from run import config
import policy
import models
from engine import prefix
import rewards
import train
from multigpu import distributed, run, sharded_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_train_worker  # noqa: E402
import dist_worker  # noqa: E402
from run_helpers import ROOT, TIMING, every_third_constant, fake_compute_rewards  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TRAIN_WORKER = Path(__file__).resolve().parent / "dist_train_worker.py"


def launch(worker, out, *args, timeout_s=180):
    """Run a launcher script; (its return code, its stdout + stderr, the time it ended)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    with open(out / "launcher.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, str(worker), str(out), *map(str, args)], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield launcher
            launcher.wait(timeout=timeout_s)
        finally:
            if launcher.poll() is None:  # timed out or interrupted: the launcher and its ranks
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()


# train.py's whole loop on 2 processes (one fixture of ~35 s on 2 cores): opt in with `pytest -m slow`; the
# two-process step itself (tests/test_multigpu.py) stays in the default suite.
SLOW_TWO_PROCESS_RUNS = pytest.mark.slow


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory, smollm2_tokenizer):
    """train.py on 2 ranks (dist_train_worker.py) and, meanwhile in this process, the "full" and "lora" runs on
    one: {"two", "one": their folders, "output", "returncode", "stop_s"}."""
    out = tmp_path_factory.mktemp("dist_train")
    model_dir, two, one = out / "tiny", out / "two", out / "one"
    models.tiny_random_model("llama").save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    two.mkdir()
    runner = launch(TRAIN_WORKER, two, model_dir)
    launcher = next(runner)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rewards, "compute_rewards", fake_compute_rewards)
        # The update runs the prefix every prompt shares once (per micro-batch and per optimizer step) and takes
        # the LM head's product itself (policy.fused_head) only in one process (prefix.several_processes): equal
        # up to float rounding, and in this tiny model a last-bit difference can flip a sampled token a step later.
        # The reference computes as the processes do.
        patch.setattr(prefix, "several_processes", lambda: True)
        patch.setattr(policy, "fused_head", lambda model: None)
        for name in ("full", "lora"):
            train.main(dist_train_worker.run_argv(model_dir, one, name))
        patch.setattr(rewards, "compute_rewards", every_third_constant)
        train.main(dist_train_worker.run_argv(model_dir, one, "dynamic"))
    next(runner, None)
    ended_at = time.time()
    output = (two / "launcher.log").read_text()
    assert (two / "raised_at.txt").is_file(), output[-6000:]
    return dict(two=two, one=one, output=output, returncode=launcher.returncode,
                stop_s=ended_at - float((two / "raised_at.txt").read_text()))


def ratios_rounded(logged):
    """A completions log (step, rows) with each pi / pi_sampler to 4 places: equal up to rounding across 1 and 2
    processes."""
    step, rows = logged
    return step, [{**row, **({"sampler_ratio": round(row["sampler_ratio"], 4)} if row.get("sampler_ratio") else {})}
                  for row in rows]


def metric_lines(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir, step):
    """The run's weights at `step` as a plain model (LoRA merged), whichever process count wrote them."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    if (path / "dcp").is_dir():
        return sharded_checkpoint.load_merged_model(path).state_dict()
    config = json.loads((path / "config.json").read_text())
    model = models.load_policy(config["model"], dtype=torch.float32, lora_rank=config["lora_rank"],
                               lora_alpha=config["lora_alpha"])
    train.checkpoint.load_checkpoint(path, model, train.update.make_optimizer(model, 1e-3))
    return (model.merge_and_unload() if hasattr(model, "merge_and_unload") else model).state_dict()


@SLOW_TWO_PROCESS_RUNS
@pytest.mark.parametrize("name, steps", [("full", 2), ("lora", 3)])
def test_train_py_on_two_processes_logs_and_trains_what_one_process_does(train_runs, name, steps):
    two, one = metric_lines(train_runs["two"] / name), metric_lines(train_runs["one"] / name)
    assert [(line["type"], line["step"]) for line in two] == [(line["type"], line["step"]) for line in one]
    assert [line["step"] for line in two if line["type"] == "train"] == list(range(1, steps + 1))
    for line_two, line_one in zip(two, one):
        assert line_two.keys() == line_one.keys()
        for key, value in line_one.items():  # the same rollouts, rewards and selection; the loss up to rounding
            assert line_two[key] == (pytest.approx(value, rel=1e-4, abs=1e-6) if isinstance(value, float) else value)
    assert any(line["type"] == "eval" and line["eval/num_samples"] == 2 for line in two)
    step_two, rows_two = completions.read_completions(train_runs["two"] / name)  # rank 0 logs every rank's rollouts
    step_one, rows_one = completions.read_completions(train_runs["one"] / name)
    ratios_two, ratios_one = ([row.pop("sampler_ratio", None) for row in rows] for rows in (rows_two, rows_one))
    assert (step_two, rows_two) == (step_one, rows_one) and len(rows_two) == 2 + 2 * 4
    assert [None if r is None else round(r, 4) for r in ratios_two] == \
        [None if r is None else round(r, 4) for r in ratios_one]   # pi / pi_sampler up to rounding
    assert all(line["grad_norm"] > 0 for line in two if line["type"] == "train")  # a real update, every step
    for rank in (0, 1):  # the update ran each distinct prompt once on every rank (--prefix-sharing on, FSDP)
        assert int((train_runs["two"] / f"prefix_calls_{name}_rank{rank}.txt").read_text()) >= steps
    weights_two, weights_one = final_weights(train_runs["two"] / name, steps), final_weights(train_runs["one"] / name,
                                                                                           steps)
    initial = models.tiny_random_model("llama").state_dict()
    moved = max(float((weights_one[k] - initial[k]).abs().max()) for k in weights_one)
    assert moved > 1e-4  # training changed the weights the comparison covers
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=1e-4, atol=1e-6, msg=key)


@SLOW_TWO_PROCESS_RUNS
def test_dynamic_sampling_on_two_processes_refills_and_trains_what_one_process_does(train_runs):
    """--dynamic-sampling with one prompt per rank: each rank refills the groups it lacks (sometimes one rank alone),
    every rank agrees on the rounds, and the metrics, the completions log of every step (filtered groups marked) and
    the weights equal the one-process run's."""
    two, one = metric_lines(train_runs["two"] / "dynamic"), metric_lines(train_runs["one"] / "dynamic")
    assert [(line["type"], line["step"]) for line in two] == [(line["type"], line["step"]) for line in one]
    for line_two, line_one in zip(two, one):
        assert line_two.keys() == line_one.keys()
        for key, value in line_one.items():
            assert line_two[key] == (pytest.approx(value, rel=1e-4, abs=1e-6) if isinstance(value, float) else value)
    steps = [line for line in one if line["type"] == "train"]
    assert any(line["dynamic_sampling/generation_rounds"] > 1 for line in steps)  # refills happened
    assert all(line["dynamic_sampling/groups_missing"] == 0 and line["update_rows"] == 2 * 2 for line in steps)
    prompts_per_step = []
    for step in range(1, 4):
        logged = ratios_rounded(completions.read_completions(train_runs["two"] / "dynamic", step))
        assert logged == ratios_rounded(completions.read_completions(train_runs["one"] / "dynamic", step))
        prompts_per_step.append(sum(row["type"] == "prompt" for row in logged[1]))
    assert any(count % 2 for count in prompts_per_step)  # a refill that one rank alone needed (the other: no prompt)
    weights_two, weights_one = (final_weights(train_runs[count] / "dynamic", 3) for count in ("two", "one"))
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=1e-4, atol=1e-6, msg=key)


@SLOW_TWO_PROCESS_RUNS
def test_a_step_gathers_the_weights_once_however_many_rounds_it_generates(train_runs):
    """On 2 gloo ranks, a step's generation rounds (--dynamic-sampling refills: up to several a step) issue one
    all-gather per FSDP unit in all, when the step gathers the weights for its rounds, not one per round."""
    for rank in (0, 1):
        for name in ("lora", "dynamic"):
            steps = json.loads((train_runs["two"] / f"gathers_{name}_rank{rank}.json").read_text())
            assert steps and all(step["rounds_all_gathers"] == step["fsdp_units"] > 1 for step in steps), steps
        assert any(step["generation_rounds"] > 1 for step in steps)   # "dynamic": refills happened on this rank


@SLOW_TWO_PROCESS_RUNS
def test_a_killed_train_py_run_resumes_exactly(train_runs):
    two, output = train_runs["two"], train_runs["output"]
    assert re.search(r"exitcode: -9\) local_rank: 1", output)  # rank 1 died of SIGKILL in step 3
    assert "resumed" in output and "step_000002" in output  # attempt 1 continued from the step-2 checkpoint
    assert metric_lines(two / "killed") == metric_lines(two / "lora")  # bit for bit, timings aside
    killed, full = final_weights(two / "killed", 3), final_weights(two / "lora", 3)
    assert all(torch.equal(killed[k], full[k]) for k in full)
    assert sorted(p.name for p in (two / "killed" / "checkpoints").glob("step_*")) == [
        "step_000001", "step_000002", "step_000003"]
    assert not list((two / "killed" / "checkpoints").glob(".tmp_*"))


@SLOW_TWO_PROCESS_RUNS
def test_a_sigterm_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(train_runs):
    two, output = train_runs["two"], train_runs["output"]
    assert "stopped by SIGTERM after step 2" in output  # rank 0 says so: it learned of rank 1's signal
    assert [(line["type"], line["step"]) for line in metric_lines(two / "preempted")] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert metric_lines(two / "preempted") == metric_lines(two / "lora")[:4]  # the same steps, then the stop
    assert (two / "preempted" / "checkpoints" / "latest.txt").read_text().strip() == "step_000002"


@SLOW_TWO_PROCESS_RUNS
def test_an_exception_on_a_train_py_rank_ends_the_run_naming_it(train_runs):
    output = train_runs["output"]
    assert train_runs["returncode"] != 0
    assert "[rank 1] failed: RuntimeError: boom on purpose" in output
    root_cause = output[output.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1\b", root_cause) and "boom on purpose" in root_cause
    assert train_runs["stop_s"] < 30  # rank 0, waiting in a collective (timeout 60 s), was stopped


@pytest.mark.parametrize("argv, changed, message", [
    (["--prompts-per-step", "3"], {}, "cannot be split evenly over 2 processes"),
    (["--prompts-per-step", "2", "--drop-zero-variance"], {}, "several processes"),
    (["--prompts-per-step", "2", "--scale-rewards", "batch"], {}, "several processes"),
    (["--prompts-per-step", "2"], {"optimizer": "adamw8bit"}, "FSDP2"),  # (on CPU config.py refuses it earlier)
    (["--prompts-per-step", "2", "--eval-samples", "1"], {}, "fewer than the 2 processes"),
])
def test_torchrun_launches_are_checked_before_loading(argv, changed, message):
    args = config.parse_args(argv)
    vars(args).update(changed)
    with pytest.raises(ValueError, match=message):
        run.check_args(args, world_size=2)
    run.check_args(config.parse_args(["--prompts-per-step", "2"]), world_size=2)


def test_a_bad_flag_under_torchrun_is_one_line_on_every_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:  # run_main prints the message and exits 1, no traceback
        run.main(["--prompts-per-step", "3"])
    assert str(exited.value.code).startswith("python -m multigpu: error: --prompts-per-step 3 cannot be split")


def test_train_py_under_torchrun_points_to_the_multigpu_entry_and_the_entry_needs_torchrun(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "train.py"], cwd=ROOT, env=dict(env, RANK="0", WORLD_SIZE="2"),
                            capture_output=True, text=True, timeout=120)  # exits before importing torch: ~0.3 s
    assert result.returncode != 0 and "-m multigpu" in result.stderr and "Traceback" not in result.stderr
    # `python -m multigpu --preset e` outside torchrun, run in this process (a new one would import torch again): it
    # ends in SystemExit with its one line, not in an exception's traceback.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["multigpu", "--preset", "e"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("multigpu", run_name="__main__", alter_sys=True)
    assert str(stop.value.code).startswith("python -m multigpu: error: training runs under torchrun")


def test_the_decode_engine_decodes_fsdp_weights_eagerly_and_as_the_plain_model_does():
    """Sharded over a 1-process gloo group: FSDP is detected (on CUDA no graph would be recorded over weights
    FSDP re-allocates), and the engine's rollouts inside full_weights_for_generation equal the plain model's."""
    import torch.distributed as dist

    import engine
    import sampling

    plain = models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB)
    batch = dist_worker.global_batch(0, completion_len=1)
    prompt = (batch["input_ids"][:4, :-1], batch["attention_mask"][:4, :-1])
    sample = dict(n=2, eos_ids=[2], pad_id=2, seed=7, settings=sampling.GenerationSettings(
        max_new_tokens=5, temperature=1.0, rollout_batch_size=4, backend="engine"))
    expected = sampling.sample_completions(plain, *prompt, **sample)
    assert not engine.fsdp_sharded(plain)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = distributed.shard_model(models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB),
                                          distributed.DistContext(enabled=True), mixed_precision=False)
        assert engine.fsdp_sharded(sharded)
        with distributed.full_weights_for_generation(sharded):
            assert engine.engine_for(sharded).capture is False  # auto: FSDP-sharded
            actual = sampling.sample_completions(sharded, *prompt, **sample)
    finally:
        dist.destroy_process_group()
    for got, want in zip(actual[:4], expected[:4]):   # ids, mask, truncated, sampler log-probs
        assert torch.equal(got, want)
