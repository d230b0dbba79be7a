"""A reward function written as TRL documents it runs unchanged, with TRL's rewards, wherever pods scores: each
signature of TRL's GRPOTrainer documentation (tests/trl_doc_rewards.py, and TRL's own trl.rewards functions) through
train.py, eval.py's reward report, the TRL demo and PODSGRPOTrainer, each compared with what TRL's own
GRPOTrainer._calculate_rewards computes from the same prompts, completions and columns (the reference: a real TRL
trainer). Also: completions in the prompts' format (chat or plain text), trainer_state, log_extra / log_metric into
metrics.jsonl and the completions log, async functions, and a failing function's one line."""

import json
import math

import pytest
import torch

pytest.importorskip("integrations.trl_pods", exc_type=ImportError)

from grading import trl_call  # noqa: E402
from run import config  # noqa: E402
import data  # noqa: E402
import rewards  # noqa: E402
import sampling  # noqa: E402
import train  # noqa: E402
import trl_doc_rewards  # noqa: E402
from run_helpers import ROOT, read_lines  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOC_FILE = ROOT / "tests" / "trl_doc_rewards.py"
CHAT_SPECS = [f"{DOC_FILE}:{name}" for name in trl_doc_rewards.CHAT]
LIBRARY = ("think_format_reward", "accuracy_reward")  # TRL's own reward functions (trl.rewards)


def library_file(folder):
    """A reward file of one's own that holds TRL's library functions, as a user would write it."""
    path = folder / "trl_library_rewards.py"
    path.write_text("from trl.rewards import accuracy_reward, think_format_reward  # noqa: F401\n")
    return path


def data_file(folder, rows=8):
    """Sums with a `solution` column and a `task` column (two tasks, for the multi-task example)."""
    path = folder / "sums.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i + 3}?", "solution": str(2 * i + 3),
                                        "task": "sums" if i % 2 == 0 else "words"}) + "\n" for i in range(rows)))
    return path


def own_flags(folder, *specs):
    return ["--dataset", str(data_file(folder)), "--question-field", "problem", "--answer-field", "solution",
            "--eval-fraction", "0.25", *[arg for spec in specs for arg in ("--reward-function", spec)]]


def functions_of(specs):
    return [config.load_reward_function(spec).func for spec in specs]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """A real TRL GRPOTrainer (a tiny random Qwen2 with a one-character tokenizer and a chat template) whose
    `_calculate_rewards` is the reference; built with an async function, so that TRL starts its event loop."""
    from test_trl_pods import char_tokenizer, tiny_qwen2
    from trl import GRPOConfig, GRPOTrainer
    import datasets

    folder = tmp_path_factory.mktemp("trl_reference")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = GRPOConfig(output_dir=str(folder), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=4, max_steps=1, save_strategy="no",
                      disable_tqdm=True)
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+2="}], "solution": "3"}] * 2)
    return GRPOTrainer(model=tiny_qwen2(), reward_funcs=[trl_doc_rewards.replied], args=args,
                       train_dataset=dataset, processing_class=tokenizer)


def trl_rewards(trainer, functions, rows, prompts, completions, completion_ids, state=(0, 0.0, 0)):
    """({name: [N] rewards}, {column: values}, {metric: values}) from TRL's own GRPOTrainer._calculate_rewards: the
    functions on `completions` (in TRL's format) of `prompts`, with the dataset rows `rows` (one per completion)
    and the trainer state (global_step, epoch, max_steps)."""
    trainer.reward_funcs, trainer.reward_processing_classes = list(functions), [None] * len(functions)
    trainer.reward_func_names = [func.__name__ for func in functions]
    trainer.state.global_step, trainer.state.epoch, trainer.state.max_steps = state
    trainer._pending_extra_logs.clear()
    trainer._pending_metrics.clear()
    values = trainer._calculate_rewards([dict(row, prompt=prompt) for row, prompt in zip(rows, prompts)], prompts,
                                        completions, completion_ids)
    return ({name: values[:, i] for i, name in enumerate(trainer.reward_func_names)},
            {column: list(logged) for column, logged in trainer._pending_extra_logs.items()},
            {name: list(logged) for name, logged in trainer._pending_metrics.items()})


