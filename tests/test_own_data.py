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
       "--prompt-template", "{question} Say it in {unit}.", "--eval-fraction", "0.2"]  # 20 rows: 2 held out


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


def split_of(path, fraction=0.25, split_rule=data.SPLIT_RULE):
    """({held-out questions}, {training questions}) of a file of question/answer rows."""
    source = data.DataSource(str(path), eval_fraction=fraction, split_rule=split_rule)
    return tuple({row["question"] for row in data.read_own_rows(source, split)} for split in ("test", "train"))


def test_a_rows_side_of_the_split_is_fixed_by_its_question(tmp_path):
    """The held-out rows of a file are those whose question hashes below --eval-fraction: a row's side depends on it
    alone, not on the file's order, its other rows or its copies: a row present three times is held out or trained on
    all three times, and rows appended to the file move no row already there (the ranked split of earlier runs did
    both: it cut at an exact count, so a tie or a longer file moved the cut)."""
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(40)]
    held, trained = split_of(write_jsonl(tmp_path / "a.jsonl", rows))
    assert held and trained and not held & trained and 4 <= len(held) <= 16  # about a quarter of 40
    assert split_of(write_jsonl(tmp_path / "b.jsonl", rows[::-1])) == (held, trained)
    first = next(row for row in rows if row["question"] in held)  # three copies of a held-out row, of a trained one
    other = next(row for row in rows if row["question"] in trained)
    tripled = write_jsonl(tmp_path / "c.jsonl", rows + [first, first, other, dict(other, answer="0")])
    source = data.DataSource(str(tripled), eval_fraction=0.25)
    test, train_rows = (data.read_own_rows(source, split) for split in ("test", "train"))
    assert [row["question"] for row in test].count(first["question"]) == 3
    assert [row["question"] for row in train_rows].count(other["question"]) == 3
    more = rows + [{"question": f"What is {i} - 1?", "answer": str(i - 1)} for i in range(60)]
    longer = split_of(write_jsonl(tmp_path / "d.jsonl", more))
    assert held <= longer[0] and trained <= longer[1]  # appended rows join a side; no earlier row changes side
    ranked = split_of(tmp_path / "d.jsonl", split_rule=data.RANKED_SPLIT)  # what runs before the rule keep
    assert len(ranked[0]) == 25 and ranked[0] != longer[0]


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
    # a cell that is not text would become Python's repr ("{'v': 28}", "True", "[28]"), which no completion matches
    ([{"question": "q", "answer": {"v": 28}}], [],
     r"bad.jsonl row 1: field 'answer' holds an object with fields \['v'\], not text: name one with a dotted path, "
     r"e.g. --answer-field answer.v"),
    ([{"question": "q", "answer": True}], [], r"bad.jsonl row 1: field 'answer' holds a boolean \(true\), not text"),
    ([{"question": "q", "answer": [28]}], [], r"bad.jsonl row 1: field 'answer' holds a list \(\[28\]\), not text"),
    ([{"question": ["a", "b"], "answer": "1"}], [], r"bad.jsonl row 1: field 'question' holds a list"),
    ([{"question": "q", "meta": {"answer": "1"}}], ["--answer-field", "meta.value"],
     r"bad.jsonl row 1: no field 'meta.value' \(fields: \['meta', 'question'\]\); name another with --answer-field"),
])
def test_bad_rows_are_refused_in_one_line_before_anything_loads(tmp_path, rows, flags, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message) as error:
        parse("--dataset", str(path), "--eval-samples", "0", *flags)
    assert "\n" not in str(error.value)


def test_nested_fields_are_read_by_a_dotted_path(tmp_path):
    """--answer-field meta.answer reads a field of a JSON object (a Parquet struct): the answer is its text, not the
    object's repr; a column whose own name has a dot is read as it is."""
    import pyarrow
    import pyarrow.parquet

    rows = [{"problem": {"text": f"What is {i} + 1?"}, "meta": {"answer": i + 1, "level": "easy"}} for i in range(4)]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "nested.parquet")
    write_jsonl(tmp_path / "nested.jsonl", rows)
    (tmp_path / "dotted.csv").write_text("q,meta.answer\nWhat is 1 + 1?,2\n")
    for name in ("nested.parquet", "nested.jsonl"):
        source = data.DataSource(str(tmp_path / name), "problem.text", "meta.answer", eval_dataset=str(tmp_path / name))
        shaped = data.read_own_rows(source, "test")
        assert [(row["question"], row["answer"]) for row in shaped] == [(f"What is {i} + 1?", str(i + 1))
                                                                          for i in range(4)]
    dotted = str(tmp_path / "dotted.csv")
    assert data.read_own_rows(data.DataSource(dotted, "q", "meta.answer", eval_dataset=dotted), "test")[0]["answer"] \
        == "2"
    for name in ("nested.jsonl", "nested.parquet"):  # the parent field: refused, not its repr as the text
        nested = str(tmp_path / name)
        with pytest.raises(ValueError, match=r"field 'meta' holds an object with fields \['answer', 'level'\]"):
            data.read_own_rows(data.DataSource(nested, "problem.text", "meta", eval_dataset=nested), "test")
        with pytest.raises(ValueError, match=r"field 'problem' holds an object .*e.g. --question-field problem.text"):
            data.read_own_rows(data.DataSource(nested, "problem", "meta.answer", eval_dataset=nested), "test")


