"""A new user's journey with their own task, as README and docs/rewards_and_data.md show it: a 20-row CSV of
GSM8K-length word problems with its own column names, trained with flags only, evaluated on its held-out rows and on a
second file, compared. What it must never do: train on nothing without a word, or put a second file's scores where the run's own
held-out scores belong (and then skip those)."""

import csv
import json

import compare
import data
import eval as eval_module
import train
from run_helpers import read_lines

# Word problems of GSM8K's length: a few sentences each, the reasoning a few dozen tokens before the answer.
STORY = ("{name} runs a bakery. On Monday she bakes {a} trays of muffins with {b} muffins on each tray. She sells "
         "{c} muffins in the morning and gives {d} to a school in the afternoon. How many muffins are left at the end "
         "of the day?")
NAMES = ["Ada", "Bea", "Cleo", "Dana", "Eve"]


def write_csv(path, header, rows):
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def story_rows(count, offset=0):
    rows = []
    for i in range(offset, offset + count):
        a, b, c, d = 3 + i % 5, 6 + i % 7, 5 + i % 4, 2 + i % 3
        rows.append((STORY.format(name=NAMES[i % 5], a=a, b=b, c=c, d=d), a * b - c - d, ["easy", "hard"][i % 2]))
    return rows


def tiny_run_argv(model_dir, run_dir, *extra):
    """The journey's train.py flags on the tiny model: the data flags and a budget; every task setting left to the
    defaults a user gets with their own rows."""
    return ["--model", str(model_dir), "--num-rollouts", "4", "--update-size", "2", "--prompts-per-step", "2",
            "--max-steps", "1", "--lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "2",
            "--checkpoint-interval-s", "0", "--no-progress", "--num-threads", "1", "--no-bf16",
            "--output-dir", str(run_dir), *extra]


def test_a_csv_of_ones_own_says_at_once_when_it_cannot_learn_and_keeps_its_held_out_scores(tiny_model_dir, tmp_path,
                                                                                           capsys):
    mine = write_csv(tmp_path / "mydata.csv", ["problem", "solution_value", "difficulty"], story_rows(20))
    other = write_csv(tmp_path / "other.csv", ["q", "a"], [(q, a) for q, a, _ in story_rows(6, offset=40)])
    run_dir = train.main(tiny_run_argv(tiny_model_dir, tmp_path / "run", "--dataset", str(mine), "--question-field",
                                       "problem", "--answer-field", "solution_value", "--eval-fraction", "0.2"))
    out, err = capsys.readouterr()
    saved = json.loads((run_dir / "config.json").read_text())
    # Not the demo's 32 tokens: the own-rows settings, said at the start, each value's source recorded.
    assert saved["max_completion_tokens"] == 256 and saved["system_prompt"] is None
    assert "your own rows: --system-prompt the paper's (data.SYSTEM_PROMPT), --max-completion-tokens 256" in out
    assert saved["value_sources"]["max_completion_tokens"] == "your own rows (presets.OWN_ROWS)"
    # The random model's gibberish never ends nor scores: said after step 1 (and as it persists: test_report.py).
    assert "truncated" in read_lines(run_dir, "train")[0]["cannot_learn"]
    said = [line for line in err.splitlines() if ": cannot learn: " in line]
    assert len(said) == 1 and said[0].startswith("step 1: cannot learn: 100% of the completions were cut at "
                                                 "--max-completion-tokens 256: raise --max-completion-tokens")

    flags = ["--no-progress", "--num-threads", "1", "--device", "cpu", "--max-completion-tokens", "4"]
    eval_module.main(["--checkpoint", str(run_dir), "--eval-dataset", str(other), "--question-field", "q",
                      "--answer-field", "a", *flags])  # every row of a second file, in a results file of its own
    whole = json.loads((run_dir / "eval_other_all.json").read_text())
    assert whole["config"]["dataset"] == str(other) and whole["config"]["split"] == "all"
    assert [entry["num_prompts"] for entry in whole["results"].values()] == [6]
    assert not (run_dir / "eval_test.json").exists()
    eval_module.main(["--checkpoint", str(run_dir), *flags])  # the run's held-out rows: evaluated, not skipped
    own = json.loads((run_dir / "eval_test.json").read_text())
    assert own["config"]["dataset"] == str(mine) and own["config"]["eval_dataset"] is None
    held_out = len(data.read_own_rows(data.DataSource(str(mine), "problem", "solution_value", eval_fraction=0.2),
                                      "test"))
    assert [entry["num_prompts"] for entry in own["results"].values()] == [held_out]  # the run's sample
    assert own["config"]["temperature"] == 0.0 and own["config"]["repeats"] == 1  # as the run evaluated them
    capsys.readouterr()
    eval_module.main(["--checkpoint", str(run_dir), "--eval-dataset", str(other), "--question-field", "q",
                      "--answer-field", "a", *flags])
    assert f"all 1 checkpoints already in {run_dir / 'eval_other_all.json'}" in capsys.readouterr().out
    assert json.loads((run_dir / "eval_test.json").read_text()) == own  # never overwritten by the other file's
    _, table = compare.compare([run_dir], eval_file="eval_test.json")
    assert f"- {run_dir}: steps that could not learn: 1 truncated" in table
