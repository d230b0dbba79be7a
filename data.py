"""Datasets and prompts of the PODS experiments (paper §4, Appendix A.1): GSM8K, MATH (train / MATH-500),
SciKnowEval Chemistry L3 multiple choice, and synthetic addition for the offline demo.

`build_prompt_set` builds the prompts of training and evaluation alike: [Example(text, prompt, answer)]
(rewards.graded_completion is the text the rewards grade). `load_split` gives the rows ("prompt": the paper's
think/answer system prompt, an optional one-shot example turn, the question; "answer"; source fields).
Rows come from the JSONL files under `data_dir` (else $PODS_DATA_DIR, else ../shared/data beside the
repository) when such a folder is given or exists, otherwise from the Hugging Face Hub (`HUB_IDS`, cached by
`datasets`), converted to the rows of the local files (same rows and order; MATH train: the Hub's order
within each subject, which the local file sorts by problem number).

Datasets are readers in a registry, `DATASET_READERS` (name -> `DatasetReader`), filled by `@register_dataset`: the
four above, and a researcher's own rows come as a local file (.jsonl, .csv, .parquet) or a Hub dataset id with named
question / answer fields and a prompt template (`DataSource`, read by `read_own_rows`), checked row by row before
anything loads (`check_own_rows`: one line naming the file, row and field).

Simplifications: the chemistry held-out split is ours (the source has none): a fixed seeded 20% of the
rows. Arithmetic train and test use disjoint sets of {a, b} pairs.
"""

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rewards import THINK_PREFILL, last_boxed_content

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think>\nreasoning process here\n</think>\n<answer>\nanswer here\n"
    "</answer>")
SPLITS = ("train", "test")
CHEMISTRY_TEST_FRACTION = 0.2  # 2100 rows -> 1680 train / 420 test
ARITHMETIC_TEST_FRACTION = 0.2  # of the unordered {a, b} pairs
ARITHMETIC_DEFAULT_ROWS = {"train": 1000, "test": 100}
ARITHMETIC_MAX_ROWS = 100_000
_SPLIT_SALT = "pods-split-v1"  # fixed: the held-out rows never depend on a run's seed
_FILES = {("gsm8k", "train"): "gsm8k/train.jsonl", ("gsm8k", "test"): "gsm8k/test.jsonl",
          ("math", "train"): "math/train.jsonl", ("math", "test"): "math/test500.jsonl",
          ("chemistry", "train"): "chemistry/l3_mcq.jsonl", ("chemistry", "test"): "chemistry/l3_mcq.jsonl"}
_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"), "chemistry": ("question", "answer")}
HUB_IDS = {("gsm8k", "train"): "openai/gsm8k", ("gsm8k", "test"): "openai/gsm8k",  # without a local folder
           ("math", "train"): "EleutherAI/hendrycks_math", ("math", "test"): "HuggingFaceH4/MATH-500",
           ("chemistry", "train"): "hicai-zju/SciKnowEval", ("chemistry", "test"): "hicai-zju/SciKnowEval"}
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "shared" / "data"
_MATH_HUB_CONFIGS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                     "number_theory", "prealgebra", "precalculus")  # EleutherAI/hendrycks_math
CHEMISTRY_INSTRUCTION = ("Given a question and four options, please select the right answer. "
                         "Your answer should be \"A\", \"B\", \"C\" or \"D\".")

# One worked example per dataset in the exact target format (small models need it to learn the format); the
# arithmetic one is as short as possible and phrased exactly like the real questions.
ONE_SHOT = {
    "arithmetic": ("What is 23 + 45?", "<think>\n23 + 45 = 68\n</think>\n<answer>\n68\n</answer>"),
    "gsm8k": ("Tom has 3 boxes with 4 apples in each box. He eats 2 of the apples. How many apples are left?",
              "<think>\nTom has 3 * 4 = 12 apples. After eating 2 he has 12 - 2 = 10 apples.\n</think>\n"
              "<answer>\n10\n</answer>"),
    "math": ("What is $\\frac{1}{2} + \\frac{1}{3}$?",
             "<think>\nWith the common denominator 6: $\\frac{3}{6} + \\frac{2}{6} = \\frac{5}{6}$.\n</think>\n"
             "<answer>\n\\frac{5}{6}\n</answer>"),
    "chemistry": (f"{CHEMISTRY_INSTRUCTION}\n\nHow many carbon atoms are there in ethanol (SMILES: CCO)?\n"
                  "A. 1\nB. 2\nC. 3\nD. 4",
                  "<think>\nCCO has two carbon atoms and one oxygen atom.\n</think>\n<answer>\nB\n</answer>"),
}
logger = logging.getLogger(__name__)


