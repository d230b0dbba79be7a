"""studies/bootstrap.py (python study.py bootstrap): the paired 95% intervals over seeds of the speed-up (Appendix A.4), peak, final and mean accuracy
on the time and the step axis, checked against hand-computed cases: pairing by seed, the fixed threshold, censored
("not reached") speed-ups, the mean-accuracy difference, runs without evaluations; the plot and CLI."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from studies import bootstrap
import compare
from test_compare import make_run, ramp


def runs_by_label(root, spec):
    """{label: [RunData]} from {label: [eval points of each seed]}."""
    return {label: [compare.read_run(make_run(root, f"{label}-{seed}", label, seed, points))
                    for seed, points in enumerate(seeds)] for label, seeds in spec.items()}


def test_resamples_are_paired_by_seed(tmp_path):
    """Seed 1's prompts are easier for every arm: the baseline reaches 0.5 at 100 s (seed 0) and 50 s (seed 1), the
    method at 50 s and 25 s, twice as fast on each seed. Paired, every resample ({0, 0}: 99/49.5, {1, 1}: 49.5/24.75,
    {0, 1}: 98/49) gives 2x, so the interval is [2, 2]; resampled arm by arm it would mix seed 0's baseline with seed
    1's method (99/24.75 = 4x) and spread from 1x to 4x. The threshold is 0.99 x the peak over both seeds, 0.495."""
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 100, every_s=5), ramp(0.5, 50, every_s=5)],
                                    "PODS": [ramp(0.5, 50, every_s=5), ramp(0.5, 25, every_s=5)]})
    result = bootstrap.bootstrap(runs, "GRPO")
    pods = result["PODS"]
    assert result["GRPO"]["threshold"] == pytest.approx(0.495) and result["GRPO"]["threshold_at"] == pytest.approx(98)
    assert pods["threshold_at"] == pytest.approx(49.0) and pods["speedup"] == pytest.approx((2.0, 2.0))
    assert pods["speedup_ci"]["low"] == pytest.approx((2.0, 2.0)) and pods["speedup_ci"]["high"] == \
        pytest.approx((2.0, 2.0)) and pods["speedup_ci"]["censored"] == 0 and pods["reached_share"] == 1.0
    assert result["GRPO"]["speedup"] == (1.0, 1.0)
    # compare.py's point figures on the same runs agree with the bootstrap's all-seeds estimate.
    rows = compare.speedup_rows([compare.method_curve(label, r, min_seeds=0) for label, r in runs.items()], "GRPO")
    assert rows[1]["time_to_threshold_s"] == pytest.approx(pods["threshold_at"]) and rows[1]["speedup"] == "2.00x"
    # A seed the method lacks (a failed run) is left out of the method only: the baseline keeps both.
    runs["PODS"] = runs["PODS"][:1]
    one = bootstrap.bootstrap(runs, "GRPO", resamples=200)
    assert one["PODS"]["seeds"] == 1 and one["GRPO"]["threshold"] == pytest.approx(0.495)
    assert one["PODS"]["final_ci"][2] > 0  # resamples drawing seed 1 alone: the method has no run, counted


def test_an_arm_on_fewer_seeds_is_paired_with_the_baselines_runs_of_those_seeds(tmp_path):
    """The baseline ran seeds 0-2, the arm only 0-1 (5 seeds against 8 in the PODS study), and the arm's runs are
    the baseline's own: paired on the seeds both have, every resample's difference is 0 and every defined speed-up
    1x. Against the baseline's mean over all drawn seeds, seed 2 (a fast learner only the baseline ran) would make
    the arm look slower and worse (mean accuracy 0.33 against 0.41 on all seeds)."""
    spec = [ramp(0.6, 100, every_s=5), ramp(0.6, 80, every_s=5)]
    runs = runs_by_label(tmp_path, {"GRPO": [*spec, ramp(0.6, 10, every_s=5)], "PODS": spec})
    result = bootstrap.bootstrap(runs, "GRPO", resamples=300, budget=100)
    pods = result["PODS"]
    assert pods["seeds"] == 2 and result["GRPO"]["seeds"] == 3
    assert pods["mean_accuracy_difference"] == 0.0 and pods["speedup"] == (1.0, 1.0)
    low, high, undefined = pods["mean_accuracy_difference_ci"]
    assert low == high == 0.0 and undefined == pytest.approx(300 / 27, abs=12)  # resamples of seed 2 alone: (1/3)^3
    assert pods["speedup_ci"]["low"] == (1.0, 1.0) and pods["speedup_ci"]["high"] == (1.0, 1.0)
    # The arm's own figures are over its own seeds: its mean accuracy is below the baseline's three-seed mean.
    assert pods["mean_accuracy"] == pytest.approx(0.33) and result["GRPO"]["mean_accuracy"] == pytest.approx(0.41)


