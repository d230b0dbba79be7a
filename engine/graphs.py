"""The decode step recorded as a CUDA graph, or compiled (engine/__init__.py: the design). GPU machinery: on a CPU
the step runs eagerly and nothing here is called.

A recorded graph replays one decode step's kernels with one launch: the step is a fixed-shape function of its
bucket (decode.State), so one graph per bucket serves every token of every call. FSDP2 re-allocates the gathered
weights around every unshard, so a sharded model is never recorded (`fsdp_sharded`).
"""

import time

import torch


def fsdp_sharded(model):
    """Whether FSDP2 (fully_shard) manages any module of `model`."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def compiled(function, backend, stats):
    """torch.compile with static shapes and a backend wrapper counting graphs (stats.compiled_graphs)."""
    def counting_backend(graph_module, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        stats.compiled_graphs += 1
        return (lookup_backend(backend) if isinstance(backend, str) else backend)(graph_module, example_inputs)

    # One code object serves every bucket: dynamo's default of 8 graphs per code object is too few.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 256))
    return torch.compile(function, backend=counting_backend, dynamic=False)


def record_graph(engine, state, stats):
    """Warm up (compiles) on a side stream, then record one decode step as a CUDA graph (its time and count added
    to `stats`, a decode.DecodeStats)."""
    start, saved = time.perf_counter(), [state.scalars[name].clone() for name in ("slot", "step")]
    state.scalars["slot"].zero_(), state.scalars["step"].zero_()  # warm-up writes columns 0..2: inside the cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            engine.step(engine, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # All graphs share one pool: a step keeps nothing it allocates (its results go into the State's buffers) and
    # graphs replay one at a time, so their temporaries (fp32 logits, CDF: ~0.1-0.3 GB at batch 64) can share
    # memory; a private pool per graph would hold that once for each of the tens of buckets.
    engine.graph_pool = engine.graph_pool or torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=engine.graph_pool):
        engine.step(engine, state)
    state.scalars["slot"].copy_(saved[0]), state.scalars["step"].copy_(saved[1])
    torch.cuda.synchronize()
    stats.warmup_s += time.perf_counter() - start
    stats.captured_graphs += 1
    return graph
