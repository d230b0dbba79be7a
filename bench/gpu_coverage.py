"""The lines of the files a GPU runs that the default test suite executes: `python -m bench coverage [--json]`.

No GPU is needed to run the GPU's code: engine/gpu_paths.py takes the GPU paths on a CPU (or on a stand-in device),
the decode engine's Triton kernels run under Triton's interpreter, and this command measures how much of those files
the default suite (`python -m pytest`, as README runs it) executes, with coverage.py, in every process the suite
starts (pytest's workers, the interpreter's and train.py's subprocesses: coverage's `patch = subprocess`).

What no CPU can run is left out of the count, by name and reason (`EXCLUDED`): recording a CUDA graph, reading a real
card's properties and memory statistics, Liger-Kernel's kernels (CUDA only, not installed here). Every other line
counts, and a line not run is listed. The figure, the suite's own run, with its date and machine, goes to BENCHMARKS.md.
"""

import argparse
import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The files the GPU paths run (the update's fast paths, the bf16 LoRA product, the decode engine and its kernels).
FILES = ("engine/kernels.py", "engine/ops.py", "engine/triton_kernels.py", "engine/graphs.py", "engine/decode.py",
         "engine/step.py", "engine/gpu_paths.py", "update.py", "models.py")
# (file, what, why no CPU runs it): what is a function's qualified name, or a regular expression matched against the
# first line of a statement (the whole statement is left out: an `if` with its body, a loop) or any other line.
EXCLUDED = (
    ("engine/graphs.py", "record_graph", "records a CUDA graph: CUDA streams and graphs exist on CUDA only"),
    ("engine/decode.py", r"graph\.replay\(\)", "replays a recorded CUDA graph"),
    ("engine/gpu_paths.py", r'if torch\.device\(device\)\.type == "cuda":',
     "a real card's memory and multiprocessors (torch.cuda)"),
    ("update.py", r'if torch\.device\(device\)\.type == "cuda":', "a real card's memory statistics (torch.cuda)"),
    ("engine/kernels.py", r'find_spec\("liger_kernel"\) is None', "Liger-Kernel absent on CUDA (not installed here)"),
    ("engine/kernels.py", r"from liger_kernel", "Liger-Kernel's kernels: CUDA only, not installed here"),
    ("engine/kernels.py", r"return dict\(rms_norm=lambda .*Liger", "Liger-Kernel's kernels: CUDA only, not installed here"),
    ("engine/triton_kernels.py", r"tl\.dot\(q, tl\.trans\(keys\)\)", "bf16 operands to the tensor cores: the "
     "compiled kernel's (the interpreter's bf16 dot is wrong: it takes float32)"),
    ("engine/triton_kernels.py", r"tl\.dot\(probs\.to\(values\.dtype\)", "bf16 operands to the tensor cores: the "
     "compiled kernel's (the interpreter's bf16 dot is wrong: it takes float32)"),
    ("engine/triton_kernels.py", r"for first in range\(low, high, BLOCK_N\):",
     "the compiled kernel's loop over columns (the interpreter's range() cannot take bounds loaded from memory: it "
     "runs the while loop)"),
)


def excluded_lines(path, source):
    """{line: reason} of `source` (the text of FILES' `path`) that EXCLUDED leaves out."""
    lines, functions, statements = {}, {}, []
    tree = ast.parse(source)

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                statements.append(child)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                functions[name] = (child.lineno, child.end_lineno)
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree)
    text = source.splitlines()
    for file, what, reason in EXCLUDED:
        if file != path:
            continue
        spans = [functions[what]] if what in functions else \
            [(number, number) for number, line in enumerate(text, 1) if re.search(what, line)]
        if not spans:
            raise ValueError(f"EXCLUDED: {what!r} names nothing in {file}")
        for first, last in spans:
            starting = [node.end_lineno for node in statements if node.lineno == first and not (   # not a docstring
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
            lines.update({line: reason for line in range(first, max([last, *starting]) + 1)})
    return lines


def run_suite(data_dir, pytest_args):
    """The default suite under coverage (every process it starts measured): the combined data file's path."""
    rcfile = Path(data_dir) / "coveragerc"
    rcfile.write_text("[run]\nparallel = True\npatch = subprocess\n"
                      f"data_file = {Path(data_dir) / '.coverage'}\n"
                      "include =\n" + "".join(f"    {ROOT / file}\n" for file in FILES))
    env = {key: value for key, value in os.environ.items() if not key.startswith("COVERAGE_")}
    # One process (-n 0; pytest_args may say otherwise): a pytest-xdist worker's coverage data was lost at its exit
    # in some runs (whole test files unexecuted; totals of 96 % and 89-100 % per file against 99 % in one process).
    done = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rcfile}", "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", "-n", "0", *pytest_args], cwd=ROOT, env=env)
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rcfile}", "-q"], cwd=ROOT, env=env,
                   check=True)
    return rcfile, done.returncode


