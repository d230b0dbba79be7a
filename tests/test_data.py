"""Datasets and prompts (paper §4): row counts and answers on the real files, splits, prompt rendering
through a real chat template, long-prompt filtering, and clear errors on bad data."""

import json
import logging
from types import SimpleNamespace

import pytest

import data
import rewards


def load(name, split, data_dir, **kwargs):
    return data.load_split(name, split, data_dir=data_dir, **kwargs)


# ------------------------------------------------------------------------------------------ real data
@pytest.mark.parametrize("name, split, rows", [("gsm8k", "train", 7473), ("gsm8k", "test", 1319),
                                               ("math", "test", 500), ("chemistry", "train", 1680),
                                               ("chemistry", "test", 420)])
def test_row_counts(data_dir, name, split, rows):
    dataset = load(name, split, data_dir)
    assert len(dataset) == rows
    assert {"prompt", "answer", "question"} <= set(dataset.column_names)
    assert all(answer for answer in dataset["answer"])


def test_math_train_skips_and_counts_the_two_empty_boxed_answers(data_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="data"):
        dataset = load("math", "train", data_dir)
    assert len(dataset) == 7500 - 2
    assert "skipped 2 of 7500 rows" in caplog.text and "5530" in caplog.text


def test_ground_truth_extraction(data_dir):
    gsm8k = load("gsm8k", "train", data_dir)
    assert all(answer.lstrip("-").isdigit() for answer in gsm8k["answer"])  # separators removed
    raw = [json.loads(line) for line in open(data_dir / "gsm8k/train.jsonl", encoding="utf-8")]
    with_separator = [i for i, row in enumerate(raw) if "," in row["answer"].split("####")[-1]]
    assert with_separator and all("," not in gsm8k[i]["answer"] for i in with_separator)
    assert data.gsm8k_final_answer("so\n#### 1,234") == "1234" and data.gsm8k_final_answer("no marker") is None

    math = load("math", "test", data_dir)  # last \boxed{} with nested braces = the curated answer field
    curated = [json.loads(line)["answer"] for line in open(data_dir / "math/test500.jsonl", encoding="utf-8")]
    assert math["answer"] == curated
    assert any("{" in answer for answer in curated)  # nested braces really occur


def test_chemistry_split_is_deterministic_disjoint_and_complete(data_dir):
    train, test = load("chemistry", "train", data_dir), load("chemistry", "test", data_dir)
    assert set(train["question"]).isdisjoint(test["question"])
    assert len(set(train["question"]) | set(test["question"])) == 2100
    assert load("chemistry", "test", data_dir, seed=123)["question"] == test["question"]  # run seed: no effect
    assert set(test["answer"]) == {"A", "B", "C", "D"}
    content = test[0]["prompt"][-1]["content"]
    assert content.startswith(data.CHEMISTRY_INSTRUCTION) and "\nA. " in content and "\nD. " in content


def test_prompt_messages_and_one_shot(data_dir):
    plain = load("gsm8k", "test", data_dir, num_rows=3)
    assert [m["role"] for m in plain[0]["prompt"]] == ["system", "user"]
    assert plain[0]["prompt"][0]["content"] == data.SYSTEM_PROMPT
    assert plain[0]["prompt"][-1]["content"] == plain[0]["question"]
    shot = load("gsm8k", "test", data_dir, num_rows=3, one_shot=True, system_prompt=None)
    assert [m["role"] for m in shot[0]["prompt"]] == ["user", "assistant", "user"]


@pytest.mark.parametrize("name", sorted(data.ONE_SHOT))
def test_one_shot_examples_earn_full_reward(name):
    question, reply = data.ONE_SHOT[name]
    answer = rewards.extract_final_answer(reply)
    assert rewards.format_reward(reply) == 1.0 and rewards.tag_count_reward(reply) == 1.0
    assert rewards.accuracy_reward(reply, answer) == 1.0 and answer in reply