def test_the_threshold_is_fixed_before_resampling(tmp_path):
    """Baseline seeds peak at 0.6 and 0.4 (at 100 s): the threshold is 0.99 x 0.5 = 0.495 in every resample, so a
    resample of seed 1 twice (p 1/4) has a baseline that never reaches it, where re-maximising would have lowered
    the bar to 0.396. The method (each seed twice as fast) then cannot be compared either: neither reached, the
    speed-up is somewhere in [0, inf], and the interval's ends are bounds: below 2 and above 2."""
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.6, 100), ramp(0.4, 100)],
                                    "PODS": [ramp(0.6, 50), ramp(0.4, 50)]})
    result = bootstrap.bootstrap(runs, "GRPO")
    assert result["GRPO"]["threshold"] == result["PODS"]["threshold"] == pytest.approx(0.495)
    assert result["GRPO"]["reached_share"] == pytest.approx(0.75, abs=0.04)
    pods = result["PODS"]
    assert pods["speedup"] == pytest.approx((2.0, 2.0))
    assert pods["speedup_ci"]["low"] == (0.0, pytest.approx(2.0)) and pods["speedup_ci"]["high"] == \
        (pytest.approx(2.0), math.inf)
    assert pods["speedup_ci"]["censored"] == pytest.approx(500, abs=80)
    assert bootstrap.speedup_text(pods) == "2.0x [< 2.0, > 2.0]"


def test_not_reached_is_a_bound_never_zero(tmp_path):
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 100)] * 2, "slow": [ramp(0.3, 100)] * 2,
                                    "half": [ramp(0.5, 50), ramp(0.3, 50)]})
    result = bootstrap.bootstrap(runs, "GRPO", resamples=400)
    # "slow" ends at 100 s below the threshold: T_m > 100 s, so the speed-up is below 99/100.
    slow = result["slow"]
    assert slow["speedup"] == (0.0, pytest.approx(0.99)) and slow["reached_share"] == 0.0
    assert bootstrap.speedup_text(slow) == "not reached (< 0.99x) [< 0.99, < 0.99]"
    # "half": one seed reaches the threshold, one never does. Both together never reach 0.495 (< 0.99x); the first
    # seed drawn twice (p 1/4) reaches it at 49.5 s: 2x. The interval's low end is censored, its high end 2x.
    half = result["half"]
    assert half["reached_share"] == pytest.approx(0.25, abs=0.07)
    assert bootstrap.speedup_text(half) == "not reached (< 0.99x) [< 0.99, 2.0]"
    by_axis = {axis: bootstrap.bootstrap(runs, "GRPO", axis, resamples=50) for axis in bootstrap.AXES}
    table = bootstrap.markdown_table(by_axis, runs, "GRPO")
    assert "| slow | 2 |" in table and "not reached (< 0.99x) [< 0.99, < 0.99]" in table
    assert "0.00]" not in table.split("Per optimizer step")[1].replace("[0.00, 0.00]", "")  # no 0x anywhere
    assert "[0.00, 0.00]" not in "".join(line.split("|")[9] for line in table.splitlines() if line.startswith("| s"))
    # A baseline that never leaves 0 has no threshold; one at its threshold from t = 0 has T_b = 0: undefined.
    for flat in ([(0, 0.0), (10, 0.0)], [(0, 0.3), (10, 0.2)]):
        runs = runs_by_label(tmp_path / str(flat[0][1]), {"GRPO": [flat] * 2, "PODS": [ramp(0.5, 50)] * 2})
        result = bootstrap.bootstrap(runs, "GRPO", resamples=20)
        assert math.isnan(result["PODS"]["speedup"][0]) and result["PODS"]["speedup_ci"]["undefined"] == 20
        by_axis = {axis: bootstrap.bootstrap(runs, "GRPO", axis, resamples=20) for axis in bootstrap.AXES}
        assert "| undefined undefined |" in bootstrap.markdown_table(by_axis, runs, "GRPO")
    with pytest.raises(ValueError, match="not among"):
        bootstrap.bootstrap(runs, "GRPO-GA")