def assert_equal_rewards(ours, theirs):
    """Per function, pods's values equal TRL's (None / NaN: not applicable, on the same completions)."""
    for name, values in theirs.items():
        ours_values = torch.tensor([math.nan if v is None else float(v) for v in ours[name]], dtype=torch.float32)
        assert torch.equal(torch.isnan(ours_values), torch.isnan(values)), name
        torch.testing.assert_close(ours_values.nan_to_num(), values.float().nan_to_num(), msg=name)


COMPLETIONS = ["<think>\n3 and 6\n</think>\n<answer>\n9\n</answer>", "It is 9", "", "3 + 6 = 10, no, 9 5",
               "<think>\nadd\n</think>\n<answer>\n5\n</answer>", "7"]


def rollouts_of(texts, prompt_index):
    """A sampling.Rollouts of these completion texts (token ids 5, 6, ... as many as characters, at most 3)."""
    lengths = [min(max(len(text), 1), 3) for text in texts]
    ids = torch.tensor([[5 + j if j < n else 0 for j in range(3)] for n in lengths])
    return sampling.Rollouts(torch.ones(max(prompt_index) + 1, 1, dtype=torch.long),
                             torch.ones(max(prompt_index) + 1, 1, dtype=torch.long), ids, (ids > 0).long(),
                             list(texts), torch.tensor(lengths), torch.zeros(len(texts), dtype=torch.bool),
                             torch.tensor(prompt_index))


def inputs_of(examples, prompt_index):
    """TRL's dataset rows for these completions: every column of the rows data.load_split gives (the answer too)."""
    return [dict(examples[i].columns, answer=examples[i].answer) for i in prompt_index]


# ----------------------------------------------------------------------------- the call, as train.py scores a round
def test_train_pys_scoring_calls_each_documented_function_as_trl_does(tmp_path, smollm2_tokenizer, trl_trainer):
    """rewards.score_rollouts (what train.train_step scores a round with), from the flags, at step 4 of 10 with half
    an epoch done: every function's values, its log_extra columns and its log_metric values equal TRL's."""
    specs = CHAT_SPECS + [f"{library_file(tmp_path)}:{name}" for name in LIBRARY]
    args = config.parse_args([*own_flags(tmp_path, *specs), "--max-steps", "10", "--device", "cpu"])
    settings = config.reward_settings(args)
    examples = data.build_prompt_set(args.dataset, "train", smollm2_tokenizer, source=config.data_source(args))
    assert len(examples) == 6 and all(trl_call.is_chat(e.prompt) for e in examples)
    trl_call.advance(settings.trainer_state, 3, (0, 3), len(examples))  # as the loop (run/loop.py) does before step 4
    index = [0, 0, 1, 1, 2, 3]
    rollouts = rollouts_of(COMPLETIONS, index)
    ours = rewards.score_rollouts(rollouts, examples, settings)
    ids = [row[:n] for row, n in zip(rollouts.completion_ids.tolist(), rollouts.lengths.tolist())]
    theirs, columns, metrics = trl_rewards(trl_trainer, functions_of(specs), inputs_of(examples, index),
                                           [examples[i].prompt for i in index],
                                           trl_call.trl_completions([examples[0].prompt], COMPLETIONS), ids,
                                           state=(3, 0.5, 10))
    assert_equal_rewards({name: values.tolist() for name, values in ours.per_func.items()}, theirs)
    assert ours.logged_columns == columns and {"expected", "last_number"} <= set(columns)
    assert [(function, name, value) for function, name, value in ours.logged_metrics if name == "solution_rate"] == \
        [("solution_logged", "solution_rate", metrics["solution_rate"][0])]
    assert not torch.isnan(ours.per_func["sums_only"]).all() and torch.isnan(ours.per_func["sums_only"]).any()


