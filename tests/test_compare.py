"""compare.py: curves, 1.96*SE bands, speed-up ratio (Appendix A.4), ragged/missing runs, plot + table."""

import json
import math
import re
import statistics

import numpy as np
import pytest

import compare


def make_run(root, name, label, seed, eval_points, step_times=(), extra_lines=()):
    """A synthetic run dir in train.py's layout: config.json + metrics.jsonl (train and eval lines)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"label": label, "seed": seed, "rule": "x"}))
    lines, elapsed = [], 0.0
    for step, duration in enumerate(step_times, start=1):
        elapsed += duration
        lines.append({"type": "train", "step": step, "elapsed_s": elapsed, "generate_s": 0.75 * duration,
                      "update_s": 0.25 * duration})
    for step, (time_s, accuracy) in enumerate(eval_points):
        lines.append({"type": "eval", "step": step, "elapsed_s": time_s, "eval/accuracy": accuracy})
    text = "\n".join(json.dumps(line) for line in lines) + "\n" + "".join(extra_lines)
    (run / "metrics.jsonl").write_text(text)
    return run


def ramp(peak, time_to_peak_s, end_s=100, every_s=10, offset=0.0):
    """Accuracy rising linearly to `peak` at time_to_peak_s, then flat; eval every `every_s`."""
    return [(t, offset + peak * min(t / time_to_peak_s, 1.0)) for t in range(0, end_s + 1, every_s)]


def test_speedup_matches_analytic_crossing_times(tmp_path):
    peak, base_peak_s, fast_peak_s = 0.5, 100, 50
    runs = [make_run(tmp_path, f"grpo{s}", "GRPO 4/4", s, ramp(peak, base_peak_s, offset=d))
            for s, d in enumerate((-0.05, 0.05))]
    runs += [make_run(tmp_path, f"pods{s}", "PODS 16/4", s, ramp(peak, fast_peak_s, offset=d))
             for s, d in enumerate((-0.05, 0.05))]
    runs += [make_run(tmp_path, f"slow{s}", "PODS random", s, ramp(0.3, 100)) for s in range(2)]
    rows, table = compare.compare(runs)  # baseline auto-detected from the "GRPO" prefix
    assert compare.compare([tmp_path])[1] == table  # a folder of runs stands for all of them
    by_method = {r["method"]: r for r in rows}
    # Symmetric seed offsets cancel in the mean, so the crossing of 0.99*peak is analytic on each ramp.
    expected_base_s, expected_fast_s = 0.99 * base_peak_s, 0.99 * fast_peak_s
    assert by_method["GRPO 4/4"]["time_to_threshold_s"] == pytest.approx(expected_base_s)
    assert by_method["PODS 16/4"]["time_to_threshold_s"] == pytest.approx(expected_fast_s)
    assert by_method["PODS 16/4"]["speedup"] == f"{expected_base_s / expected_fast_s:.2f}x"
    assert by_method["GRPO 4/4"]["speedup"] == "1.00x"
    assert by_method["PODS random"]["speedup"] == "not reached"
    assert by_method["PODS 16/4"]["peak_accuracy"] == pytest.approx(peak)
    assert "not reached" in table and "GRPO 4/4" in table


def test_step_interpolation_uses_first_eval_at_or_above_threshold(tmp_path):
    runs = [make_run(tmp_path, "b", "GRPO", 0, ramp(0.5, 100)), make_run(tmp_path, "p", "PODS", 0, ramp(0.5, 50))]
    rows, _ = compare.compare(runs, interp="step")
    by_method = {r["method"]: r for r in rows}
    assert by_method["GRPO"]["time_to_threshold_s"] == 100  # first eval >= 0.495
    assert by_method["PODS"]["time_to_threshold_s"] == 50
    assert by_method["PODS"]["speedup"] == "2.00x"


def test_band_is_196_standard_errors_across_seeds(tmp_path):
    levels = [0.2, 0.45, 0.6]
    runs = [compare.read_run(make_run(tmp_path, f"r{i}", "M", i, [(t, a + t / 1000) for t in (0, 10, 20)]))
            for i, a in enumerate(levels)]
    curve = compare.method_curve("M", runs)
    expected_band = 1.96 * statistics.stdev(levels) / math.sqrt(len(levels))
    np.testing.assert_allclose(curve.band, expected_band)
    np.testing.assert_allclose(curve.mean, statistics.mean(levels) + np.array([0, 10, 20]) / 1000)
    assert list(curve.count) == [3, 3, 3]


def test_one_seed_has_no_band(tmp_path):
    run = compare.read_run(make_run(tmp_path, "r", "M", 0, ramp(0.4, 50)))
    curve = compare.method_curve("M", [run])
    assert np.isnan(curve.band).all() and len(curve.mean) == 11
    assert any("no band" in note for note in curve.notes)


def test_ragged_seeds_cut_where_too_few_remain(tmp_path):
    runs = [compare.read_run(make_run(tmp_path, "a", "M", 0, ramp(0.4, 100, end_s=100))),
            compare.read_run(make_run(tmp_path, "b", "M", 1, ramp(0.4, 100, end_s=60))),
            compare.read_run(make_run(tmp_path, "c", "M", 2, ramp(0.4, 100, end_s=100, every_s=25)))]
    at_least_two = compare.method_curve("M", runs, min_seeds=2)
    every_seed = compare.method_curve("M", runs, min_seeds=0)
    assert at_least_two.times_s[-1] == 100 and at_least_two.count.min() >= 2
    assert every_seed.times_s[-1] == 60 and (every_seed.count == 3).all()
    # Grid = union of eval times (seed c evaluates at 25 and 75, between the others' points).
    assert 25 in every_seed.times_s and 75 in at_least_two.times_s
    assert any("last evals" in note for note in at_least_two.notes)


def test_values_on_grid_no_extrapolation():
    times, accuracy = np.array([10.0, 20.0]), np.array([0.2, 0.4])
    grid = np.array([0.0, 10.0, 15.0, 20.0, 30.0])
    linear = compare.values_on_grid(times, accuracy, grid, "linear")
    step = compare.values_on_grid(times, accuracy, grid, "step")
    np.testing.assert_allclose(linear[1:4], [0.2, 0.3, 0.4])
    np.testing.assert_allclose(step[1:4], [0.2, 0.2, 0.4])
    assert np.isnan(linear[[0, 4]]).all() and np.isnan(step[[0, 4]]).all()
    with pytest.raises(ValueError, match="interp"):
        compare.values_on_grid(times, accuracy, grid, "cubic")


def test_missing_and_broken_data_is_reported(tmp_path):
    good = [make_run(tmp_path, f"g{s}", "GRPO", s, ramp(0.5, 100)) for s in range(2)]
    no_evals = make_run(tmp_path, "noeval", "PODS", 0, [], step_times=[1.0, 2.0])
    partial = make_run(tmp_path, "partial", "PODS", 1, [(0, 0.1), (10, float("nan")), (20, 0.3)],
                       extra_lines=['{"type": "eval", "step": 9, "elapsed_s": 9'])  # killed mid-write
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    rows, table = compare.compare([*good, no_evals, partial, not_a_run])
    pods = next(r for r in rows if r["method"] == "PODS")
    assert pods["seeds"] == 2 and sorted(pods["evals_per_seed"]) == [0, 2]  # NaN eval dropped
    assert "noeval: no evaluation" in table
    assert "skipped" in table and "empty" in table
    assert "1 unreadable metrics lines" in table


def test_runs_of_different_datasets_or_models_are_not_pooled_and_an_unreadable_log_says_why(tmp_path):
    """One label's seeds on two datasets would be averaged into one curve: refused, naming the settings."""
    runs = [make_run(tmp_path, f"s{seed}", "PODS 16/4", seed, ramp(0.5, 100)) for seed in (0, 1)]
    config = json.loads((runs[1] / "config.json").read_text())
    (runs[1] / "config.json").write_text(json.dumps(dict(config, preset="c", dataset="math")))
    with pytest.raises(ValueError, match=r"different presets, datasets or models .*'c \(math, None\)': 1"):
        compare.compare(runs)
    (runs[0] / "metrics.jsonl").write_bytes(b'{"type": "eval", "eval/accuracy": 0.5}\n\xff\n')
    with pytest.raises(ValueError, match=r"no readable run directory: .*s0: 'utf-8' codec can't decode byte 0xff"):
        compare.compare(runs[:1])


