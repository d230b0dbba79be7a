"""config.py: presets, --baseline, precedence (flags > resumed config > baseline > preset), reward weights parsed
once, every bad flag, path or combination failing in parse_args, before anything loads, and every selection flag
arriving through train.train_step at the update (against pods.select called directly with the flag's value)."""

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from run import config
import data
import models
import pods
import policy
import rewards
import sampling
import train
import update
from loss_options import LossSettings
from run.presets import PRESETS


@pytest.mark.filterwarnings("ignore:--bf16 on CPU")
def test_presets_baseline_and_overrides():
    a = config.parse_args(["--preset", "a"])
    assert (a.model, a.dataset, a.num_rollouts, a.update_size, a.rule) == (
        "Qwen/Qwen2.5-3B-Instruct", "gsm8k", 64, 16, "max_variance")
    assert (a.learning_rate, a.kl_coef, a.lora_rank, a.lora_alpha, a.weight_decay, a.max_grad_norm) == (
        5e-6, 0.0, 64, 64, 0.1, 1.0)
    assert a.max_prompt_tokens + a.max_completion_tokens == 1024 and a.bf16 and a.gradient_checkpointing
    base = config.parse_args(["--preset", "a", "--baseline"])
    assert (base.num_rollouts, base.update_size, base.rule) == (16, 16, "none")
    assert config.method_label(base) == "GRPO 16/16" and config.method_label(a) == "PODS max_variance 64/16"
    paper_baselines = {p: config.parse_args(["--preset", p, "--baseline"]) for p in "bcd"}
    assert {p: (x.num_rollouts, x.update_size) for p, x in paper_baselines.items()} == {
        "b": (8, 8), "c": (16, 16), "d": (16, 16)}
    b = config.parse_args(["--preset", "b", "--baseline", "--learning-rate", "1e-6", "-n", "16", "-m", "16"])
    assert (b.kl_coef, b.learning_rate, b.num_rollouts, b.rule) == (0.04, 1e-6, 16, "none")  # explicit flags win
    demo = config.parse_args([])
    assert demo.preset == "demo" and demo.model == models.SMOLLM2_ALIAS and demo.dataset == "arithmetic"
    assert demo.update_size < demo.num_rollouts  # a budget in steps (the same learning on every CPU), greedy eval
    assert (demo.max_steps, demo.max_time_s, demo.eval_interval, demo.eval_temperature) == (16, 0, 8, 0)


NOT_BATCH_SCOPE = next(name for name, rule in pods.RULES.items() if not rule.batch_scope and name != "none")


@pytest.mark.parametrize("argv, message", [
    (["-n", "4", "-m", "8"], "must be <= --num-rollouts"),
    (["--rule", "none", "-n", "8", "-m", "4"], "needs m == n"),
    (["--lora-rank", "0", "--kl-coef", "0.1"], "incompatible flags"),
    (["--load-in-4bit", "--device", "cpu"], "incompatible flags"),
    (["--optimizer", "adamw8bit", "--device", "cpu"], "adamw8bit"),
    (["--reward-weights", "accuracy=1,bogus=2"], "unknown reward function"),
    (["--reward-weights", "accuracy=1,format=x,tag_count=1"], "not a number"),
    (["--resume"], "--output-dir"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--eval-samples", "-1"], "--eval-samples must be >= 0"),
    (["--top-p", "1.5"], "top-p"),
    (["--num-train-rows", "0"], "--num-train-rows"),
    (["--selection-scope", "batch", "--rule", NOT_BATCH_SCOPE],
     f"--selection-scope batch .* needs --rule {' or '.join(pods.batch_scope_rules())}"),
    (["--clip-eps-high", "0"], "--clip-eps-high 0.0 must be >= --clip-eps 0.2"),
    (["--clip-eps-high", "0.1"], "must be >= --clip-eps 0.2"),
])
def test_bad_flags_fail_before_loading(argv, message):
    with pytest.raises(ValueError, match=message):
        config.parse_args(argv)


def test_every_float_flag_must_be_finite_before_anything_loads():
    """NaN passes `x < 0` and `x > 0` checks alike: every float flag of the parser is refused non-finite (none gives
    infinity a meaning), so nothing non-finite reaches a run or config.json; --max-time-s 0 is documented."""
    floats = [action for action in config.build_parser()._actions if action.type is float]
    assert {"--temperature", "--kl-coef", "--checkpoint-interval-s", "--max-time-s", "--learning-rate"} <= {
        action.option_strings[0] for action in floats}
    for action in floats:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ValueError, match=f"{action.option_strings[0]} must be a finite number"):
                config.parse_args([f"{action.option_strings[0]}={value}"])
    with pytest.raises(ValueError, match="weight of 'format' is not a number"):
        config.parse_args(["--reward-weights", "accuracy=1,format=nan,tag_count=1"])
    assert "0 = no time limit" in next(action.help for action in floats if action.dest == "max_time_s")


