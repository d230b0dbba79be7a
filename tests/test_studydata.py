"""studydata.py: a run folder exported to its data file and read back gives the same figures; files with values not
recorded are reported per step only; the committed GA data reproduce the committed table and BENCHMARKS.md's."""

import json
import math

import numpy as np
import pytest

from studies import bootstrap
import compare
from studies import studydata
from run_helpers import ROOT
from test_bootstrap import make_two_arms
from test_compare import make_run, ramp

GA_COMMAND = ["--from-data", str(ROOT / "results" / "ga"), "--baseline-label", "GRPO 16/16", "--budget-s", "900",
              "--estimate-clock", "--jitter", "0.1"]


def test_a_run_folder_exported_and_read_back_gives_the_same_report(tmp_path, capsys):
    make_two_arms(tmp_path / "runs", 25, 50, pods_offset=0.02)
    written = studydata.export_runs([tmp_path / "runs"], tmp_path / "data")
    assert sorted(p.name for p in written) == [f"{arm}{seed}.json" for arm in "gp" for seed in range(3)]
    original, back = compare.read_run(tmp_path / "runs" / "p1"), studydata.read_data(tmp_path / "data" / "p1.json")
    for field in ("eval_times_s", "eval_accuracy", "eval_steps", "step_durations_s"):
        np.testing.assert_allclose(getattr(back, field), getattr(original, field))
    assert back.phase_means_s == pytest.approx(original.phase_means_s) and back.label == original.label
    assert back.seed == 1 and back.config["label"] == "PODS max_variance 16/4"
    _, from_runs = bootstrap.report([tmp_path / "runs"], "GRPO 16/16", resamples=100, budget_s=60)
    args = ["--baseline-label", "GRPO 16/16", "--resamples", "100", "--budget-s", "60"]
    bootstrap.main([str(tmp_path / "runs"), *args, "--export-data", str(tmp_path / "cli")])
    capsys.readouterr()
    bootstrap.main(["--from-data", str(tmp_path / "cli"), *args])  # the budget cut works from the data too
    assert capsys.readouterr().out.strip() == from_runs
    assert "On the clock (training wall-clock):\n\nthreshold" in from_runs


def test_values_not_recorded_are_null_and_the_clock_is_not_reported(tmp_path):
    record = studydata.run_record(compare.read_run(make_run(tmp_path, "r", "GRPO", 0, ramp(0.5, 100))))
    record["evaluations"]["elapsed_s"][3] = None
    path = studydata.write_record(record, tmp_path / "data" / "r.json")
    other = dict(record, seed=1, run="r1")
    studydata.write_record(other, tmp_path / "data" / "r1.json")
    studydata.write_record({"arm_clock_s": {"GRPO": {"generate_s": 1.0, "update_s": 2.0, "step_s": 3.0}}},
                           tmp_path / "data" / studydata.STUDY_FILE)
    run = studydata.read_data(path)
    assert math.isnan(run.eval_times_s[3]) and run.eval_steps[3] == 3
    runs, clock = studydata.read_study([tmp_path / "data"])
    by_axis, table = bootstrap.report_runs(runs, "GRPO", resamples=20, clock=clock)
    assert by_axis["time"] is None and by_axis["steps"]["GRPO"]["seeds"] == 2
    assert "not recorded: the evaluations' training seconds were not kept for every run." in table
    assert "| 1.0 / 2.0 / 3.0 (arm mean) |" in table
    # --estimate-clock: a missing time is its step x the arm's mean step time (evaluations here: one per step).
    estimated = studydata.estimate_clock(runs, clock)
    assert estimated[0].eval_times_s[3] == pytest.approx(3 * 3.0) and estimated[0].eval_times_s[2] == 20.0
    by_axis, table = bootstrap.report_runs(estimated, "GRPO", resamples=20, clock=clock, clock_note="ESTIMATED")
    assert by_axis["time"]["GRPO"]["seeds"] == 2 and "On the clock, ESTIMATED:" in table
    with pytest.raises(ValueError, match="no mean step time recorded for 'GRPO'"):
        studydata.estimate_clock(runs, {})
    with pytest.raises(ValueError, match="not recorded, so it cannot be cut to a budget of 50 s"):
        compare.within_budget(run, 50)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a run data file"):
        studydata.read_data(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="holds accuracy, not both_accuracy"):
        studydata.read_data(path, "both_accuracy")


