"""Benchmarks for pods: `python bench.py <name> [options]`.

Speed and memory targets live here as printed figures (ratios measured in one run), never in timed
tests. Measured numbers, with the command that made them, are recorded in BENCHMARKS.md.

  selector   max-variance down-sampling vs torch.sort and the authors' loop (paper §3.3, Lemma 1)
  rewards    grading throughput of the three reward functions (paper Appendix A.1)
  asymmetry  generation vs update time over rollouts per step (paper Fig. 1)   -> bench_gpu.py
  decode     decode step time vs the memory-bandwidth bound                    -> bench_gpu.py
  memory     peak memory per phase of a setting-(a) PODS step                  -> bench_gpu.py
"""

import sys


def bench_selector(argv):
    raise NotImplementedError("selector benchmark not written yet")


def bench_rewards(argv):
    raise NotImplementedError("rewards benchmark not written yet")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    local = {"selector": bench_selector, "rewards": bench_rewards}
    gpu = ("asymmetry", "decode", "memory")
    if not argv or argv[0] not in (*local, *gpu):
        sys.exit(f"usage: python bench.py {{{','.join((*local, *gpu))}}} [options]")
    name, rest = argv[0], argv[1:]
    if name in local:
        return local[name](rest)
    import bench_gpu  # heavy model-shape benchmarks live in their own module

    return bench_gpu.main(name, rest)


if __name__ == "__main__":
    main()
