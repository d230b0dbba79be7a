"""Your own data and reward with flags only: a JSONL / CSV / Parquet file (or a Hub id) with named fields and a prompt
template, its held-out part, refusals of bad rows before anything loads (one line: file, row, field), the recorded
files a resume checks, a reward function from a file of one's own, and the worked example of tests/example trained
end to end."""

import json
import shutil

import pytest
import torch

from run import config
import data
import rewards
import train
from run_helpers import ROOT, read_lines, tiny_argv

EXAMPLE = ROOT / "tests" / "example"
OWN = ["--dataset", str(EXAMPLE / "pens.jsonl"), "--question-field", "problem", "--answer-field", "solution",
       "--prompt-template", "{question} Say it in {unit}."]


def parse(*argv):
    return config.parse_args([*argv, "--device", "cpu"])


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------------------- reading and refusing
def test_a_file_of_ones_own_is_shaped_by_its_fields_and_template():
    args = parse(*OWN, "--eval-samples", "2")
    source = config.data_source(args)
    train_rows, test_rows = (data.load_split(args.dataset, split, source=source) for split in ("train", "test"))
    assert len(train_rows) + len(test_rows) == 20 and len(test_rows) == 2  # --eval-fraction's default 0.1
    assert not {row["problem"] for row in train_rows} & {row["problem"] for row in test_rows}
    row = test_rows[0]
    assert row["answer"] == row["solution"] and row["prompt"][-1]["content"] == f"{row['problem']} Say it in pens."
    assert args.one_shot is False  # the demo preset's worked example is for its own dataset
    assert args.data_files["dataset"]["sha256"] == data.file_sha256(EXAMPLE / "pens.jsonl")


def test_the_held_out_part_depends_on_the_rows_not_their_order(tmp_path):
    rows = [json.loads(line) for line in (EXAMPLE / "pens.jsonl").read_text().splitlines()]
    source = data.DataSource(str(write_jsonl(tmp_path / "a.jsonl", rows)), "problem", "solution", eval_fraction=0.25)
    reversed_source = data.DataSource(str(write_jsonl(tmp_path / "b.jsonl", rows[::-1])), "problem", "solution",
                                      eval_fraction=0.25)
    held_out = [row["problem"] for row in data.read_own_rows(source, "test")]
    assert len(held_out) == 5 and sorted(held_out) == sorted(r["problem"] for r in data.read_own_rows(reversed_source,
                                                                                                       "test"))