class HubUnavailable(RuntimeError):
    """A dataset's Hub copy could not be read (no network, unknown id): the CLIs print it as one line."""


def default_data_dir():
    """$PODS_DATA_DIR, else <repo>/../shared/data when it exists, else None (= read the Hub)."""
    if os.environ.get("PODS_DATA_DIR"):
        return Path(os.environ["PODS_DATA_DIR"])
    return DEFAULT_DATA_DIR if DEFAULT_DATA_DIR.is_dir() else None


def check_data_source(name, data_dir=None, splits=SPLITS, source=None):
    """A one-line ValueError when `name` has neither its local files nor a usable Hub source. Fast and offline
    (run before any model loads): "usable" = a Hub id and an importable `datasets`; an unreachable Hub shows
    when the rows are read (load_split's RuntimeError). A file of one's own (source: its DataSource) is read and
    every row checked (check_own_rows), and {split: number of rows} returned (None for the other datasets)."""
    if reader_of(name) is None:
        return check_own_rows(source or DataSource(name), splits)
    folder = Path(data_dir) if data_dir is not None else default_data_dir()
    if name == "arithmetic":
        return
    if folder is not None:
        missing = [str(path) for path in sorted({folder / _FILES[(name, split)] for split in splits})
                   if not path.is_file()]
        if missing:
            raise ValueError(f"data file not found: {', '.join(missing)} (--data-dir / PODS_DATA_DIR must name "
                             "the folder holding gsm8k/, math/ and chemistry/)")
    elif importlib.util.find_spec("datasets") is None:
        raise ValueError(f"no local data folder for {name} (pass --data-dir or set PODS_DATA_DIR) and the "
                         f"`datasets` package, needed to read {HUB_IDS[(name, splits[0])]} from the Hub, "
                         "is not installed")


def jsonl_values(path, where):
    """(line number, value) of each non-blank line of a JSONL file; a line that is not UTF-8 or not JSON is one
    ValueError naming it by where(line number) ("file:3", or "file row 3" for rows of one's own)."""
    with Path(path).open("rb") as handle:  # bytes: a byte that is not UTF-8 is reported with its line
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where(line_number)}: not UTF-8 ({error.reason}, byte {error.start + 1})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where(line_number)}: malformed JSON ({error.msg})") from None
            yield line_number, value


def read_jsonl(path, required_fields=()):
    """Rows of a JSONL file; errors name the file and line (blank lines are allowed and skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (pass data_dir=/path/to/data or set PODS_DATA_DIR)")
    rows = []
    for line_number, row in jsonl_values(path, lambda line_number: f"{path}:{line_number}"):
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
        missing = [name for name in required_fields if name not in row]
        if missing:
            raise ValueError(f"{path}:{line_number}: missing field(s) {missing}")
        rows.append((line_number, row))
    if not rows:
        raise ValueError(f"{path}: file is empty")
    return rows


def gsm8k_final_answer(solution):
    """N from the solution's final `#### N` line, thousands separators removed; None when absent."""
    match = re.search(r"####\s*(.+?)\s*$", solution or "")
    answer = match.group(1).replace(",", "").replace("$", "").strip() if match else ""
    return answer or None


def _gsm8k_row(row):
    answer = gsm8k_final_answer(row["answer"])
    return answer and {"question": row["question"], "answer": answer, "solution": row["answer"]}


def _math_row(row):
    level = row.get("level")
    if isinstance(level, str):  # Hub copies say "Level 3"
        level = int(level.split()[-1]) if level.split() and level.split()[-1].isdigit() else None
    answer = last_boxed_content(row["solution"] or "")
    return answer and {"question": row["problem"], "answer": answer, "solution": row["solution"],
                       "subject": row.get("subject", row.get("type")), "level": level,
                       "unique_id": row.get("unique_id", "")}


def _chemistry_row(row):
    answer = str(row["answer"]).strip()
    return answer in ("A", "B", "C", "D") and {
        "question": row["question"], "answer": answer, "choices": list(row.get("choices") or []),
        "task": row.get("task", ""), "subtask": row.get("subtask", "")}


_CONVERTERS = {"gsm8k": _gsm8k_row, "math": _math_row, "chemistry": _chemistry_row}


