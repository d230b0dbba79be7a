"""integrations/trl_demo.py: train.py's flags mapped onto TRL (the demo preset and its baseline), flags it cannot map
refused in one line, and (slow) a whole tiny run (PODS 4/2, two micro-batches a step) writing train.py's metrics
lines that compare.py reads."""

import pytest

pytest.importorskip("integrations.trl_pods", exc_type=ImportError)

import compare  # noqa: E402
import config  # noqa: E402
from integrations import trl_demo  # noqa: E402
from run_helpers import read_lines, tiny_argv  # noqa: E402


@pytest.mark.parametrize("flags, n, m, rule, rows", [([], 16, 4, "max_variance", 64),
                                                     (["--baseline"], 4, 4, "none", 16)])
def test_the_demo_preset_maps_onto_one_trl_generation_per_step(tmp_path, flags, n, m, rule, rows):
    args = config.parse_args(flags + ["--output-dir", str(tmp_path / "run")])
    trl_args = trl_demo.trl_config(args, tmp_path)
    assert (trl_args.num_generations, trl_args.num_generations_kept, trl_args.downsampling_rule) == (n, m, rule)
    assert trl_args.per_device_train_batch_size == rows and trl_args.steps_per_generation == 1  # 4 prompts a step
    assert (trl_args.loss_type, trl_args.scale_rewards, trl_args.beta, trl_args.top_k) == ("grpo", "group", 0.0, 0)
    assert (trl_args.temperature, trl_args.max_completion_length, trl_args.epsilon) == (1.0, 32, 0.2)


@pytest.mark.parametrize("flags, message", [
    (["--grad-accum-steps", "2"], "--grad-accum-steps 2 is not mapped"),
    (["--kl-coef", "0.04"], "--kl-coef 0.04 is not mapped"),
    (["--micro-batch-size", "3"], "multiple of --micro-batch-size"),
])
def test_flags_it_cannot_map_are_refused(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        trl_demo.run(config.parse_args(flags + ["--output-dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()  # refused before anything is written or loaded


@pytest.mark.slow  # ~20 s on 2 shared cores (TRL's first step imports and compiles kernels)
@pytest.mark.usefixtures("varied_rewards")
def test_a_tiny_run_writes_train_py_metrics_lines(tiny_model_dir, tmp_path):
    run_dir = trl_demo.main(tiny_argv(tiny_model_dir, tmp_path / "run"))
    steps, evals = read_lines(run_dir, "train"), read_lines(run_dir, "eval")
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    for line in steps:
        assert line["generate_s"] > 0 and line["update_s"] > 0 and line["step_s"] >= line["generate_s"]
        assert 0 <= line["pods/frac_zero_variance_groups"] <= 1 and "pods/kept_reward_mean" in line
    assert steps[1]["elapsed_s"] > steps[0]["elapsed_s"] == pytest.approx(steps[0]["step_s"])
    run = compare.read_run(run_dir)
    assert run.label == "TRL PODS max_variance 4/2" and len(run.eval_times_s) == 2
    assert len(run.step_durations_s) == 2 and set(run.phase_means_s) == {"generate_s", "update_s"}