def test_a_plain_text_prompt_gets_its_completions_as_text(trl_trainer):
    """TRL's standard format: with plain-text prompts the completions are texts, and the examples written for it
    (len(completion), re.search on it) get TRL's rewards; chat prompts get one assistant message each."""
    functions = [trl_doc_rewards.reply_length_text, trl_doc_rewards.boxed_solution_text, trl_doc_rewards.token_count]
    prompts, texts = ["Solve 2x = 4.", "Solve 3x = 9."], [r"so \boxed{2}.", r"\boxed{4}"]
    ours = rewards.compute_rewards(prompts, texts, ["2", "3"], {f.__name__: f for f in functions},
                                   dict.fromkeys((f.__name__ for f in functions), 1.0), completion_ids=[[1, 2], [3]],
                                   columns={"solution": ["2", "3"]})
    theirs, _, _ = trl_rewards(trl_trainer, functions, [{"solution": "2"}, {"solution": "3"}], prompts, texts,
                               [[1, 2], [3]])
    assert_equal_rewards({name: values.tolist() for name, values in ours.per_func.items()}, theirs)
    assert ours.per_func["boxed_solution_text"].tolist() == [1.0, 0.0]
    assert trl_call.trl_completions([[{"role": "user", "content": "q"}]], ["a"]) == [[{"role": "assistant",
                                                                                      "content": "a"}]]


# ------------------------------------------------------------------------------------------ train.py, end to end
@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A 1-step train.py run of the tiny model on the sums file with every documented function and TRL's two library
    functions, its rollouts logged (the run folder)."""
    folder = tmp_path_factory.mktemp("trl_rewards_run")
    specs = CHAT_SPECS + [f"{library_file(folder)}:{name}" for name in LIBRARY]
    argv = ["--model", str(tiny_model_dir), *own_flags(folder, *specs), "--num-rollouts", "4", "--update-size", "2",
            "--prompts-per-step", "2", "--max-completion-tokens", "8", "--max-steps", "1", "--lora-rank", "4",
            "--micro-batch-size", "2", "--eval-samples", "2", "--checkpoint-interval-s", "0", "--no-progress",
            "--num-threads", "1", "--no-bf16", "--log-completions-interval", "1", "--output-dir", str(folder / "run")]
    return train.main(argv), specs


def logged_rollouts(run_dir):
    """[(prompt row of the file, rollout row)] of step 1's completions log."""
    lines = [json.loads(line) for line in (run_dir / "completions" / "step_000001.jsonl").read_text().splitlines()]
    file_rows = [json.loads(line) for line in (run_dir.parent / "sums.jsonl").read_text().splitlines()]
    prompts = {line["prompt_id"]: next(row for row in file_rows if row["problem"] in line["prompt"])
               for line in lines if line["type"] == "prompt"}
    return [(prompts[line["prompt_id"]], line) for line in lines if line["type"] == "rollout"]


def as_trl_row(row):
    """A row of the file as data.load_split gives it (and TRL would pass it): its columns, question and answer."""
    return dict(row, question=row["problem"], answer=row["solution"])


def chat_prompt(row):
    return [{"role": "system", "content": data.SYSTEM_PROMPT}, {"role": "user", "content": row["problem"]}]


def test_train_py_runs_each_documented_function_unchanged_with_trls_rewards(trained_run, trl_trainer):
    """The run's logged rewards of every function equal TRL's on the logged completions (step 1: global_step 0 of
    max_steps 1, epoch 0); log_extra's columns are in the completions log, log_metric's value in metrics.jsonl."""
    run_dir, specs = trained_run
    logged = logged_rollouts(run_dir)
    assert len(logged) == 8
    texts = [line["completion"] for _, line in logged]
    theirs, columns, metrics = trl_rewards(
        trl_trainer, functions_of(specs), [as_trl_row(row) for row, _ in logged], [chat_prompt(row) for row, _ in logged],
        trl_call.trl_completions([chat_prompt(logged[0][0])], texts), [[7] * line["length"] for _, line in logged],
        state=(0, 0.0, 1))
    assert_equal_rewards({name: [line["rewards"][name] for _, line in logged] for name in theirs}, theirs)
    assert [line["logged"] for _, line in logged] == [{column: values[k] for column, values in columns.items()}
                                                      for k in range(len(logged))]
    step = read_lines(run_dir, "train")[0]
    assert step["solution_rate"] == pytest.approx(metrics["solution_rate"][0])
    assert all(f"rewards/{name}/mean" in step for name in theirs)