def _convert(name, numbered_rows, source):
    """Loader rows, skipping (with a logged count) rows without a usable answer; never silently empty."""
    rows, skipped_lines = [], []
    for line_number, row in numbered_rows:
        converted = _CONVERTERS[name](row)
        if converted:
            rows.append(converted)
        else:
            skipped_lines.append(line_number)
    if skipped_lines:
        logger.warning("%s: skipped %d of %d rows without an answer (lines %s%s)", source, len(skipped_lines),
                       len(numbered_rows), skipped_lines[:10], " ..." if len(skipped_lines) > 10 else "")
    if not rows:
        raise ValueError(f"{source}: no row has a usable answer ({len(numbered_rows)} rows read)")
    return rows


def _split_part(items, keys, fraction, split):
    """The `split` part of items, in their order: "test" is the `fraction` of them whose keys have the smallest
    salted SHA-256 (exact size, independent of file order and library versions), "train" the rest."""
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(f"{_SPLIT_SALT}:{keys[i]}".encode()).hexdigest())
    test = set(order[:round(fraction * len(keys))])
    return [item for i, item in enumerate(items) if (i in test) == (split == "test")]


def sciknoweval_l3_mcq(rows):
    """SciKnowEval rows (Hub schema) -> the rows of chemistry/l3_mcq.jsonl, selected and shaped as it was:
    Chemistry, L3, mcq-4-choices, labels A-D with 4 texts, answerKey in A-D; the question, then one line
    "X. <text>" per option; by task (the file joins the task files by name, each in source order: stable)."""
    picked = []
    for row in rows:
        details, choices = row.get("details") or {}, row.get("choices") or {}
        texts = list(choices.get("text") or [])
        if (row.get("domain") == "Chemistry" and details.get("level") == "L3" and row.get("type") == "mcq-4-choices"
                and list(choices.get("label") or []) == list("ABCD") and len(texts) == 4
                and row.get("answerKey") in ("A", "B", "C", "D")):
            options = "".join(f"\n{label}. {text}" for label, text in zip("ABCD", texts))
            picked.append({"question": row["question"] + options, "choices": texts, "answer": row["answerKey"],
                           "task": details.get("task", ""), "subtask": details.get("subtask", "")})
    return sorted(picked, key=lambda row: row["task"])