def test_a_dataset_without_a_worked_example_refuses_one_shot(monkeypatch):
    """A dataset registered without an entry in data.ONE_SHOT trains as it is, and --one-shot is refused in one line
    naming it (not a KeyError)."""
    monkeypatch.setitem(data.DATASET_READERS, "sums", data.DATASET_READERS["arithmetic"])
    assert len(load("sums", "test", None, num_rows=3)) == 3
    with pytest.raises(ValueError, match="--one-shot: dataset 'sums' has no worked example"):
        load("sums", "test", None, num_rows=3, one_shot=True)
    assert set(data.ONE_SHOT) <= set(data.DATASETS)


def test_num_rows_is_a_seeded_subset(data_dir):
    first = load("gsm8k", "test", data_dir, num_rows=50, seed=1)
    assert first["question"] == load("gsm8k", "test", data_dir, num_rows=50, seed=1)["question"]
    assert first["question"] != load("gsm8k", "test", data_dir, num_rows=50, seed=2)["question"]
    with pytest.raises(ValueError, match="--eval-samples 5000 .*gsm8k has 1319 held-out rows"):
        load("gsm8k", "test", data_dir, num_rows=5000)


# ----------------------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("max_digits", [1, 2])
def test_arithmetic_is_seeded_correct_and_train_test_disjoint(max_digits):
    train = data.load_split("arithmetic", "train", num_rows=300, max_digits=max_digits, seed=3)
    test = data.load_split("arithmetic", "test", num_rows=300, max_digits=max_digits, seed=3)
    assert len(train) == 300 and len(test) == 300  # any size: 1-digit pools repeat pairs
    for row in train:
        assert row["question"] == f"What is {row['a']} + {row['b']}?" and row["answer"] == str(row["a"] + row["b"])
        assert 0 <= row["a"] < 10 ** max_digits and 0 <= row["b"] < 10 ** max_digits
    unordered = lambda rows: {frozenset((r["a"], r["b"])) for r in rows}  # noqa: E731
    assert unordered(train).isdisjoint(unordered(test))
    assert train["question"] == data.load_split("arithmetic", "train", num_rows=300, max_digits=max_digits,
                                                seed=3)["question"]
    assert train["question"] != data.load_split("arithmetic", "train", num_rows=300, max_digits=max_digits,
                                                seed=4)["question"]


def test_arithmetic_one_shot_matches_the_question_format():
    rows = data.load_split("arithmetic", "train", num_rows=2, one_shot=True, max_digits=1)
    example, question = rows[0]["prompt"][1]["content"], rows[0]["prompt"][-1]["content"]
    shape = lambda text: "".join("9" if c.isdigit() else c for c in text).replace("99", "9")  # noqa: E731
    assert shape(example) == shape(question) == "What is 9 + 9?"
    assert len(data.load_split("arithmetic", "test")) == data.ARITHMETIC_DEFAULT_ROWS["test"]
    with pytest.raises(ValueError, match="max_digits"):
        data.load_split("arithmetic", max_digits=7)