def test_csv_parquet_and_a_second_file_as_the_held_out_rows(tmp_path):
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "train.csv").write_text("q,a\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"q": "What is 3 + 3?", "a": 6}]), tmp_path / "test.parquet")
    source = data.DataSource(str(tmp_path / "train.csv"), "q", "a", eval_dataset=str(tmp_path / "test.parquet"))
    assert [row["answer"] for row in data.read_own_rows(source, "train")] == ["2", "4"]
    assert [row["answer"] for row in data.read_own_rows(source, "test")] == ["6"]
    args = parse("--dataset", str(tmp_path / "train.csv"), "--question-field", "q", "--answer-field", "a",
                 "--eval-dataset", str(tmp_path / "test.parquet"), "--eval-samples", "1")
    assert set(args.data_files) == {"dataset", "eval_dataset"}


@pytest.mark.parametrize("rows, flags, message", [
    ([{"question": "q", "answer": "1"}, {"question": "q2"}], [], r"bad.jsonl row 2: no field 'answer'"),
    ([{"question": "q", "answer": " "}], [], r"bad.jsonl row 1: field 'answer' is empty"),
    (['["a list"]'], [], r"bad.jsonl row 1: expected an object with fields, got list"),
    ([{"question": "q", "answer": "1"}], ["--prompt-template", "{question} in {unit}"],
     r"bad.jsonl row 1: --prompt-template names field 'unit'"),
    ([{"question": "q", "answer": "x"}], ["--answer-kind", "number"], r"bad.jsonl row 1: field 'answer' is not a number"),
    (['{"question": "q", '], [], r"bad.jsonl row 1: malformed JSON"),
])
def test_bad_rows_are_refused_in_one_line_before_anything_loads(tmp_path, rows, flags, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message) as error:
        parse("--dataset", str(path), "--eval-samples", "0", *flags)
    assert "\n" not in str(error.value)


def test_missing_files_and_flags_that_would_do_nothing_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nowhere.jsonl"):
        parse("--dataset", str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(ValueError, match="--answer-field shape your own rows"):
        parse("--dataset", "arithmetic", "--answer-field", "solution")
    with pytest.raises(ValueError, match="--one-shot has a worked example for the registered datasets only"):
        parse(*OWN, "--one-shot")
    with pytest.raises(ValueError, match=r"--eval-fraction must be in \(0, 1\)"):
        parse(*OWN, "--eval-fraction", "1.5")
    with pytest.raises(ValueError, match="not a registered dataset"):
        parse("--dataset", "gsm9k")


def test_the_template_may_be_a_file(tmp_path):
    (tmp_path / "template.txt").write_text("Problem: {problem}\nUnit: {unit}")
    args = parse(*OWN, "--prompt-template", str(tmp_path / "template.txt"), "--eval-samples", "2")
    assert args.prompt_template == "Problem: {problem}\nUnit: {unit}"


def test_a_hub_id_reads_its_splits_and_checks_its_rows(monkeypatch):
    import datasets

    splits = {"train": [{"question": "What is 1 + 1?", "answer": "2"}], "test": [{"question": "Q?", "answer": ""}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, split: splits[split])
    source = data.DataSource("someone/sums")
    assert data.own_kind("someone/sums") == "hub"
    assert data.read_own_rows(source, "train")[0]["answer"] == "2"
    with pytest.raises(ValueError, match=r"someone/sums \(test\) row 1: field 'answer' is empty"):
        data.read_own_rows(source, "test")


def test_a_registered_dataset_is_one_decorated_function(monkeypatch):
    monkeypatch.setattr(data, "DATASET_READERS", dict(data.DATASET_READERS))
    data.register_dataset("doubles", answer_kind="number")(
        lambda split, **options: [{"question": f"Double {i}?", "answer": str(2 * i)} for i in range(3)])
    rows = data.load_split("doubles", "train", num_rows=2)
    assert len(rows) == 2 and rows[0]["prompt"][-1]["content"].startswith("Double")


# ------------------------------------------------------------------------------------------ resume identity
def test_a_resume_refuses_a_changed_data_file_or_reward_file(tmp_path, monkeypatch):
    from run import runfolder

    monkeypatch.setattr(runfolder, "check_run_dir", lambda args, restarted=False: None)  # no checkpoint needed here
    for name in ("pens.jsonl", "pens_reward.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    own = ["--dataset", str(tmp_path / "pens.jsonl"), "--question-field", "problem", "--answer-field", "solution",
           "--reward-function", f"{tmp_path / 'pens_reward.py'}:says_the_unit=0.5", "--eval-samples", "2"]
    run_dir = tmp_path / "run"
    args = parse(*own, "--output-dir", str(run_dir))
    assert args.reward_functions["says_the_unit"]["weight"] == 0.5
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(vars(args)))
    parse("--output-dir", str(run_dir), "--resume")  # unchanged: accepted, the flags from config.json
    with (tmp_path / "pens_reward.py").open("a") as handle:
        handle.write("\n# changed\n")
    with pytest.raises(ValueError, match="other --reward-function functions .*says_the_unit"):
        parse("--output-dir", str(run_dir), "--resume")
    shutil.copy(EXAMPLE / "pens_reward.py", tmp_path / "pens_reward.py")
    with (tmp_path / "pens.jsonl").open("a") as handle:
        handle.write(json.dumps({"problem": "One more?", "solution": "1", "unit": "pens"}) + "\n")
    with pytest.raises(ValueError, match=r"pens.jsonl \(--dataset\) changed since the run"):
        parse("--output-dir", str(run_dir), "--resume")


# ------------------------------------------------------------------------------------------- own rewards
def test_a_reward_function_gets_every_column_and_is_weighted():
    own = config.load_reward_function(f"{EXAMPLE / 'pens_reward.py'}:says_the_unit=0.5")
    result = rewards.compute_rewards(
        [[{"role": "user", "content": "q"}]] * 3, ["12 pens", "12", "12 cups"], ["12"] * 3,
        {**rewards.REWARD_FUNCS, own.name: own.func}, {own.name: own.weight}, completion_ids=[[1, 2]] * 3,
        columns={"unit": ["pens", "pens", ""]})
    assert torch.allclose(result.per_func["says_the_unit"][:2], torch.tensor([0.998, -0.002]))
    assert torch.isnan(result.per_func["says_the_unit"][2])  # None: not applicable
    assert "rewards/says_the_unit/mean" in result.metrics()


@pytest.mark.parametrize("body, message", [
    ("raise ZeroDivisionError('division by zero')", r"reward function 'bad' raised ZeroDivisionError: division by zero"),
    ("return [1.0]", r"reward function 'bad' returned 1 values for 2 completions"),
    ("return [1.0, float('nan')]", r"reward function 'bad' returned nan for completion 1 of 2 \(prompt 'second'\)"),
    ("return ['1', 0.0]", r"reward function 'bad' returned '1' for completion 0 of 2"),
    ("return 1.0", r"reward function 'bad' returned float, not a list"),
])
def test_a_bad_reward_function_is_one_line_naming_it_and_the_first_bad_row(tmp_path, body, message):
    (tmp_path / "bad.py").write_text(f"def bad(prompts, completions, **kwargs):\n    {body}\n")
    own = config.load_reward_function(f"{tmp_path / 'bad.py'}:bad")
    with pytest.raises(ValueError, match=message) as error:
        rewards.compute_rewards([[{"role": "user", "content": "first"}], [{"role": "user", "content": "second"}]],
                                ["a", "b"], ["1", "2"], {"bad": own.func}, {"bad": 1.0})
    assert "\n" not in str(error.value)


def test_reward_function_specs_are_checked_before_anything_loads(tmp_path):
    (tmp_path / "r.py").write_text("def positional(prompts, completions):\n    return [0.0] * len(completions)\n")
    for spec, message in ((f"{tmp_path}/r.py", "expected FILE.py:NAME"), (f"{tmp_path}/r.py:missing", "no function"),
                          (f"{tmp_path}/r.py:positional", r"must take \*\*kwargs"),
                          (f"{tmp_path}/none.py:f", "file not found"), (f"{tmp_path}/r.py:accuracy",
                                                                        "registered reward term")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            parse("--reward-function", spec)


# ------------------------------------------------------------------------------------------- the worked example
WORKED = [*OWN, "--num-train-rows", "16", "--reward-function", f"{EXAMPLE / 'pens_reward.py'}:says_the_unit=0.5"]


def test_the_worked_example_trains_two_steps_with_its_own_reward(tiny_model_dir, tmp_path):
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", *WORKED))
    steps = read_lines(run_dir, "train")
    assert [s["step"] for s in steps] == [1, 2]
    assert all("rewards/says_the_unit/mean" in s and "rewards/accuracy/mean" in s for s in steps)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["reward_functions"]["says_the_unit"]["sha256"] == data.file_sha256(EXAMPLE / "pens_reward.py")
    assert saved["data_files"]["dataset"]["path"].endswith("pens.jsonl") and saved["question_field"] == "problem"


def test_a_reward_function_that_fails_stops_the_step_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path):
    (tmp_path / "late.py").write_text(
        "calls = []\n\ndef late(prompts, completions, **kwargs):\n    calls.append(1)\n"
        "    return [0.0] * len(completions) if len(calls) == 1 else [None] * (len(completions) - 1) + [float('inf')]\n")
    argv = tiny_argv(tiny_model_dir, tmp_path / "run", *WORKED[:-2], "--reward-function", f"{tmp_path}/late.py:late",
                     "--eval-samples", "0")
    with pytest.raises(ValueError, match=r"reward function 'late' returned inf for completion 7 of 8"):
        train.main(argv)
    assert [s["step"] for s in read_lines(tmp_path / "run", "train")] == [1]
    assert (tmp_path / "run" / "checkpoints" / "latest.txt").read_text().strip() == "step_000001"


def test_eval_reads_the_runs_held_out_rows_and_any_other_benchmark_by_the_same_flags(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    import eval as eval_module

    kinds, grade = [], rewards.accuracy_rewards  # the held-out grading gets the run's --answer-kind, as training does
    monkeypatch.setattr(rewards, "accuracy_rewards", lambda *args, **kwargs: kinds.append(kwargs.get("answer_kind"))
                        or grade(*args, **kwargs))
    data_file = tmp_path / "pens.jsonl"  # a copy: the test changes it below
    shutil.copy(EXAMPLE / "pens.jsonl", data_file)
    worked = [str(data_file) if arg == str(EXAMPLE / "pens.jsonl") else arg for arg in WORKED]
    run_dir = train.main(tiny_argv(tiny_model_dir, tmp_path / "run", *worked, "--max-steps", "1",
                                   "--answer-kind", "number"))
    assert kinds and set(kinds) == {"number"}  # train.py's held-out evaluations
    flags = ["--repeats", "1", "--temperature", "0", "--max-completion-tokens", "4", "--no-progress",
             "--num-threads", "1", "--device", "cpu"]
    eval_module.main(["--checkpoint", str(run_dir), *flags])
    assert set(kinds) == {"number"}  # eval.py's, read from the run's config.json
    original = data_file.read_bytes()  # a changed file: its held-out rows may differ, refused in one line
    data_file.write_bytes(original + b"\n")
    with pytest.raises(ValueError, match="changed since the run trained on it"):
        eval_module.main(["--checkpoint", str(run_dir), *flags])
    data_file.write_bytes(original)
    own = json.loads((run_dir / "eval_test.json").read_text())
    assert own["config"]["dataset"] == str(data_file) and own["results"]
    other = write_jsonl(tmp_path / "sums.jsonl", [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(10)])
    eval_module.main(["--checkpoint", str(run_dir), "--dataset", str(other), "--question-field", "q",
                      "--answer-field", "a", "--prompt-template", "{question}", "--eval-fraction", "0.2", *flags])
    assert json.loads((run_dir / "eval_sums_test.json").read_text())["results"]
    import compare  # the two benchmarks side by side: a table each, an accuracy panel each

    rows = compare.main([str(run_dir), "--eval-file", "eval_test.json", "eval_sums_test.json", "--min-seeds", "0",
                         "--plot", str(tmp_path / "benchmarks.png")])
    assert list(rows) == ["eval_test.json", "eval_sums_test.json"] and all(len(r) == 1 for r in rows.values())
    assert (tmp_path / "benchmarks.png").stat().st_size > 0