@contextlib.contextmanager
def hub_quiet():
    """huggingface_hub's and datasets' warnings held back while rows are read from the Hub: a Hub that cannot be
    reached ends in one line (HubUnavailable), not after a "Retrying in 1s [Retry 1/5]" line per retry."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _hub_rows(name, split, hub_id):
    import datasets

    try:
        with hub_quiet():
            if name == "gsm8k":
                parts = [datasets.load_dataset(hub_id, "main", split=split)]
            elif name == "chemistry":  # one "test" collection; our train/test split is made from it below
                parts = [sciknoweval_l3_mcq(datasets.load_dataset(hub_id, "v2", split="test"))]
            elif "hendrycks_math" in hub_id:
                parts = [datasets.load_dataset(hub_id, config, split=split) for config in _MATH_HUB_CONFIGS]
            else:  # e.g. HuggingFaceH4/MATH-500, which only has a test split
                parts = [datasets.load_dataset(hub_id, split=split)]
    except Exception as error:  # noqa: BLE001  network, auth, unknown id: one clear message
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise HubUnavailable(f"could not load {hub_id!r} ({split}) from the Hugging Face Hub: {reason}. Offline? "
                           "pass data_dir (--data-dir, or set PODS_DATA_DIR) naming a folder with the local "
                           "files, e.g. ../shared/data") from error
    rows = [row for part in parts for row in part]
    missing = [field for field in _FIELDS[name] if rows and field not in rows[0]]
    if missing:
        raise ValueError(f"{hub_id} ({split}): rows lack field(s) {missing}")
    return list(enumerate(rows, start=1))


def _arithmetic_rows(split, num_rows, seed, max_digits):
    if not 1 <= max_digits <= 3:
        raise ValueError(f"max_digits must be 1, 2 or 3, got {max_digits}")
    high = 10 ** max_digits
    pairs = [(a, b) for a in range(high) for b in range(a, high) if (a, b) != (23, 45)]  # not the one-shot
    pool = _split_part(pairs, [f"{a}+{b}" for a, b in pairs], ARITHMETIC_TEST_FRACTION, split)
    rng = random.Random(f"{seed}:{split}:{max_digits}")
    if num_rows > ARITHMETIC_MAX_ROWS:  # a typo would fill the memory before any message
        raise ValueError(f"arithmetic: {num_rows} rows asked (--num-train-rows, --eval-samples), the most is "
                         f"{ARITHMETIC_MAX_ROWS}")
    rows = []
    while len(rows) < num_rows:  # each pass uses every pair once: no repeats until the pool is used up
        rng.shuffle(pool)
        for a, b in pool[:num_rows - len(rows)]:
            a, b = (a, b) if rng.random() < 0.5 else (b, a)
            rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b})
    return rows


# ------------------------------------------------------------------------------------ the registry of datasets
@dataclass
class DatasetReader:
    """A dataset: read(split, *, data_dir, hub_id, num_rows, seed, max_digits) -> rows, each a dict with "question" and
    "answer" (strings) and any other columns (the reward functions receive them by name). template: the user turn,
    str.format'ed with the row. makes_rows: read() makes exactly num_rows rows itself (synthetic data). answer_kind:
    what the accuracy reward compares (ANSWER_KINDS; None: told by the answer, a letter A-D a choice). columns: the
    fields of its rows, which a --prompt-template is checked against before anything loads (None: checked as the
    rows are read)."""
    name: str
    read: Callable
    template: str = "{question}"
    answer_kind: str | None = None
    makes_rows: bool = False
    summary: str = ""  # one line of markdown: the table of datasets in docs/rewards_and_data.md
    columns: tuple | None = None


DATASET_READERS: dict[str, DatasetReader] = {}  # name -> reader, in registration order
ANSWER_KINDS = ("number", "latex", "choice")


def register_dataset(name, *, template="{question}", answer_kind=None, makes_rows=False, summary="", columns=None):
    """Decorator: add a reader of rows to the registry as `name` (--dataset NAME)."""
    def add(read):
        DATASET_READERS[name] = DatasetReader(name, read, template, answer_kind, makes_rows, summary,
                                              None if columns is None else tuple(columns))
        return read
    return add


def _read_files(name, split, data_dir, hub_id):
    """The rows of a dataset with local files or a Hub copy, converted (_CONVERTERS)."""
    folder = None if hub_id else Path(data_dir) if data_dir is not None else default_data_dir()
    if folder is None:  # no local folder: the Hub
        hub_id = hub_id or HUB_IDS[(name, split)]
        return _convert(name, _hub_rows(name, split, hub_id), f"{hub_id} ({split})")
    path = folder / _FILES[(name, split)]
    return _convert(name, read_jsonl(path, _FIELDS[name]), str(path))


@register_dataset("gsm8k", answer_kind="number",
                  summary="GSM8K grade-school word problems (Hub config `main`): 7473 train, 1319 test rows; the "
                          "answer: the number after `####`, separators removed",
                  columns=("question", "answer", "solution"))
def read_gsm8k(split, *, data_dir=None, hub_id=None, **unused):
    return _read_files("gsm8k", split, data_dir, hub_id)


@register_dataset("math", answer_kind="latex",
                  summary="MATH competition problems (the Hub's 7 subject configs), held out: MATH-500; 7498 train "
                          "rows (+2 skipped), 500 test; the answer: the last `\\boxed{}` of the solution, nested "
                          "braces",
                  columns=("question", "answer", "solution", "subject", "level", "unique_id"))
def read_math(split, *, data_dir=None, hub_id=None, **unused):
    return _read_files("math", split, data_dir, hub_id)


@register_dataset("chemistry", template=f"{CHEMISTRY_INSTRUCTION}\n\n{{question}}", answer_kind="choice",
                  summary="SciKnowEval Chemistry L3 four-choice questions (Hub config `v2`, split `test`), split here "
                          "80/20 by a fixed seed: 1680 train, 420 test rows; the answer: a letter A–D",
                  columns=("question", "answer", "choices", "task", "subtask"))
def read_chemistry(split, *, data_dir=None, hub_id=None, **unused):
    rows = _read_files("chemistry", split, data_dir, hub_id)
    return _split_part(rows, [row["question"] for row in rows], CHEMISTRY_TEST_FRACTION, split)


@register_dataset("arithmetic", answer_kind="number", makes_rows=True,
                  summary="synthetic sums a + b (the offline demo's): any number of rows (default 1000 train, 100 "
                          "test), train and test from disjoint pairs; the answer: the sum",
                  columns=("question", "answer", "a", "b"))
def read_arithmetic(split, *, hub_id=None, num_rows=None, seed=0, max_digits=2, **unused):
    if hub_id:
        raise ValueError("the arithmetic task is synthetic: it has no Hub id")
    return _arithmetic_rows(split, num_rows or ARITHMETIC_DEFAULT_ROWS[split], seed, max_digits)


DATASETS = tuple(DATASET_READERS)


# ------------------------------------------------------------------------------------------ your own rows
OWN_FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")
DEFAULT_EVAL_FRACTION = 0.1  # of your own rows, held out by a stable hash when no --eval-dataset is given
# How a file's rows are split: each row by a salted SHA-256 of its question alone, so duplicates stay together and
# appending rows moves no row already there. Runs before it took the exact fraction of smallest hashes of question and
# answer (RANKED_SPLIT): config.json records the rule ("split_rule"), and a run keeps the one it started with.
SPLIT_RULE = "question-hash"
RANKED_SPLIT = "row-hash-rank"


@dataclass(frozen=True)
class DataSource:
    """Where a run's rows come from and how they are shaped (the data flags). dataset: a registered name, a local
    .jsonl / .csv / .parquet file or a Hub dataset id; the rest apply to one's own rows (a template also to the
    registered ones). question_field / answer_field: a column, or a field nested in one by a dotted path
    (meta.answer). eval_dataset: the held-out rows' file or Hub id (all its rows); else eval_fraction of the rows
    are held out, by split_rule (SPLIT_RULE)."""
    dataset: str
    question_field: str = "question"
    answer_field: str = "answer"
    prompt_template: str | None = None
    eval_dataset: str | None = None
    eval_fraction: float | None = None
    answer_kind: str | None = None
    split_rule: str = SPLIT_RULE


def own_kind(name):
    """"file" for a path ending in a known suffix, "hub" for an owner/name id, else None."""
    if name is None:
        return None
    if str(name).lower().endswith(OWN_FILE_SUFFIXES):
        return "file"
    return "hub" if re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)) and not Path(name).exists() else None


def reader_of(name):
    """The registered DatasetReader of --dataset `name`, or None for rows of one's own (a .jsonl / .csv / .parquet
    file or a Hub id); anything else is one ValueError line listing what --dataset takes."""
    if name not in DATASET_READERS and own_kind(name) is None:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}, a .jsonl / .csv / .parquet file "
                         "or a Hub dataset id (owner/name)")
    return DATASET_READERS.get(name)


def answer_kind_of(source):
    """The answer kind the accuracy reward compares: --answer-kind, else the registered dataset's, else None."""
    reader = DATASET_READERS.get(source.dataset)
    return source.answer_kind or (reader.answer_kind if reader else None)