def test_mean_accuracy_over_the_budget_and_its_paired_difference(tmp_path):
    """Baseline seeds flat at 0.1 and 0.3; the method rises 0 -> 0.4 and 0.2 -> 0.6 over 100 s. Mean accuracy over
    [0, 100] (trapezoid): 0.2 / 0.4 for the method, 0.1 / 0.3 for the baseline; paired, the difference is +0.1 on
    both seeds, so its interval is [0.1, 0.1] (unpaired draws would spread it from -0.1 to +0.3). With a budget of
    150 s each seed is held at its last evaluation to 150 s: seed 0 of the method (0.2 x 100 + 0.4 x 50) / 150."""
    runs = runs_by_label(tmp_path, {"GRPO": [[(0, 0.1), (100, 0.1)], [(0, 0.3), (100, 0.3)]],
                                    "PODS": [[(0, 0.0), (100, 0.4)], [(0, 0.2), (100, 0.6)]]})
    result = bootstrap.bootstrap(runs, "GRPO", resamples=300)
    assert result["PODS"]["window"] == (0.0, 100.0) and result["PODS"]["mean_accuracy"] == pytest.approx(0.3)
    assert result["PODS"]["mean_accuracy_difference"] == pytest.approx(0.1)
    assert result["PODS"]["mean_accuracy_difference_ci"] == pytest.approx((0.1, 0.1, 0))
    assert result["GRPO"]["mean_accuracy_ci"] == pytest.approx((0.1, 0.3, 0))
    held = bootstrap.bootstrap(runs, "GRPO", resamples=10, budget=150)
    assert held["PODS"]["window"] == (0.0, 150.0)
    assert held["PODS"]["mean_accuracy"] == pytest.approx(((0.2 * 100 + 0.4 * 50) + (0.4 * 100 + 0.6 * 50)) / 300)
    # Without a budget the window ends at the earliest last evaluation: a run ending at 50 s cuts it there.
    assert bootstrap.mean_accuracy(np.array([0.0, 100.0]), np.array([0.0, 0.4]), 0.0, 50.0) == pytest.approx(0.1)
    assert math.isnan(bootstrap.mean_accuracy(np.array([0.0]), np.array([0.3]), 0.0, 0.0))
    by_axis = {axis: bootstrap.bootstrap(runs, "GRPO", axis, resamples=50) for axis in bootstrap.AXES}
    table = bootstrap.markdown_table(by_axis, runs, "GRPO")
    assert "| mean accuracy, 0-100 s | difference from GRPO |" in table
    assert "| 0.30 [0.20, 0.40] | +0.10 [+0.10, +0.10], t [+0.10, +0.10] |" in table  # paired t: sd 0
    assert result["PODS"]["mean_accuracy_difference_t"] == pytest.approx((0.1, 0.1, 0))


def test_the_paired_t_interval_and_the_baselines_crossing_on_the_arms_own_seeds(tmp_path):
    """Differences +0.1 and +0.3 on 2 seeds: mean 0.2, sd 0.1414, t(1) = 12.706: 0.2 -/+ 12.706 x 0.1. An arm run
    on seed 1 only is paired with the baseline's seed 1: its crossing beside the arm's is that seed's, not the
    mean over both."""
    runs = runs_by_label(tmp_path, {"GRPO": [[(0, 0.1), (100, 0.1)], [(0, 0.0), (50, 0.5), (100, 0.5)]],
                                    "PODS": [[(0, 0.2), (100, 0.2)], [(0, 0.3), (100, 0.4)]]})
    low, high, _ = bootstrap.bootstrap(runs, "GRPO", resamples=10)["PODS"]["mean_accuracy_difference_t"]
    differences = np.array([0.2 - 0.1, 0.35 - 0.375])
    half = 12.706 * differences.std(ddof=1) / math.sqrt(2)
    assert (low, high) == pytest.approx((differences.mean() - half, differences.mean() + half))
    one_seed = {"GRPO": runs["GRPO"], "PODS": runs["PODS"][1:]}
    result = bootstrap.bootstrap(one_seed, "GRPO", resamples=10)
    threshold = result["GRPO"]["threshold"]  # 0.99 x the mean curve's peak (0.3)
    assert result["PODS"]["baseline_threshold_at"] == pytest.approx(50 * threshold / 0.5)  # seed 1 alone
    assert result["GRPO"]["threshold_at"] != pytest.approx(result["PODS"]["baseline_threshold_at"])


