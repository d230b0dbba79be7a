"""The decode engine's matrix products on a CPU: F.linear against oneDNN's blocked weight layout (not the paper's
method: how fast a CPU runs the demo's generation).

    python -m bench products [--threads 1,2] [--repeats 200] [--tiny] [--out-dir bench_out]

Times, for each dtype (float32, bfloat16) and thread count, the products a demo decode step makes (64 rows: the
demo's 16 rollouts x 4 prompts of a chunk; SmolLM2-135M's q|k|v, o, gate|up, down and LM head shapes) by F.linear and
by `engine.step.linear` over the weight's `cpu_layout` (laid out once, as the engine does whenever its weights
change), the two interleaved, and prints each shape's times, the ratio and whether the numbers are equal. On a CPU
without oneDNN the layout is None and the row says so.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from bench import common

# (rows, in, out) of one demo decode step's products: q|k|v stacked, o, gate|up stacked, down, the LM head
DEMO_SHAPES = ((64, 576, 960), (64, 576, 576), (64, 576, 3072), (64, 1536, 576), (64, 576, 49152))
TINY_SHAPES = ((8, 32, 48), (8, 48, 32))


def per_call_ms(function, repeats):
    """Mean milliseconds of a call after 3 warm-up calls."""
    for _ in range(3):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e3


def compare_shape(rows, inputs, outputs, dtype, repeats, rounds=3):
    """{"linear_ms", "laid_out_ms", "ratio", "equal"} of one product shape: the medians over `rounds` interleaved
    rounds; laid_out_ms None where the CPU cannot lay the weight out."""
    from engine import step as weights

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
    layout = [weights.cpu_layout(weight, rows)]
    if layout[0] is None:
        return dict(linear_ms=per_call_ms(lambda: F.linear(x, weight), repeats), laid_out_ms=None, ratio=None,
                    equal=None)
    plain, laid = [], []
    for _ in range(rounds):
        plain.append(per_call_ms(lambda: F.linear(x, weight), repeats))
        laid.append(per_call_ms(lambda: weights.linear(x, weight, None, layout), repeats))
    plain_ms, laid_ms = sorted(plain)[rounds // 2], sorted(laid)[rounds // 2]
    return dict(linear_ms=round(plain_ms, 4), laid_out_ms=round(laid_ms, 4), ratio=round(plain_ms / laid_ms, 2),
                equal=bool(torch.equal(weights.linear(x, weight, None, layout), F.linear(x, weight))))


def bench_products(argv):
    parser = argparse.ArgumentParser(prog="python -m bench products", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--repeats", type=int, default=200, help="calls timed per shape and round (the LM head: /8)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (a smoke run)")
    parser.add_argument("--out-dir", default="bench_out", help="bench_products.json goes here")
    args = parser.parse_args(argv)
    try:
        threads = [int(count) for count in args.threads.split(",")]
    except ValueError:
        parser.error(f"argument --threads: a comma list of integers, got {args.threads!r}")
    if any(count < 1 for count in threads) or args.repeats < 1:
        parser.error("argument --threads / --repeats: must be >= 1")
    shapes = TINY_SHAPES if args.tiny else DEMO_SHAPES
    before, results = torch.get_num_threads(), []
    print("# products of a demo decode step: F.linear vs the weight laid out for oneDNN (engine/step.py)")
    print("dtype | threads | rows x in x out | F.linear ms | laid out ms | ratio | equal")
    try:
        for count in threads:
            torch.set_num_threads(count)
            for dtype in (torch.float32, torch.bfloat16):
                for rows, inputs, outputs in shapes:
                    repeats = max(1, args.repeats // 8) if outputs > 10_000 else args.repeats
                    row = dict(dtype=str(dtype).removeprefix("torch."), threads=count, shape=[rows, inputs, outputs],
                               **compare_shape(rows, inputs, outputs, dtype, repeats))
                    results.append(row)
                    print(f"{row['dtype']} | {count} | {rows} x {inputs} x {outputs} | {row['linear_ms']} | "
                          f"{row['laid_out_ms']} | {row['ratio']} | {row['equal']}", flush=True)
    finally:
        torch.set_num_threads(before)
    common.save_json(args.out_dir, "products", dict(results=results))
    return dict(results=results)
