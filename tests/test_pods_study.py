"""pods_study.py: the PODS study's plan (arms, seeds, pinned settings), its runner and report (train.py replaced by a
fake script; one slow test trains with the real train.py and a tiny model), pairing on the seeds each arm ran, the
per-seed table and plot, and the committed pilot and study data reproducing what the docs say."""

from pathlib import Path

import pytest

from studies import pods_study
import study
from studies import studyrun
from studies import studydata
from test_study import FAKE_TRAIN


@pytest.mark.filterwarnings("ignore:--clip-eps-high 0.2 cannot act")  # the study's pinned default, inert at mu = 1
def test_pods_plan_arms_train_m_4_rows_of_the_same_prompts_with_the_same_settings(tmp_path):
    """GRPO 4/4, max-variance 16/4, random 16/4, max-variance 8/4 and 32/4: 8 seeds for the first two, 5 for the
    others (the n arms skip seed 3: every arm of a seed on one machine), seed-major; every setting but the method
    and seed the same, evaluated on 256 greedy held-out prompts every 100 s of training and never by step."""
    from run import config

    runs = pods_study.pods_plan()
    assert len(runs) == 8 + 8 + 5 + 5 + 5
    assert list(runs)[:5] == ["grpo-n4-m4-s0", "max_variance-n16-m4-s0", "random-n16-m4-s0", "max_variance-n8-m4-s0",
                              "max_variance-n32-m4-s0"]
    assert [name for name in runs if name.endswith("-s3")] == ["grpo-n4-m4-s3", "max_variance-n16-m4-s3",
                                                               "random-n16-m4-s3"]
    assert list(runs)[-8:] == ["grpo-n4-m4-s5", "max_variance-n16-m4-s5", "max_variance-n8-m4-s5",
                               "max_variance-n32-m4-s5", "grpo-n4-m4-s6", "max_variance-n16-m4-s6",
                               "grpo-n4-m4-s7", "max_variance-n16-m4-s7"]
    parsed = {name: config.parse_args(studyrun.train_flags(tmp_path / name, flags, 900, 2, (),
                                                           pods_study.PODS_TRAIN_ARGS)) for name, flags in runs.items()}
    labels = {config.method_label(args) for args in parsed.values()}
    assert labels == {pods_study.PODS_BASELINE, *pods_study.PODS_CONTROL, "PODS max_variance 8/4", "PODS max_variance 32/4"}
    per_run = {"rule", "num_rollouts", "seed", "output_dir"}
    settings = [{k: v for k, v in vars(args).items() if k not in per_run} for args in parsed.values()]
    assert all(s == settings[0] for s in settings)
    first = parsed["grpo-n4-m4-s0"]
    assert (first.update_size, first.prompts_per_step, first.grad_accum_steps) == (4, 4, 1)
    assert (first.eval_samples, first.eval_temperature, first.eval_interval, first.eval_interval_s) == (256, 0, 0, 100)
    assert first.learning_rate == float(pods_study.PODS_TASK["--learning-rate"]) and first.dataset == "arithmetic"
    assert first.log_completions_interval == 10
    assert list(pods_study.pods_plan(["random", "grpo"], [3])) == ["random-n16-m4-s3", "grpo-n4-m4-s3"]
    with pytest.raises(ValueError, match="unknown arm"):
        pods_study.pods_plan(["grpo", "ppo"])


