"""README states what the code is: the "Read the code" line counts (rounded figures, within 15% of the files), and
every flag of its flag table is one train.py's parser knows."""

import re

import config
from run_helpers import ROOT

TOLERANCE = 0.15  # README's figures are rounded ("about 250"): they need updating only when a file changes a lot


def lines_of(name):
    return len((ROOT / name).read_text().splitlines())


def test_read_the_code_line_counts_match_the_files():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Read the code"):readme.index("## Paper settings")]
    stated = {name: int(count) for name, count in re.findall(r"`(\w+\.py)` \(about (\d+)", section)}
    assert list(stated) == ["train.py", "sampling.py", "rewards.py", "answers.py", "pods.py", "advantages.py",
                            "update.py", "grpo_loss.py"]
    for name, count in stated.items():
        assert abs(lines_of(name) - count) <= TOLERANCE * lines_of(name), f"README: {name} about {count} lines, " \
                                                                         f"it has {lines_of(name)}"
    total = int(re.search(r"Six steps, eight files, about ([\d,]+) lines", section).group(1).replace(",", ""))
    actual = sum(map(lines_of, stated))
    assert abs(actual - total) <= TOLERANCE * actual, f"README: about {total} lines, the eight files have {actual}"


def test_every_flag_in_readmes_flag_table_is_a_train_flag():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Flags worth knowing"):readme.index("**Variants researchers combine")]
    known = {option for action in config.build_parser()._actions for option in action.option_strings}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", table))
    assert len(named) > 30 and named - known == set()
