"""Benchmarks for pods: `python -m bench <name> [options]` from the repository root (`<name> --help` for options).

Speed and memory targets live here as printed figures (ratios measured in one run), never in timed tests.
Measured numbers, with the command that made them, are recorded in BENCHMARKS.md.

  selector   max-variance down-sampling vs torch.sort and the authors' loop (§3.3, Lemma 1)    bench/selector.py
  rewards    grading throughput of the three reward functions (Appendix A.1)                    bench/grading.py
  asymmetry  generation vs update time over rollouts per step (§1, Fig. 1)                      bench/phases.py
  memory     peak memory per phase of a setting-(a) PODS step (§4 setting (a))                  bench/phases.py
  decode     decode step time vs the memory-bandwidth bound and generate() (§1)                 bench/decode.py
  step       the real train_step, GRPO-PODS 64/16 vs GRPO 16/16 (Algorithm 1, Fig. 1)          bench/step.py
  sampler    sampler vs trainer log-prob gap: correct paths, planted faults (the fallback limit) bench/sampler.py
  prefix     the demo's update with prefix sharing off / on (each distinct token once), ratios  bench/prefix.py
  evalprefix held-out evaluation with prefix sharing off vs on: time ratio, same completions bench/eval_prefix.py
  census     kernels, host syncs, bytes, FLOPs and a GPU roofline of the update and a decode step   bench/census.py
             (the host's time of both, --host-repeats: bench/host_time.py; the narrow policy: bench/narrow.py)
  update     setting (a)'s update, its speed changes switched on in turn: time, GPU busy         bench/update_speed.py
  coverage   the lines of the files a GPU runs that the default test suite executes (no GPU)      bench/gpu_coverage.py
  load       a demo step beside 16 busy processes against the quiet machine, per --num-threads   bench/load.py
  products   a demo decode step's matrix products on a CPU: F.linear vs oneDNN's weight layout  bench/products.py
  save-tokenizer DIR   the offline SmolLM2 tokenizer, for `step --tokenizer DIR` on a GPU machine  bench/step.py
  show FILE.json ...   a saved run's tables as it printed them (the GPU figures, from results/)     bench/show.py

--tiny (every benchmark, not save-tokenizer; always on for the model-shape ones without CUDA) runs the code path
at toy sizes, with a 2-layer model for asymmetry / memory / decode / step: smoke figures, what tests/test_bench.py
runs (part of `pytest`).
Shared helpers (shapes, models from model_configs/, timing, output): bench/common.py.

GPU commands (one H100 or H200, from the repository root; each prints its rows as they complete):

    python -m bench save-tokenizer bench_out/tokenizer   # where the offline demo package is installed (3.5 MB)
    # copy bench_out/tokenizer/ to the same place in the checkout on the GPU machine, then:
    python -m bench decode                               # bf16 (+ 4-bit when bitsandbytes imports), < 5 min
    python -m bench asymmetry                            # Fig. 1 table + bench_out/bench_asymmetry.png, < 5 min
    python -m bench memory                               # 4-bit + LoRA r=64 + checkpointing, < 5 min
    python -m bench step --tokenizer bench_out/tokenizer                 # PODS vs GRPO, steady state
    python -m bench step --tokenizer bench_out/tokenizer --vary-widths   # 20 steps: recompiles after warm-up
    python -m bench update                               # the update, each speed change in turn, ~3 min
"""

import importlib
import sys

# name -> (module in bench/, function taking the remaining argv): modules are imported on demand, so that
# `selector` or `rewards` do not pay for the model-shape benchmarks' imports.
COMMANDS = {"selector": ("selector", "bench_selector"), "rewards": ("grading", "bench_rewards"),
            "asymmetry": ("phases", "bench_asymmetry"), "memory": ("phases", "bench_memory"),
            "decode": ("decode", "bench_decode"), "step": ("step", "bench_step"),
            "sampler": ("sampler", "bench_sampler"), "prefix": ("prefix", "bench_prefix"),
            "evalprefix": ("eval_prefix", "bench_evalprefix"), "census": ("census", "bench_census"),
            "update": ("update_speed", "bench_update"), "coverage": ("gpu_coverage", "bench_coverage"),
            "load": ("load", "bench_load"), "products": ("products", "bench_products"),
            "save-tokenizer": ("step", "save_tokenizer"), "show": ("show", "bench_show")}
USAGE = f"usage: python -m bench {{{','.join(COMMANDS)}}} [options]   (python -m bench --help: the list)"


def main(argv=None):
    """Run benchmark argv[0] with the options argv[1:]; returns its result (a dict for the benchmarks)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    if not argv or argv[0] not in COMMANDS:
        sys.exit(USAGE)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # rows appear as they complete, even through a pipe
    module_name, function_name = COMMANDS[argv[0]]
    module = importlib.import_module(f"bench.{module_name}")
    return getattr(module, function_name)(argv[1:])

if __name__ == "__main__":
    main()
