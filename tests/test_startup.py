"""The commands' start-up: their flags are parsed and checked before torch, transformers and peft load, so `--help`
and a mistyped flag are answered at once (the imports take ~10 s of CPU on 2 cores); train.py's --help shows every
flag with its help and default; the progress bar shows the budget. Measured as what is imported, not as seconds."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from run import config
from run import report
from run.checkpoint import TrainerState

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "peft", "sympy", "datasets")
COMMANDS = ("train.py", "eval.py", "compare.py", "study.py", "study.py bootstrap")


def imported_by(script, argv):
    """(exit status, stderr lines, the heavy modules imported) of `python script argv`, run as the command line runs
    it."""
    script, *subcommand = script.split()  # "study.py bootstrap": study.py's subcommand
    argv = [*subcommand, *argv]
    code = (f"import json, runpy, sys; sys.argv = [{script!r}] + {argv!r}\n"
            "try:\n"
            f"    runpy.run_path({script!r}, run_name='__main__')\n"
            "finally:\n"
            f"    print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr.strip().splitlines(), json.loads(done.stdout.strip().splitlines()[-1])


MISTYPED = {"train.py": ["--bogus"], "eval.py": ["--model", "m", "--bogus"], "compare.py": ["RUN", "--bogus"],
            "study.py": ["compare", "RUN", "--bogus"], "study.py bootstrap": ["RUN", "--baseline-label", "X", "--bogus"]}


@pytest.mark.parametrize("script", COMMANDS)
@pytest.mark.parametrize("mistyped", [False, True])
def test_help_and_a_mistyped_flag_load_no_heavy_library(script, mistyped):
    status, err, heavy = imported_by(script, MISTYPED[script] if mistyped else ["--help"])
    assert heavy == [], f"{script} imported {heavy}"
    assert status == (2 if mistyped else 0)
    if mistyped:
        assert "error: unrecognized arguments: --bogus" in err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1e-3"], "--learning-rate must be > 0, got -0.001"),
    (["-n", "4", "-m", "8"], "--update-size m = 8 must be <= --num-rollouts n = 4"),
    (["--preset", "z"], "argument --preset: invalid choice: 'z'"),
    (["--max-time-s", "nan"], "--max-time-s must be a finite number, got nan"),
])
def test_a_bad_value_is_refused_in_one_line_before_torch_loads(argv, message):
    status, err, heavy = imported_by("train.py", argv)
    assert heavy == [] and status in (1, 2)
    assert err == [err[-1]] and err[-1].startswith("train.py: error: ") and message in err[-1]


def test_every_flag_has_help_and_says_its_default():
    parser = config.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help text"
        shown = formatter._get_help_string(action)
        assert "default" in shown, f"{flag}'s help names no default: {shown!r}"
    text = " ".join(parser.format_help().split())
    assert "rollouts generated per prompt (n) (default: from --preset; the demo's: 16)" in text
    assert "(default: 0.2)" in text and "(default: off)" in text


def test_the_choices_written_in_the_flags_are_their_modules():
    """config.py lists them so that --help needs none of these modules (each loads torch)."""
    from variants import dynamic_sampling
    from run import report as report_module
    import sampling
    import update
    assert config.BACKENDS == sampling.BACKENDS[1:] and config.OPTIMIZERS == update.OPTIMIZERS
    assert config.REPORT_TO == report_module.REPORT_TO and config.DYNAMIC_SAMPLING_METRICS == dynamic_sampling.METRICS


def bar_output(capsys, max_time_s, max_steps, elapsed_s, step):
    args = argparse.Namespace(max_time_s=max_time_s, max_steps=max_steps)
    state = TrainerState(step=step, elapsed_s=elapsed_s)
    bar = report.progress_bar(args, TrainerState(), "PODS max_variance 16/4", True)
    report.show_progress(bar, args, state, 1.875, 0.5)
    bar.close()
    return " ".join(capsys.readouterr().err.replace("\r", "\n").split())


def test_the_progress_bar_shows_training_seconds_against_a_time_budget_and_steps_otherwise(capsys):
    timed = bar_output(capsys, 330.0, 0, 99.6, 10)
    assert "100/330 s of training" in timed and "30%" in timed and "step=10" in timed
    assert "reward=1.88" in timed and "acc=0.50" in timed
    counted = bar_output(capsys, 0.0, 40, 99.6, 10)
    assert "10/40" in counted and "s of training" not in counted and "reward=1.88" in counted


def test_after_its_first_step_a_run_says_what_the_budget_means_in_time():
    steps = argparse.Namespace(max_steps=16, max_time_s=0.0)
    assert report.eta_line(steps, TrainerState(step=1, elapsed_s=24.0), 24.0) == (
        "step 1 took 24 s: the 15 steps left take about 6.0 min more, plus the held-out evaluations")
    timed = argparse.Namespace(max_steps=0, max_time_s=330.0)
    assert report.eta_line(timed, TrainerState(step=1, elapsed_s=10.0), 10.0) == (
        "step 1 took 10 s: about 32 more fit in the 330 s budget")
    assert report.eta_line(argparse.Namespace(max_steps=0, max_time_s=0.0), TrainerState(step=1), 5.0) is None