def _numbered_rows(path):
    """[(row number, row)] of a local file: JSONL line numbers; CSV and Parquet count data rows from 1. A CSV may
    start with a byte-order mark (Excel's "CSV UTF-8" writes one); one that is not UTF-8 is one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return list(jsonl_values(path, lambda line_number: f"{path} row {line_number}"))
    if suffix == ".csv":
        import csv
        import io

        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            raise ValueError(f"{path} line {line}: not UTF-8 ({error.reason}, byte {error.start + 1}); save it as "
                             "UTF-8 CSV") from None
        return list(enumerate(csv.DictReader(io.StringIO(text, newline="")), start=1))
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    return list(enumerate(pyarrow.parquet.read_table(path).to_pylist(), start=1))


def _hub_own_rows(hub_id, split):
    import datasets

    try:
        with hub_quiet():
            return list(enumerate(datasets.load_dataset(hub_id, split=split), start=1))
    except Exception as error:  # noqa: BLE001  network, auth, unknown id or split: one clear message
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise HubUnavailable(f"could not load {hub_id!r} ({split}) from the Hugging Face Hub: {reason}") from error


def template_fields(template):
    """The column names a prompt template's {placeholders} name."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(f"--prompt-template: {error} (write a literal brace as {{{{ or }}}})") from None


def read_template(value):
    """--prompt-template's text: a file's content where `value` names a file (UTF-8), else `value` itself."""
    if value is None or not Path(value).is_file():
        return value
    try:
        return Path(value).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompt-template {value}: not UTF-8 text ({error.reason}, byte {error.start + 1})") \
            from None


def check_template(template, columns=None, dataset=None):
    """The one-line ValueError of a prompt template that cannot render a question: a stray brace, a placeholder that
    is not a column name, none at all (every prompt would be the same text; a path of no file reads as such a text),
    or, given the dataset's `columns`, a placeholder naming none of them."""
    fields = template_fields(template)
    if any(not name or not name.isidentifier() for name in fields):
        raise ValueError(f"--prompt-template {template!r}: every placeholder must name a column, e.g. {{question}}")
    if not fields:
        if re.search(r"[/\\]|\.\w{1,5}$", template.strip()):
            raise ValueError(f"--prompt-template {template}: no such file (a template text names the question "
                             "by {question})")
        raise ValueError(f"--prompt-template {template!r} has no placeholder: every prompt would be this same text; "
                         "put {question} where the question goes")
    missing = [name for name in fields if columns is not None and name not in columns]
    if missing:
        raise ValueError(f"--prompt-template names field {missing[0]!r}, which {dataset}'s rows lack (fields: "
                         f"{sorted(columns)})")


