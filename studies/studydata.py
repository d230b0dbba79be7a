"""A study's runs as small data files that anyone can recompute the reported figures from (paper §4, App. A.4).

A run folder (train.py's config.json + metrics.jsonl, with checkpoints and logs) is too large to commit; what the
comparison figures need is small: each evaluation's step, training seconds and held-out accuracy, and each step's
time and generate / update phases. `export_run` writes those as one JSON file per run; `read_study` reads them back
as compare.RunData, so `python study.py bootstrap --from-data results/<study> --baseline-label ...` recomputes a study's
tables from the committed files. Values that were not recorded are null (NaN once read): a run whose evaluations'
seconds are missing is reported per step only. A folder of data files may hold `study.json`: facts recorded for the
study as a whole, e.g. `arm_clock_s` ({label: {generate_s, update_s, step_s}}, per-arm means where the per-step
times were not kept).

    python study.py bootstrap runs/ga --baseline-label "GRPO 16/16" --budget-s 900 --export-data results/ga
"""

import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np

import compare

FORMAT = "pods run data 1"
STUDY_FILE = "study.json"
CONFIG_KEYS = ("label", "seed", "rule", "num_rollouts", "update_size", "max_time_s", "max_steps", "preset",
               "dataset", "model")  # what the readers use (labels, budgets, the settings check)


def _column(values):
    return [None if v is None or not math.isfinite(v) else round(float(v), 6) for v in values]


def run_record(run, metric="accuracy", note=None):
    """One run (compare.RunData) as the data file's dictionary."""
    record = {"format": FORMAT, "run": Path(run.run_dir).name, "label": run.label, "seed": run.seed,
              "metric": metric, "config": {k: run.config[k] for k in CONFIG_KEYS if k in run.config},
              "evaluations": {"step": [int(s) for s in run.eval_steps], "elapsed_s": _column(run.eval_times_s),
                              metric: _column(run.eval_accuracy)},
              "steps": len(run.step_durations_s), "step_s": _column(run.step_durations_s),
              **{k: _column(v) for k, v in run.step_phases_s.items()}}
    return dict(record, note=note) if note else record


def write_record(record, path):
    """One key per line, each value on it: small, diffable files."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items())
                          + "\n}\n")
    return Path(path)


def export_run(run_dir, out_dir, metric="accuracy"):
    """Read a run folder's metrics.jsonl (compare.read_run) and write <out_dir>/<run folder name>.json."""
    run = compare.read_run(run_dir, metric=metric)
    return write_record(run_record(run, metric), Path(out_dir) / f"{Path(run_dir).name}.json")


def export_runs(paths, out_dir, metric="accuracy"):
    """export_run for every run folder among paths (a folder of runs stands for all of them)."""
    return [export_run(path, out_dir, metric) for path in compare.expand_run_dirs(paths)]


def tracked_by_git(paths):
    """The paths among `paths` that git tracks (committed data, never to be deleted by a study); none outside a git
    checkout or without git."""
    paths = [Path(p) for p in paths]
    if not paths:
        return []
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *(p.name for p in paths)], cwd=paths[0].parent,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    names = set(listed.stdout.split("\0")) if listed.returncode == 0 else set()
    return [p for p in paths if p.name in names]


def read_data(path, metric="accuracy"):
    """A data file as compare.RunData (null values as NaN; per-step times, when only their count was kept, NaN)."""
    record = compare.read_json_object(path)
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: not a run data file (format {record.get('format')!r}, expected {FORMAT!r})")
    missing = [key for key in ("label", "seed", "steps", "evaluations") if key not in record]
    if missing or not isinstance(record["evaluations"], dict):
        raise ValueError(f"{path}: a run data file without {', '.join(missing) or 'its evaluations table'}")
    evaluations = record["evaluations"]
    if metric not in evaluations:
        raise ValueError(f"{path}: holds {record.get('metric')}, not {metric}")
    if any(key not in evaluations for key in ("elapsed_s", "step")):
        raise ValueError(f"{path}: its evaluations lack elapsed_s or step")

    def floats(values):
        return np.array([math.nan if v is None else v for v in values], dtype=float)

    steps = record["steps"]
    durations = floats(record["step_s"]) if record.get("step_s") else np.full(steps, math.nan)
    phases = {k: floats(record[k]) for k in compare.PHASES if record.get(k)}
    return compare.RunData(str(path), record["label"], record["seed"], floats(evaluations["elapsed_s"]),
                           floats(evaluations[metric]), durations, phases, config=dict(record.get("config", {})),
                           eval_steps=floats(evaluations["step"]))


def estimate_clock(runs, clock):
    """The runs with each evaluation whose training seconds were not recorded placed at its step x the arm's mean
    step time (clock: {label: {step_s}}); recorded seconds kept. An estimate, for a study whose times were lost:
    reported as such (bootstrap.py --estimate-clock)."""
    estimated = []
    for run in runs:
        step_s = (clock.get(run.label) or {}).get("step_s")
        if step_s is None:
            raise ValueError(f"{run.run_dir}: no mean step time recorded for {run.label!r} (study.json arm_clock_s): "
                             "its clock cannot be estimated")
        times = np.where(np.isfinite(run.eval_times_s), run.eval_times_s, run.eval_steps * step_s)
        estimated.append(replace(run, eval_times_s=times))
    return estimated


def read_study(paths, metric="accuracy"):
    """(runs, arm clock) from data files or folders of them (each folder's study.json: its arm_clock_s)."""
    runs, clock = [], {}
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_dir():
            files = sorted(p for p in path.glob("*.json") if p.name != STUDY_FILE)
            if (path / STUDY_FILE).is_file():
                clock.update(compare.read_json_object(path / STUDY_FILE).get("arm_clock_s", {}))
            if not files:
                raise ValueError(f"{path}: no run data files (*.json)")
        else:
            files = [path]
        runs += [read_data(file, metric) for file in files]
    return runs, clock