def test_missing_model_path_and_unknown_choices(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        config.parse_args(["--model", str(tmp_path / "nowhere")])
    unknown_rule = "not_" + "_or_".join(pods.RULES)  # derived from the registry: never a registered rule
    for flag, value in (("--rule", unknown_rule), ("--preset", "z")):
        with pytest.raises(SystemExit):
            config.parse_args([flag, value])
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dataset 'imagenet': not a registered dataset"):  # nor a file or Hub id
        config.parse_args(["--dataset", "imagenet"])


def test_reward_weights_are_parsed_once_into_a_dict():
    args = config.parse_args(["--reward-weights", "accuracy=2,format=0,tag_count=0.5"])
    assert args.reward_weights == dict(rewards.DEFAULT_REWARD_WEIGHTS, accuracy=2.0, format=0.0, tag_count=0.5)
    assert config.parse_reward_weights(args.reward_weights) == args.reward_weights  # a config.json dict is accepted
    assert config.parse_args([]).reward_weights == rewards.DEFAULT_REWARD_WEIGHTS  # every registered term's default
    paper = {name: rewards.DEFAULT_REWARD_WEIGHTS[name] for name in ("accuracy", "format", "tag_count")}
    assert paper == {"accuracy": 1.0, "format": 1.0, "tag_count": 1.0}
    # Only the weights that change are named; the others keep their defaults (the registry's).
    assert config.parse_args(["--reward-weights", "format=0.1"]).reward_weights == dict(
        rewards.DEFAULT_REWARD_WEIGHTS, format=0.1)


@pytest.mark.parametrize("name", [name for name in config.LABEL_FLAGS if name != "reward_options"])  # that one:
def test_every_label_flag_that_differs_from_the_preset_is_in_the_label(name):  # test_rewards_registry (needs a term)
    """Each entry of config.LABEL_FLAGS, given a value other than the demo preset's, adds its words to the label
    (a new entry needs a value in `changed`)."""
    paper = config.preset_defaults("demo")
    changed = {"loss_aggregation": "token", "scale_rewards": "none", "selection_scope": "batch", "clip_eps_high": 0.28,
               "mask_truncated": True, "drop_zero_variance": True, "advantage_normalization": "group",
               "clip_eps": 0.3, "kl_coef": 0.05, "dynamic_sampling": True,
               "reward_weights": dict(paper["reward_weights"], format=0.1), "reward_function": ["mine.py:mine=0.5"]}
    args = argparse.Namespace(**dict(paper, **{name: changed[name]}))
    words = config.LABEL_FLAGS[name](changed[name], args)
    assert words and config.method_label(args) == f"PODS max_variance 16/4 + {words}"


def test_a_ratio_only_loss_option_with_mu_1_warns_in_one_line():
    with pytest.warns(UserWarning, match=r"--clip-eps-high 0.28 cannot act with --updates-per-batch 1") as caught:
        config.parse_args(["--clip-eps-high", "0.28"])
    assert "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.parse_args(["--clip-eps-high", "0.28", "--mu", "2"])  # the ratio differs from 1: no warning


@pytest.mark.filterwarnings("ignore:--bf16 on CPU")
def test_data_is_checked_before_any_model_loads(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was touched before the data check")

    monkeypatch.setattr(models, "check_model_source", no_model)
    with pytest.raises(FileNotFoundError, match="--data-dir .*nonexistent is not a folder"):
        config.parse_args(["--preset", "a", "--data-dir", str(tmp_path / "nonexistent")])
    with pytest.raises((ValueError, FileNotFoundError), match="gsm8k"):
        config.parse_args(["--preset", "a", "--data-dir", str(tmp_path)])  # a folder without the files


def test_run_folder_is_checked_up_front(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"type": "train"}\n')
    with pytest.raises(ValueError, match="already holds a run"):
        config.parse_args(["--output-dir", str(tmp_path)])
    (tmp_path / "config.json").write_text(json.dumps({"learning_rate": 0.1}))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        config.parse_args(["--output-dir", str(tmp_path), "--resume"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match="no CUDA device"):
        config.parse_args(["--device", "cuda"])


def test_update_settings_follow_the_flags():
    args = config.parse_args(["--mu", "3", "--clip-eps", "0.3", "--micro-batch-size", "5", "--temperature", "0.7",
                              "--max-grad-norm", "0"])
    settings = config.update_settings(args)
    assert settings == update.UpdateSettings(micro_batch_size=5, temperature=0.7, updates_per_batch=3,
                                             max_grad_norm=0.0, autocast_dtype=None,
                                             loss=LossSettings(clip_eps=0.3, kl_coef=0.0, max_completion_tokens=32))


def test_variant_flags_reach_the_update_settings_and_the_label():
    paper = config.parse_args([])
    assert (paper.loss_aggregation, paper.scale_rewards, paper.selection_scope, paper.clip_eps_high) == (
        "sequence", "group", "prompt", None) and not paper.mask_truncated and not paper.drop_zero_variance
    args = config.parse_args(["--loss-aggregation", "fixed", "--clip-eps-high", "0.28", "--mask-truncated",
                              "--scale-rewards", "none", "--selection-scope", "batch", "--drop-zero-variance"])
    settings = config.update_settings(args)
    loss = settings.loss
    assert (loss.aggregation, loss.clip_eps_high, loss.mask_truncated) == ("fixed", 0.28, True)
    assert settings.loss.max_completion_tokens == args.max_completion_tokens == 32
    assert config.method_label(args) == ("PODS max_variance 16/4 + fixed loss, none std, batch scope, clip-high 0.28, "
                                         "truncated masked, zero-variance dropped")
    same_clip = config.parse_args(["--clip-eps-high", "0.2"])  # = --clip-eps: the paper's objective, same label
    assert config.method_label(same_clip) == config.method_label(paper) == "PODS max_variance 16/4"


def test_dynamic_sampling_flags_default_off_and_name_the_method():
    paper = config.parse_args([])
    assert (paper.dynamic_sampling, paper.dynamic_sampling_metric, paper.max_generation_rounds) == (False, "total", 10)
    args = config.parse_args(["--dynamic-sampling", "--dynamic-sampling-metric", "accuracy",
                              "--max-generation-rounds", "3"])
    assert (args.dynamic_sampling, args.dynamic_sampling_metric, args.max_generation_rounds) == (True, "accuracy", 3)
    assert config.method_label(args) == "PODS max_variance 16/4 + dynamic sampling (accuracy)"
    with pytest.raises(ValueError, match="--max-generation-rounds must be >= 1, got 0"):
        config.parse_args(["--dynamic-sampling", "--max-generation-rounds", "0"])


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_report_to_without_its_package_fails_before_loading(sink, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == sink else real_find_spec(name, *args))
    with pytest.raises(ValueError, match=f"--report-to {sink} needs the '{sink}' package"):
        config.parse_args(["--report-to", sink])


@pytest.mark.filterwarnings("ignore:--bf16 on CPU")
def test_multi_gpu_presets_e_f_and_their_grpo_ga_baselines_follow_the_paper_table():
    for preset, model, lr in (("e", "Qwen/Qwen2.5-3B-Instruct", 2e-5), ("f", "Qwen/Qwen2.5-7B-Instruct", 1.5e-5)):
        pods_run = config.parse_args(["--preset", preset])
        assert (pods_run.model, pods_run.dataset, pods_run.lora_rank, pods_run.learning_rate) == (model, "gsm8k", 0, lr)
        assert (pods_run.weight_decay, pods_run.max_grad_norm, pods_run.kl_coef) == (0.1, 1.0, 0.0)
        assert pods_run.bf16 and pods_run.gradient_checkpointing and pods_run.rule == "max_variance"
        assert pods_run.max_prompt_tokens + pods_run.max_completion_tokens == 2048
        assert (pods_run.grad_accum_steps, pods_run.num_rollouts, pods_run.update_size) == (4, 128, 32)
        ga = config.parse_args(["--preset", preset, "--baseline"])
        assert (ga.grad_accum_steps, ga.num_rollouts, ga.update_size, ga.rule) == (16, 32, 32, "none")
        # the same effective n per prompt slot: 4 x 128 = 16 x 32 = 512; m: 4 x 32 = 128 vs 512
        assert pods_run.grad_accum_steps * pods_run.num_rollouts == ga.grad_accum_steps * ga.num_rollouts == 512
        assert pods_run.grad_accum_steps * pods_run.update_size == 128
        assert config.method_label(ga) == "GRPO-GA 32/32" and pods_run.prompts_per_step == ga.prompts_per_step == 8
    assert config.parse_args(["--preset", "a", "--baseline"]).grad_accum_steps == 1  # (a)-(d): n = m only


def test_the_collective_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--dist-timeout-s must be > 0"):
        config.parse_args(["--dist-timeout-s", "0"])


def test_is_clip_without_a_correction_warns_in_one_line_and_stays_out_of_the_label():
    """--is-clip acts only with --importance-sampling-correction: alone it warns and the label is the plain run's,
    so compare.py does not split two identical runs; with a correction it is in the label."""
    with pytest.warns(UserWarning, match=r"--is-clip 1.5 does nothing with --importance-sampling-correction none") \
            as caught:
        alone = config.parse_args(["--is-clip", "1.5"])
    assert "\n" not in str(caught[0].message)
    assert config.method_label(alone) == config.method_label(config.parse_args([]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acting = config.parse_args(["--is-clip", "1.5", "--importance-sampling-correction", "tis"])
    assert "is-clip 1.5" in config.method_label(acting)


def test_is_clip_help_states_the_defaults_of_trl_and_verl():
    """TRL 1.16's vllm_importance_sampling_clip_max is 3 (with the sequence_mask mode by default); verl's
    rollout_is_threshold is 2: the help must not call 2 TRL's default."""
    trl_config = pytest.importorskip("trl.trainer.grpo_config")
    fields = {f.name: f for f in dataclasses.fields(trl_config.GRPOConfig)}
    assert fields["vllm_importance_sampling_clip_max"].default == 3.0
    assert fields["vllm_importance_sampling_mode"].default == "sequence_mask"
    help_text = next(action.help for action in config.build_parser()._actions if action.dest == "is_clip")
    assert "TRL's default is 3" in help_text and "verl" in help_text and "TRL's and verl's default: 2" not in help_text


@pytest.mark.parametrize("mode", ["tis", "token_mask", "token_reject"])
def test_each_importance_sampling_mode_is_a_choice_of_the_flag(mode):
    args = config.parse_args(["--importance-sampling-correction", mode])
    assert config.loss_settings(args).importance_sampling_correction == mode


def test_a_resume_of_a_run_with_the_removed_mask_mode_is_refused_naming_the_new_modes(tmp_path, capsys):
    """Older runs' config.json may say `mask` (weight 1 below C: neither TRL's nor verl's); continuing it under
    another rule would change what it trains, so the resume is refused naming token_mask and token_reject; the flag
    itself no longer offers it."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"x")
    saved = vars(config.parse_args(["--importance-sampling-correction", "tis"]))
    (run / "config.json").write_text(json.dumps(dict(saved, importance_sampling_correction="mask")))
    with pytest.raises(ValueError, match=r"--importance-sampling-correction 'mask' .*token_mask.*token_reject"):
        config.parse_args(["--output-dir", str(run), "--resume"])
    with pytest.raises(SystemExit):
        config.parse_args(["--importance-sampling-correction", "mask"])
    assert "invalid choice: 'mask'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--dynamic-sampling", "-n", "1", "-m", "1"], "--dynamic-sampling with --num-rollouts 1: a group of one"),
    (["--dynamic-sampling", "--reward-weights", "accuracy=0,format=0,tag_count=0"], "no group can have a spread"),
    (["--dynamic-sampling", "--max-generation-rounds", "1000000"], "--max-generation-rounds must be <= 100"),
])
def test_dynamic_sampling_that_cannot_find_a_spread_is_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        config.parse_args(argv)
    # the accuracy metric does not read the weights: its groups can still have a spread
    config.parse_args(["--dynamic-sampling", "--dynamic-sampling-metric", "accuracy", "--reward-weights",
                       "accuracy=0,format=0,tag_count=0"])


@pytest.mark.parametrize("flag", ["--lr", "--learning-rate", "--temperature", "--clip-eps", "--is-clip", "--top-p",
                                  "--max-time-s", "--weight-decay", "--kl-coef", "--dist-timeout-s"])
@pytest.mark.parametrize("value", ["-1e-3", "-2", "-0.5", "-1E+2"])
def test_a_negative_number_is_a_value_so_the_range_check_speaks(flag, value, capsys):
    """argparse took `-1e-3` for a flag ("expected one argument"): every numeric flag now gets the value, and its
    own check names what is wrong."""
    name = "--learning-rate" if flag == "--lr" else flag
    with pytest.raises(ValueError, match=f"{name} must be .*got {float(value):g}"):
        config.parse_args([flag, value])
    assert "expected one argument" not in capsys.readouterr().err


def test_a_negative_count_is_a_value_too():
    for flag in ("--max-steps", "--eval-samples", "--num-threads", "-n"):
        with pytest.raises(ValueError, match="must be"):
            config.parse_args([flag, "-3"])
    with pytest.raises(ValueError, match="must be a finite number"):
        config.parse_args(["--lr", "-inf"])


def test_a_restarted_run_resumes_from_its_latest_checkpoint(tmp_path):
    from run import checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"x")
    (run / "checkpoints" / "latest.txt").write_text("step_000002\n")
    (run / "config.json").write_text(json.dumps({"learning_rate": 0.25}))
    (run / "metrics.jsonl").write_text('{"type": "train"}\n')
    assert checkpoint.latest_checkpoint(run) is not None
    with pytest.raises(ValueError, match="already holds a run"):  # the first attempt: no silent resume
        config.parse_args(["--output-dir", str(run)])
    args = config.parse_args(["--output-dir", str(run)], restarted=True)  # e.g. by torchrun --max-restarts
    assert args.resume and args.learning_rate == 0.25  # the saved config, as with --resume
    early = tmp_path / "killed_before_its_first_checkpoint"
    early.mkdir()
    (early / "metrics.jsonl").write_text('{"type": "eval"}\n')
    assert not config.parse_args(["--output-dir", str(early)], restarted=True).resume  # starts over, no error


def test_a_resumed_run_keeps_its_preset_and_refuses_another(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"x")
    (run / "checkpoints" / "latest.txt").write_text("step_000001\n")
    saved = vars(config.parse_args(["--preset", "demo", "--baseline", "--learning-rate", "0.125"]))
    weights = "accuracy=1,format=1,tag_count=1"
    (run / "config.json").write_text(json.dumps(dict(saved, preset="c", reward_weights=weights)))
    args = config.parse_args(["--output-dir", str(run), "--resume"])
    assert args.preset == "c" and args.learning_rate == 0.125 and args.num_rollouts == 4  # all from config.json
    with pytest.raises(ValueError, match=r"would change what it is: --preset 'c' -> 'demo'"):
        config.parse_args(["--output-dir", str(run), "--resume", "--preset", "demo"])  # the demo's settings would stay


@pytest.mark.parametrize("flags", [["-n", "8", "-m", "8"], ["-m", "2"], ["--rule", "random"], ["--baseline"],
                                   ["--preset", "a"], ["--dataset", "gsm8k"], ["--loss-aggregation", "token"],
                                   ["--seed", "1"], ["--dynamic-sampling"], ["--importance-sampling-correction", "tis"],
                                   ["--reward-weights", "format=0.5"]])
def test_a_resume_refuses_to_change_what_the_run_is_and_records_an_optimizer_change(tmp_path, flags):
    """Method, n/m, rule, preset, dataset, loss variant, prompt filtering, reward weights, seed: refused with the flag
    named (compare.py would credit the earlier steps to the new method); a new learning rate and a new budget are
    allowed and recorded; an interval changes silently."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"x")
    (run / "config.json").write_text(json.dumps(vars(config.parse_args([]))))  # a demo run: PODS 16/4
    with pytest.raises(ValueError, match="would change what it is: --.*(num-rollouts|update-size|rule|baseline|"
                                         "preset|dataset|loss-aggregation|seed|dynamic-sampling|"
                                         "importance-sampling-correction|reward-weights)"):
        config.parse_args(["--output-dir", str(run), "--resume", *flags])
    args = config.parse_args(["--output-dir", str(run), "--resume", "--lr", "1e-4", "--max-steps", "9",
                              "--eval-interval", "3"])
    assert args.changes == [{"step": None, "learning_rate": [3e-4, 1e-4], "max_steps": [16, 9]}]
    assert (args.max_steps, args.eval_interval) == (9, 3)


def a_checkpointed_run(tmp_path, saved):
    """A run folder with config.json `saved` and a checkpoint (parse_args checks only that trainer_state.pt exists)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"x")
    (run / "config.json").write_text(json.dumps(saved))
    return ["--output-dir", str(run), "--resume"]


def test_a_flag_the_runs_config_lacks_had_its_default_and_a_resume_changes_it_as_any_other(tmp_path):
    """A run started before an option existed has no key for it: it ran with the option's default, so a new value is
    refused (an identity flag) or recorded (an optimizer flag), never taken as the run's own."""
    older = {key: value for key, value in vars(config.parse_args([])).items()
             if key not in ("importance_sampling_correction", "is_clip", "max_grad_norm", "bf16", "reward_terms")}
    resume = a_checkpointed_run(tmp_path, older)
    with pytest.raises(ValueError, match=r"would change what it is: --importance-sampling-correction 'none' -> 'tis'"):
        config.parse_args(resume + ["--importance-sampling-correction", "tis"])
    args = config.parse_args(resume + ["--max-grad-norm", "0.5"])
    assert args.changes == [{"step": None, "max_grad_norm": [1.0, 0.5]}]
    assert config.parse_args(resume).changes == []  # nothing given: the defaults it ran with
    baseline = vars(config.parse_args(["--preset", "e", "--baseline"]))  # GRPO-GA: 16 rollout batches per step
    resume = a_checkpointed_run(tmp_path / "ga", {k: v for k, v in baseline.items() if k != "grad_accum_steps"})
    assert config.parse_args(resume).grad_accum_steps == 16  # the baseline's, not the preset's 4
    with pytest.raises(ValueError, match=r"would change what it is: --grad-accum-steps 16 -> 4"):
        config.parse_args(resume + ["--grad-accum-steps", "4"])


def test_precision_flags_on_resume_are_refused_or_recorded(tmp_path, monkeypatch):
    """--load-in-4bit quantises the base the adapter was trained on: refused. --bf16 changes the numerics (a run moved
    to other hardware may need it): recorded."""
    started = vars(config.parse_args([]))
    resume = a_checkpointed_run(tmp_path, started)
    flip = "--no-bf16" if started["bf16"] else "--bf16"
    assert config.parse_args(resume + [flip]).changes == [{"step": None, "bf16": [started["bf16"],
                                                                                  not started["bf16"]]}]
    assert config.parse_args(resume).changes == []   # the run's recorded precision, whatever this device has
    monkeypatch.setattr(config, "_check_device_flags", lambda args: None)  # --load-in-4bit needs CUDA otherwise
    with pytest.raises(ValueError, match=r"would change what it is: --load-in-4bit False -> True"):
        config.parse_args(resume + ["--load-in-4bit"])


def test_a_reward_term_registered_after_the_run_started_does_not_join_it(tmp_path, monkeypatch):
    """config.json records every term's resolved weight and options: a term registered since is refused unless
    weighted 0, and so is a recorded option whose default changed; a run older than that record is checked by the
    terms of its resolved weights."""
    started = vars(config.parse_args([]))
    assert started["reward_terms"] == {name: {"weight": term.weight, "options": dict(term.options)}
                                       for name, term in rewards.REWARD_TERMS.items()}
    resume = a_checkpointed_run(tmp_path, started)
    term = rewards.RewardTerm("length_bonus", lambda completions, **kwargs: [0.0] * len(completions), 1.0,
                              {"scale": 1.0}, "added later")
    monkeypatch.setitem(rewards.REWARD_TERMS, "length_bonus", term)
    monkeypatch.setitem(rewards.REWARD_FUNCS, "length_bonus", term.func)
    monkeypatch.setitem(rewards.DEFAULT_REWARD_WEIGHTS, "length_bonus", 1.0)
    for saved in (started, {key: value for key, value in started.items() if key != "reward_terms"}):
        (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
        with pytest.raises(ValueError, match=r"reward terms \['length_bonus'\] did not exist when the run .* "
                                             r"started; continue it without them \(--reward-weights length_bonus=0\)"):
            config.parse_args(resume)
        args = config.parse_args(resume + ["--reward-weights", "length_bonus=0"])
        assert args.changes == [] and args.reward_weights["length_bonus"] == 0
        with pytest.raises(ValueError, match=r"reward terms \['length_bonus'\] did not exist"):
            config.parse_args(resume + ["--reward-weights", "length_bonus=0.5"])
        with pytest.raises(ValueError, match=r"would change what it is: --reward-weights"):
            config.parse_args(resume + ["--reward-weights", "length_bonus=0,format=0.5"])
    recorded = dict(started["reward_terms"], length_bonus={"weight": 0.0, "options": {"scale": 2.0}})
    (tmp_path / "run" / "config.json").write_text(json.dumps(dict(started, reward_terms=recorded)))
    with pytest.raises(ValueError, match=r"length_bonus.scale 2.0 -> 1.0\); continue it with --reward-options "
                                         r"length_bonus.scale=2.0"):
        config.parse_args(resume + ["--reward-weights", "length_bonus=0"])


# ------------------------------------------- every selection flag arrives: command line -> train_step -> the update

SELECT_BASE = ["--model", models.SMOLLM2_ALIAS, "--device", "cpu", "--lora-rank", "4", "-n", "4", "-m", "2",
               "--max-completion-tokens", "4", "--micro-batch-size", "8", "--learning-rate", "0.01", "--seed", "3"]
SELECT_EXAMPLES = [data.Example(text="What is 2 + 3?", prompt=[], answer="5"),
                   data.Example(text="Add 10 and 7, then say hi:", prompt=[], answer="17"),
                   data.Example(text="Say nothing.", prompt=[], answer="0")]
SELECT_STEP = 2


def text_rewards(prompts, completions, answers, **kwargs):
    """A deterministic reward of the completion text that varies between texts (a random model's rollouts would all
    score 0 under the real rewards); every rollout of the prompt whose answer is "0" gets 0.5: zero variance."""
    values = torch.tensor([0.5 if answer == "0" else float(sum(map(ord, text)) % 101) / 100
                           for text, answer in zip(completions, answers)])
    return rewards.RewardResult(total=values, per_func={"char_sum": values})


def expected_selection(rollouts, args, round_index=0):
    """(kept rows as an UpdateBatch, prompts dropped) of one rollout batch by pods.select called directly with the
    flags' values, the rewards recomputed from the texts, and train.py's seed for the random rule (one process:
    first chunk 0)."""
    num_prompts = rollouts.prompt_ids.shape[0]
    answers = [SELECT_EXAMPLES[i].answer for i in rollouts.prompt_index.tolist()]
    reward_matrix = text_rewards(None, rollouts.texts, answers).total.view(num_prompts, -1)
    seed = sampling.derived_seed(args.seed, SELECT_STEP, round_index)
    kept, advantages, dropped = pods.select(
        reward_matrix, args.update_size, args.rule, normalize=args.advantage_normalization,
        scale_rewards=args.scale_rewards, scope=args.selection_scope, drop_zero_variance=args.drop_zero_variance,
        generator=torch.Generator().manual_seed(train.selection_seed(seed, 0)))
    return update.kept_batch(rollouts, kept, advantages), dropped


def same_rows(one, other):
    return one.completion_ids.shape == other.completion_ids.shape and \
        torch.equal(one.completion_ids, other.completion_ids) and torch.equal(one.prompt_ids, other.prompt_ids)


SELECT_FLAG_CASES = [  # (flags, the flags whose selection they must change (power); None: the paper's defaults)
    ([], None),
    *[(["--rule", rule, *(["-m", "4"] if rule == "none" else [])], []) for rule in pods.RULES  # every other rule
      if rule != PRESETS["demo"]["rule"]],
    *[(["--rule", rule, "--seed", "4"], ["--rule", rule]) for rule in pods.RULES if pods.RULES[rule].random],
    (["-m", "3"], []),
    (["-n", "6", "-m", "3"], ["-n", "6"]),
    (["--advantage-normalization", "group"], []),
    (["--scale-rewards", "batch"], []),
    (["--scale-rewards", "none"], []),
    (["--selection-scope", "batch"], []),
    (["--selection-scope", "batch", "--advantage-normalization", "group", "--scale-rewards", "none"],
     ["--selection-scope", "batch"]),
    (["--drop-zero-variance"], []),
    (["--drop-zero-variance", "--rule", "random", "--scale-rewards", "batch"],
     ["--rule", "random", "--scale-rewards", "batch"]),  # a random rule's draw with a dropped prompt
]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("argv, baseline", SELECT_FLAG_CASES,
                         ids=[" ".join(case[0]) or "paper" for case in SELECT_FLAG_CASES])
def test_every_selection_flag_arrives_at_the_update(argv, baseline, tiny_model, smollm2_tokenizer, monkeypatch):
    """Each selection-phase flag (rule, -n/-m, --advantage-normalization, --scale-rewards, --selection-scope,
    --drop-zero-variance, --seed for the random rule), parsed from the command line, reaches train.train_step's
    selection: the rollouts generated, the rows and advantages update.update_policy receives and the dropped count
    are those of pods.select called directly with the flags' values on the same rewards. The flag matters here: the
    same call with the compared flags (the defaults) keeps other rows or gives other advantages, so a flag that
    train.py drops or mixes up fails."""
    seen = {"rollouts": [], "batches": []}
    real_generate, real_update = sampling.generate_rollouts, update.update_policy

    def spy_generate(*args, **kwargs):
        seen["rollouts"].append(real_generate(*args, **kwargs))
        return seen["rollouts"][-1]

    def spy_update(model, optimizer, batches, settings, **kwargs):
        seen["batches"] = batches
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(sampling, "generate_rollouts", spy_generate)
    monkeypatch.setattr(update, "update_policy", spy_update)
    monkeypatch.setattr(rewards, "compute_rewards", text_rewards)
    args = config.parse_args([*SELECT_BASE, *argv])
    model = models.prepare_for_training(tiny_model, lora_rank=4, lora_alpha=8)
    optimizer = update.make_optimizer(model, args.learning_rate)
    metrics, _ = train.train_step(model, smollm2_tokenizer, optimizer, [SELECT_EXAMPLES],
                                  train.step_settings(args), SELECT_STEP)
    [rollouts], [batch] = seen["rollouts"], seen["batches"]
    assert rollouts.completion_ids.shape[0] == len(SELECT_EXAMPLES) * args.num_rollouts
    expected, dropped = expected_selection(rollouts, args)
    assert same_rows(batch, expected), f"kept rows differ from pods.select's for {argv}"
    torch.testing.assert_close(batch.advantages, expected.advantages)
    assert metrics["num_zero_variance_dropped"] == dropped and metrics["update_rows"] == len(expected.advantages)
    if baseline is not None:
        other, _ = expected_selection(rollouts, config.parse_args([*SELECT_BASE, *baseline]))
        assert not same_rows(expected, other) or not torch.allclose(expected.advantages, other.advantages), \
            f"{argv} selects the same as {baseline} on these rewards: the test has no power"


def test_print_config_shows_the_preset_resolved_values_before_any_check(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # a data folder that does not exist: nothing is checked yet
        config.parse_args(["--preset", "b", "--baseline", "--data-dir", str(tmp_path / "none"), "--print-config"])
    shown = json.loads(capsys.readouterr().out)
    assert exit_info.value.code == 0 and "print_config" not in shown
    assert (shown["kl_coef"], shown["weight_decay"], shown["num_rollouts"], shown["rule"]) == (0.04, 0.1, 8, "none")
    with pytest.raises(SystemExit):
        config.parse_args(["--print-config"])
    assert json.loads(capsys.readouterr().out)["weight_decay"] == 0.0  # the demo's: no weight decay
    assert not hasattr(config.parse_args([]), "print_config")  # a run's config.json holds no such flag


@pytest.mark.parametrize("argv", [[], ["--eval-interval", "3", "--reward-weights", "format=0.1"],
                                  ["--baseline", "--log-completions-interval", "0", "--lr", "1e-3"]])
def test_print_config_prints_the_values_the_run_uses(argv, capsys):
    """--print-config prints every value as the run resolves it (config.json: vars of config.parse_args): the reward
    weights as the dict of every term's weight, the completions interval as a number, not "" and null."""
    with pytest.raises(SystemExit) as stopped:
        config.parse_args([*argv, "--print-config"])
    assert stopped.value.code in (0, None)
    printed = json.loads(capsys.readouterr().out)
    resolved = config.parse_args(argv)
    run_config = dict(vars(resolved), label=config.method_label(resolved), output_dir=printed["output_dir"])
    assert printed == {key: value for key, value in json.loads(json.dumps(run_config)).items() if key != "changes"}
    assert printed["output_dir"].startswith(f"runs/{resolved.preset}-") and printed["label"]  # what config.json holds
    assert set(printed["reward_weights"]) == set(rewards.REWARD_TERMS)
    assert isinstance(printed["log_completions_interval"], int)


def test_a_resume_may_switch_prefix_sharing_which_does_not_change_what_is_trained(tmp_path):
    """--prefix-sharing changes how the update computes the same loss (prefix.py, exact), not what the run is: a
    resume may switch it, silently (no "changes" record), and it reaches the update settings."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"x")
    (run / "config.json").write_text(json.dumps(vars(config.parse_args([]))))   # saved with the default: on
    assert "prefix_sharing" not in config.RUN_IDENTITY + config.RECORDED_AT_RESUME
    args = config.parse_args(["--output-dir", str(run), "--resume", "--prefix-sharing", "off"])
    assert args.changes == [] and args.prefix_sharing == "off" and not config.update_settings(args).prefix_sharing
    assert not config.generation_settings(args).prefix_sharing  # generation and evaluation follow the flag too
    assert config.update_settings(config.parse_args([])).prefix_sharing
    assert config.generation_settings(config.parse_args([])).prefix_sharing


@pytest.mark.parametrize("native", [True, False])
def test_the_demo_computes_in_bf16_where_the_device_has_bf16_arithmetic(monkeypatch, native):
    """The demo preset's --bf16 auto: on where policy.native_bf16 says the device computes bf16 natively (the CPU's
    AVX-512 BF16 or AMX), else off; resolved before anything records it; a flag given wins; the paper's presets
    keep their own value."""
    monkeypatch.setattr(policy, "native_bf16", lambda device: native)
    assert config.parse_args([]).bf16 is native
    assert config.parse_args(["--no-bf16"]).bf16 is False and config.parse_args(["--bf16"]).bf16 is True
    assert config.parse_args(["--preset", "a", "--device", "cpu"]).bf16 is True


def test_no_command_takes_a_flag_by_a_prefix_of_its_name(capsys):
    """`--num-rollout 4` is a typo, not --num-rollouts: every parser of the commands refuses abbreviations (argparse's
    allow_abbrev), so a mistyped flag never starts a run; each parser in the sources says so (a new one too)."""
    import ast

    import compare
    import eval as eval_module
    import study

    for command, argv in ((config.parse_args, ["--num-rollout", "4"]), (eval_module.parse_args, ["--checkpoin", "x"]),
                          (compare.main, ["x", "--budget", "3"]), (study.main, ["pods", "--seed", "0", "--dry-run"])):
        with pytest.raises(SystemExit) as refused:
            command(argv)
        assert refused.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    root = Path(__file__).resolve().parents[1]
    sources = [path for path in root.rglob("*.py") if not {"tests", ".git"} & set(path.relative_to(root).parts)]
    parsers = [(path.name, node) for path in sources for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser"]
    assert len(parsers) >= 15 and config.OneLineParser(prog="x").allow_abbrev is False
    assert [name for name, call in parsers if not any(keyword.arg == "allow_abbrev" and keyword.value.value is False
                                                      for keyword in call.keywords)] == []


def test_a_top_entropy_quantile_of_0_is_refused_not_read_as_the_top_token(capsys):
    """--top-entropy-quantile 0 reads as "no token", but the mask at 0 keeps each micro-batch's highest-entropy token(s)
    (TRL's too): refused in one line, as an out-of-range value is."""
    for value, message in (("0", "0 would train on the highest-entropy token(s) alone"), ("1.5", "must be in [0, 1]")):
        with pytest.raises(SystemExit) as refused:
            config.parse_args(["--top-entropy-quantile", value])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert config.parse_args(["--top-entropy-quantile", "0.2"]).top_entropy_quantile == 0.2