# ------------------------------------------------------------------------------------ eval.py's reward report
def test_eval_pys_reward_report_scores_each_documented_function_as_trl_does(trained_run, trl_trainer, monkeypatch,
                                                                           capsys):
    """eval.py --checkpoint reports the run's own functions on its held-out completions (each sample's values equal
    TRL's, at the checkpoint's step), their means in the results file and in its printed line."""
    import eval as eval_module

    run_dir, specs = trained_run
    samples, evaluate_repeats = [], eval_module.evaluate_repeats
    monkeypatch.setattr(eval_module, "evaluate_repeats",
                        lambda *args, **kwargs: evaluate_repeats(*args, **dict(kwargs, samples_out=samples)))
    saved = eval_module.main(["--checkpoint", str(run_dir), "--repeats", "1", "--temperature", "0", "--no-progress",
                              "--max-completion-tokens", "6", "--num-threads", "1", "--device", "cpu",
                              "--out", str(run_dir / "eval_rewards.json")])
    assert "rewards of the run's own functions: token_count" in capsys.readouterr().out
    report = saved["results"]["step_000001"]["rewards"]
    assert saved["config"]["reward_functions"].keys() == report.keys() == {
        *trl_doc_rewards.CHAT, *LIBRARY}
    rows = [json.loads(line) for line in (run_dir.parent / "sums.jsonl").read_text().splitlines()]
    held_out = [next(row for row in rows if row["problem"] in sample["prompt"]) for sample in samples]
    theirs, _, _ = trl_rewards(trl_trainer, functions_of(specs), [as_trl_row(row) for row in held_out],
                               [chat_prompt(row) for row in held_out],
                               trl_call.trl_completions([chat_prompt(held_out[0])], [s["completion"] for s in samples]),
                               [[7] * int(s["rewards"]["token_count"]) for s in samples], state=(1, 0.0, 1))
    del theirs["token_count"]  # a sample holds no token ids: its count was given to TRL from it, not compared
    assert_equal_rewards({name: [s["rewards"][name] for s in samples] for name in theirs}, theirs)
    for name, values in theirs.items():
        applied = values[~values.isnan()]
        assert report[name]["mean"] == (pytest.approx(float(applied.mean())) if len(applied) else None), name


# --------------------------------------------------------------------------------------------------- the TRL demo
@pytest.mark.parametrize("name", [*trl_doc_rewards.CHAT, *LIBRARY])
def test_the_trl_demos_reward_runs_each_documented_function_unchanged_with_trls_rewards(
        name, tmp_path, smollm2_tokenizer, trl_trainer):
    """The demo's one TRL reward function, called by TRL's own _calculate_rewards on the demo's dataset rows (rendered
    text prompts, plain-text completions, TRL's trainer_state, log_extra and log_metric): with the registered terms
    weighted 0, its total is the function's rewards as TRL computes them on the chat prompts (None: 0); what the
    function logs reaches TRL's log_extra / log_metric, and its mean is logged as train.py names it."""
    from integrations import trl_demo

    spec = f"{library_file(tmp_path)}:{name}" if name in LIBRARY else f"{DOC_FILE}:{name}"
    args = trl_demo.parse_args([*own_flags(tmp_path, spec), "--reward-weights", "accuracy=0,format=0,tag_count=0",
                                "--output-dir", str(tmp_path / "run")])
    examples = data.build_prompt_set(args.dataset, "train", smollm2_tokenizer, source=config.data_source(args))
    index = [0, 0, 1, 1, 2, 3]
    rows = [trl_demo.dataset_rows(examples)[i] for i in index]
    ids = [[5] * (k + 1) for k in range(len(index))]
    through_demo, columns, metrics = trl_rewards(trl_trainer, [trl_demo.reward_function(args)],
                                                 [{k: v for k, v in row.items() if k != "prompt"} for row in rows],
                                                 [row["prompt"] for row in rows], COMPLETIONS, ids, state=(2, 0.25, 16))
    theirs, their_columns, their_metrics = trl_rewards(
        trl_trainer, functions_of([spec]), inputs_of(examples, index), [examples[i].prompt for i in index],
        trl_call.trl_completions([examples[0].prompt], COMPLETIONS), ids, state=(2, 0.25, 16))
    torch.testing.assert_close(through_demo["demo_reward"], theirs[name].nan_to_num())
    assert columns == their_columns and {k: v for k, v in metrics.items() if not k.startswith("rewards/")} == \
        their_metrics
    assert metrics[f"rewards/{name}/mean"] == [pytest.approx(float(theirs[name].nanmean()), nan_ok=True)]