def test_non_finite_eval_points_are_counted_under_the_table(tmp_path):
    """A NaN (or infinite) accuracy or time drops that eval point from the curve, and the table says so."""
    runs = [make_run(tmp_path, "g", "GRPO", 0, ramp(0.5, 100)),
            make_run(tmp_path, "nan", "PODS", 0, [(0, 0.1), (10, float("nan")), (20, 0.3), (30, float("inf"))],
                     extra_lines=[json.dumps({"type": "eval", "step": 9, "elapsed_s": float("nan"),
                                              "eval/accuracy": 0.4}) + "\n"])]
    assert compare.read_run(runs[1]).nonfinite_evals == 3
    rows, table = compare.compare(runs)
    assert rows[1]["evals_per_seed"] == [2]
    assert f"- {runs[1]}: 3 eval points left out, their time or accuracy not a finite number" in table
    assert f"{runs[0]}:" not in table  # nothing left out of the complete run
    # A line without the compared metric is not a point of its curve, not a dropped one.
    both = compare.read_run(runs[1], metric="both_accuracy")
    assert both.nonfinite_evals == 0 and len(both.eval_times_s) == 0


def test_resumed_run_keeps_last_line_per_step_and_step_times(tmp_path):
    run = make_run(tmp_path, "r", "M", 0, [(0, 0.1), (5, 0.2)], step_times=[2.0, 4.0, 3.0],
                   extra_lines=[json.dumps({"type": "eval", "step": 1, "elapsed_s": 6, "eval/accuracy": 0.5}) + "\n"])
    data = compare.read_run(run)
    np.testing.assert_allclose(data.eval_times_s, [0, 6])
    np.testing.assert_allclose(data.eval_accuracy, [0.1, 0.5])
    np.testing.assert_allclose(data.step_durations_s, [2.0, 4.0, 3.0])
    assert data.phase_means_s["generate_s"] == pytest.approx(0.75 * 3.0)