# ------------------------------------------------------------------------------------------ rendering
def test_render_prompts_with_the_smollm2_chat_template(smollm2_tokenizer, data_dir):
    prompts = load("arithmetic", "test", data_dir, num_rows=4, one_shot=True)["prompt"]
    texts = data.render_prompts(smollm2_tokenizer, prompts)
    assert len(texts) == 4
    for text, messages in zip(texts, prompts):
        assert text.startswith("<|im_start|>system\n" + data.SYSTEM_PROMPT + "<|im_end|>")
        assert "<|im_start|>assistant\n<think>\n23 + 45 = 68\n</think>\n<answer>\n68\n</answer><|im_end|>" in text
        assert text.endswith(messages[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    plain = data.render_prompts(smollm2_tokenizer, prompts, use_chat_template=False)  # base-model style
    assert plain[0].startswith(data.SYSTEM_PROMPT + "\n\nUser: ") and "<|im_start|>" not in plain[0]
    prefilled = data.render_prompts(smollm2_tokenizer, prompts, prefill_think=True)
    assert all(p == t + "<think>\n" for p, t in zip(prefilled, texts))
    completion = "2 + 3 = 5\n</think>\n<answer>\n5\n</answer>"  # what the model writes after the prefill
    assert rewards.format_reward(rewards.THINK_PREFILL + completion) == 1.0


def test_render_prompts_plain_text_without_a_chat_template():
    prompts = [[{"role": "system", "content": "SYS"}, {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": "<answer>\n3\n</answer>"}, {"role": "user", "content": "Q?"}]]
    base_tokenizer = SimpleNamespace(chat_template=None)
    assert data.render_prompts(base_tokenizer, prompts) == [
        "SYS\n\nUser: What is 1 + 2?\nAssistant: <answer>\n3\n</answer>\nUser: Q?\nAssistant:"]
    assert data.render_prompts(base_tokenizer, prompts, prefill_think=True)[0].endswith("Assistant: <think>\n")


def test_filter_long_prompts_counts_what_it_drops(smollm2_tokenizer, data_dir, caplog):
    texts = data.render_prompts(smollm2_tokenizer, load("gsm8k", "test", data_dir, num_rows=200)["prompt"])
    lengths = [len(smollm2_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    limit = sorted(lengths)[150]
    with caplog.at_level(logging.WARNING, logger="data"):
        kept, dropped = data.filter_long_prompts(texts, smollm2_tokenizer, limit)
    assert kept == [i for i, n in enumerate(lengths) if n <= limit]
    assert dropped == sum(n > limit for n in lengths) > 0 and f"dropped {dropped} of 200" in caplog.text
    assert data.filter_long_prompts(texts, smollm2_tokenizer, None) == (list(range(200)), 0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        data.filter_long_prompts(texts, smollm2_tokenizer, 0)


# ------------------------------------------------------------------------------------------- bad data
def write(folder, relative, text):
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_wrong_path_and_empty_file_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="gsm8k/test.jsonl.*data_dir"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)
    path = write(tmp_path, "gsm8k/test.jsonl", "\n\n")
    with pytest.raises(ValueError, match=f"{path}: file is empty"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)


def test_malformed_line_and_missing_field_name_file_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "x\n#### 4"})
    path = write(tmp_path, "gsm8k/test.jsonl", f"{good}\n{good}\n{{not json\n")
    with pytest.raises(ValueError, match=f"{path}:3: malformed JSON"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)
    write(tmp_path, "gsm8k/test.jsonl", f"{good}\n{json.dumps({'question': 'q'})}\n")
    with pytest.raises(ValueError, match=r"test.jsonl:2: missing field\(s\) \['answer'\]"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)
    write(tmp_path, "gsm8k/test.jsonl", "[1, 2]\n")
    with pytest.raises(ValueError, match="test.jsonl:1: expected a JSON object"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)
    (tmp_path / "gsm8k/test.jsonl").write_bytes(f"{good}\n".encode() + b'{"question": "caf\xe9"}\n')  # Latin-1
    with pytest.raises(ValueError, match=f"{path}:2: not UTF-8 \\(invalid continuation byte, byte 18\\)"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)


def test_rows_without_answer_are_counted_skips_never_silently_empty(tmp_path, caplog):
    rows = [{"question": "q1", "answer": "x\n#### 4"}, {"question": "q2", "answer": "no final line"}]
    write(tmp_path, "gsm8k/test.jsonl", "\n".join(json.dumps(r) for r in rows))
    with caplog.at_level(logging.WARNING, logger="data"):
        dataset = data.load_split("gsm8k", "test", data_dir=tmp_path)
    assert dataset["answer"] == ["4"] and "skipped 1 of 2 rows" in caplog.text and "[2]" in caplog.text
    write(tmp_path, "gsm8k/test.jsonl", json.dumps(rows[1]))
    with pytest.raises(ValueError, match="no row has a usable answer"):
        data.load_split("gsm8k", "test", data_dir=tmp_path)


def test_unknown_names_and_missing_data_dir(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load_split("gsm9k")
    with pytest.raises(ValueError, match="unknown split"):
        data.load_split("gsm8k", "validation")
    monkeypatch.setenv("PODS_DATA_DIR", str(tmp_path / "elsewhere"))
    assert data.default_data_dir() == tmp_path / "elsewhere"
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        data.load_split("math", "test")


# ------------------------------------------------------------------------------------------------ Hub
def test_hub_failure_names_the_id_and_suggests_data_dir(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="'openai/gsm8k'.*pass data_dir") as error:
        data.load_split("gsm8k", "test", hub_id="openai/gsm8k")
    assert "\n" not in str(error.value)  # one line for the command line
    with pytest.raises(RuntimeError, match="'hicai-zju/SciKnowEval'.*pass data_dir"):
        data.load_split("chemistry", "test", hub_id="hicai-zju/SciKnowEval")
    with pytest.raises(ValueError, match="no Hub id"):
        data.load_split("arithmetic", "test", hub_id="some/id")


def test_hub_rows_in_hendrycks_schema_are_converted(monkeypatch):
    import datasets

    calls = []

    def fake_load(hub_id, config=None, split=None):
        calls.append(config)
        return [{"problem": f"{config}?", "solution": "so $\\boxed{\\frac{1}{2}}$", "level": "Level 3",
                 "type": "Algebra"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    dataset = data.load_split("math", "train", hub_id="EleutherAI/hendrycks_math")
    assert len(dataset) == len(calls) == 7 and set(dataset["answer"]) == {"\\frac{1}{2}"}
    assert dataset[0]["level"] == 3 and dataset[0]["subject"] == "Algebra"


def hub_shaped(data_dir):
    """The local files' rows as the Hub serves them: {(hub id, config, split): rows}, plus SciKnowEval rows
    that the selection must leave out and its tasks interleaved (the local file groups them by task)."""
    read = lambda relative: [json.loads(line) for line in open(data_dir / relative, encoding="utf-8")]  # noqa: E731
    served = {("openai/gsm8k", "main", split): read(f"gsm8k/{split}.jsonl") for split in ("train", "test")}
    served[("HuggingFaceH4/MATH-500", None, "test")] = read("math/test500.jsonl")
    for row in read("math/train.jsonl"):  # hendrycks_math: one config per subject folder, "Level N", "type"
        config = row["unique_id"].split("/")[1]
        served.setdefault(("EleutherAI/hendrycks_math", config, "train"), []).append(
            {"problem": row["problem"], "solution": row["solution"], "type": row["subject"],
             "level": f"Level {row['level'] if row['level'] is not None else '?'}"})
    by_task = {}
    for row in read("chemistry/l3_mcq.jsonl"):
        by_task.setdefault(row["task"], []).append(
            {"question": row["question"].rsplit("\n", 4)[0], "answerKey": row["answer"], "type": "mcq-4-choices",
             "choices": {"text": row["choices"], "label": ["A", "B", "C", "D"]}, "domain": "Chemistry",
             "details": {"level": "L3", "task": row["task"], "subtask": row["subtask"]}, "answer": ""})
    decoy = by_task["retrosynthesis"][0]
    chemistry = [dict(decoy, domain="Biology"), dict(decoy, details=dict(decoy["details"], level="L2")),
                 dict(decoy, type="filling", choices={"text": [], "label": []})]
    for i in range(max(map(len, by_task.values()))):  # round robin over the tasks
        chemistry += [rows[i] for rows in reversed(by_task.values()) if i < len(rows)]
    served[("hicai-zju/SciKnowEval", "v2", "test")] = chemistry
    return served


@pytest.mark.parametrize("name, split", [("gsm8k", "test"), ("math", "train"), ("math", "test"),
                                         ("chemistry", "train"), ("chemistry", "test")])
def test_hub_and_local_files_give_identical_examples(data_dir, monkeypatch, tmp_path, name, split):
    import datasets

    served, calls = hub_shaped(data_dir), []

    def fake_load(hub_id, config=None, split=None):
        calls.append(hub_id)
        return served[(hub_id, config, split)]

    plain = SimpleNamespace(chat_template=None)  # rendering is not what this test is about: keep it fast
    local = data.build_prompt_set(name, split, plain, data_dir=data_dir, one_shot=True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.delenv("PODS_DATA_DIR", raising=False)
    monkeypatch.setattr(data, "DEFAULT_DATA_DIR", tmp_path / "no-such-folder")
    assert data.default_data_dir() is None and not calls
    hub = data.build_prompt_set(name, split, plain, one_shot=True)  # no local folder: the Hub is the default
    assert set(calls) == {data.HUB_IDS[(name, split)]}
    assert len(hub) == len(local) > 0 and hub == local


def test_check_data_source_is_offline_and_names_what_is_missing(data_dir, monkeypatch, tmp_path):
    import importlib.util

    for name in ("gsm8k", "math", "chemistry", "arithmetic"):
        data.check_data_source(name, data_dir)
    data.check_data_source("arithmetic", tmp_path / "nowhere")  # synthetic: needs no files
    with pytest.raises(ValueError, match=r"data file not found: .*nowhere/math/test500.jsonl, .*math/train.jsonl"):
        data.check_data_source("math", tmp_path / "nowhere")
    write(tmp_path, "gsm8k/train.jsonl", "{}")
    data.check_data_source("gsm8k", tmp_path, splits=("train",))
    with pytest.raises(ValueError, match="unknown dataset"):
        data.check_data_source("gsm9k", data_dir)
    monkeypatch.delenv("PODS_DATA_DIR", raising=False)
    monkeypatch.setattr(data, "DEFAULT_DATA_DIR", tmp_path / "no-such-folder")
    data.check_data_source("chemistry")  # no folder, `datasets` importable: the Hub will be tried
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real_find_spec(n, *a))
    with pytest.raises(ValueError, match="no local data folder for chemistry.*hicai-zju/SciKnowEval"):
        data.check_data_source("chemistry")


def test_build_prompt_set_renders_every_row_and_drops_only_with_a_limit(smollm2_tokenizer, caplog):
    kwargs = dict(num_rows=30, one_shot=True, prefill_think=True)
    examples = data.build_prompt_set("arithmetic", "test", smollm2_tokenizer, **kwargs)
    rows = data.load_split("arithmetic", "test", num_rows=30, one_shot=True)
    assert [e.answer for e in examples] == rows["answer"] and [e.prompt for e in examples] == rows["prompt"]
    assert [e.text for e in examples] == data.render_prompts(smollm2_tokenizer, rows["prompt"], prefill_think=True)
    lengths = [len(smollm2_tokenizer(e.text, add_special_tokens=False)["input_ids"]) for e in examples]
    limit = max(lengths) - 1  # drops the prompts with two 2-digit numbers, keeps the others
    with caplog.at_level(logging.WARNING, logger="data"):
        short = data.build_prompt_set("arithmetic", "test", smollm2_tokenizer, max_prompt_tokens=limit, **kwargs)
    assert short == [e for e, n in zip(examples, lengths) if n <= limit] and 0 < len(short) < 30
    assert f"dropped {30 - len(short)} of 30" in caplog.text
    with pytest.raises(ValueError, match="every arithmetic/test prompt is longer"):
        data.build_prompt_set("arithmetic", "test", smollm2_tokenizer, max_prompt_tokens=1, **kwargs)


def test_graded_completion_restores_the_think_prefill():
    completion = "2 + 3 = 5\n</think>\n<answer>\n5\n</answer>"  # written after a "<think>\n" prefill
    assert rewards.graded_completion(completion, prefill_think=False) == completion
    graded = rewards.graded_completion(completion, prefill_think=True)
    assert graded == rewards.THINK_PREFILL + completion and rewards.format_reward(graded) == 1.0


def test_the_tests_find_the_data_folder_as_train_does(tmp_path, monkeypatch):
    from conftest import find_data_dir  # the data_dir fixture's folder

    monkeypatch.setenv("PODS_DATA_DIR", str(tmp_path))
    assert find_data_dir() == tmp_path.resolve() == data.default_data_dir().resolve()
    monkeypatch.setenv("PODS_DATA_DIR", str(tmp_path / "missing"))
    assert find_data_dir() is None  # the tests that read real data skip, naming PODS_DATA_DIR
    monkeypatch.delenv("PODS_DATA_DIR")
    assert find_data_dir() == (data.DEFAULT_DATA_DIR.resolve() if data.DEFAULT_DATA_DIR.is_dir() else None)
