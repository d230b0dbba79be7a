"""bootstrap.py: the 95% intervals over seeds of the speed-up (Appendix A.4), peak and final accuracy, on the time
and the step axis, checked against hand-computed cases; never-reached and undefined speed-ups; the plot and CLI."""

import json
import math

import numpy as np
import pytest

import bootstrap
import compare
from test_compare import make_run, ramp


def runs_by_label(root, spec):
    """{label: [RunData]} from {label: [eval points of each seed]}."""
    return {label: [compare.read_run(make_run(root, f"{label}-{seed}", label, seed, points))
                    for seed, points in enumerate(seeds)] for label, seeds in spec.items()}


def test_interval_matches_a_hand_computed_bootstrap(tmp_path):
    """Baseline: one seed reaching 0.5 at t = 100 (evaluations every 5 s), so its threshold 0.495 is crossed at
    t = 99 on every resample. Method: seed A reaches 0.5 at 50 s (crosses at 49.5), seed B at 25 s (24.75).
    A resample of the method's two seeds is AA (p 1/4, 99/49.5 = 2x), BB (1/4, 99/24.75 = 4x) or AB (1/2: the mean
    is 0.475 at 45 s and 0.5 at 50 s, crossing at 49 s, 99/49 = 2.0204x); the 2.5th and 97.5th percentiles of
    2000 resamples are therefore AA's and BB's values, and the point estimate (both seeds) is AB's."""
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 100, every_s=5)],
                                    "PODS": [ramp(0.5, 50, every_s=5), ramp(0.5, 25, every_s=5)]})
    result = bootstrap.bootstrap(runs, "GRPO")
    assert result["GRPO"]["threshold_at"] == pytest.approx(99.0) and result["GRPO"]["speedup"] == pytest.approx(1.0)
    assert result["GRPO"]["speedup_ci"] == pytest.approx((1.0, 1.0, 0))
    pods = result["PODS"]
    assert pods["threshold_at"] == pytest.approx(49.0) and pods["speedup"] == pytest.approx(99 / 49)
    assert pods["speedup_ci"] == pytest.approx((2.0, 4.0, 0))
    assert pods["peak"] == pytest.approx(0.5) and pods["peak_ci"] == pytest.approx((0.5, 0.5, 0))
    # compare.py's point figures on the same runs agree with the bootstrap's all-seeds estimate.
    rows = compare.speedup_rows([compare.method_curve(label, r, min_seeds=0) for label, r in runs.items()], "GRPO")
    assert rows[1]["time_to_threshold_s"] == pytest.approx(pods["threshold_at"])
    assert rows[1]["speedup"] == f"{99 / 49:.2f}x"


def test_identical_seeds_give_an_interval_of_one_value_and_final_accuracy_its_percentiles(tmp_path):
    """Every resample of identical seeds gives the same curves: the interval is the point. Final accuracy: the mean
    of the drawn seeds' last evaluations, so with seeds ending at 0.2 and 0.4 its extremes are those values."""
    same = [ramp(0.5, 40, every_s=5)] * 3
    ends = [[(0, 0.0), (10, 0.2)], [(0, 0.0), (10, 0.4)]]
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 80, every_s=5)] * 2, "PODS": same, "other": ends})
    result = bootstrap.bootstrap(runs, "GRPO", resamples=300)
    assert result["PODS"]["speedup"] == pytest.approx(2.0)  # 79.2 s / 39.6 s
    assert result["PODS"]["speedup_ci"] == pytest.approx((2.0, 2.0, 0))
    assert result["other"]["final"] == pytest.approx(0.3)
    assert result["other"]["final_ci"] == pytest.approx((0.2, 0.4, 0))
    assert result["other"]["speedup"] == 0.0 and result["other"]["speedup_ci"][:2] == (0.0, 0.0)  # never reached
    again = bootstrap.bootstrap(runs, "GRPO", resamples=300)
    assert json.dumps(again, sort_keys=True) == json.dumps(result, sort_keys=True)  # seeded: the same every call


