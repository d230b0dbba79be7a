"""study.py: the rule study / n/m study and loss-variant study plans, and the runner (train.py replaced by a fake
script; one slow test runs the variant study with the real train.py and a tiny model)."""

import pytest

from studies import pods_study
import study
from studies import studyrun

FAKE_TRAIN = r'''
import argparse, json, pathlib, sys
parser = argparse.ArgumentParser()
for flag in ("--preset", "--output-dir", "--max-time-s", "--rule", "--num-rollouts", "--update-size", "--seed",
             "--loss-aggregation", "--clip-eps-high", "--updates-per-batch"):
    parser.add_argument(flag)
parser.add_argument("--no-progress", action="store_true")
parser.add_argument("--num-threads")
parser.add_argument("--resume", action="store_true")
args, extra = parser.parse_known_args()
out = pathlib.Path(args.output_dir)
with open(out.parent / "calls.txt", "a") as calls:
    calls.write(f"{out.name} resume={args.resume} mu={args.updates_per_batch} extra={extra}\n")
if args.rule == "random" and args.seed == "1":
    sys.exit(3)  # one failing run
out.mkdir(parents=True, exist_ok=True)
n, m = int(args.num_rollouts), int(args.update_size)
label = f"GRPO {n}/{m}" if args.rule == "none" else f"PODS {args.rule} {n}/{m}"
variants = {"token loss": args.loss_aggregation == "token", "clip-high 0.28": args.clip_eps_high == "0.28"}
label += "".join(f" + {name}" for name, on in variants.items() if on)
(out / "config.json").write_text(json.dumps({"label": label, "seed": int(args.seed)}))
speed = n / m * (2 if args.loss_aggregation == "token" else 1)  # n/m: more rollouts per kept one learn faster
lines = [{"type": "eval", "step": s, "elapsed_s": float(s), "eval/accuracy": 0.5 * min(1.0, speed * s / 100),
          "eval/both_accuracy": 0.1} for s in range(101)]  # linear ramp: 0.99*peak is crossed at t = 99 / speed
(out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
'''


def test_study_plan_shares_runs_between_studies():
    runs, studies = study.study_plan([0, 1])
    assert len(runs) == 2 * (1 + len(study.STUDY_RULES) + 1)  # GRPO + rules + max_variance 8/4, per seed
    assert "grpo-n4-m4-s0" in studies["rules"] and "grpo-n4-m4-s0" in studies["nm"]
    assert "max_variance-n16-m4-s1" in studies["rules"] and "max_variance-n16-m4-s1" in studies["nm"]
    assert runs["percentile-n16-m4-s1"][:2] == ["--rule", "percentile"]


