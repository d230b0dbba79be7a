"""What `python train.py` prints: the start line, each held-out evaluation, where the results are and the commands
that read them, and nothing from the libraries (no progress bars of the loaders, no bitsandbytes message, no
FutureWarning). Fast: a tiny model in a fresh interpreter; slow: the real demo's start-up from the GGUF file."""

import os
import re
import shlex
import subprocess
import sys

import pytest

import compare
import eval as eval_module
from run_helpers import ROOT, tiny_argv

# train.py as a user runs it, in a fresh interpreter (nothing imported by other tests), then whether bitsandbytes
# was imported along the way, and which modules of several processes or the benchmarks were, once the other commands
# are imported too (the one-process path loads none).
RUN_TRAIN = ("import runpy, sys; sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', "
             "run_name='__main__'); print('bitsandbytes imported:', 'bitsandbytes' in sys.modules); "
             "import eval, compare, study; print('multigpu or bench imported:', sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('multigpu', 'bench')))")


def run_train(argv, env=None, timeout=300):
    return subprocess.run([sys.executable, "-c", RUN_TRAIN, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def test_a_run_prints_what_it_does_and_where_its_results_are_and_nothing_else(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    done = run_train(tiny_argv(tiny_model_dir, run_dir, "--eval-interval", "1"))
    assert done.returncode == 0, done.stderr
    # --no-progress: not one line from a library (bars, warnings, log messages); the random model's 8-token gibberish
    # is cut and scores 0, which its first step says, and the second as it persists (report.learning_signal)
    assert [line.split(": cannot learn: ")[0] for line in done.stderr.splitlines()] == ["step 1", "step 2"]
    assert done.stderr.splitlines()[1].endswith("(2 steps in a row)")
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"PODS max_variance 4/2: {tiny_model_dir} on arithmetic, 2 steps; "
                               "held-out evaluation of 2 prompts at step 0, every 1 steps")
    assert lines[0].endswith(f"-> {run_dir}")
    assert re.fullmatch(r"LoRA r=4 on down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj: [\d,]+ of [\d,]+ "
                        "parameters train", lines[1])  # every projection of the decoder (the default targets)
    assert lines[2] == "evaluating 2 held-out prompts at step 0 ..."
    assert [int(m.group(1)) for m in map(re.compile(r"step (\d+): held-out accuracy 0\.\d\d, format ").match, lines)
            if m] == [0, 1, 2]
    assert any(re.fullmatch(rf"done: 2 steps, \d+ s of training -> {re.escape(str(run_dir))}", line) for line in lines)
    assert lines[-2:] == ["bitsandbytes imported: False",  # a LoRA run in fp32 needs none of it
                          "multigpu or bench imported: []"]
    # The printed commands run as printed on this run folder.
    commands = {line.split("#")[0].split(":", 1)[-1].strip() for line in lines if "   # " in line}
    assert {c.split()[1] for c in commands} == {"compare.py", "eval.py"} and len(commands) == 3
    compare_argv = shlex.split(next(c for c in commands if c.startswith("python compare.py")))[2:]
    compare.main(compare_argv)
    assert (run_dir / "accuracy.png").stat().st_size > 0
    assert eval_module.main(shlex.split(next(c for c in commands if "rollouts" in c))[2:])[0] == f"{run_dir}: step 2"


@pytest.mark.slow
def test_the_demo_starts_up_quietly_from_the_gguf_file(tmp_path):
    """The demo as a new user starts it (a fresh model cache: the GGUF is converted), with one small step (4 rollouts
    of one prompt) for a budget: the only lines besides the run's own are its progress bar's."""
    cache, run_dir = tmp_path / "cache", tmp_path / "demo"
    done = run_train(["--max-steps", "1", "-n", "4", "-m", "2", "--prompts-per-step", "1", "--eval-samples", "4",
                      "--num-threads", "1", "--output-dir", str(run_dir)], env={"PODS_CACHE_DIR": str(cache)},
                     timeout=900)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("PODS max_variance 4/2: smollm2-135m-offline on arithmetic, 1 steps; held-out "
                               "evaluation of 4 prompts") and lines[0].endswith(f"-> {run_dir}")
    assert lines[1].startswith(f"converting the demo model's GGUF file once into {cache}")
    assert lines[2].startswith("LoRA r=16 on ") and lines[2].endswith(" parameters train")
    assert lines[3] == "evaluating 4 held-out prompts at step 0 ..." and lines[4].startswith("step 0: held-out")
    assert "bitsandbytes imported: False" in lines and "done: 1 steps" in done.stdout
    bar_lines = [part.strip() for part in re.split(r"[\r\n]", done.stderr) if part.strip()]
    assert bar_lines and all(part.startswith("PODS max_variance 4/2:") for part in bar_lines), done.stderr
