"""train.py's data flags (the "data" group; run/config.py assembles the parser): the dataset (registered, a file of
one's own rows or a Hub id), the columns and template of one's own rows, the held-out rows, the prompt; the values
resolved from them (`resolve_defaults`), their checks (`check_values` without the files, `check_data` reading them,
`check_data_files` at a resume), and `data_source`, the data.DataSource of them."""

import argparse
from pathlib import Path

import data

POSITIVE_INTS = ("max_prompt_tokens", "num_train_rows")  # >= 1 (num_train_rows: when given)


def add_flags(group):
    """The data flags, in --help's order."""
    add = group.add_argument
    add("--dataset", help=f"a registered dataset ({', '.join(data.DATASETS)}: docs/rewards_and_data.md), your own "
        "rows as a .jsonl / .csv / .parquet file, or a Hub dataset id (owner/name)")
    add("--question-field", default="question", help="your own rows: the column holding the question")
    add("--answer-field", default="answer", help="your own rows: the column holding the ground-truth answer")
    add("--prompt-template", help="the user turn, a text or a file holding it, with {question} and any other column "
        "by name, e.g. 'Solve: {question}' (default: the question; chemistry: its instruction, then the question)")
    add("--eval-dataset", help="your own rows: the held-out rows' file or Hub id (default: --eval-fraction of "
        "--dataset's rows)")
    add("--eval-fraction", type=float, help=f"your own rows: the fraction held out, chosen by a stable hash of each "
        f"row (default: {data.DEFAULT_EVAL_FRACTION:g} of a file; a Hub id's own test split)")
    add("--answer-kind", choices=data.ANSWER_KINDS, help="what the accuracy reward compares: a number, a LaTeX "
        "expression (math-verify) or a choice letter A-D (default: the dataset's; your own rows: told by the answer)")
    add("--data-dir", help="folder with the dataset files (default: $PODS_DATA_DIR, else ../shared/data, else the Hub)")
    add("--num-train-rows", type=int,
        help="use this many training rows (arithmetic: the synthetic set size; default: every row)")
    add("--one-shot", action=argparse.BooleanOptionalAction, default=False, help="one worked example in the prompt")
    add("--prefill-think", action="store_true", help="end the prompt with '<think>\\n' (scored as completion)")
    add("--max-prompt-tokens", type=int,
        help="training prompts longer than this many tokens are dropped (held-out prompts are kept)")
    add("--system-prompt", help="the system turn of every prompt; '' = none (unset: the paper's think/answer "
        "instruction, data.SYSTEM_PROMPT)")


def resolve_defaults(args):
    """The data values as the run uses them (and config.json holds them): a --prompt-template file's text, the
    registered dataset's --answer-kind, and with a file of one's own the held-out rows it has (`_own_eval_samples`)."""
    sources = args.value_sources
    if args.prompt_template and Path(args.prompt_template).is_file():  # a file: its text is what the run uses
        sources["prompt_template"] += f" (the file {args.prompt_template})"
        args.prompt_template = data.read_template(args.prompt_template)
    reader = data.DATASET_READERS.get(args.dataset)
    if args.answer_kind is None and reader and reader.answer_kind and not args.resume:  # a resumed run keeps its own
        args.answer_kind, sources["answer_kind"] = reader.answer_kind, f"dataset {args.dataset}"
    _own_eval_samples(args)


def _own_eval_samples(args):
    """With a file of one's own and --eval-samples not given (nor recorded by the resumed run): every held-out row
    where the file holds fewer than the preset's count (a row it cannot read is left to the checks)."""
    source = args.value_sources["eval_samples"]
    if not args.eval_samples or source.startswith(("flag", "the resumed run")) or data.own_kind(args.dataset) != "file":
        return
    try:
        count = len(data.read_own_rows(data_source(args), "test"))
    except (ValueError, OSError):
        return
    if count < args.eval_samples:
        args.value_sources["eval_samples"] = f"{source}: every held-out row ({count}), at most {args.eval_samples}"
        args.eval_samples = count


def own_files(args):
    """config.json's `data_files`: {role: {"path", "sha256"}} of one's own rows, so that a resume refuses a changed
    file. A file not there is left out here: the checks refuse it."""
    present = [name if name and Path(name).is_file() else None for name in (args.dataset, args.eval_dataset)]
    return data.own_files(data.DataSource(present[0], eval_dataset=present[1]))


def check_values(args):
    """The data flags that act on one's own rows only are refused with a registered dataset (they would do
    nothing); a template's placeholders must be names; the held-out fraction a fraction."""
    own = args.dataset not in data.DATASET_READERS
    if not own:
        given = [flag for flag, value, default in (("--question-field", args.question_field, "question"),
                                                   ("--answer-field", args.answer_field, "answer"),
                                                   ("--eval-dataset", args.eval_dataset, None),
                                                   ("--eval-fraction", args.eval_fraction, None)) if value != default]
        if given:
            raise ValueError(f"{', '.join(given)} shape your own rows (a file or Hub id as --dataset); "
                             f"{args.dataset} is a registered dataset with its own fields and held-out split")
    elif data.own_kind(args.dataset) is None:
        raise ValueError(f"--dataset {args.dataset!r}: not a registered dataset ({', '.join(data.DATASETS)}), "
                         "a .jsonl / .csv / .parquet file or a Hub id (owner/name)")
    elif args.one_shot:
        raise ValueError("--one-shot has a worked example for the registered datasets only; with your own rows, "
                         "write an example into --prompt-template (--no-one-shot)")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction:g}")
    if args.eval_dataset and args.eval_fraction is not None:
        raise ValueError("--eval-dataset and --eval-fraction both name the held-out rows: give one")
    if args.prompt_template is not None:  # a stray brace, no placeholder, a column the registered rows lack: one line
        reader = data.DATASET_READERS.get(args.dataset)
        data.check_template(args.prompt_template, reader and reader.columns, args.dataset)


def check_data(args):
    """The dataset is readable: synthetic, files in the data folder (data.default_data_dir) or its Hub source; one's
    own file read and every row checked, its path and SHA-256 recorded (args.data_files, config.json)."""
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {args.data_dir} is not a folder")
    source = data_source(args)
    counts = data.check_data_source(args.dataset, args.data_dir, source=source,
                                     splits=("train", "test") if args.eval_samples else ("train",))
    for split, asked in (("train", args.num_train_rows), ("test", args.eval_samples)):
        if asked and split in (counts or {}) and asked > counts[split]:
            raise ValueError(data.too_many_rows(asked, split, args.dataset, counts[split]))


def data_source(args):
    """The data flags as a data.DataSource."""
    return data.DataSource(args.dataset, args.question_field, args.answer_field, args.prompt_template,
                           args.eval_dataset, args.eval_fraction, args.answer_kind, args.split_rule)


def check_data_files(args, saved):
    """A resume reads the files its run started with: a file of one's own rows changed since is refused."""
    for role, recorded in (saved.get("data_files") or {}).items():
        now = (args.data_files.get(role) or {}).get("sha256")
        if now != recorded.get("sha256"):
            raise ValueError(f"--resume: {recorded.get('path')} (--{role.replace('_', '-')}) changed since the run "
                             f"in {args.output_dir} started (sha256 {recorded.get('sha256', '')[:12]} -> "
                             f"{(now or 'absent')[:12]}); restore it or start a new run in another --output-dir")