def test_never_reached_and_undefined_speedups(tmp_path):
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 100)] * 2, "slow": [ramp(0.3, 100)] * 2,
                                    "half": [ramp(0.5, 50), ramp(0.3, 50)]})
    result = bootstrap.bootstrap(runs, "GRPO", resamples=400)
    assert result["slow"]["speedup"] == 0.0 and result["slow"]["speedup_ci"] == (0.0, 0.0, 0)
    # "half": one seed reaches the threshold, one never does. The mean of both never reaches 0.495; a resample of
    # the first seed twice (p 1/4) reaches it at 49.5 s: the interval runs from 0 (not reached) to 2x.
    assert result["half"]["speedup"] == 0.0 and result["half"]["speedup_ci"][:2] == pytest.approx((0.0, 2.0))
    by_axis = {axis: bootstrap.bootstrap(runs, "GRPO", axis, resamples=50) for axis in bootstrap.AXES}
    table = bootstrap.markdown_table(by_axis, runs, "GRPO")
    assert "| slow | 2 |" in table and "not reached [0.00, 0.00]" in table
    # A baseline that never leaves 0 has no threshold; one at its threshold from t = 0 has T_b = 0: undefined.
    for flat in ([(0, 0.0), (10, 0.0)], [(0, 0.3), (10, 0.2)]):
        runs = runs_by_label(tmp_path / str(flat[0][1]), {"GRPO": [flat] * 2, "PODS": [ramp(0.5, 50)] * 2})
        result = bootstrap.bootstrap(runs, "GRPO", resamples=20)
        assert math.isnan(result["PODS"]["speedup"]) and math.isnan(result["PODS"]["speedup_ci"][0])
        assert result["PODS"]["speedup_ci"][2] == 20  # every resample undefined, and counted
        by_axis = {axis: bootstrap.bootstrap(runs, "GRPO", axis, resamples=20) for axis in bootstrap.AXES}
        assert "| undefined undefined |" in bootstrap.markdown_table(by_axis, runs, "GRPO")
    with pytest.raises(ValueError, match="not among"):
        bootstrap.bootstrap(runs, "GRPO-GA")


def test_step_axis_measures_learning_per_step(tmp_path):
    """PODS takes half the time per step and learns the same per step: 2x on the clock, 1x per step."""
    grpo = [(10.0 * step, 0.05 * min(step, 10)) for step in range(21)]
    pods = [(5.0 * step, 0.05 * min(step, 10)) for step in range(21)]
    runs = runs_by_label(tmp_path, {"GRPO": [grpo] * 2, "PODS": [pods] * 2})
    on_time = bootstrap.bootstrap(runs, "GRPO", "time", resamples=50)
    on_steps = bootstrap.bootstrap(runs, "GRPO", "steps", resamples=50)
    assert on_time["PODS"]["speedup"] == pytest.approx(2.0) and on_steps["PODS"]["speedup"] == pytest.approx(1.0)
    assert on_steps["PODS"]["threshold_at"] == pytest.approx(9.9)  # steps: 0.495 at step 9.9
    with pytest.raises(ValueError, match="axis"):
        bootstrap.on_axis(runs["GRPO"][0], "tokens")