def test_figures_are_quoted_at_two_significant_digits():
    assert [bootstrap._sig(v) for v in (2.0317, 0.8412, 12.3, 150.2, 0.0, math.inf)] == \
        ["2.0", "0.84", "12", "150", "0", "inf"]
    assert bootstrap._end(0.0, 0.83) == "< 0.83" and bootstrap._end(1.2, math.inf) == "> 1.2"
    assert bootstrap._end(1.9, 1.9) == "1.9" and bootstrap._end(1.5, 2.2) == "1.5-2.2"


def test_runs_without_evaluations_are_said_so(tmp_path, monkeypatch):
    """No run evaluated: one clear line, no numpy warning. An arm killed before its first evaluation: 'missing',
    with the count of its runs without one, not 'not reached'."""
    import runpy
    import warnings

    for seed in range(2):
        make_run(tmp_path / "none", f"g{seed}", "GRPO", seed, [], step_times=[1.0, 1.0])
    monkeypatch.setattr("sys.argv", ["study.py", "bootstrap", str(tmp_path / "none"), "--baseline-label", "GRPO"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(Path(bootstrap.__file__).parents[1] / "study.py"), run_name="__main__")
    assert str(exit_info.value.code) == ("study.py bootstrap: error: none of the 2 runs has an evaluation (no eval lines "
                                         "in metrics.jsonl: stopped before the first --eval-interval?); nothing "
                                         "to report")
    for seed in range(2):
        make_run(tmp_path / "some", f"g{seed}", "GRPO", seed, ramp(0.5, 100), step_times=[1.0, 1.0])
        make_run(tmp_path / "some", f"k{seed}", "killed", seed, [], step_times=[1.0])
        make_run(tmp_path / "some", f"p{seed}", "PODS", seed, ramp(0.5, 50) if seed else [], step_times=[1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_axis, table = bootstrap.report([tmp_path / "some"], "GRPO", resamples=50)
    killed = next(line for line in table.splitlines() if line.startswith("| killed |"))
    assert "| killed | 0 (2 of 2 runs without evaluation) |" in killed and "missing: no evaluation" in killed
    assert "not reached" not in killed and by_axis["time"]["killed"]["missing"]
    assert "| PODS | 1 (1 of 2 runs without evaluation) |" in table
    with pytest.raises(ValueError, match="the baseline 'killed' has no run with an evaluation"):
        bootstrap.report([tmp_path / "some"], "killed", resamples=5)


def test_step_axis_measures_learning_per_step(tmp_path):
    """PODS takes half the time per step and learns the same per step: 2x on the clock, 1x per step."""
    grpo = [(10.0 * step, 0.05 * min(step, 10)) for step in range(21)]
    pods = [(5.0 * step, 0.05 * min(step, 10)) for step in range(21)]
    runs = runs_by_label(tmp_path, {"GRPO": [grpo] * 2, "PODS": [pods] * 2})
    on_time = bootstrap.bootstrap(runs, "GRPO", "time", resamples=50)
    on_steps = bootstrap.bootstrap(runs, "GRPO", "steps", resamples=50)
    assert on_time["PODS"]["speedup"] == pytest.approx((2.0, 2.0)) and on_steps["PODS"]["speedup"] == (1.0, 1.0)
    assert on_steps["PODS"]["threshold_at"] == pytest.approx(9.9)  # steps: 0.495 at step 9.9
    with pytest.raises(ValueError, match="axis"):
        bootstrap.on_axis(runs["GRPO"][0], "tokens")


def make_two_arms(runs_dir, grpo_steps, pods_steps, pods_offset=0.01):
    """Three seeds of GRPO 16/16 (4 s a step, accuracy ramping to 0.4 by 100 s) and of PODS max_variance 16/4 (2 s a
    step, to 0.4 by 50 s) as run folders under runs_dir: g0-g2, p0-p2."""
    for seed in range(3):
        make_run(runs_dir, f"g{seed}", "GRPO 16/16", seed, ramp(0.4, 100, offset=0.01 * seed),
                 step_times=[4.0] * grpo_steps)
        make_run(runs_dir, f"p{seed}", "PODS max_variance 16/4", seed, ramp(0.4, 50, offset=pods_offset * seed),
                 step_times=[2.0] * pods_steps)


def test_report_writes_table_plot_and_json_from_run_folders(tmp_path, capsys):
    make_two_arms(tmp_path / "runs", 5, 10)
    out = tmp_path / "out"
    by_axis = bootstrap.main([str(tmp_path / "runs"), "--baseline-label", "GRPO 16/16", "--plot", str(out / "p.png"),
                              "--table", str(out / "t.md"), "--json", str(out / "f.json"), "--resamples", "100"])
    assert (out / "p.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "t.md").read_text()
    assert table.strip() in capsys.readouterr().out
    pods_row = next(line for line in table.splitlines() if line.startswith("| PODS max_variance 16/4 |"))
    assert "| 3 | 10,10,10 | 1.5 / 0.5 / 2.0 |" in pods_row  # make_run: generate 0.75, update 0.25 of a step
    assert "Per optimizer step:" in table and "On the clock (training wall-clock):" in table
    assert json.loads((out / "f.json").read_text())["time"]["PODS max_variance 16/4"]["seeds"] == 3
    assert by_axis["steps"]["GRPO 16/16"]["speedup"] == pytest.approx((1.0, 1.0))


def test_cli_errors_are_one_line(tmp_path, monkeypatch):
    import runpy

    make_run(tmp_path, "a", "GRPO", 0, ramp(0.5, 100))
    for argv, message in (([str(tmp_path / "missing"), "--baseline-label", "GRPO"], "missing does not exist"),
                          ([str(tmp_path), "--baseline-label", "nope"], "'nope' is not among")):
        monkeypatch.setattr("sys.argv", ["study.py", "bootstrap", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(Path(bootstrap.__file__).parents[1] / "study.py"), run_name="__main__")
        text = str(exit_info.value.code)
        assert text.startswith("study.py bootstrap: error: ") and message in text and "\n" not in text
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
    cut = compare.within_budget(run, 45)
    assert list(cut.eval_steps) == [0, 2, 4] and list(cut.eval_accuracy) == pytest.approx([0.0, 0.2, 0.4])
    assert len(cut.step_durations_s) == 4 and len(compare.within_budget(run, 50).step_durations_s) == 5
    # The per-phase clock is the kept steps' too: steps of 10 s then 40 s (make_run: generate = 0.75 x the step).
    slow_end = compare.read_run(make_run(tmp_path, "slow-end", "GRPO", 2, evals, step_times=[10.0] * 4 + [40.0] * 2))
    assert slow_end.phase_means_s["generate_s"] == pytest.approx((4 * 7.5 + 2 * 30.0) / 6)
    assert compare.within_budget(slow_end, 45).phase_means_s == pytest.approx({"generate_s": 7.5, "update_s": 2.5})
    assert compare.within_budget(run, None) is run and compare.within_budget(run, 1e9).eval_steps.tolist() == \
        run.eval_steps.tolist()
    no_steps = compare.read_run(make_run(tmp_path, "evals-only", "GRPO", 1, evals))
    assert list(compare.within_budget(no_steps, 45).eval_times_s) == [0.0, 20.0, 40.0]
    make_run(tmp_path, "short", "GRPO", 1, evals[:3], step_times=[10.0] * 4)
    by_axis, _ = bootstrap.report([tmp_path / "long", tmp_path / "short"], "GRPO", resamples=20, budget_s=45)
    assert by_axis["time"]["GRPO"]["peak"] == pytest.approx(0.4)
    by_axis, _ = bootstrap.report([tmp_path / "long", tmp_path / "short"], "GRPO", resamples=20)
    assert by_axis["time"]["GRPO"]["final"] == pytest.approx((1.0 + 0.4) / 2)


def test_clock_jitter_shows_how_far_the_intervals_move(tmp_path):
    """Each run's times scaled by up to +-10%: the method (twice as fast on every seed) stays at about 2x, so every
    draw's interval ends lie within 2 x 1.1 / 0.9 and 2 x 0.9 / 1.1; without jitter they are 2.0."""
    runs = runs_by_label(tmp_path, {"GRPO": [ramp(0.5, 100, every_s=5), ramp(0.5, 50, every_s=5)],
                                    "PODS": [ramp(0.5, 50, every_s=5), ramp(0.5, 25, every_s=5)]})
    lines = bootstrap.jitter_lines(runs, "GRPO", 0.1, resamples=50, draws=4)
    assert lines[0].startswith("Clock jitter: 4 draws, each run's times x U[0.9, 1.1]") and len(lines) == 2
    ends = [float(v) for v in lines[1].split("low end ")[1].split("; difference")[0].replace("high end ", "")
            .replace(";", ",").split(", ")]
    assert all(2 * 0.9 / 1.1 <= v <= 2 * 1.1 / 0.9 for v in ends) and len(set(ends)) > 1
    assert bootstrap.jitter_lines(runs, "GRPO", 0.0, resamples=20, draws=2)[1] == \
        "- PODS: low end 2.0; high end 2.0; difference [+0.06, +0.12]"  # no jitter: one value each