def _ranges(numbers):
    numbers, spans = sorted(numbers), []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def measured(rcfile):
    """{file: {statements, executed, missing (ranges), excluded {reason: lines}}} from the combined data."""
    import coverage

    cov = coverage.Coverage(config_file=str(rcfile))
    cov.load()
    result = {}
    for file in FILES:
        path = ROOT / file
        _, statements, _, missing, _ = cov.analysis2(str(path))
        out = excluded_lines(file, path.read_text())
        kept = [line for line in statements if line not in out]
        not_run = [line for line in missing if line not in out]
        reasons = {}
        for line in statements:
            if line in out:
                reasons[out[line]] = reasons.get(out[line], 0) + 1
        result[file] = dict(statements=len(kept), executed=len(kept) - len(not_run), missing=_ranges(not_run),
                            excluded=reasons)
    return result


def bench_coverage(argv):
    """`python -m bench coverage`: run the default suite under coverage, print the table (or, with --json, one JSON
    object), save the figures (`python -m bench show` prints them again)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench coverage",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the total and whether the suite "
                        "passed)")
    parser.add_argument("--out", default="bench_out/bench_coverage.json", help="where the figures go (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments instead of the default "
                        "suite's none (a file or -k, to look at a part)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as data_dir:
        rcfile, returncode = run_suite(data_dir, args.pytest_args)
        files = measured(rcfile)
    statements = sum(entry["statements"] for entry in files.values())
    executed = sum(entry["executed"] for entry in files.values())
    rows = [{"file": file, "lines": entry["statements"], "executed": entry["executed"],
             "%": round(100 * entry["executed"] / max(entry["statements"], 1), 1), "not executed": entry["missing"]}
            for file, entry in files.items()]
    rows.append({"file": "total", "lines": statements, "executed": executed,
                 "%": round(100 * executed / max(statements, 1), 1), "not executed": ""})
    excluded = [dict(file=file, what=what, lines=files[file]["excluded"].get(reason, 0), reason=reason)
                for file, what, reason in EXCLUDED]
    saved = dict(benchmark="coverage", date=datetime.date.today().isoformat(),
                 device=f"CPU ({platform.machine()}, {os.cpu_count()} cores, no GPU)",
                 command=" ".join(["python -m bench coverage", *(["--", *args.pytest_args] if args.pytest_args
                                                                  else [])]),
                 suite_passed=returncode == 0, percent=rows[-1]["%"], rows=rows, excluded=excluded)
    path = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1) + "\n")
    if args.json:
        print(json.dumps({key: saved[key] for key in ("percent", "suite_passed")}))
        return saved
    from bench.common import print_header, print_row

    for table in (rows, excluded):
        print_header(list(table[0]))
        for row in table:
            print_row(row, list(table[0]))
        print()
    print(f"the suite {'passed' if returncode == 0 else 'FAILED'}; records: {path}")
    return saved