def test_report_writes_table_plot_and_json_from_run_folders(tmp_path, capsys):
    for seed in range(3):
        make_run(tmp_path / "runs", f"g{seed}", "GRPO 16/16", seed, ramp(0.4, 100, offset=0.01 * seed),
                 step_times=[4.0] * 5)
        make_run(tmp_path / "runs", f"p{seed}", "PODS max_variance 16/4", seed, ramp(0.4, 50, offset=0.01 * seed),
                 step_times=[2.0] * 10)
    out = tmp_path / "out"
    by_axis = bootstrap.main([str(tmp_path / "runs"), "--baseline-label", "GRPO 16/16", "--plot", str(out / "p.png"),
                              "--table", str(out / "t.md"), "--json", str(out / "f.json"), "--resamples", "100"])
    assert (out / "p.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "t.md").read_text()
    assert table.strip() in capsys.readouterr().out
    pods_row = next(line for line in table.splitlines() if line.startswith("| PODS max_variance 16/4 |"))
    assert "| 3 | 10,10,10 | 1.5 / 0.5 / 2.0 |" in pods_row  # make_run: generate 0.75, update 0.25 of a step
    assert json.loads((out / "f.json").read_text())["time"]["PODS max_variance 16/4"]["seeds"] == 3
    assert by_axis["steps"]["GRPO 16/16"]["speedup"] == pytest.approx(1.0)


def test_cli_errors_are_one_line(tmp_path, monkeypatch):
    import runpy

    make_run(tmp_path, "a", "GRPO", 0, ramp(0.5, 100))
    for argv, message in (([str(tmp_path / "missing"), "--baseline-label", "GRPO"], "missing does not exist"),
                          ([str(tmp_path), "--baseline-label", "nope"], "'nope' is not among")):
        monkeypatch.setattr("sys.argv", ["bootstrap.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(bootstrap.__file__, run_name="__main__")
        text = str(exit_info.value.code)
        assert text.startswith("bootstrap.py: error: ") and message in text and "\n" not in text
    assert np.isnan(bootstrap.interval([math.nan] * 3)[0]) and bootstrap.interval([math.nan] * 3)[2] == 3


def test_a_run_is_read_as_one_with_the_budget_would_have_logged(tmp_path):
    """Steps of 10 s, evaluations every 2 steps. Budget 45 s: train.py stops after step 4 (elapsed 40 + 10 > 45),
    so the evaluations at steps 0, 2, 4 stay; budget 50 s allows step 5 (40 + 10 = 50), not step 6. The report with
    --budget-s ranks a run longer than the others by its first part only: its later peak is not seen."""
    evals = [(10.0 * step, 0.1 * step) for step in range(0, 11, 2)]
    path = make_run(tmp_path, "long", "GRPO", 0, evals, step_times=[10.0] * 10)
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for line in lines:  # make_run numbers evaluations 0, 1, 2...: give them their steps
        if line["type"] == "eval":
            line["step"] = int(line["elapsed_s"] // 10)
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = compare.read_run(path)
    cut = bootstrap.within_budget(run, 45)
    assert list(cut.eval_steps) == [0, 2, 4] and list(cut.eval_accuracy) == pytest.approx([0.0, 0.2, 0.4])
    assert len(cut.step_durations_s) == 4 and len(bootstrap.within_budget(run, 50).step_durations_s) == 5
    # The per-phase clock is the kept steps' too: steps of 10 s then 40 s (make_run: generate = 0.75 x the step).
    slow_end = compare.read_run(make_run(tmp_path, "slow-end", "GRPO", 2, evals, step_times=[10.0] * 4 + [40.0] * 2))
    assert slow_end.phase_means_s["generate_s"] == pytest.approx((4 * 7.5 + 2 * 30.0) / 6)
    assert bootstrap.within_budget(slow_end, 45).phase_means_s == pytest.approx({"generate_s": 7.5, "update_s": 2.5})
    assert bootstrap.within_budget(run, None) is run and bootstrap.within_budget(run, 1e9).eval_steps.tolist() == \
        run.eval_steps.tolist()
    no_steps = compare.read_run(make_run(tmp_path, "evals-only", "GRPO", 1, evals))
    assert list(bootstrap.within_budget(no_steps, 45).eval_times_s) == [0.0, 20.0, 40.0]
    make_run(tmp_path, "short", "GRPO", 1, evals[:3], step_times=[10.0] * 4)
    by_axis, _ = bootstrap.report([tmp_path / "long", tmp_path / "short"], "GRPO", resamples=20, budget_s=45)
    assert by_axis["time"]["GRPO"]["peak"] == pytest.approx(0.4)
    by_axis, _ = bootstrap.report([tmp_path / "long", tmp_path / "short"], "GRPO", resamples=20)
    assert by_axis["time"]["GRPO"]["final"] == pytest.approx((1.0 + 0.4) / 2)