def test_baseline_selection(tmp_path):
    runs = [make_run(tmp_path, "a", "GRPO 4/4", 0, ramp(0.5, 100)),
            make_run(tmp_path, "b", "GRPO 8/8", 0, ramp(0.5, 50))]
    with pytest.raises(ValueError, match="baseline"):
        compare.compare(runs)
    rows, _ = compare.compare(runs, baseline_label="GRPO 8/8")
    assert rows[0]["speedup"] == "0.50x"
    with pytest.raises(ValueError, match="not among"):
        compare.compare(runs, baseline_label="nope")


def test_degenerate_baselines_give_undefined_speedup(tmp_path):
    runs = [make_run(tmp_path, "a", "GRPO", 0, [(0, 0.0), (10, 0.0)]),
            make_run(tmp_path, "b", "PODS", 0, [(0, 0.0), (10, 0.2)])]
    rows, _ = compare.compare(runs)
    assert all(r["speedup"].startswith("undefined") for r in rows)
    # A baseline already at 0.99 x its peak at t = 0 gives T_b = 0: no meaningful ratio either, whether its
    # peak is that first evaluation or a later one within 1% of it.
    for name, baseline in (("c", [(0, 0.3), (10, 0.2)]), ("e", [(0, 0.298), (10, 0.3)])):
        runs = [make_run(tmp_path, name, "GRPO", 0, baseline), make_run(tmp_path, name + "2", "PODS", 0,
                                                                         [(0, 0.3), (10, 0.4)])]
        rows, table = compare.compare(runs)
        assert [r["speedup"] for r in rows] == ["undefined (baseline reaches the threshold at 0 s)"] * 2
        assert rows[1]["peak_accuracy"] == 0.4 and rows[1]["time_to_threshold_s"] == 0.0
    # A baseline that peaks at its first evaluation taken after t = 0 has T_b > 0: the ratio is defined.
    runs = [make_run(tmp_path, "f", "GRPO", 0, [(5, 0.3), (10, 0.2)]),
            make_run(tmp_path, "g", "PODS", 0, [(5, 0.3), (10, 0.4)])]
    assert [r["speedup"] for r in compare.compare(runs)[0]] == ["1.00x", "1.00x"]