def test_a_spreadsheets_csv_is_read_as_it_is_saved(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark, which is not part of the first column's name; a CSV in
    another encoding is one line naming the file and line, not a bare codec error."""
    (tmp_path / "bom.csv").write_bytes("\ufeffquestion,answer\r\nWhat is 1 + 1?,2\r\n".encode())
    bom = str(tmp_path / "bom.csv")
    rows = data.read_own_rows(data.DataSource(bom, eval_dataset=bom), "test")
    assert [(row["question"], row["answer"]) for row in rows] == [("What is 1 + 1?", "2")]
    (tmp_path / "latin.csv").write_bytes("question,answer\nWhat is 1 + 1?,2\nCombien fait 3 \u00d7 2 ?,6\n"
                                         .encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.csv line 3: not UTF-8 \(invalid .*\); save it as UTF-8 CSV"):
        parse("--dataset", str(tmp_path / "latin.csv"), "--eval-samples", "0")


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
    assert args.value_sources["prompt_template"] == f"flag (the file {tmp_path / 'template.txt'})"


@pytest.mark.parametrize("dataset", ["own", "arithmetic"])
def test_a_template_that_cannot_show_the_question_is_refused_before_anything_loads(tmp_path, dataset):
    """A path of no file is not used as the template's text (every prompt the path), a text with no placeholder not
    as every prompt, a file that is not UTF-8 is named, and a placeholder the rows lack is one line for a registered
    dataset as for a file (its columns: DatasetReader.columns), not a KeyError once the run has started."""
    own = OWN[:6] if dataset == "own" else ["--dataset", "arithmetic"]
    (tmp_path / "latin.txt").write_bytes("{question} \u00e9crit en {unit}".encode("latin-1"))
    for template, message in ((str(tmp_path / "nope_template.txt"), r"nope_template.txt: no such file"),
                              ("Solve this problem.", r"'Solve this problem.' has no placeholder: every prompt would "
                                                      r"be this same text; put \{question\} where the question goes"),
                              (str(tmp_path / "latin.txt"), r"--prompt-template .*latin.txt: not UTF-8 text"),
                              ("{questoin} Answer briefly.", "names field 'questoin', which " + (
                                  "the row lacks" if dataset == "own" else
                                  r"arithmetic's rows lack \(fields: \['a', 'answer', 'b', 'question'\]\)"))):
        with pytest.raises(ValueError, match=message) as error:
            parse(*own, "--prompt-template", template, "--eval-samples", "0")
        assert "\n" not in str(error.value)


def test_a_registered_readers_rows_that_lack_a_template_field_are_one_line(monkeypatch):
    monkeypatch.setattr(data, "DATASET_READERS", dict(data.DATASET_READERS))
    data.register_dataset("doubles")(lambda split, **options: [{"question": "Double 2?", "answer": "4"}])
    with pytest.raises(ValueError, match=r"names field 'unit', which doubles's rows lack \(fields: \['answer', "):
        data.load_split("doubles", "train", source=data.DataSource("doubles", prompt_template="{question} {unit}"))


def test_registered_datasets_grade_by_their_answer_kind():
    """A registered dataset's answer kind (DatasetReader.answer_kind: MATH's LaTeX) is what the rewards and the
    held-out evaluation compare, unless --answer-kind says otherwise; a run resumed from before keeps the kind it
    recorded (None: told by the answer)."""
    math_run = parse("--dataset", "math", "--eval-samples", "0")
    assert math_run.answer_kind == "latex" and config.reward_settings(math_run).answer_kind == "latex"
    assert math_run.value_sources["answer_kind"] == "dataset math"
    assert parse("--dataset", "math", "--answer-kind", "choice", "--eval-samples", "0").answer_kind == "choice"
    assert parse("--dataset", "chemistry", "--eval-samples", "0").answer_kind == "choice"
    assert data.answer_kind_of(data.DataSource("gsm8k")) == "number"


def test_your_own_rows_take_settings_of_their_own_not_the_demos_and_say_where_each_came_from(tmp_path, capsys):
    """With --dataset FILE the demo's task settings (32 completion tokens, its one-line format instruction, 100
    held-out sums) do not carry over: presets.OWN_ROWS gives 256 tokens, the paper's instruction and every held-out
    row up to 100; flags win; --print-config and config.json say where each value came from; a run resumed from
    before keeps what it recorded."""
    from run.presets import OWN_ROWS, PRESETS

    args = parse(*OWN)
    assert (args.max_completion_tokens, args.system_prompt, args.eval_samples) == (256, None, 2)
    assert args.value_sources["max_completion_tokens"] == "your own rows (presets.OWN_ROWS)" != \
        PRESETS["demo"]["max_completion_tokens"]
    assert args.value_sources["eval_samples"] == "your own rows (presets.OWN_ROWS): every held-out row (2), at most 100"
    assert args.value_sources["learning_rate"] == "preset demo" and args.value_sources["top_p"] == "default"
    assert args.value_sources["question_field"] == "flag" and OWN_ROWS["demo"]["eval_samples"] == 100
    given = parse(*OWN, "--max-completion-tokens", "64", "--system-prompt", "", "--eval-samples", "1")
    assert (given.max_completion_tokens, given.system_prompt, given.eval_samples) == (64, "", 1)
    assert {given.value_sources[key] for key in ("max_completion_tokens", "system_prompt", "eval_samples")} == {"flag"}
    from run import report

    assert report.own_rows_line(args) == (
        "your own rows: --system-prompt the paper's (data.SYSTEM_PROMPT), --max-completion-tokens 256, --eval-samples "
        "2, not the demo preset's task settings (presets.OWN_ROWS; a flag sets any of them, --print-config shows "
        "where each value comes from)")
    assert report.own_rows_line(given) is None and report.own_rows_line(parse()) is None
    with pytest.raises(SystemExit):
        parse(*OWN, "--print-config")
    assert json.loads(capsys.readouterr().out)["value_sources"]["system_prompt"] == "your own rows (presets.OWN_ROWS)"
    run_dir = tmp_path / "run"  # a run started with the demo's values (before OWN_ROWS) keeps them when resumed
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"x")
    (run_dir / "config.json").write_text(json.dumps(dict(json.loads(json.dumps(vars(args))), max_completion_tokens=32,
                                                         system_prompt=PRESETS["demo"]["system_prompt"])))
    resumed = parse("--output-dir", str(run_dir), "--resume")
    assert (resumed.max_completion_tokens, resumed.system_prompt) == (32, PRESETS["demo"]["system_prompt"])
    assert resumed.value_sources["max_completion_tokens"] == "the resumed run: your own rows (presets.OWN_ROWS)"
    assert resumed.split_rule == data.SPLIT_RULE  # as recorded; a run from before the rule keeps its ranked split
    older = {key: value for key, value in json.loads((run_dir / "config.json").read_text()).items()
             if key not in ("split_rule", "value_sources")}
    (run_dir / "config.json").write_text(json.dumps(older))
    assert parse("--output-dir", str(run_dir), "--resume").split_rule == data.RANKED_SPLIT


def test_more_rows_than_the_file_holds_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--num-train-rows 1000: .*pens.jsonl has 18 training rows"):
        parse(*OWN, "--num-train-rows", "1000")
    with pytest.raises(ValueError, match=r"--eval-samples 50 \(eval.py: --num-prompts\): .*pens.jsonl has 2 held-out "
                                         r"rows; ask for at most 2"):
        parse(*OWN, "--eval-samples", "50")


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
           "--reward-function", f"{tmp_path / 'pens_reward.py'}:says_the_unit=0.5", "--eval-samples", "2",
           "--eval-fraction", "0.2"]
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
    for named in ([], ["--dataset", str(data_file)]):  # whether the run's config.json or --dataset names it
        with pytest.raises(ValueError, match="changed since the run trained on it"):
            eval_module.main(["--checkpoint", str(run_dir), *named, *flags])
    data_file.write_bytes(original)
    own = json.loads((run_dir / "eval_test.json").read_text())
    assert own["config"]["dataset"] == str(data_file) and own["results"]
    other = write_jsonl(tmp_path / "sums.jsonl", [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(10)])
    eval_module.main(["--checkpoint", str(run_dir), "--dataset", str(other), "--question-field", "q",
                      "--answer-field", "a", "--prompt-template", "{question}", "--eval-fraction", "0.2", *flags])
    assert json.loads((run_dir / "eval_sums_test.json").read_text())["results"]
    with other.open("a") as handle:  # the file edited: recorded by SHA-256, so its new scores are not mixed in
        handle.write(json.dumps({"q": "What is 10 + 1?", "a": "11"}) + "\n")
    with pytest.raises(ValueError, match=r"eval_sums_test.json holds results measured with other settings "
                                         r"\(data_files\); pass --out"):
        eval_module.main(["--checkpoint", str(run_dir), "--dataset", str(other), "--question-field", "q",
                          "--answer-field", "a", "--prompt-template", "{question}", "--eval-fraction", "0.2", *flags])
    eval_module.main(["--checkpoint", str(run_dir), "--eval-dataset", str(other), "--question-field", "q",
                      "--answer-field", "a", "--prompt-template", "Q: {question}", *flags])  # another template
    import hashlib

    tagged = run_dir / f"eval_sums-{hashlib.sha256(b'Q: {question}').hexdigest()[:8]}_all.json"
    assert json.loads(tagged.read_text())["results"]["step_000001"]["num_prompts"] == 11  # every row of the file
    assert sorted(path.name for path in run_dir.glob("eval_*.json")) == sorted(
        ["eval_test.json", "eval_sums_test.json", tagged.name])
    import compare  # the two benchmarks side by side: a table each, an accuracy panel each

    rows = compare.main([str(run_dir), "--eval-file", "eval_test.json", "eval_sums_test.json", "--min-seeds", "0",
                         "--plot", str(tmp_path / "benchmarks.png")])
    assert list(rows) == ["eval_test.json", "eval_sums_test.json"] and all(len(r) == 1 for r in rows.values())
    assert (tmp_path / "benchmarks.png").stat().st_size > 0


def test_a_hub_id_that_cannot_be_read_is_one_line_without_retry_noise_and_leaves_no_folder(tiny_model_dir, tmp_path,
                                                                                          monkeypatch, caplog):
    """Offline, huggingface_hub logs a "Retrying in Ns [Retry k/5]" warning per retry before it gives up: the run
    says one line naming the id, and the folder it made is gone (a rerun is not told the folder holds a run)."""
    import logging

    import datasets

    def unreachable(hub_id, split):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise ConnectionError(f"Couldn't reach '{hub_id}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    caplog.set_level(logging.INFO)
    with pytest.raises(data.HubUnavailable, match=r"could not load 'nosuchowner/nosuchdataset' \(train\) from the "
                                                  r"Hugging Face Hub: Couldn't reach"):
        train.main(tiny_argv(tiny_model_dir, tmp_path / "run", "--dataset", "nosuchowner/nosuchdataset",
                             "--num-train-rows", "4"))
    assert not [record for record in caplog.records if "Retry" in record.getMessage()]
    assert not (tmp_path / "run").exists()


def test_a_held_out_row_too_long_for_the_model_is_named(tiny_model_dir, tmp_path):
    """Held-out prompts are never cut (eval.py evaluates them all): one too long for the model's positions is refused
    naming its file and question, not with advice about batch sizes that cannot help."""
    long_row = {"problem": "Count the words: " + "pens " * 3000, "solution": "3000", "unit": "words"}
    held_out = write_jsonl(tmp_path / "long.jsonl", [long_row, {"problem": "What is 1 + 1?", "solution": "2",
                                                                 "unit": "pens"}])
    with pytest.raises(ValueError, match=r"--eval-dataset .*long.jsonl: a held-out row's prompt is \d{4} tokens, which "
                                         r"with --max-completion-tokens 8 exceed the model's 2048 positions \(question "
                                         r"'Count the words: pens pens .*'; 1 such rows\): shorten or remove them"):
        train.main(tiny_argv(tiny_model_dir, tmp_path / "run", *OWN[:-2], "--eval-dataset", str(held_out),
                             "--num-train-rows", "16"))
    assert not (tmp_path / "run").exists()


def test_eval_names_each_rows_results_file_and_refuses_a_split_of_a_whole_file(tmp_path):
    """Without a run: the results file's name follows the rows (dataset, split, template); --eval-dataset is every row
    of its file, so a --split with it is refused."""
    import hashlib

    import eval as eval_module

    other = str(write_jsonl(tmp_path / "other.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)}
                                                         for i in range(10)]))
    tagged = f"eval_other-{hashlib.sha256(b'Q: {question}').hexdigest()[:8]}_all.json"
    for argv, name in ((["--dataset", "arithmetic"], "eval_arithmetic_test.json"),
                       (["--dataset", other], "eval_other_test.json"),
                       (["--dataset", other, "--split", "train"], "eval_other_train.json"),
                       (["--eval-dataset", other], "eval_other_all.json"),
                       (["--eval-dataset", other, "--prompt-template", "Q: {question}"], tagged)):
        assert eval_module.run_settings(eval_module.parse_args(["--model", "m", *argv]), [])["name"] == name, argv
    with pytest.raises(ValueError, match="--eval-dataset evaluates every row of its file: leave out --split"):
        eval_module.run_settings(eval_module.parse_args(["--model", "m", "--eval-dataset", other, "--split",
                                                         "train"]), [])