def field_value(row, name):
    """The value of column `name`, or of a field nested in one by a dotted path (meta.answer: row["meta"]["answer"];
    a column whose own name holds a dot is taken first). KeyError(name) when there is none."""
    if name in row:
        return row[name]
    value = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def cell_problem(value, name, flag):
    """Why a question or answer cell cannot be read as text, or None: an object, a list or a boolean would become
    Python's repr ("{'v': 28}", "True"), which no completion matches."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or not str(value).strip():
        return f"field {name!r} is empty"
    if isinstance(value, bool):
        return f"field {name!r} holds a boolean ({str(value).lower()}), not text: write it as text in the file"
    if isinstance(value, dict):
        fields = sorted(map(str, value))
        return (f"field {name!r} holds an object with fields {fields}, not text: name one with a dotted path, e.g. "
                f"{flag} {name}.{fields[0] if fields else 'name'}")
    if not isinstance(value, (str, int, float)):
        return f"field {name!r} holds a {type(value).__name__} ({str(value)[:40]}), not text"
    return None


def shaped_rows(numbered_rows, where, source):
    """Rows of one's own as loader rows ({**columns, "question", "answer"}), each checked: an object, the question
    and answer fields present (dotted paths: nested fields), text or numbers and not empty, every template column
    present, an answer of --answer-kind; the first bad row is one ValueError line naming `where`, the row number and
    the field."""
    template = source.prompt_template or "{question}"
    check_template(template)
    fields = template_fields(template)
    rows = []
    for number, row in numbered_rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where} row {number}: expected an object with fields, got {type(row).__name__}")
        cells = {}
        for name, flag in ((source.question_field, "--question-field"), (source.answer_field, "--answer-field")):
            try:
                cells[flag] = field_value(row, name)
            except KeyError:
                raise ValueError(f"{where} row {number}: no field {name!r} (fields: {sorted(row, key=str)}); name "
                                 f"another with {flag}") from None
            problem = cell_problem(cells[flag], name, flag)
            if problem:
                raise ValueError(f"{where} row {number}: {problem}")
        shaped = {**row, "question": str(cells["--question-field"]), "answer": str(cells["--answer-field"]).strip()}
        missing = [name for name in fields if name not in shaped]
        if missing:
            raise ValueError(f"{where} row {number}: --prompt-template names field {missing[0]!r}, which the row "
                             f"lacks (fields: {sorted(row, key=str)})")
        problem = answer_problem(shaped["answer"], source.answer_kind)
        if problem:
            raise ValueError(f"{where} row {number}: field {source.answer_field!r} {problem}")
        rows.append(shaped)
    if not rows:
        raise ValueError(f"{where}: no rows")
    return rows


def answer_problem(answer, kind):
    """Why `answer` is not of --answer-kind `kind`, or None."""
    from rewards import plain_number

    if kind == "number" and plain_number(answer) is None:
        return f"is not a number: {answer!r} (--answer-kind number)"
    if kind == "choice" and answer not in ("A", "B", "C", "D"):
        return f"is not a choice letter A-D: {answer!r} (--answer-kind choice)"
    return None


def _own_part(name, split, source):
    """[(number, row)] of a file or Hub id, and where they come from (for messages)."""
    if own_kind(name) == "file":
        return _numbered_rows(name), str(name)
    return _hub_own_rows(name, split), f"{name} ({split})"


def held_out(question, fraction):
    """Whether a row of this question is held out (SPLIT_RULE): its salted SHA-256, read as a number in [0, 1), is
    below `fraction`. The row alone decides: duplicates go together, and rows added to the file move no other."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{question.strip()}".encode()).hexdigest()
    return int(digest[:15], 16) / 16 ** 15 < fraction