def test_run_pods_reports_exports_data_and_recomputes_from_it(tmp_path, capsys):
    """With the fake train.py (accuracy n/m times faster per second): the report against GRPO 4/4, the control table,
    the pilot line, a data file per run and study.json; the report recomputed from the data files is the same."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out, data_dir = tmp_path / "pods", tmp_path / "results" / "pods"
    table = pods_study.run_pods(out, ("grpo", "pods", "random"), [0, 1], 100, ["--eval-samples", "7"], data_dir=data_dir,
                           resamples=50, train_script=script)
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 6 and all(c.endswith("'--eval-samples', '7']") for c in calls)
    assert "failed runs: random-n16-m4-s1" in capsys.readouterr().out
    assert (out / "pods.png").read_bytes()[:4] == b"\x89PNG" and (out / "pods.md").read_text().strip() == table
    assert "## Every arm against GRPO 4/4" in table and "Baseline: GRPO 4/4" in table
    assert "Clock jitter: 10 draws, each run's times x U[0.9, 1.1]" in table  # how far the clock's ends move
    assert "## PODS random 16/4 against PODS max_variance 16/4" in table and "Baseline: PODS max_variance 16/4" in table
    assert "- per step: 0.90: 4.0x, 0.95: 4.0x" in table  # the speed-up at other thresholds: the same, here
    assert "null (A/A) comparison by construction" in table  # why random vs GRPO per step is no evidence
    pods_rows = [line for line in table.splitlines() if line.startswith("| PODS max_variance 16/4 | 2 |")]
    assert len(pods_rows) >= 2 and all("| 4.0x [4.0, 4.0] |" in row for row in pods_rows[:2])  # per step and clock
    assert "- GRPO 4/4: not recorded" in table  # the fake logs no per-step phases
    # Each run's curve, the arms in the study's order (baseline, method, control) whatever order the folders have.
    rows = [line for line in table.splitlines() if line.startswith("| ") and " | 0.00 " in line]
    assert [row.split(" | ")[:2] for row in rows] == [["| GRPO 4/4", "0"], ["| GRPO 4/4", "1"],
                                                        ["| PODS max_variance 16/4", "0"],
                                                        ["| PODS max_variance 16/4", "1"], ["| PODS random 16/4", "0"]]
    assert rows[0].endswith("| 0.50 | 0.50 |") and " 100 | 0 1 2 " in rows[0]  # peak, final; seconds and steps
    assert (out / "pods_seeds.png").read_bytes()[:4] == b"\x89PNG"
    # The fake's GRPO reaches 0.5 at 100 s, its plateau: at a third of the budget (33 s) it is still rising.
    assert "Pilot: GRPO 4/4 (2 seeds): mean accuracy 0.17 at a third of the budget (33 s)" in table
    assert "still rising" in table
    assert sorted(p.name for p in data_dir.glob("*.json")) == sorted(
        ["grpo-n4-m4-s0.json", "grpo-n4-m4-s1.json", "max_variance-n16-m4-s0.json", "max_variance-n16-m4-s1.json",
         "random-n16-m4-s0.json", "study.json"])
    recorded = __import__("json").loads((data_dir / "study.json").read_text())
    assert recorded["budget_s"] == 100 and recorded["command"].startswith("python study.py pods --out ")
    assert sorted(recorded["run_wall_s"]) == sorted(recorded["run_eval_s"]) and len(recorded["run_wall_s"]) == 5
    assert "Cost: 5 runs, 0.0 h one after the other; a run took " in table  # the fake's runs take a second
    assert (data_dir / "pods.md").read_text().strip() == table
    capsys.readouterr()
    assert study.main(["pods", "--from-data", str(data_dir), "--resamples", "50"]) == table
    assert capsys.readouterr().out.strip() == table


def test_pods_command_dry_run_pilot_and_refusals(tmp_path, capsys):
    study.main(["pods", "--out", str(tmp_path), "--dry-run"])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(commands) == 31 and commands[0].startswith("[1/31]") and "grpo-n4-m4-s0" in commands[0]
    assert all("--max-time-s 600.0" in c and "--num-threads 2" in c and "--eval-interval-s 100" in c for c in commands)
    assert not (tmp_path / "logs").exists()
    study.main(["pods", "--out", str(tmp_path), "--arms", "grpo", "--seeds", "0", "1", "--dry-run"])  # the pilot
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["[1/2]", "[2/2]"]
    with pytest.raises(SystemExit):
        study.main(["pods", "--from-data", str(tmp_path), "--out", str(tmp_path)])
    assert "--from-data reports committed data" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no GRPO 4/4 run"):
        pods_study.pods_report([], 900)


@pytest.mark.slow  # four train.py processes: ~20 s on a quiet machine, a minute on a busy one
def test_pods_study_end_to_end_with_a_tiny_model(tmp_path, tiny_model_dir):
    """The real train.py, 2 arms x 2 seeds of 3 steps: each seed's arms train on the same prompts (the completions
    logs), every run evaluates at step 0, after each step whose training seconds cross a multiple of
    --eval-interval-s, and at the end, and the report and the data files are written."""
    import json

    from run import completions
    from run_helpers import read_lines

    interval_s = 0.2
    tiny = ["--model", str(tiny_model_dir), "--max-steps", "3", "--max-completion-tokens", "4", "--eval-samples", "2",
            "--eval-interval-s", str(interval_s), "--checkpoint-interval-s", "0", "--prompts-per-step", "1",
            "--log-completions-interval", "1"]
    out, data_dir = tmp_path / "out", tmp_path / "data"
    table = pods_study.run_pods(out, ("grpo", "pods"), [0, 1], 0, tiny, num_threads=1, data_dir=data_dir, resamples=20)
    names = ["grpo-n4-m4-s0", "max_variance-n16-m4-s0", "grpo-n4-m4-s1", "max_variance-n16-m4-s1"]
    assert all((out / name / "study_done.json").is_file() for name in names)

    def prompts(name):
        return [[row["prompt"] for row in completions.read_completions(out / name, step)[1] if row["type"] == "prompt"]
                for step in (1, 2, 3)]

    assert prompts(names[0]) == prompts(names[1]) and prompts(names[2]) == prompts(names[3])
    assert prompts(names[0]) != prompts(names[2])
    for name in names:
        clock = [0.0] + [line["elapsed_s"] for line in read_lines(out / name, "train")]
        crossed = [step for step in (1, 2) if clock[step] // interval_s > clock[step - 1] // interval_s]
        evaluations = read_lines(out / name, "eval")
        assert [line["step"] for line in evaluations] == [0, *crossed, 3]
        assert [line["elapsed_s"] for line in evaluations] == [clock[step] for step in (0, *crossed, 3)]
    assert (out / "pods.png").is_file() and (out / "pods.md").read_text().strip() == table
    assert f"| {pods_study.PODS_BASELINE} | 2 | 3,3 |" in table and "| PODS max_variance 16/4 | 2 | 3,3 |" in table
    assert "- PODS max_variance 16/4: generate" in table and "of which generation" in table
    assert sorted(p.name for p in data_dir.glob("*.json")) == sorted([f"{name}.json" for name in names]
                                                                      + ["study.json"])
    record = json.loads((data_dir / "max_variance-n16-m4-s1.json").read_text())
    assert record["label"] == "PODS max_variance 16/4" and len(record["generate_s"]) == 3
    assert pods_study.report_pods_data(data_dir, resamples=20) == table
    one_seed = pods_study.report_pods_data(data_dir, resamples=20, seeds=[1])  # a part of the study: seed 1's runs
    assert f"| {pods_study.PODS_BASELINE} | 1 | 3 |" in one_seed and f"| {pods_study.PODS_BASELINE} | 2 |" not in one_seed
    assert "Cost: 2 runs" in one_seed  # the costs of seed 1's two runs only
    with pytest.raises(ValueError, match="--seeds: .* no run of seed 5"):
        pods_study.report_pods_data(data_dir, resamples=20, seeds=[1, 5])


def test_pods_clock_lines_say_how_much_of_the_clock_difference_is_generation_and_the_pilot_line_a_plateau():
    import numpy as np

    from compare import RunData

    def run(label, seed, generate_s, update_s, accuracy):
        steps = 10
        phases = {"generate_s": np.full(steps, generate_s), "update_s": np.full(steps, update_s)}
        times = np.arange(0, 1000, 100.0)
        return RunData(f"r{label}{seed}", label, seed, times, np.asarray(accuracy, dtype=float),
                       np.full(steps, generate_s + update_s + 0.5), phases, eval_steps=times / 100)

    flat = [0.3] + [0.6] * 9  # on its plateau from the first evaluation after step 0
    runs = [run("GRPO 4/4", seed, 2.0, 7.5, flat) for seed in (0, 1)]
    runs += [run("PODS max_variance 16/4", seed, 8.0, 7.6, flat) for seed in (0, 1)]
    lines = pods_study.clock_lines(runs)
    assert lines[2] == "- GRPO 4/4: generate 2.0 s, update 7.5 s, step 10.0 s"
    assert lines[3].endswith("step 16.1 s; +6.1 s per step against GRPO 4/4, of which generation +6.0 s (98%)")
    assert "NOT rising at a third of the budget" in pods_study.rising_line(runs, 900)
    rising = [run("GRPO 4/4", 0, 2.0, 7.5, np.linspace(0.3, 0.7, 10))]
    assert "0.43 at a third of the budget (300 s), 0.57 on average over the rest" in pods_study.rising_line(rising, 900)
    assert "still rising" in pods_study.rising_line(rising, 900)


def test_a_finished_pods_run_trained_with_other_flags_is_refused_not_reported(tmp_path, monkeypatch):
    """A pilot trained before PODS_TASK changed would otherwise be skipped as done and reported as this study's."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out, data_dir = tmp_path / "pods", tmp_path / "data"
    pods_study.run_pods(out, ("grpo",), [0], 100, data_dir=data_dir, resamples=20, train_script=script)  # the pilot
    assert "Pilot: GRPO 4/4 (1 seed)" in (data_dir / "pods.md").read_text()
    monkeypatch.chdir(tmp_path)
    pods_study.run_pods("pods", ("grpo",), [0], 100, data_dir=data_dir, resamples=20,
                   train_script=script)  # the same study (its folder spelled otherwise): the finished run skipped
    assert len((out / "calls.txt").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match=r"grpo-n4-m4-s0 was trained with other flags than this study's "
                                         r"\(--max-time-s 100 \(now 200\)\)"):
        pods_study.run_pods(out, ("grpo",), [0], 200, data_dir=data_dir, resamples=20, train_script=script)