def test_run_study_trains_compares_and_resumes(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out = tmp_path / "study"
    (out / "max_reward-n16-m4-s0").mkdir(parents=True)  # interrupted before any checkpoint: restarted
    (out / "max_reward-n16-m4-s0" / "metrics.jsonl").write_text("garbage")
    tables = study.run_study(out, [0, 1], 5, train_args=["--eval-samples", "7"], train_script=script)
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 12 and all(c.endswith("'--eval-samples', '7']") for c in calls)  # user flags last
    assert all((out / f"{name}.png").is_file() for name in ("rules", "nm", "rules_both", "nm_both"))
    assert "Held-out both_accuracy" in (out / "rules_both.md").read_text()
    assert "| PODS max_variance 16/4 | 2 |" in tables["rules"] and "| PODS random 16/4 | 1 |" in tables["rules"]
    assert "| PODS max_variance 8/4 | 2 |" in tables["nm"] and (out / "nm.md").read_text().strip() == tables["nm"]
    # Fake accuracy grows speed = n/m times faster, so the analytic speed-up over GRPO 4/4 is n/m.
    assert "| 4.00x |" in tables["rules"] and "| 2.00x |" in tables["nm"]
    # Second call: only the failed run is tried again.
    study.run_study(out, [0, 1], 5, train_script=script)
    again = (out / "calls.txt").read_text().splitlines()[12:]
    assert [c.split()[0] for c in again] == ["random-n16-m4-s1"]


# Flags whose value cannot change the recorded tables (or cannot be given on the command line: store_true
# flags that are off; --backend unset, the engine with its fallback), so the study leaves them to their defaults.
UNPINNED_OK = {"baseline", "load_in_4bit", "generation_copy", "prefill_think", "data_dir", "keep_checkpoints", "resume",
               "dist_timeout_s", "log_completions_interval", "print_config", "backend", "dynamic_sampling_metric",
               "max_generation_rounds",
               # your own data and reward: they act only on a dataset given as a file or Hub id (a registered one, as
               # every study's, refuses them), and no extra reward function unless one is named
               "question_field", "answer_field", "prompt_template", "eval_dataset", "eval_fraction", "answer_kind",
               "reward_function", "reward_function_timeout_s"}


def test_every_setting_of_the_recorded_tables_is_pinned():
    """Each train.py flag is given explicitly, so a later preset or default edit cannot change the study."""
    from run import config
    import loss_options

    parser = config.build_parser()
    unset = object()
    parser.set_defaults(**{action.dest: unset for action in parser._actions if action.dest != "help"})
    runs, _ = study.study_plan([0])
    plans = [(flags, studyrun.STUDY_TRAIN_ARGS) for flags in [*runs.values(), *study.variants_plan([0])[0].values()]]
    plans += [(flags, study.GA_TRAIN_ARGS) for flags in study.ga_plan([0]).values()]
    plans += [(flags, pods_study.PODS_TRAIN_ARGS) for flags in pods_study.pods_plan(seeds=[0]).values()]
    for flags, settings in plans:
        args = parser.parse_args(studyrun.train_flags("runs/x", flags, 120, settings=settings))
        unpinned = {name for name, value in vars(args).items() if value is unset}
        unpinned -= {loss_options.flag_name(option)[2:].replace("-", "_")  # a loss option whose default is None (off)
                     for option in config.LOSS_FLAGS if option.default is None}
        assert unpinned <= UNPINNED_OK, f"pin these in studyrun.STUDY_TRAIN_ARGS: {sorted(unpinned - UNPINNED_OK)}"
    args = parser.parse_args(studyrun.train_flags("runs/x", runs["grpo-n4-m4-s0"], 120))
    assert args.eval_temperature == 0 and args.eval_samples == 20 and args.eval_interval == 3  # greedy, as recorded
    assert args.prompts_per_step == 1 and args.max_completion_tokens == 32 and args.num_threads == 1
    assert args.system_prompt == studyrun.STUDY_SYSTEM_PROMPT and args.learning_rate == 5e-4


def test_the_variant_studys_baseline_label_is_the_label_train_py_writes(tmp_path):
    from run import config

    runs, baseline = study.variants_plan([0])
    labels = {name: config.method_label(config.parse_args(studyrun.train_flags(tmp_path / name, flags, 120)))
              for name, flags in runs.items()}
    assert labels == {"paper-n16-m4-s0": baseline, "token-n16-m4-s0": baseline + " + token loss",
                      "cliphigh-n16-m4-s0": baseline + " + clip-high 0.28"}


def test_a_run_with_a_checkpoint_is_resumed(tmp_path, capsys):
    from run import checkpoint

    step = tmp_path / "grpo-n4-m4-s0" / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    (step.parent / checkpoint.LATEST_FILE).write_text("step_000003\n")
    study.run_study(tmp_path, [0], 5, nm_values=(4, 16), dry_run=True)
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(commands) == 5 and "grpo-n4-m4-s0 " in commands[0] and commands[0].endswith(" --resume")
    assert not any(c.endswith("--resume") for c in commands[1:])
    assert "--system-prompt 'Reason inside" in commands[0]  # printed ready to paste into a shell


def test_cli_errors_are_one_line(tmp_path, monkeypatch):
    import runpy

    missing = ["compare", str(tmp_path / "missing")]
    for argv, start, message in ((missing, "study.py: error: ", "missing does not exist"),
                                 ([], "usage: python study.py", "study.py run --out")):
        monkeypatch.setattr("sys.argv", ["study.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(study.__file__, run_name="__main__")
        text = str(exit_info.value.code)
        assert text.startswith(start) and message in text and "\n" not in text


def test_variant_study_plan_trains_three_objectives_at_mu_two(tmp_path, capsys):
    runs, baseline = study.variants_plan([0, 1, 2])
    assert len(runs) == 9 and baseline == "PODS max_variance 16/4"
    assert runs["token-n16-m4-s1"][-2:] == ["--loss-aggregation", "token"]
    assert runs["cliphigh-n16-m4-s2"][-2:] == ["--clip-eps-high", "0.28"]
    assert all(flags[flags.index("--updates-per-batch") + 1] == "2" for flags in runs.values())
    study.main(["variants", "--out", str(tmp_path), "--seeds", "0", "1", "2", "--max-time-s", "120", "--dry-run"])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(commands) == 9 and commands[0].startswith("[1/9]") and "paper-n16-m4-s0" in commands[0]
    assert "--max-time-s 120.0" in commands[0] and commands[2].endswith("--clip-eps-high 0.28")


def test_run_variants_compares_against_the_paper_objective(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out = tmp_path / "variants"
    tables = study.run_variants(out, [0, 1], 5, train_script=script)
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 6 and all(" mu=2 " in c for c in calls)
    assert (out / "variants.png").is_file() and (out / "variants.md").read_text().strip() == tables["variants"]
    table = tables["variants"]
    assert "Baseline: PODS max_variance 16/4" in table and "| PODS max_variance 16/4 + clip-high 0.28 | 2 |" in table
    token_row = next(line for line in table.splitlines() if line.startswith("| PODS max_variance 16/4 + token loss |"))
    assert "| 2 |" in token_row and "| 1.94x |" in token_row  # the fake's token arm learns 2x as fast
    study.run_variants(out, [0, 1], 5, train_script=script)  # everything done: nothing trained again
    assert len((out / "calls.txt").read_text().splitlines()) == 6


@pytest.mark.slow
def test_variant_study_end_to_end_with_a_tiny_model(tmp_path, tiny_model_dir):
    tiny = ["--model", str(tiny_model_dir), "--max-steps", "1", "--max-completion-tokens", "4", "--eval-samples", "2",
            "--eval-interval", "1", "--checkpoint-interval-s", "0"]
    tables = study.run_variants(tmp_path / "out", [0], 0, train_args=tiny)
    assert (tmp_path / "out" / "variants.png").is_file()
    assert all(f"| {label} | 1 |" in tables["variants"] for label in (
        "PODS max_variance 16/4", "PODS max_variance 16/4 + token loss", "PODS max_variance 16/4 + clip-high 0.28"))


def test_help_describes_the_commands_with_their_flags(capsys):
    study.main(["--help"])
    out = capsys.readouterr().out
    for command in ("python study.py run --out", "python study.py variants --out", "python study.py ga --out",
                    "python study.py pods --out", "python study.py pods --from-data", "python study.py compare"):
        assert command in out


@pytest.mark.filterwarnings("ignore:--clip-eps-high 0.2 cannot act")  # the study's pinned default, inert at mu = 1
def test_ga_plan_arms_differ_only_in_the_method_and_seed_and_evaluate_the_same_prompts(tmp_path):
    """PODS 16/4, GRPO-GA (every one of the same 16 rollouts per prompt trained) and random 16/4: the same prompts per
    step, rollouts per prompt, held-out set (256 prompts, every 5 steps, greedy) and every other setting."""
    from run import config
    import data

    runs = study.ga_plan([0, 1, 2, 3, 4])
    assert len(runs) == 15 and list(runs)[:3] == ["grpo_ga-n16-m16-s0", "pods-n16-m4-s0", "random-n16-m4-s0"]
    parsed = {name: config.parse_args(studyrun.train_flags(tmp_path / name, flags, 1800, 2, (), study.GA_TRAIN_ARGS))
              for name, flags in runs.items()}
    labels = {name.rsplit("-s", 1)[0]: config.method_label(args) for name, args in parsed.items()}
    assert labels == {"grpo_ga-n16-m16": study.GA_BASELINE, "pods-n16-m4": "PODS max_variance 16/4",
                      "random-n16-m4": "PODS random 16/4"}
    per_run = {"rule", "update_size", "seed", "output_dir"}
    settings = [{k: v for k, v in vars(args).items() if k not in per_run} for args in parsed.values()]
    assert all(s == settings[0] for s in settings)
    first = parsed["grpo_ga-n16-m16-s0"]
    assert (first.num_rollouts, first.update_size, first.rule, first.grad_accum_steps) == (16, 16, "none", 1)
    assert first.prompts_per_step == 4 and first.micro_batch_size == 16  # GRPO-GA: 64 rows, 4 micro-batches of 16
    assert (first.eval_samples, first.eval_interval, first.eval_temperature) == (256, 5, 0)
    assert 0.5 / first.eval_samples ** 0.5 <= 0.035  # one evaluation's standard error is at most 3.5 points
    assert parsed["pods-n16-m4-s3"].seed == 3 and parsed["random-n16-m4-s4"].rule == "random"
    # The held-out rows are drawn with a fixed seed, never the run's: every arm and seed evaluates the same prompts.
    def questions(run):
        return [row["question"] for row in data.load_split("arithmetic", "test", num_rows=run.eval_samples)]

    assert len(set(questions(first))) == 256 and questions(first) == questions(parsed["pods-n16-m4-s3"])


def test_run_ga_trains_reports_with_intervals_and_resumes(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out, plot = tmp_path / "ga", tmp_path / "docs" / "study_ga.png"
    table = study.run_ga(out, [0, 1], 5, train_args=["--eval-samples", "7"], plot=plot, resamples=50,
                         train_script=script)
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 6 and all(c.endswith("'--eval-samples', '7']") for c in calls)  # user flags last
    assert plot.read_bytes()[:4] == b"\x89PNG" and (out / "ga.md").read_text().strip() == table
    assert "Baseline: GRPO 16/16" in table and "| PODS random 16/4 | 1 |" in table  # random, seed 1 failed
    # The fake learns n/m times faster per step (one step per second): 4x on both axes, on every resample.
    pods_rows = [line for line in table.splitlines() if line.startswith("| PODS max_variance 16/4 | 2 |")]
    assert len(pods_rows) == 2 and all("| 4.0x [4.0, 4.0] |" in row for row in pods_rows)  # per step, on the clock
    figures = __import__("json").loads((out / "ga.json").read_text())
    assert figures["steps"]["PODS max_variance 16/4"]["speedup_ci"] == {"low": [4.0, 4.0], "high": [4.0, 4.0],
                                                                        "undefined": 0, "censored": 0}
    study.run_ga(out, [0, 1], 5, plot=plot, resamples=50, train_script=script)  # only the failed run again
    assert [c.split()[0] for c in (out / "calls.txt").read_text().splitlines()[6:]] == ["random-n16-m4-s1"]


def test_ga_command_runs_one_run_at_a_time_on_both_cores(tmp_path, capsys):
    study.main(["ga", "--out", str(tmp_path), "--dry-run"])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(commands) == 15 and commands[0].startswith("[1/15]") and "grpo_ga-n16-m16-s0" in commands[0]
    assert all("--max-time-s 900.0" in c and "--num-threads 2" in c and "--eval-samples 256" in c for c in commands)
    assert "random-n16-m4-s4" in commands[-1] and not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_ga_study_end_to_end_with_a_tiny_model(tmp_path, tiny_model_dir):
    import json

    tiny = ["--model", str(tiny_model_dir), "--max-steps", "2", "--max-completion-tokens", "4", "--eval-samples", "2",
            "--eval-interval", "1", "--checkpoint-interval-s", "0", "--prompts-per-step", "1"]
    table = study.run_ga(tmp_path / "out", [0], 0, train_args=tiny, num_threads=1, plot=tmp_path / "ga.png",
                         resamples=20)
    assert (tmp_path / "ga.png").is_file()
    assert all(f"| {label} | 1 | 2 |" in table for label in (
        study.GA_BASELINE, "PODS max_variance 16/4", "PODS random 16/4"))
    figures = json.loads((tmp_path / "out" / "ga.json").read_text())
    assert set(figures) == {"time", "steps"} and figures["steps"][study.GA_BASELINE]["seeds"] == 1


def test_ga_without_plot_writes_into_its_out_folder_never_into_docs(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    docs_plot = study.Path(study.__file__).with_name("docs") / "study_ga.png"
    before = docs_plot.stat().st_mtime_ns if docs_plot.exists() else None
    real = study.run_ga

    def run_ga(out_dir, seeds, max_time_s, train_args, dry_run, num_threads, plot, resamples):
        assert plot is None or study.Path(plot).resolve() != docs_plot.resolve(), "the committed figure, overwritten"
        return real(out_dir, seeds, max_time_s, train_args, dry_run, num_threads, plot, 20, script)

    monkeypatch.setattr(study, "run_ga", run_ga)
    study.main(["ga", "--out", str(tmp_path / "ga"), "--seeds", "0", "--max-time-s", "5"])
    assert (tmp_path / "ga" / "ga.png").read_bytes()[:4] == b"\x89PNG"  # the plot beside ga.md and ga.json
    assert (docs_plot.stat().st_mtime_ns if docs_plot.exists() else None) == before  # the committed figure untouched


@pytest.mark.parametrize("command, recorded_s", [("run", 120.0), ("variants", 150.0), ("ga", 900.0)])
def test_each_command_defaults_to_the_budget_of_its_recorded_study(tmp_path, capsys, command, recorded_s):
    """BENCHMARKS.md records `study.py run ... --max-time-s 120`, `study.py variants ... --max-time-s 150` and
    `study.py ga` at 900 s: the commands without --max-time-s must train as long."""
    study.main([command, "--out", str(tmp_path), "--dry-run"])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert commands and all(f"--max-time-s {recorded_s}" in line for line in commands)
    benchmarks = (study.Path(study.__file__).with_name("BENCHMARKS.md")).read_text()
    recorded = [line for line in benchmarks.splitlines() if line.startswith(f"python study.py {command} --out")][0]
    assert f"--max-time-s {recorded_s:g}" in recorded or "--max-time-s" not in recorded.split("#")[0]