def read_own_rows(source, split):
    """One split of one's own rows: --eval-dataset's rows (every one) for "test" where given, else the rows of
    --dataset whose question is held out (`held_out`, about `eval_fraction` of them) for "test", the others for
    "train". A Hub id without --eval-dataset or --eval-fraction reads its own "train" / "test" splits."""
    if split == "test" and source.eval_dataset:
        return shaped_rows(*_own_part(source.eval_dataset, "test", source), source)
    hub_splits = own_kind(source.dataset) == "hub" and not source.eval_dataset and source.eval_fraction is None
    rows = shaped_rows(*_own_part(source.dataset, split if hub_splits else "train", source), source)
    if source.eval_dataset or hub_splits:
        return rows
    fraction = DEFAULT_EVAL_FRACTION if source.eval_fraction is None else source.eval_fraction
    if source.split_rule == RANKED_SPLIT:  # a run started before SPLIT_RULE: the rows it was split into
        part = _split_part(rows, [json.dumps([row["question"], row["answer"]]) for row in rows], fraction, split)
    else:
        part = [row for row in rows if held_out(row["question"], fraction) == (split == "test")]
    if not part:
        raise ValueError(f"{source.dataset}: the {'held-out' if split == 'test' else 'training'} part of its "
                         f"{len(rows)} rows is empty (--eval-fraction {fraction:g} holds out each row by a hash of "
                         "its question, about that fraction of them); give another --eval-fraction or an "
                         "--eval-dataset file (train.py: or --eval-samples 0, no held-out evaluation)")
    return part


def check_own_rows(source, splits=SPLITS):
    """The offline checks of one's own rows before anything loads: local files read and every row checked
    (shaped_rows); a Hub id needs `datasets` importable (its rows are checked as they are read). Returns {split:
    number of rows} of the splits read from files."""
    if source.answer_kind is not None and source.answer_kind not in ANSWER_KINDS:
        raise ValueError(f"--answer-kind must be one of {ANSWER_KINDS}, got {source.answer_kind!r}")
    names = [source.dataset] + ([source.eval_dataset] if source.eval_dataset and "test" in splits else [])
    for name in names:
        kind = own_kind(name)
        if kind is None:
            raise ValueError(f"--eval-dataset {name!r}: expected a .jsonl / .csv / .parquet file or a Hub id")
        if kind == "hub" and importlib.util.find_spec("datasets") is None:
            raise ValueError(f"reading {name} from the Hub needs the `datasets` package (pip install datasets)")
    return {split: len(read_own_rows(source, split)) for split in splits
            if all(own_kind(name) == "file" for name in names)}


def file_sha256(path):
    """The SHA-256 of a file's bytes (what config.json records of one's own data and reward files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def own_files(source):
    """{role: {"path", "sha256"}} of the local files a run reads its rows from (none for registered datasets)."""
    return {role: {"path": str(Path(name).resolve()), "sha256": file_sha256(name)}
            for role, name in (("dataset", source.dataset), ("eval_dataset", source.eval_dataset))
            if name and name not in DATASET_READERS and own_kind(name) == "file"}


def system_prompt_of(flag):
    """The system turn of --system-prompt: unset (None) is the paper's (SYSTEM_PROMPT), '' is none."""
    return SYSTEM_PROMPT if flag is None else flag


def _messages(system_prompt, example, user_content):
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if example:
        messages += [{"role": "user", "content": example[0]}, {"role": "assistant", "content": example[1]}]
    return messages + [{"role": "user", "content": user_content}]


def load_split(name, split="train", *, data_dir=None, hub_id=None, num_rows=None, seed=0, one_shot=False,
               system_prompt=SYSTEM_PROMPT, max_digits=2, source=None):
    """One split of a dataset as a `datasets.Dataset` ("prompt", "answer", "question", source fields).

    name: a registered dataset (DATASET_READERS), a local .jsonl / .csv / .parquet file or a Hub dataset id (read as
    `source`, a DataSource, says: fields, template, held-out part). num_rows: a seeded random subset (in file order);
    for arithmetic, the number of generated rows (default 1000 train / 100 test). Rows come from data_dir, else
    default_data_dir(), else the Hub (HUB_IDS); hub_id reads that Hub dataset whatever folders exist."""
    import datasets

    reader = reader_of(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    if num_rows is not None and num_rows <= 0:
        raise ValueError(f"num_rows must be positive, got {num_rows}")
    source = source or DataSource(name)
    if reader is None:
        rows, template, example = read_own_rows(source, split), source.prompt_template or "{question}", None
        if one_shot:
            raise ValueError("--one-shot has a worked example for the registered datasets only; for your own rows, "
                             "write the example into --prompt-template")
    else:
        options = dict(data_dir=data_dir, hub_id=hub_id, num_rows=num_rows, seed=seed, max_digits=max_digits)
        template = source.prompt_template or reader.template
        check_template(template, reader.columns, name)
        rows = reader.read(split, **options)
        if one_shot and name not in ONE_SHOT:
            raise ValueError(f"--one-shot: dataset {name!r} has no worked example (data.ONE_SHOT); write one into "
                             "--prompt-template (--no-one-shot)")
        example = ONE_SHOT[name] if one_shot else None
    if num_rows is not None and not (reader and reader.makes_rows):
        if num_rows > len(rows):
            raise ValueError(too_many_rows(num_rows, split, name, len(rows)))
        rows = [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), num_rows))]
    for row in rows:
        try:
            row["prompt"] = _messages(system_prompt, example, template.format_map(row))
        except KeyError as error:  # a registered reader that lists no columns: its rows tell
            raise ValueError(f"--prompt-template names field {error}, which {name}'s rows lack (fields: "
                             f"{sorted(row, key=str)})") from None
    return datasets.Dataset.from_list(rows)