def test_compare_cli_writes_plot_table_and_json(tmp_path, capsys):
    runs = [str(make_run(tmp_path, f"{m}{s}", m, s, ramp(0.4, p, offset=0.02 * s), step_times=[1.0] * 5))
            for m, p in (("GRPO", 100), ("PODS", 60)) for s in range(3)]
    out = tmp_path / "out"
    rows = compare.main([*runs, "--plot", str(out / "c.png"), "--table", str(out / "t.md"),
                         "--json", str(out / "r.json")])
    assert (out / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "| PODS |" in (out / "t.md").read_text() and "| PODS |" in capsys.readouterr().out
    assert json.loads((out / "r.json").read_text())[1]["method"] == rows[1]["method"] == "PODS"
    assert rows[1]["step_s"] == pytest.approx(1.0) and rows[1]["generate_s"] == pytest.approx(0.75)
    assert "| 0.75 / 0.25 |" in (out / "t.md").read_text()


def test_metric_choice(tmp_path):
    run = make_run(tmp_path, "r", "M", 0, [(0, 0.3), (5, 0.4)],
                   extra_lines=[json.dumps({"type": "eval", "step": 2, "elapsed_s": 9, "eval/accuracy": 0.2,
                                            "eval/both_accuracy": 0.15}) + "\n"])
    assert list(compare.read_run(run).eval_accuracy) == [0.3, 0.4, 0.2]
    both = compare.read_run(run, metric="both_accuracy")  # lines without the metric are left out
    assert list(both.eval_times_s) == [9.0] and list(both.eval_accuracy) == [0.15]
    with pytest.raises(ValueError, match="metric"):
        compare.read_run(run, metric="loss")


def test_settings_that_differ_between_runs_are_reported(tmp_path):
    runs = [make_run(tmp_path, f"r{s}", "GRPO" if s else "PODS", s, ramp(0.4, 50)) for s in range(3)]
    for run, lr in zip(runs, (3e-4, 3e-4, 5e-4)):
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps(dict(config, learning_rate=lr, output_dir=str(run))))
    _, table = compare.compare(runs)
    assert "settings differ between runs: learning_rate: 0.0003 (2 runs), 0.0005 (1 runs)" in table
    assert "output_dir" not in table and "seed" not in table.split("settings differ")[1]
    # A variant flag the method label does not name would otherwise pool different objectives as seeds of one.
    config = json.loads((runs[2] / "config.json").read_text())
    (runs[2] / "config.json").write_text(json.dumps(dict(config, advantage_normalization="group")))
    assert "advantage_normalization: " in compare.compare(runs)[1]


def test_one_method_draws_its_curve_and_table_without_a_speedup(tmp_path):
    run = make_run(tmp_path, "demo", "PODS max_variance 16/4", 0, ramp(0.5, 50), step_times=[2.0] * 4)
    rows, table = compare.compare([run], plot=tmp_path / "demo.png")  # the one run a newcomer has
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert rows[0]["speedup"] is None and rows[0]["threshold"] is None and rows[0]["time_to_threshold_s"] is None
    assert rows[0]["peak_accuracy"] == pytest.approx(0.5)
    header, rule, line = table.splitlines()[2:5]
    assert "speed-up" not in header and "threshold" not in table and "one method" in table
    assert header.count("|") == rule.count("|") == line.count("|") == 8  # 7 columns, each row alike
    assert line.startswith("| PODS max_variance 16/4 | 1 | 11 | 100 | 0.500 | 2.00 |")
    with pytest.raises(ValueError, match="not among"):
        compare.compare([run], baseline_label="GRPO 4/4")


