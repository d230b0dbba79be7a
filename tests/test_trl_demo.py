"""integrations/trl_demo.py: train.py's flags mapped onto TRL (the demo preset and its baseline) or refused in one
line before anything loads (the refusals come from train.py's parser: a new flag is refused until mapped), --help
listing only what it honours, the rewards seeing --reward-options and the token ids, --max-time-s stopping training,
a quiet start, and (slow) whole tiny runs writing train.py's metrics lines that compare.py reads."""

import json
import os
import subprocess
import sys
import types
import warnings

import pytest

import loss_options

pytest.importorskip("integrations.trl_pods", exc_type=ImportError)

import compare  # noqa: E402
from run import config, loop  # noqa: E402
import rewards  # noqa: E402
import torch  # noqa: E402
from integrations import trl_demo  # noqa: E402
from run_helpers import ROOT, read_lines  # noqa: E402


def tiny_demo_argv(model_dir, out_dir, *extra):
    """A 2-step PODS 4/2 run of the tiny model through TRL: 2 prompts a step, 2 micro-batches of 2 kept rows."""
    return ["--model", str(model_dir), "--dataset", "arithmetic", "--num-train-rows", "64", "--num-rollouts", "4",
            "--update-size", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8", "--max-steps", "2",
            "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2", "--micro-batch-size", "2",
            "--eval-samples", "2", "--eval-interval", "2", "--num-threads", "1", "--output-dir", str(out_dir), *extra]


@pytest.fixture
def nothing_loads(monkeypatch):
    """The loop's load stops the test: a refusal must come before any model or data is loaded."""
    def load(*args, **kwargs):
        raise AssertionError("run.loop.load was reached: the flag was not refused")
    monkeypatch.setattr(loop, "load", load)


@pytest.mark.parametrize("flags, n, m, rule, rows", [([], 16, 4, "max_variance", 64),
                                                     (["--baseline"], 4, 4, "none", 16)])
def test_the_demo_preset_maps_onto_one_trl_generation_per_step(tmp_path, flags, n, m, rule, rows):
    args = trl_demo.parse_args(flags + ["--output-dir", str(tmp_path / "run")])
    trl_args = trl_demo.trl_config(args, tmp_path)
    assert (trl_args.num_generations, trl_args.num_generations_kept, trl_args.downsampling_rule) == (n, m, rule)
    assert trl_args.per_device_train_batch_size == rows and trl_args.steps_per_generation == 1  # 4 prompts a step
    assert (trl_args.loss_type, trl_args.scale_rewards, trl_args.beta, trl_args.top_k) == ("grpo", "group", 0.0, 0)
    assert (trl_args.temperature, trl_args.max_completion_length, trl_args.epsilon) == (1.0, 32, 0.2)
    assert args.device == "cpu" and args.checkpoint_interval_s < 0 and args.log_completions_interval == 0
    assert trl_args.max_steps == 16  # the demo's budget: 16 steps, as in train.py


@pytest.mark.parametrize("flags", [["--importance-sampling-level", "sequence"], ["--clip-eps-high", "0.28"],
                                   ["--policy-loss", "cispo", "--loss-aggregation", "token", "--clip-eps", "1"]])
@pytest.mark.usefixtures("nothing_loads")
def test_the_loss_options_that_act_on_the_ratio_alone_are_refused(tiny_model_dir, tmp_path, flags):
    """The demo runs one update per rollout batch, where pi / pi_old is exactly 1: GSPO's sequence level, CISPO and the
    clip bounds cannot act there, so they are refused rather than accepted with advice (--mu) the demo refuses too."""
    with pytest.raises(ValueError, match="is not mapped onto TRL by this demo: it acts on the ratio pi / pi_old alone, "
                                         "which is exactly 1 with the one update per rollout batch this demo runs"):
        trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run", *flags))