def too_many_rows(num_rows, split, name, count):
    """The line refusing `num_rows` rows of a split that has `count`, naming the flag that asked for them."""
    if split == "train":
        return f"--num-train-rows {num_rows}: {name} has {count} training rows"
    return (f"--eval-samples {num_rows} (eval.py: --num-prompts): {name} has {count} held-out rows; ask for at most "
            f"{count}")


def render_prompts(tokenizer, prompts, prefill_think=False, *, use_chat_template=None):
    """Prompt texts ending where the assistant's reply starts. With a chat template: apply_chat_template(...,
    add_generation_prompt=True). Without one, or with use_chat_template=False (base models whose tokenizer
    still ships a template): plain "<system>\\n\\nUser: <q>\\nAssistant: <a>\\n...User: <q>\\nAssistant:".
    prefill_think appends THINK_PREFILL ("<think>\\n", after a space in plain text); rewards.graded_completion puts
    it back in front of the completion."""
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template:
        texts = [tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
                 for messages in prompts]
        return [text + THINK_PREFILL for text in texts] if prefill_think else texts
    turns = {"system": "{}\n", "user": "\nUser: {}"}  # any other role: "\nAssistant: {}"
    end = "\nAssistant:" + (" " + THINK_PREFILL if prefill_think else "")
    return ["".join(turns.get(m["role"], "\nAssistant: {}").format(m["content"]) for m in messages).lstrip("\n") + end
            for messages in prompts]


def prompt_token_counts(texts, tokenizer):
    """Tokens of each rendered prompt, counted as the sampler tokenizes them: add_special_tokens=False (the template
    already holds them)."""
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []


def filter_long_prompts(texts, tokenizer, max_prompt_tokens):
    """(indices of texts of at most max_prompt_tokens tokens (`prompt_token_counts`), number dropped); None: all."""
    if max_prompt_tokens is None:
        return list(range(len(texts))), 0
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    lengths = prompt_token_counts(texts, tokenizer)
    kept = [i for i, length in enumerate(lengths) if length <= max_prompt_tokens]
    dropped = len(texts) - len(kept)
    if dropped:
        logger.warning("dropped %d of %d prompts longer than %d tokens", dropped, len(texts), max_prompt_tokens)
    return kept, dropped


@dataclass
class Example:
    text: str     # the rendered prompt the model continues (render_prompts)
    prompt: list  # its chat messages (what the rewards see as the prompt)
    answer: str   # ground truth the accuracy reward compares against
    columns: dict = field(default_factory=dict, compare=False)  # the row's other columns: reward functions get them by name


def build_prompt_set(dataset, split, tokenizer, *, data_dir=None, hub_id=None, num_rows=None, seed=0,
                     one_shot=False, system_prompt=SYSTEM_PROMPT, prefill_think=False, max_prompt_tokens=None,
                     max_digits=2, source=None):
    """One split as [Example] rendered for `tokenizer`, for training and evaluation alike. Prompts longer than
    max_prompt_tokens are dropped (a logged count); None keeps all. source: the DataSource of one's own rows."""
    rows = load_split(dataset, split, data_dir=data_dir, hub_id=hub_id, num_rows=num_rows, seed=seed,
                      one_shot=one_shot, system_prompt=system_prompt, max_digits=max_digits, source=source)
    prompts, answers = list(rows["prompt"]), list(rows["answer"])
    columns = [{key: value for key, value in row.items() if key not in ("prompt", "answer")} for row in rows]
    texts = render_prompts(tokenizer, prompts, prefill_think=prefill_think)
    kept, _ = filter_long_prompts(texts, tokenizer, max_prompt_tokens)
    if not kept:
        raise ValueError(f"every {dataset}/{split} prompt is longer than max_prompt_tokens={max_prompt_tokens}")
    return [Example(texts[i], prompts[i], answers[i], columns[i]) for i in kept]
