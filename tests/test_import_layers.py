"""Imports point down: every import of the project's modules (tests/ aside; imports inside functions count, and the
deferred ones, lazy_module("name", ...)) goes to a module of the importer's own layer or a lower one. The layers are
the table of docs/training.md ("### Layers"), read here, so the docs and the check cannot drift; a module with no
row fails. A planted upward import is caught (the checker on a small graph, and on planted source)."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Calls that import the module named by their first argument, a string: the project's deferred import (lazy.py) and
# Python's own.
IMPORTING_CALLS = {"lazy_module", "__import__", "import_module"}


def layer_table(text):
    """{"lazy.py": 0, "engine/": 2, ...}: the rows of the "### Layers" table of docs/training.md's `text`."""
    start = text.index("\n### Layers\n")
    end = text.find("\n#", start + 1)
    table = {}
    for line in text[start:end if end >= 0 else len(text)].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            for name in re.findall(r"`([\w/.]+)`", cells[1]):
                assert name not in table, f"docs/training.md, Layers: {name} has two rows"
                table[name] = int(cells[0])
    return table


def project_files():
    """The project's Python files (paths relative to the repository, tests/ left out): tracked, or new and not
    ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return sorted({name for name in listed if not name.startswith(("tests/", ".")) and (ROOT / name).is_file()})


def module_names(files):
    """{dotted module name: file} ("engine.decode": "engine/decode.py", "engine": "engine/__init__.py")."""
    return {name[:-3].replace("/", ".").removesuffix(".__init__"): name for name in files}


def imported_files(path, source, modules):
    """The project files the module at `path` (with `source`) imports: import statements anywhere in it (relative
    ones resolved), and IMPORTING_CALLS with a literal module name. A name resolves to the longest module it starts
    with ("engine.decode.STATS" -> engine/decode.py)."""
    package = path[:-3].replace("/", ".").removesuffix(".__init__") if path.endswith("__init__.py") \
        else path[:-3].replace("/", ".").rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(part for part in parts[:len(parts) - node.level + 1] + [base] if part)
            names += [base] + [f"{base}.{alias.name}".strip(".") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if function in IMPORTING_CALLS:
                names.append(node.args[0].value)
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and modules[name] != path:
            found.add(modules[name])
    return found


def import_graph(files):
    """{file: the project files it imports}."""
    modules = module_names(files)
    return {path: imported_files(path, (ROOT / path).read_text(), modules) for path in files}


def layer_of(path, table):
    """The layer of a file: its folder's row ("engine/") or its own ("train.py"); None without one."""
    folder, _, _ = path.partition("/")
    return table.get(f"{folder}/") if "/" in path else table.get(path)


def upward_imports(graph, table):
    """["importer (layer a) imports imported (layer b > a)", ...]: every import that runs up the layers."""
    return sorted(f"{path} (layer {layer_of(path, table)}) imports {target} (layer {layer_of(target, table)})"
                  for path, targets in graph.items() for target in targets
                  if layer_of(target, table) > layer_of(path, table))


@pytest.fixture(scope="module")
def table():
    return layer_table((ROOT / "docs" / "training.md").read_text())


@pytest.fixture(scope="module")
def files():
    return project_files()


def test_every_module_has_a_layer_and_every_row_a_module(table, files):
    assert len(set(table.values())) >= 3, "docs/training.md, Layers: the table was not read"
    unplaced = [path for path in files if layer_of(path, table) is None]
    assert not unplaced, f"docs/training.md, Layers: no row for {unplaced} (add the module or its folder to a layer)"
    named = {path if "/" not in path else path.partition("/")[0] + "/" for path in files}
    assert set(table) <= named, f"docs/training.md, Layers: rows for no module: {sorted(set(table) - named)}"


def test_every_import_points_down(table, files):
    upward = upward_imports(import_graph(files), table)
    assert not upward, "imports that run up the layers of docs/training.md (move the code down, or pass it in at a " \
                       "seam):\n" + "\n".join(upward)


def test_an_upward_import_is_caught(table, files):
    """The checker on planted edges: the engine timing itself with the run's report (the upward import stopwatch.py
    replaced); in planted source, an import inside a function (the engine calling sampling's fallback), a deferred
    one and a relative one. Downward imports pass."""
    graph = {"engine/decode.py": {"run/report.py", "stopwatch.py"}, "update.py": {"policy.py"}}
    assert upward_imports(graph, table) == [
        f"engine/decode.py (layer {table['engine/']}) imports run/report.py (layer {table['run/']})"]
    modules = module_names(files)
    planted = {
        "def check(model, gap):\n    import sampling\n    sampling.fall_back(model, 'hf', gap)\n": "sampling.py",
        "from lazy import lazy_module\nupdate = lazy_module('update', globals())\n": "update.py",
        "from ..run import report\n": "run/report.py",
    }
    for source, target in planted.items():
        imported = imported_files("engine/hf_generate.py", source, modules)
        assert target in imported, source
        assert any(line.startswith(f"engine/hf_generate.py (layer {table['engine/']}) imports {target}")
                   for line in upward_imports({"engine/hf_generate.py": imported}, table)), source
    assert upward_imports({"sampling.py": imported_files("sampling.py", "import engine\nimport policy\n", modules)},
                          table) == []