@pytest.mark.slow  # ~30 s: TRL's first step, then the evaluation
def test_a_tiny_trl_demo_run_trains_with_every_documented_function(tiny_model_dir, tmp_path):
    """The whole demo through TRL with every documented function and TRL's library ones: it trains, and its metrics
    line has each function's mean (train.py's names) and the value an example gave log_metric."""
    from integrations import trl_demo

    specs = CHAT_SPECS + [f"{library_file(tmp_path)}:{name}" for name in LIBRARY]
    run_dir = trl_demo.main(["--model", str(tiny_model_dir), *own_flags(tmp_path, *specs), "--num-rollouts", "4",
                             "--update-size", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8",
                             "--max-steps", "1", "--lora-rank", "4", "--micro-batch-size", "2", "--eval-samples", "0",
                             "--num-threads", "1", "--output-dir", str(tmp_path / "run")])
    step = read_lines(run_dir, "train")[0]
    assert "solution_rate" in step and all(f"rewards/{name}/mean" in step for name in (*trl_doc_rewards.CHAT,
                                                                                         *LIBRARY))


# ----------------------------------------------------------------------------------------------- PODSGRPOTrainer
def test_pods_grpo_trainer_runs_each_documented_function_with_the_rewards_pods_computes(tmp_path):
    """The same functions as reward_funcs of PODSGRPOTrainer on a chat dataset (TRL calls them): one training step,
    and what TRL computed for each equals rewards.compute_rewards on the same prompts, completions, token ids,
    columns and trainer state."""
    import datasets
    from integrations import trl_pods
    from test_trl_pods import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"problem": f"what is {i} + 3", "solution": str(i + 3), "task": "sums" if i % 2 else "words"}
            for i in range(4)]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": row["problem"]}], **row}
                                          for row in rows])
    functions = functions_of(CHAT_SPECS + [f"{library_file(tmp_path)}:{name}" for name in LIBRARY])
    args = trl_pods.PODSConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                               num_generations=4, num_generations_kept=2, per_device_train_batch_size=8,
                               max_completion_length=6, max_steps=1, learning_rate=1e-2, save_strategy="no",
                               logging_steps=1, disable_tqdm=True)
    trainer = trl_pods.PODSGRPOTrainer(model=tiny_qwen2(), reward_funcs=functions, args=args, train_dataset=dataset,
                                       processing_class=tokenizer)
    calls, calculate = [], trainer._calculate_rewards

    def recorded(inputs, prompts, completions, completion_ids):
        state = (trainer.state.global_step, trainer.state.epoch, trainer.state.max_steps)
        calls.append((inputs, prompts, completions, completion_ids, state, calculate(inputs, prompts, completions,
                                                                                     completion_ids)))
        return calls[-1][-1]

    trainer._calculate_rewards = recorded
    trainer.train()
    assert trainer.state.global_step == 1 and len(calls) == 1
    inputs, prompts, completions, completion_ids, state, theirs = calls[0]
    columns = {key: [row[key] for row in inputs] for key in ("problem", "solution", "task")}
    names = [func.__name__ for func in functions]
    ours = rewards.compute_rewards(prompts, [c[0]["content"] for c in completions], columns["solution"],
                                   dict(zip(names, functions)), dict.fromkeys(names, 1.0),
                                   completion_ids=completion_ids, columns=columns,
                                   trainer_state=trl_call.trainer_state(*state))
    assert_equal_rewards({name: values.tolist() for name, values in ours.per_func.items()},
                         {name: theirs[:, i] for i, name in enumerate(names)})
    assert any("solution_rate" in line for line in trainer.state.log_history)