def test_the_trl_settings_raise_no_deprecation_warning(tmp_path):
    args = trl_demo.parse_args(["--output-dir", str(tmp_path / "run"), "--gradient-checkpointing"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl_args = trl_demo.trl_config(args, tmp_path)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert trl_args.gradient_checkpointing is True


@pytest.mark.parametrize("flags, message", [
    (["--dynamic-sampling"], "--dynamic-sampling is not mapped onto TRL"),
    (["--importance-sampling-correction", "tis"], "--importance-sampling-correction is not mapped onto TRL"),
    (["--resume"], "--resume is not mapped onto TRL by this demo: it writes no checkpoints"),
    (["--grad-accum-steps", "2"], "--grad-accum-steps is not mapped"),
    (["--kl-coef", "0.04"], "--kl-coef is not mapped"),
    (["--mu", "2"], "--updates-per-batch is not mapped"),
    (["--progress"], "--progress is not mapped"),
    (["--backend", "engine"], "--backend engine is not mapped onto TRL by this demo"),
    (["--checkpoint-interval-s", "60"], "--checkpoint-interval-s 60.0 is not mapped onto TRL by this demo"),
    (["--micro-batch-size", "3"], "multiple of --micro-batch-size"),
    (["--prompts-per-step", "3", "--num-rollouts", "5", "--micro-batch-size", "3"], "15 rows a step generates"),
    (["--rollout-batch-size", "4"], "--rollout-batch-size 4 is less than"),
])
@pytest.mark.usefixtures("nothing_loads")
def test_flags_it_cannot_map_are_refused_before_anything_loads(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run", *flags))
    assert not (tmp_path / "run").exists()  # refused before anything is written


def example_argv(action):
    """The flag of a train.py argparse action with a value it accepts."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    accepted = {int: 1, float: 1.5, loss_options.fraction: 0.5}
    return [flag, str(action.choices[-1] if action.choices else accepted.get(action.type, "x"))]


@pytest.mark.usefixtures("nothing_loads")
def test_every_train_py_flag_is_mapped_or_refused(tiny_model_dir, tmp_path):
    honoured = set(trl_demo.MAPPED) | set(trl_demo.LIMITED)
    refused = []
    for action in config.build_parser()._actions:
        if action.dest == "help" or action.dest in honoured:
            continue
        with pytest.raises(ValueError, match=f"^{action.option_strings[0]} is not mapped onto TRL"):
            trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run", *example_argv(action)))
        refused.append(action.dest)
    assert {"dynamic_sampling", "importance_sampling_correction", "resume", "kl_coef"} <= set(refused)
    assert "bf16" in trl_demo.MAPPED  # train.py's precision (test_the_demo_computes_in_train_pys_precision)
    mapped_flags = [option for action in trl_demo.demo_parser()._actions for option in action.option_strings]
    for action in config.build_parser()._actions:  # argparse's prefix matching must not turn one into the other
        if action.dest in refused:
            assert not [flag for flag in mapped_flags for option in action.option_strings if flag.startswith(option)]


@pytest.mark.usefixtures("nothing_loads")
def test_a_new_train_py_flag_is_refused_until_mapped(monkeypatch, tiny_model_dir, tmp_path):
    build = config.build_parser

    def with_a_new_flag():
        parser = build()
        parser.add_argument("--new-idea", type=int, default=0)
        return parser

    monkeypatch.setattr(config, "build_parser", with_a_new_flag)
    with pytest.raises(ValueError, match="^--new-idea is not mapped onto TRL"):
        trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run", "--new-idea", "3"))


@pytest.mark.usefixtures("nothing_loads")
def test_a_preset_value_it_cannot_map_is_refused(monkeypatch, tiny_model_dir, tmp_path):
    monkeypatch.setitem(config.PRESETS, "demo", dict(config.PRESETS["demo"], drop_zero_variance=True))
    with pytest.raises(ValueError, match="--preset demo sets --drop-zero-variance True, which is not mapped"):
        trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run"))


def test_help_lists_only_what_it_honours(capsys):
    with pytest.raises(SystemExit) as exit_:
        trl_demo.main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and text.startswith("usage: python -m integrations.trl_demo")
    for flag in ("--num-rollouts", "--max-time-s", "--reward-options", "--micro-batch-size", "--backend"):
        assert flag in text
    for flag in ("--dynamic-sampling", "--importance-sampling-correction", "--resume", "--kl-coef", "--mu",
                 "--grad-accum-steps", "--print-config", "--keep-checkpoints", "--progress", "--dist-timeout-s"):
        assert flag not in text


def test_the_rewards_get_the_reward_options_and_the_completion_token_ids(monkeypatch, tmp_path):
    args = trl_demo.parse_args(["--output-dir", str(tmp_path / "run")])
    args.reward_options = {"accuracy": {"timeout_s": 3.0}}  # no registered term has options yet: set as parsed
    seen = {}

    def compute_rewards(prompts, completions, answers, **kwargs):
        seen.update(kwargs)
        return rewards.RewardResult(total=__import__("torch").zeros(len(completions)), per_func={})

    monkeypatch.setattr(rewards, "compute_rewards", compute_rewards)
    values = trl_demo.reward_function(args)(prompts=["p"], completions=["<answer>3</answer>"], answer=["3"],
                                            messages=[[{"role": "user", "content": "1+2"}]],
                                            completion_ids=[[7, 8, 2]], trainer_state=None)
    assert values == [0.0] and seen["options"] == {"accuracy": {"timeout_s": 3.0, "answer_kind": "number"}}
    assert seen["completion_ids"] == [[7, 8, 2]] and seen["weights"] == args.reward_weights


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_max_time_s_stops_training_before_a_step_that_would_pass_it(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trl_demo.time, "perf_counter", clock)
    trainer = types.SimpleNamespace(phase_s=dict.fromkeys(("generate_s", "reward_s", "select_s"), 0.0))
    args = types.SimpleNamespace(max_time_s=10.0, eval_interval=0)
    timer, state, _ = trl_demo.step_logger(trainer, args, None, [], lambda line: None)
    stops = []
    for step in (1, 2, 3):
        control = types.SimpleNamespace(should_training_stop=False)
        timer.on_step_begin(None, types.SimpleNamespace(global_step=step - 1), control)
        clock.now += 4.0  # each step takes 4 s: after two (8 s), a third would end at 12 s > 10 s
        timer.on_step_end(None, types.SimpleNamespace(global_step=step), control)
        stops.append(control.should_training_stop)
        if control.should_training_stop:
            break
    assert stops == [False, True] and state.step == 2 and state.elapsed_s == 8.0
    args.max_time_s = 0.0  # no time limit
    control = types.SimpleNamespace(should_training_stop=False)
    timer.on_step_begin(None, None, control)
    clock.now += 100.0
    timer.on_step_end(None, types.SimpleNamespace(global_step=3), control)
    assert not control.should_training_stop


@pytest.mark.slow  # ~20 s on 2 shared cores (TRL's first step imports and compiles kernels)
@pytest.mark.usefixtures("varied_rewards")
def test_a_tiny_run_writes_train_py_metrics_lines(tiny_model_dir, tmp_path):
    run_dir = trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run"))
    steps, evals = read_lines(run_dir, "train"), read_lines(run_dir, "eval")
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    for line in steps:
        assert line["generate_s"] > 0 and line["update_s"] > 0 and line["step_s"] >= line["generate_s"]
        assert 0 <= line["pods/frac_zero_variance_groups"] <= 1 and "pods/kept_reward_mean" in line
    assert steps[1]["elapsed_s"] > steps[0]["elapsed_s"] == pytest.approx(steps[0]["step_s"])
    run = compare.read_run(run_dir)
    assert run.label == "TRL PODS max_variance 4/2" and len(run.eval_times_s) == 2
    assert len(run.step_durations_s) == 2 and set(run.phase_means_s) == {"generate_s", "update_s"}


@pytest.mark.slow  # ~20 s: a subprocess importing TRL, one step of the tiny model
def test_the_command_starts_quietly_and_stops_at_max_time_s(tiny_model_dir, tmp_path):
    argv = tiny_demo_argv(tiny_model_dir, tmp_path / "run", "--max-steps", "3", "--max-time-s", "0.001",
                          "--eval-samples", "0")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    done = subprocess.run([sys.executable, "-m", "integrations.trl_demo", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no bitsandbytes kernel line, no transformers FutureWarning
    lines = done.stdout.splitlines()
    assert lines[0].startswith("TRL PODS max_variance 4/2: ") and "0.001 s of training" in lines[0]
    assert [line["step"] for line in read_lines(tmp_path / "run", "train")] == [1]  # the budget ends after one step
    assert any(line.startswith("done: 1 steps") for line in lines)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["checkpoint_interval_s"] < 0


@pytest.mark.usefixtures("nothing_loads")
def test_a_folder_holding_a_run_is_refused_without_advice_to_resume(tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    with pytest.raises(ValueError, match="already holds a run, which this demo cannot continue") as error:
        trl_demo.main(tiny_demo_argv(tiny_model_dir, tmp_path / "run"))
    assert "--resume" not in str(error.value)


def test_eval_interval_s_evaluates_on_the_training_clock_as_train_py(monkeypatch):
    """--eval-interval-s S: an evaluation after each step that crosses a multiple of S training seconds
    (loop.evaluation_due), whatever the step count."""
    clock, evaluated = FakeClock(), []
    monkeypatch.setattr(trl_demo.time, "perf_counter", clock)
    monkeypatch.setattr(loop, "evaluate_heldout", lambda model, tok, eval_set, args, state, *rest:
                        evaluated.append((state.step, state.elapsed_s)))
    trainer = types.SimpleNamespace(phase_s=dict.fromkeys(("generate_s", "reward_s", "select_s"), 0.0), model=None)
    args = types.SimpleNamespace(max_time_s=0.0, eval_interval=0, eval_interval_s=5.0)
    timer, state, _ = trl_demo.step_logger(trainer, args, None, ["a held-out prompt"], lambda line: None)
    for step in range(1, 7):   # 4 s a step: 4, 8, 12, 16, 20, 24 s
        control = types.SimpleNamespace(should_training_stop=False)
        timer.on_step_begin(None, types.SimpleNamespace(global_step=step - 1), control)
        clock.now += 4.0
        timer.on_step_end(None, types.SimpleNamespace(global_step=step), control)
        trainer.after_log({"reward": 0.0})
    assert evaluated == [(2, 8.0), (3, 12.0), (4, 16.0), (5, 20.0)]


@pytest.mark.usefixtures("nothing_loads")
@pytest.mark.parametrize("lora_rank, autocast", [(4, False), (0, True)])
def test_the_demo_computes_in_train_pys_precision(monkeypatch, tiny_model_dir, tmp_path, lora_rank, autocast):
    """The demo preset computes in bf16 where the CPU has bf16 instructions (--bf16 auto), through TRL as in train.py:
    the loader gives the weights train.py's dtype (LoRA: bf16 base weights) and TRL autocasts where train.py does (full
    fine-tuning: float32 weights, bf16 autocast)."""
    monkeypatch.setattr(trl_demo.config.policy, "native_bf16", lambda device: True)
    argv = tiny_demo_argv(tiny_model_dir, tmp_path / "run", "--lora-rank", str(lora_rank))
    args, like_train_py = trl_demo.parse_args(argv), config.parse_args(argv)
    assert args.bf16 is like_train_py.bf16 is True
    assert trl_demo.trl_config(args, tmp_path).bf16 is autocast
    assert (torch.bfloat16 if lora_rank else torch.float32, torch.bfloat16 if autocast else None) == \
        __import__("models").compute_dtypes(args.bf16, args.lora_rank)  # what the loop's load and train.py's update use


def test_help_and_the_refusals_come_before_torch_loads():
    """--help, a mistyped flag, a flag it cannot map and a combination it cannot run are answered in one line before
    torch, transformers or TRL load (they took seconds each when the demo imported them first)."""
    code = ("import json, runpy, sys; sys.argv = ['trl_demo'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('integrations.trl_demo', run_name='__main__')\n"
            "finally:\n    print(json.dumps(sorted(m for m in ('torch', 'transformers', 'peft', 'trl', 'datasets') "
            "if m in sys.modules)))")
    for argv, status, said in ((["--help"], 0, "usage: python -m integrations.trl_demo"),
                               (["--max-stepz", "3"], 2, "trl_demo: error: unrecognized arguments: --max-stepz 3"),
                               (["--dynamic-sampling"], 1, "trl_demo: error: --dynamic-sampling is not mapped"),
                               (["--prompts-per-step", "2"], 1, "must be a multiple of --micro-batch-size"),
                               (["--update-size", "32"], 1, "--update-size m = 32 must be <= --num-rollouts n = 16")):
        done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == status and said in done.stdout + done.stderr, (argv, done.stderr)
        assert json.loads(done.stdout.strip().splitlines()[-1]) == [], argv
        assert status == 0 or len(done.stderr.strip().splitlines()) == 1


def test_your_own_file_and_reward_function_reach_trls_reward_as_train_pys(tmp_path, smollm2_tokenizer):
    """The worked example (tests/example: a JSONL file of one's own fields and template, a reward file) through the TRL
    demo: TRL's dataset carries the file's own columns, and the demo's reward function of a batch equals train.py's
    scoring of the same completions (rewards.score_rollouts), the function of one's own included."""
    import data
    import sampling
    from test_own_data import WORKED

    args = trl_demo.parse_args([*WORKED, "--output-dir", str(tmp_path / "run")])
    examples = data.build_prompt_set(args.dataset, "train", smollm2_tokenizer, num_rows=2,
                                     source=config.data_source(args))
    completions = ["<think>\n4 x 7\n</think>\n<answer>\n28 pens\n</answer>", "28", "I do not know", "96 pens"]
    ids = [[5, 6, 7], [8], [9, 10], [11, 12]]
    rollouts = sampling.Rollouts(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                                 torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0], [11, 12, 0]]),
                                 torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]), completions,
                                 torch.tensor([3, 1, 2, 2]), torch.zeros(4, dtype=torch.bool),
                                 torch.tensor([0, 0, 1, 1]))
    trained = rewards.score_rollouts(rollouts, examples, config.reward_settings(args))
    rows = [examples[i] for i in (0, 0, 1, 1)]
    columns = {key: [e.columns[key] for e in rows] for key in rows[0].columns if key not in ("answer",)}
    assert "unit" in columns  # the file's own column, as TRL's dataset row carries it
    through_trl = trl_demo.reward_function(args)([e.text for e in rows], completions, [e.answer for e in rows],
                                                 [e.prompt for e in rows], completion_ids=ids, **columns)
    assert through_trl == pytest.approx(trained.total.tolist())
    assert "says_the_unit" in trained.per_func and not torch.isnan(trained.per_func["says_the_unit"]).all()


@pytest.mark.usefixtures("nothing_loads")
def test_a_paper_preset_keeps_its_bf16_through_trl(tiny_model_dir, tmp_path):
    """--preset a sets --bf16 (LoRA: bf16 base weights): the demo runs it so, as train.py would, where it once ran
    such a preset in float32 without a word."""
    argv = ["--preset", "a", "--model", str(tiny_model_dir), "--dataset", "arithmetic", "--eval-samples", "0",
            "--output-dir", str(tmp_path / "run")]
    with pytest.warns(UserWarning, match="--bf16 on a CPU without bf16 instructions"):
        args, like_train_py = trl_demo.parse_args(argv), config.parse_args(argv)
    assert args.bf16 is like_train_py.bf16 is True and args.lora_rank == 64
    assert trl_demo.trl_config(args, tmp_path).bf16 is False  # LoRA: no autocast, as in train.py