def test_the_committed_ga_data_reproduce_the_committed_tables(capsys):
    """results/ga holds what survives of the GA study; the table recomputed from it is results/ga/ga.md, and that
    table is the one BENCHMARKS.md reports."""
    bootstrap.main(GA_COMMAND)
    table = capsys.readouterr().out.strip()
    assert table == (ROOT / "results" / "ga" / "ga.md").read_text().strip()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 8 and all(row in benchmarks for row in rows)  # per step and on the clock
    command = " ".join(f'"{a}"' if " " in a else a for a in GA_COMMAND).replace(str(ROOT) + "/", "")
    assert f"python study.py bootstrap {command}" in benchmarks
    runs, _ = studydata.read_study([ROOT / "results" / "ga"])
    assert sorted((r.label, r.seed) for r in runs) == sorted((label, seed) for seed in range(5) for label in
                                                             ("GRPO 16/16", "PODS max_variance 16/4",
                                                              "PODS random 16/4"))


@pytest.mark.parametrize("folder, seeds, budget_s", [("demo-prefix", [0, 1, 2], 270.0),
                                                     ("demo-prefix-600", [0], 600.0), ("demo-330", [0, 1, 2], 330.0)])
def test_the_committed_demo_runs_with_prefix_sharing_reproduce_their_table(capsys, folder, seeds, budget_s):
    """results/demo-prefix: the 3 seeds of `python train.py --max-time-s 270` with each distinct token computed once,
    results/demo-prefix-600: the then default 600 s run, results/demo-330: the 3 seeds of today's default (330 s);
    the table recomputed from each is its demo.md, and BENCHMARKS.md reports its rows and the command."""
    command = ["--from-data", str(ROOT / "results" / folder), "--baseline-label", "PODS max_variance 16/4"]
    bootstrap.main(command)
    table = capsys.readouterr().out.strip()
    assert table == (ROOT / "results" / folder / "demo.md").read_text().strip()
    rows = [line for line in table.splitlines() if line.startswith("| PODS")]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(rows) == 2 and all(row in benchmarks for row in rows)
    assert f'python study.py bootstrap --from-data results/{folder} --baseline-label "PODS max_variance 16/4"' in benchmarks
    runs, _ = studydata.read_study([ROOT / "results" / folder])
    assert sorted(r.seed for r in runs) == seeds and {r.config["max_time_s"] for r in runs} == {budget_s}


def test_the_committed_bf16_demo_runs_reproduce_their_comparison_with_float32(capsys):
    """results/demo-330-bf16: the 3 seeds of the 330 s demo in bf16; beside results/demo-330 (float32, the same
    seeds) they give BENCHMARKS' bf16-against-fp32 tables, per step and on the clock."""
    bootstrap.main(["--from-data", str(ROOT / "results" / "demo-330"), str(ROOT / "results" / "demo-330-bf16"),
                    "--baseline-label", "PODS max_variance 16/4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| PODS")]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(rows) == 4 and all(row in benchmarks for row in rows)
    assert sum("PODS max_variance 16/4, bf16" in row for row in rows) == 2
    runs, _ = studydata.read_study([ROOT / "results" / "demo-330-bf16"])
    assert sorted(r.seed for r in runs) == [0, 1, 2] and {r.label for r in runs} == {"PODS max_variance 16/4, bf16"}


@pytest.mark.parametrize("folder, table, baseline", [
    ("demo-16", "demo.md", "PODS max_variance 16/4"), ("demo-lr", "lr.md", "PODS max_variance 16/4, lr 5e-4"),
    ("demo-16-bf16", "demo.md", "PODS max_variance 16/4, bf16, code of 2026-11-27"),
    ("demo-16-host", "demo.md", "PODS max_variance 16/4, bf16, code of 2026-11-28 morning")])