# ------------------------------------------------------------------------ what goes wrong: one line naming the function
CHAT_PROMPTS = [[{"role": "user", "content": "What is 1 + 1?"}], [{"role": "user", "content": "What is 2 + 3?"}]]


def own_rewards(tmp_path, body, *, timeout_s=trl_call.DEFAULT_TIMEOUT_S, weight=1.0, header=""):
    """compute_rewards of a function of one's own `f`, from a file holding `body`, on two chat prompts."""
    (tmp_path / "f.py").write_text(f"{header}\ndef f(prompts, completions, **kwargs):\n" +
                                   "".join(f"    {line}\n" for line in body.splitlines()))
    own = config.load_reward_function(f"{tmp_path / 'f.py'}:f={weight}")
    return rewards.compute_rewards(CHAT_PROMPTS, ["2", "5"], ["2", "5"], {"f": own.func}, {"f": own.weight},
                                   completion_ids=[[1], [2]], columns={"solution": ["2", "5"]},
                                   function_timeout_s=timeout_s)


def test_a_function_that_raises_says_where_and_what_it_was_given(tmp_path):
    """The journey's failure, a body for plain-text completions given chat ones: the line names the function, its
    file and line, and what it got (each keyword's count, type and a sample), so the format is plain at once."""
    with pytest.raises(ValueError) as error:
        own_rewards(tmp_path, "import re\nreturn [float(bool(re.search('2', c))) for c in completions]")
    line = str(error.value)
    assert "\n" not in line and line.startswith("reward function 'f' raised TypeError: ")
    assert " at f.py:4; it was given prompts (2 x list of chat messages, e.g. [{'role': 'user', 'content'" in line
    assert "completions (2 x list of chat messages, e.g. [{'role': 'assistant', 'content': '2'}])" in line
    assert "completion_ids (2 x list[int], e.g. [1])" in line and "solution (2 x str, e.g. '2')" in line
    assert "trainer_state (TrainerState, global_step 0), log_extra, log_metric" in line


def test_sys_exit_in_a_function_is_one_line_and_a_second_signal_still_stops_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"^reward function 'f' called sys.exit\(3\) at f.py:4: a reward function "
                                         "returns its rewards"):
        own_rewards(tmp_path, "import sys\nsys.exit(3)")
    import os
    import signal
    from run import signals

    with signals.stop_on_signal(), pytest.raises(SystemExit) as stopped:  # stop now: not the function's own exit
        own_rewards(tmp_path, "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\n"
                              "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)")
    assert isinstance(stopped.value, signals.StoppedNow) and stopped.value.code == 128 + signal.SIGTERM
    assert os.getpid()  # this process is still here


@pytest.mark.parametrize("body, header", [("time.sleep(60)", "import time"),
                                          ("try:\n    time.sleep(60)\nexcept Exception:\n    return [0.0, 0.0]",
                                           "import time"),
                                          ("while True:\n    pass", "")])
def test_a_function_past_its_time_limit_stops_in_one_line(tmp_path, body, header):
    """A sleeping, a sleeping-and-catching and a spinning function are all stopped at the limit."""
    import time

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^reward function 'f' gave no rewards within 0.5 s "
                                         r"\(--reward-function-timeout-s\)") as error:
        own_rewards(tmp_path, body, timeout_s=0.5, header=header)
    assert time.monotonic() - start < 5 and "\n" not in str(error.value)
    assert own_rewards(tmp_path, "return [1.0, 2.0]", timeout_s=0.5).total.tolist() == [1.0, 2.0]  # still usable