def run_cli(monkeypatch, argv):
    """compare.py run as a command (its __main__ block); returns the exit message."""
    import runpy

    monkeypatch.setattr("sys.argv", ["compare.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(compare.__file__, run_name="__main__")
    return exit_info.value.code


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    runs = [make_run(tmp_path, "a", "GRPO 4/4", 0, ramp(0.5, 100)),
            make_run(tmp_path, "b", "GRPO 8/8", 0, ramp(0.5, 50))]
    for argv, message in (([tmp_path / "missing"], "missing does not exist"),
                          ([empty], "no readable run directory"),
                          (runs, "cannot pick the baseline among"),
                          ([*runs, "--baseline-label", "nope"], "'nope' is not among")):
        text = run_cli(monkeypatch, argv)
        assert text.startswith("compare.py: error: ") and message in text and "\n" not in text
    assert run_cli(monkeypatch, [*runs, "--metric", "loss"]) == 2  # argparse: usage line, no traceback
    assert "invalid choice: 'loss'" in capsys.readouterr().err


def test_the_plotted_band_stays_inside_0_and_1_and_is_the_mean_without_seeds():
    low, high = compare.band_limits(np.array([0.1, 0.5, 0.95]), np.array([0.3, 0.2, np.nan]))
    assert low == pytest.approx([0.0, 0.3, 0.95]) and high == pytest.approx([0.4, 0.7, 0.95])


def test_runs_of_different_budgets_are_not_pooled_unless_cut_to_one(tmp_path, monkeypatch):
    """A 180 s and a 600 s demo run are not two seeds of one curve: refused in one line naming both; --budget-s 180
    reads both as 180 s runs; --budget-s 600 cannot stretch the 180 s run; different step limits stay refused."""
    runs = []
    for seed, budget in enumerate((180, 600)):
        run = make_run(tmp_path, f"demo-{budget}", "PODS max_variance 16/4", seed,
                       [(0, 0.1), (170, 0.3), (590, 0.5)][:2 + seed], step_times=[10.0] * (budget // 10))
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps(dict(config, max_time_s=budget, max_steps=0)))
        runs.append(run)
    text = run_cli(monkeypatch, runs)
    assert text == ("compare.py: error: runs of different budgets are not pooled as seeds: max_time_s 180, max_steps "
                    "0: demo-180; max_time_s 600, max_steps 0: demo-600. Pass --budget-s S to read every run as one "
                    "of S seconds of training, or compare them apart")
    rows, _ = compare.compare(runs, budget_s=180)
    assert rows[0]["seeds"] == 2 and rows[0]["curve_end_s"] == 170  # the 600 s run's later evaluations cut
    with pytest.raises(ValueError, match=r"--budget-s 600: runs trained for less .*: demo-180 \(180 s\)"):
        compare.compare(runs, budget_s=600)
    config = json.loads((runs[1] / "config.json").read_text())
    (runs[1] / "config.json").write_text(json.dumps(dict(config, max_steps=5)))
    with pytest.raises(ValueError, match="different step limits"):
        compare.compare(runs, budget_s=180)
    from studies import bootstrap  # its report refuses them alike

    with pytest.raises(ValueError, match="different budgets"):
        bootstrap.report(runs, "PODS max_variance 16/4", resamples=5)


def test_a_budget_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch, capsys):
    """--budget-s -5 would cut every run to its first step and nan read as no budget: argparse refuses both, naming
    the flag (as study.py's budgets)."""
    run = make_run(tmp_path, "a", "GRPO 4/4", 0, ramp(0.5, 100))
    for value in ("-5", "nan", "0"):
        assert run_cli(monkeypatch, [run, "--budget-s", value]) == 2
        assert f"argument --budget-s: must be a finite number > 0, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (b'{"config": {}, "results": {"step_000001": {"step": 1, "elapsed_s"', "not valid JSON, cut short or corrupt"),
    (b'{"config": {}}', "not an eval.py results file (no 'results' in it)"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (None, "no such file"),
])
def test_an_unreadable_eval_file_is_named(tmp_path, monkeypatch, content, message):
    """--eval-file that is cut short, not eval.py's, not UTF-8 or missing: one line naming the file of each run."""
    runs = [make_run(tmp_path, name, "GRPO 4/4", seed, ramp(0.5, 100)) for seed, name in enumerate("ab")]
    for run in runs:
        if content is not None:
            (run / "scores.json").write_bytes(content)
    text = run_cli(monkeypatch, [*runs, "--eval-file", "scores.json"])
    assert text.startswith("compare.py: error: no readable run directory: ") and "\n" not in text
    assert all(f"{run / 'scores.json'}: {message}" in text for run in runs)
    with pytest.raises(ValueError, match=re.escape(f"{runs[0] / 'scores.json'}: {message}")):  # several files
        compare.compare_benchmarks(runs, ["scores.json", "scores.json"])


def test_runs_whose_steps_could_not_learn_are_named_under_the_table(tmp_path):
    """A step that gave the update nothing to learn from (metrics.jsonl's "cannot_learn") is counted under the table,
    by why, with what to change."""
    stuck = make_run(tmp_path, "stuck", "GRPO 4/4", 0, ramp(0.5, 100), step_times=[1.0] * 3, extra_lines=[
        json.dumps({"type": "train", "step": step, "elapsed_s": float(step), "cannot_learn": codes}) + "\n"
        for step, codes in ((1, ["truncated", "rewards_zero"]), (2, ["truncated"]), (3, []))])
    fine = make_run(tmp_path, "fine", "GRPO 4/4", 1, ramp(0.5, 100), step_times=[1.0] * 3)
    _, table = compare.compare([stuck, fine])
    assert (f"- {stuck}: steps that could not learn: 2 truncated, 1 rewards_zero of 3 steps; raise "
            "--max-completion-tokens") in table
    assert str(fine) not in table
