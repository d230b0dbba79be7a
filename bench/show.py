"""A saved benchmark run's tables, as the run printed them: `python -m bench show FILE.json ...`.

Benchmarks that need a GPU save every row they print (bench_<name>.json, common.save_json); the GPU figures in
BENCHMARKS.md are these tables, recomputed from the JSON files committed under results/ on any machine. A census
(`python -m bench census`) saves its raw records: its tables and figures are computed again from them.
"""

import json
from pathlib import Path

import compare
from bench.common import print_header, print_row


def row_tables(saved):
    """{key: rows} for every list of row dicts in a saved result, in the order it was saved."""
    return {key: value for key, value in saved.items()
            if isinstance(value, list) and value and all(isinstance(row, dict) for row in value)}


def bench_show(argv):
    """Print each file's row tables (columns in the rows' own order) and its summary dicts as one line each."""
    if not argv or any(arg.startswith("-") for arg in argv):
        raise SystemExit("usage: python -m bench show FILE.json [FILE.json ...]   (a benchmark's saved results)")
    shown = {}
    for path in map(Path, argv):
        if not path.is_file():
            raise SystemExit(f"python -m bench show: no file {path}")
        try:
            saved = compare.read_json_object(path)
        except ValueError as error:
            raise SystemExit(f"python -m bench show: {error}") from None
        for key, value in saved.items():  # rows mixed with other values: a damaged table, said, not skipped
            if isinstance(value, list) and any(isinstance(row, dict) for row in value) and key not in row_tables(saved):
                bad = next(i for i, row in enumerate(value) if not isinstance(row, dict))
                raise SystemExit(f"python -m bench show: {path}: {key!r} is not a table of rows (item {bad} is "
                                 f"{value[bad]!r})")
        print(f"# {path}")
        if saved.get("benchmark") == "census":  # its tables are recomputed from its records
            from bench import census

            shown[str(path)] = census.print_report(saved)
            print()
            continue
        for key, rows in row_tables(saved).items():
            columns = list(dict.fromkeys(column for row in rows for column in row))
            print(f"\n## {key}")
            print_header(columns)
            for row in rows:
                print_row(row, columns)
        for key, value in saved.items():
            if key != "args" and key not in row_tables(saved):  # summaries and other values, one line each
                print(f"\n{key}: {json.dumps(value, default=str)}")
        print()
        shown[str(path)] = saved
    return shown