def test_an_async_function_is_awaited_and_limited_too(tmp_path):
    (tmp_path / "a.py").write_text("import asyncio\n\nasync def slow(prompts, completions, **kwargs):\n"
                                   "    await asyncio.sleep(60)\n\nasync def quick(prompts, completions, **kwargs):\n"
                                   "    await asyncio.sleep(0)\n    return [len(completions[0][0]['content'])] * 2\n")
    functions = {name: config.load_reward_function(f"{tmp_path / 'a.py'}:{name}").func for name in ("slow", "quick")}
    result = rewards.compute_rewards(CHAT_PROMPTS, ["22", "5"], ["2", "5"], {"quick": functions["quick"]},
                                     {"quick": 1.0})
    assert result.total.tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="reward function 'slow' gave no rewards within 0.3 s"):
        rewards.compute_rewards(CHAT_PROMPTS, ["2", "5"], ["2", "5"], {"slow": functions["slow"]}, {"slow": 1.0},
                                function_timeout_s=0.3)


def test_the_time_limit_comes_from_its_flag(tmp_path):
    sleepy = tmp_path / "sleepy.py"
    sleepy.write_text("import time\n\ndef sleepy(prompts, completions, **kwargs):\n    time.sleep(60)\n")
    args = config.parse_args([*own_flags(tmp_path, f"{sleepy}:sleepy"), "--reward-function-timeout-s", "0.4",
                              "--device", "cpu"])
    settings = config.reward_settings(args)
    assert settings.function_timeout_s == 0.4
    examples = [data.Example("q", CHAT_PROMPTS[0], "2")]
    with pytest.raises(ValueError, match=r"'sleepy' gave no rewards within 0.4 s \(--reward-function-timeout-s\)"):
        rewards.score_texts(examples, [0], ["2"], [[1]], settings)
    with pytest.raises(ValueError, match="--reward-function-timeout-s must be >= 0"):
        config.parse_args(["--reward-function-timeout-s", "-1"])


def test_a_function_deaf_to_the_interrupt_ends_the_process_in_one_line():
    """C code that ignores signals (here: the interrupt blocked) is ended with the process, GRACE_S after the limit."""
    import subprocess
    import sys

    code = ("import signal, time\nfrom grading import trl_call\ntrl_call.GRACE_S = 0.5\n"
            "def deaf(**kwargs):\n    signal.pthread_sigmask(signal.SIG_BLOCK, {trl_call.INTERRUPT})\n"
            "    time.sleep(30)\n"
            "trl_call.call('deaf', deaf, {}, 0.3)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["-c: error: reward function 'deaf' gave no rewards within 0.3 s "
                                                "(--reward-function-timeout-s) and did not stop when interrupted"]


@pytest.mark.parametrize("returned, accepted", [
    ("[np.float32(0.5), np.float32(1.0)]", [0.5, 1.0]), ("np.array([0.5, 1.0], dtype=np.float32)", [0.5, 1.0]),
    ("[np.int64(1), None]", [1.0, float("nan")]), ("torch.tensor([0.5, 2.0])", [0.5, 2.0])])
def test_numpy_and_torch_numbers_are_rewards_as_trl_takes_them(tmp_path, returned, accepted):
    result = own_rewards(tmp_path, f"return {returned}", header="import numpy as np\nimport torch")
    torch.testing.assert_close(result.per_func["f"], torch.tensor(accepted), equal_nan=True)