def test_the_pilot_behind_the_budget_says_what_study_py_says():
    """results/pods-pilot: the pilot GRPO 4/4 run (seed 0, lr 1e-4, 900 s planned, stopped at 704 s) that set
    PODS_MAX_TIME_S: on its plateau at a third of 900 s, still rising at a third of 600 s (rising_line)."""
    runs, _ = studydata.read_study([Path(study.__file__).with_name("results") / "pods-pilot"])
    assert [(r.label, r.seed, r.config["max_time_s"]) for r in runs] == [("GRPO 4/4", 0, 900.0)]
    assert "NOT rising" in pods_study.rising_line(runs, 900)
    assert "0.54 at a third of the budget (200 s), 0.64 on average over the rest" in pods_study.rising_line(runs, 600)
    assert "still rising" in pods_study.rising_line(runs, pods_study.PODS_MAX_TIME_S)


def test_report_only_reports_the_finished_runs_and_trains_nothing(tmp_path, capsys):
    """A study under way: the run in progress (no study_done.json yet) is left out and named, nothing is trained."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out, data_dir = tmp_path / "pods", tmp_path / "data"
    pods_study.run_pods(out, ("grpo", "pods"), [0, 1], 100.0, data_dir=data_dir, resamples=20, train_script=script)
    (out / "max_variance-n16-m4-s1" / "study_done.json").unlink()  # as if it were still training
    calls = (out / "calls.txt").read_text()
    capsys.readouterr()
    study.main(["pods", "--out", str(out), "--arms", "grpo", "pods", "--seeds", "0", "1", "--max-time-s", "100",
                "--data", str(data_dir), "--resamples", "20", "--report-only"])
    printed = capsys.readouterr().out
    assert "reporting the 3 finished runs of 4; not finished: max_variance-n16-m4-s1" in printed
    assert (out / "calls.txt").read_text() == calls  # nothing trained
    table = (data_dir / "pods.md").read_text()
    assert "| GRPO 4/4 | 2 |" in table and "| PODS max_variance 16/4 | 1 |" in table
    assert not (data_dir / "max_variance-n16-m4-s1.json").exists()  # the earlier export's file of it, removed
    assert "removing " in printed and (data_dir / "study.json").exists()
    with pytest.raises(SystemExit):
        study.main(["pods", "--from-data", str(data_dir), "--report-only"])


def test_a_study_continued_in_a_new_out_adds_its_runs_to_the_data_folder(tmp_path, capsys):
    """The first runs' folders are gone (another machine), their data files remain: --add-to-data trains the runs
    left in a new --out, keeps the data folder's files and recorded costs, and reports them all (without it the
    export removes them). A data folder of another budget, or with no study.json, is refused before any training."""
    import json

    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    data_dir = tmp_path / "data"
    pods_study.run_pods(tmp_path / "first", ("grpo", "pods"), [0], 100.0, data_dir=data_dir, resamples=20,
                        train_script=script)
    first = json.loads((data_dir / "study.json").read_text())
    pods_study.run_pods(tmp_path / "second", ("grpo", "pods"), [1], 100.0, data_dir=data_dir, resamples=20,
                        train_script=script, add_to_data=True)
    names = sorted(path.stem for path in data_dir.glob("*-s*.json"))
    assert names == ["grpo-n4-m4-s0", "grpo-n4-m4-s1", "max_variance-n16-m4-s0", "max_variance-n16-m4-s1"]
    recorded = json.loads((data_dir / "study.json").read_text())
    assert sorted(recorded["run_wall_s"]) == names and sorted(recorded["run_eval_s"]) == names
    assert recorded["earlier"] == [{"command": first["command"], "commit": first["commit"]}]
    assert "--add-to-data" in recorded["command"]
    table = (data_dir / "pods.md").read_text()
    assert "| GRPO 4/4 | 2 |" in table and "| PODS max_variance 16/4 | 2 |" in table
    capsys.readouterr()
    study.main(["pods", "--out", str(tmp_path / "second"), "--arms", "grpo", "pods", "--seeds", "0", "1",
                "--max-time-s", "100", "--data", str(data_dir), "--resamples", "20", "--report-only", "--add-to-data"])
    assert f"reporting the 2 finished runs of 4 and 2 from {data_dir}'s data files\n" in capsys.readouterr().out
    assert len(json.loads((data_dir / "study.json").read_text())["earlier"]) == 2
    with pytest.raises(ValueError, match="records another budget_s than this study's"):
        pods_study.run_pods(tmp_path / "third", ("grpo",), [2], 200.0, data_dir=data_dir, resamples=20,
                            train_script=script, add_to_data=True)
    with pytest.raises(ValueError, match="has no study.json"):
        pods_study.run_pods(tmp_path / "third", ("grpo",), [2], 100.0, data_dir=tmp_path / "empty", resamples=20,
                            train_script=script, add_to_data=True)
    assert not (tmp_path / "third").exists()  # refused before training
    with pytest.raises(SystemExit):
        study.main(["pods", "--out", str(tmp_path / "second"), "--report-only", "--dry-run"])
    assert "--report-only trains nothing and --dry-run" in capsys.readouterr().err


def test_the_committed_study_data_reproduce_the_report_and_benchmarks_quotes_it():
    """results/pods holds each finished run's data file and study.json; the report recomputed from them is
    results/pods/pods.md, trained with today's pinned settings and budget, and BENCHMARKS.md quotes its tables and
    each run's row."""
    import json

    root = Path(pods_study.__file__).resolve().parents[1]
    data = root / "results" / "pods"
    recorded = json.loads((data / studydata.STUDY_FILE).read_text())
    assert recorded["train_args"] == list(pods_study.PODS_TRAIN_ARGS)
    assert recorded["budget_s"] == pods_study.PODS_MAX_TIME_S
    table = pods_study.report_pods_data(data)
    assert table == (data / "pods.md").read_text().strip()
    benchmarks = (root / "BENCHMARKS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    runs, _ = studydata.read_study([data])
    assert len(rows) == 2 * len({r.label for r in runs}) + 2 * 2 + len(runs)  # both axes; the control; each run
    assert [row for row in rows if row not in benchmarks] == []
    assert "python study.py pods --from-data results/pods" in benchmarks