def test_the_committed_runs_of_the_16_step_demo_reproduce_their_tables(capsys, folder, table, baseline):
    """results/demo-16: today's default demo, 3 seeds, natively and with torch held to AVX2 kernels; results/demo-lr:
    the runs behind its learning rate; results/demo-16-bf16: the bf16 demo on 3 seeds with today's code and the code
    of 2026-11-27, interleaved. The tables recomputed from each are the committed ones, which BENCHMARKS.md quotes with
    their commands; demo-16's runs trained with today's demo budget and evaluation."""
    bootstrap.main(["--from-data", str(ROOT / "results" / folder), "--baseline-label", baseline])
    printed = capsys.readouterr().out.strip()
    assert printed == (ROOT / "results" / folder / table).read_text().strip()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert f'python study.py bootstrap --from-data results/{folder}' in " ".join(benchmarks.split())
    if folder in ("demo-16", "demo-16-bf16"):
        rows = [line for line in printed.splitlines() if line.startswith("| PODS")]
        assert len(rows) == 4 and all(row in benchmarks for row in rows)
    if folder == "demo-16":
        runs, _ = studydata.read_study([ROOT / "results" / folder])
        from run.presets import PRESETS
        demo = PRESETS["demo"]
        assert {(r.config["max_steps"], r.config["max_time_s"]) for r in runs} == {(demo["max_steps"], 0.0)}
        assert sorted(r.seed for r in runs) == [0, 0, 1, 1, 2, 2]


def test_the_demo_times_in_benchmarks_are_the_committed_runs():
    """BENCHMARKS.md's table of the demo before and after the page and padding-row changes: each row's accuracies,
    evaluation seconds, mean step and its phases and whole-command time recomputed from results/demo-16-host, and the
    averages and paired ratios quoted below it."""
    folder = ROOT / "results" / "demo-16-host"
    benchmarks = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    names = {"before-s": "seed {}, before", "s": "seed {}, after", "fp32-before-s": "float32 seed {}, before",
             "fp32-s": "float32 seed {}, after"}
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    whole = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        prefix, seed = path.stem.rstrip("0123456789"), int(path.stem[-1])
        bold = "" if prefix.endswith("before-s") else "**"   # the changed code's time in bold
        minutes, seconds = divmod(round(record["command_s"]), 60)
        row = (f"| {names[prefix].format(seed)} | {' '.join(f'{a:.2f}' for a in record['evaluations']['accuracy'])} | "
               f"{' / '.join(f'{t:.1f}' for t in record['eval_s'])} | {mean(record['step_s']):.2f}: "
               f"{mean(record['generate_s']):.2f} + {mean(record['update_s']):.2f} | "
               f"{bold}{minutes} min {seconds} s{bold} |")
        assert row in benchmarks, row
        whole[path.stem] = record["command_s"]
    before, after = [whole[f"before-s{s}"] for s in range(3)], [whole[f"s{s}"] for s in range(3)]
    clock = lambda s: f"{int(s // 60)} min {round(s % 60)} s"  # noqa: E731
    ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(after, before))
    assert (f"bf16: {clock(sum(before) / 3)} -> {clock(sum(after) / 3)} on average, "
            f"{sum(a / b for a, b in zip(after, before)) / 3:.2f}x paired ({ratios})") in benchmarks
    assert f"{clock(sum(whole[f'fp32-s{s}'] for s in range(3)) / 3)} over the 3 seeds" in benchmarks
    assert f"({whole['fp32-s0'] / whole['fp32-before-s0']:.2f}x)" in benchmarks


def test_the_committed_objectives_runs_reproduce_their_table(capsys):
    """results/objectives: `python study.py objectives --seeds 0 1 2` (the paper's loss, GSPO, CISPO and the
    high-entropy tokens, every arm at --updates-per-batch 2 with today's demo settings): the table recomputed from
    its data files is objectives.md, which BENCHMARKS.md quotes row by row with its command."""
    import study

    folder = ROOT / "results" / "objectives"
    bootstrap.main(["--from-data", str(folder), "--baseline-label", study.OBJECTIVES_BASELINE])
    printed = capsys.readouterr().out.strip()
    assert printed == (folder / "objectives.md").read_text().strip()
    rows = [line for line in printed.splitlines() if line.startswith("| PODS")]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(rows) == 2 * len(study.OBJECTIVES) and all(row in benchmarks for row in rows)
    assert f'python study.py bootstrap --from-data results/objectives --baseline-label "{study.OBJECTIVES_BASELINE}"' \
        in benchmarks
    runs, _ = studydata.read_study([folder])
    assert sorted({r.seed for r in runs}) == [0, 1, 2] and len({r.label for r in runs}) == len(study.OBJECTIVES)
    assert len(runs) == 3 * len(study.OBJECTIVES)  # every arm on every seed: the pairs are complete
    assert {r.config["max_steps"] for r in runs} == {study.OBJECTIVES_STEPS}