@pytest.mark.parametrize("body, weight, message", [
    ("return [1e300, 0.0]", 1.0, r"reward function 'f' returned 1e\+300 for completion 0 of 2 \(prompt 'What is 1 \+ "
     r"1\?'\): beyond float32's range"),
    ("return [0.0, -np.float64(1e39)]", 1.0, r"returned np.float64\(-1e\+39\) for completion 1 of 2 .*beyond float32"),
    ("return [3e38, 0.0]", 10.0, r"the weighted total reward of completion 0 of 2 is beyond float32's range "
     r"\(3.4e38\): f 3e\+38 x weight 10"),
    ("return [True, 0.0]", 1.0, r"returned True for completion 0 of 2"),
])
def test_a_reward_beyond_float32_is_refused_not_trained_as_inf(tmp_path, body, weight, message):
    """1e300 is finite as a Python float and inf in the float32 rewards are computed in: refused in one line."""
    with pytest.raises(ValueError, match=message) as error:
        own_rewards(tmp_path, body, weight=weight, header="import numpy as np")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("body, message", [
    ("log_extra = kwargs['log_extra']\nlog_extra('x', [1])\nreturn [0.0, 0.0]",
     r"reward function 'f' called log_extra\('x', ...\) with 1 values for 2 completions"),
    ("kwargs['log_metric']('rate', 'high')\nreturn [0.0, 0.0]",
     r"reward function 'f' called log_metric\('rate', 'high'\): give a metric name and a finite number"),
])
def test_what_a_function_logs_is_checked(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        own_rewards(tmp_path, body)


def test_a_logged_metric_lands_in_the_step_line_unless_its_name_is_taken():
    rounds = [type("Round", (), {"logged_metrics": [("f", "rate", 0.25), ("f", "rate", 0.75)]})()]
    assert train.logged_metrics(rounds, {"loss": 0.1}) == {"rate": 0.5}
    rounds[0].logged_metrics.append(("g", "loss", 1.0))
    with pytest.raises(ValueError, match="reward function 'g' logged 'loss' with log_metric, a name the step's "
                                         "metrics line has already"):
        train.logged_metrics(rounds, {"loss": 0.1})


# ------------------------------------------------------------------------------------ the weight, from the flag on
def test_the_weight_given_with_the_flag_weighs_the_function_in_the_trained_total(tmp_path):
    """--reward-function FILE:NAME=0.5, parsed as train.py parses it, scored as train.train_step scores a round
    (train.scored_round): the total is the registered terms at their weights plus 0.5 x the function."""
    (tmp_path / "w.py").write_text("def four(prompts, completions, **kwargs):\n    return [4.0] * len(completions)\n")
    args = config.parse_args([*own_flags(tmp_path, f"{tmp_path / 'w.py'}:four=0.5"), "--device", "cpu", "-n", "2",
                              "-m", "1"])
    examples = [data.Example("What is 1 + 1?", CHAT_PROMPTS[0], "2", {"solution": "2", "task": "sums"})]
    texts = ["<think>\n1 and 1\n</think>\n<answer>\n2\n</answer>", "3"]
    scored = train.scored_round(examples, rollouts_of(texts, [0, 0]), train.step_settings(args))
    registered = sum(rewards.DEFAULT_REWARD_WEIGHTS[name] * scored.per_func[name] for name in rewards.REWARD_TERMS)
    assert scored.per_func["four"].tolist() == [4.0, 4.0] and registered.tolist() == [3.0, 0.0]
    assert scored.rewards.flatten().tolist() == [3.0 + 0.5 * 4.0, 0.0 + 0.5 * 4.0]


def test_a_resume_that_changes_a_functions_weight_names_the_change(tmp_path, monkeypatch):
    from run import runfolder

    monkeypatch.setattr(runfolder, "check_run_dir", lambda args, restarted=False: None)  # no checkpoint needed here
    (tmp_path / "w.py").write_text("def four(prompts, completions, **kwargs):\n    return [4.0] * len(completions)\n")
    args = config.parse_args([*own_flags(tmp_path, f"{tmp_path / 'w.py'}:four=0.5"), "--device", "cpu",
                              "--output-dir", str(tmp_path / "run")])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(vars(args)))
    resumed = ["--output-dir", str(tmp_path / "run"), "--resume", "--device", "cpu"]
    assert config.parse_args(resumed).reward_function == [f"{tmp_path / 'w.py'}:four=0.5"]
    with pytest.raises(ValueError, match=r"started with other --reward-function functions \(four: w.py sha256 \w+ "
                                         r"weight 0.5 -> w.py sha256 \w+ weight 0.7\)"):
        config.parse_args([*resumed, "--reward-function", f"{tmp_path / 'w.py'}:four=0.7"])


def test_a_reward_file_is_imported_once(tmp_path, capsys):
    (tmp_path / "once.py").write_text("print('imported')\n\ndef once(prompts, completions, **kwargs):\n"
                                      "    return [0.0] * len(completions)\n")
    args = config.parse_args([*own_flags(tmp_path, f"{tmp_path / 'once.py'}:once"), "--device", "cpu"])
    config.reward_settings(args)
    assert capsys.readouterr().out.count("imported") == 1  # check_args loaded it; the settings reuse it
