"""Process group, FSDP2 sharding and collectives of a multi-process run (torchrun; paper settings (e), (f)).

`init_from_env` joins the process group torchrun describes; `run_main` ends every rank when one fails (torchrun
names it); `shard_model` shards the policy with FSDP2 (fp32 masters, bf16 compute, gradients summed over ranks);
`full_weights_for_generation` gathers the weights once for decoding; the collectives below are what the seams in
run.py are made of.
"""

import contextlib
import datetime
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# What a rank's error says when a peer died first (gloo, NCCL): such a rank waits a moment before its error is
# recorded, so that torchrun reports the rank that failed first as the root cause, not the peer that noticed.
PEER_FAILURE_WAIT_S = 2.0
PEER_FAILURE_TEXT = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands; `enabled` is False for a plain `python train.py` run (no process group)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    enabled: bool = False

    @property
    def is_main(self):
        return self.rank == 0


def init_from_env(device=None, timeout_s=1800.0):
    """The process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), else a single-process context.

    nccl on CUDA (one GPU per local rank), gloo on CPU. timeout_s bounds every collective, so a rank that
    stops answering ends the others with an error, not a silent hang; it must exceed the longest stretch
    one rank works alone (generating its rollouts)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistContext(device=device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        cuda = device.type == "cuda"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", store=_attempt_store(world_size, timeout),
                                rank=rank, world_size=world_size, device_id=device if cuda else None, timeout=timeout)
    return DistContext(rank, world_size, local_rank, device, enabled=True)


def _attempt_store(world_size, timeout):
    """The store of torchrun's agent, with keys of this attempt only; None outside torchrun (env:// then).

    After a failure torchrun --max-restarts starts the ranks again on the same agent store, where the
    failed attempt's keys would point the new ranks at dead peers (gloo: "connection refused")."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", agent)


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


def run_main(main, *args, **kwargs):
    """Run this rank's `main`; an exception prints the rank and its traceback and exits 1. torchrun then
    stops the other ranks (maybe blocked in a collective waiting for this one) and prints a summary naming
    the rank, with the traceback `record` saved. A deliberate exit (SystemExit, e.g. run.signals.Stopped after a
    preemption's checkpoint) keeps its status, without a traceback. os._exit: teardown can block on a live process
    group."""
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        return record(_waiting_on_peer_failure(main))(*args, **kwargs)
    except BaseException as error:  # noqa: B036 (KeyboardInterrupt ends the rank too)
        if isinstance(error, SystemExit) and error.code in (0, None):
            raise
        if isinstance(error, SystemExit):
            if isinstance(error.code, str):
                print(error.code, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(error.code if isinstance(error.code, int) else 1)
        traceback.print_exc()
        print(f"[rank {os.environ.get('RANK', '0')}] failed: {type(error).__name__}: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _waiting_on_peer_failure(main):
    # torchrun's summary blames the rank whose error (file, in whole seconds) is oldest. A rank failing
    # because a peer died first waits before its error is recorded: torchrun then sees the peer exit
    # first, and stops this rank, or at worst finds this rank's error younger.
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as error:
            if isinstance(error, dist.DistError) or any(text in str(error) for text in PEER_FAILURE_TEXT):
                time.sleep(PEER_FAILURE_WAIT_S)
            raise
    return wrapped


# ------------------------------------------------------------------------------------ sharding

def _decoder_layers(model):
    # The blocks Hugging Face lists as never to be split (e.g. LlamaDecoderLayer): one FSDP unit each.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"cannot shard {type(base).__name__}: it names no decoder layer class "
                         "(_no_split_modules)")
    return layers


def _plain_params_to_float32(module):
    # Cast what FSDP has not sharded yet, block by block: the fp32 copy of the whole model never exists
    # on the host at once (7B: 28 GB per rank).
    for param in module.parameters():
        if not isinstance(param, DTensor) and param.dtype != torch.float32:
            param.data = param.data.float()


def shard_model(model, ctx, *, mixed_precision):
    """FSDP2-shard `model` in place (one unit per decoder layer, plus the root); returns it.

    Parameters, gradients and optimizer state are float32 (master weights: a 1e-5 update is not rounded
    away as on bf16 weights); mixed_precision computes in bf16 and reduces gradients in fp32. Gradients are
    summed over ranks, not averaged: normalise the loss by `global_count`. LoRA models work the same way.
    Single process (ctx.enabled False): the model is returned unchanged."""
    if not ctx.enabled:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed_precision else None,
                                  reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        _plain_params_to_float32(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    _plain_params_to_float32(model)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)  # root: FSDP's default
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # sum over ranks
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no pre-scaled sum)
    return model


def _fsdp_modules(model):
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


@contextlib.contextmanager
def full_weights_for_generation(model):
    """Gather every FSDP unit once, kept gathered until the block ends (generation, evaluation).

    Otherwise each decoding step would all-gather every layer again, and ranks whose generations stop after
    different numbers of steps would issue unmatched collectives and hang; inside the block no collective
    runs. Memory: the full parameters in the compute dtype on top of the shards. No-op without FSDP."""
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            module.set_reshard_after_forward(module is not model, recurse=False)  # as shard_model set it
            module.reshard()


# ------------------------------------------------------------------------------------ data and metrics

def rank_slice(indices, rank, world_size, *, even=True):
    """This rank's contiguous share of the step's prompt indices (concatenated in rank order: the global
    order). The indices are the same on every rank (a pure function of seed and data position), so the
    share is deterministic in (seed, step, rank). Training needs equal shares (even=True): every rank then
    runs the same number of forward and backward passes, hence of FSDP collectives. Evaluation, which
    runs no collective while generating, may split unevenly (shares differ by at most one)."""
    if even and len(indices) % world_size:
        raise ValueError(f"{len(indices)} prompts per step cannot be split evenly over {world_size} processes: "
                         "make --prompts-per-step a multiple of the number of processes")
    return list(indices[len(indices) * rank // world_size:len(indices) * (rank + 1) // world_size])


def global_count(local_count):
    """Sum of a count over ranks: the loss normaliser that makes the update the global-batch update. A tensor (a count
    on the device: update.loss_denominator) is summed there, with no host sync."""
    if not dist.is_initialized():
        return local_count
    if isinstance(local_count, torch.Tensor):
        summed = local_count.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
    return type(local_count)(_all_reduce([local_count], dist.ReduceOp.SUM)[0])


def all_ranks(flag):
    """True when `flag` holds on every rank: a decision all ranks must take alike (skip a non-finite step)."""
    return bool(flag) if not dist.is_initialized() else _all_reduce([float(bool(flag))], dist.ReduceOp.MIN)[0] == 1.0


def all_reduce_metrics(metrics, weights=1.0, *, sum_keys=(), min_keys=(), max_keys=()):
    """Metrics of all ranks (each passes the same keys): weighted means (weights: a number or {key: weight},
    e.g. this rank's rows or tokens), sums for sum_keys, min/max for min_keys/max_keys. Single process: as is."""
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"metric {key!r} = {value!r} is not a number")
    if not dist.is_initialized():
        return {key: float(value) for key, value in metrics.items()}
    sign = {k: -1.0 if k in min_keys else 1.0 for k in metrics}  # min = -max(-x): one MAX all-reduce
    peaks = sorted(k for k in metrics if k in min_keys or k in max_keys)
    added = sorted(k for k in metrics if k not in peaks)
    weight = {k: 1.0 if k in sum_keys else float(weights.get(k, 1.0) if isinstance(weights, dict) else weights)
              for k in added}
    totals = _all_reduce([metrics[k] * weight[k] for k in added] + [weight[k] for k in added], dist.ReduceOp.SUM)
    result = {k: totals[i] if k in sum_keys else totals[i] / totals[len(added) + i] for i, k in enumerate(added)}
    highest = _all_reduce([sign[k] * metrics[k] for k in peaks], dist.ReduceOp.MAX)
    result.update({k: sign[k] * value for k, value in zip(peaks, highest)})
    return result


def _all_reduce(values, op):
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    packed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=op)
    return packed.tolist()


def broadcast_object(obj, src=0):
    """rank src's value on every rank (decisions that must agree: stop now, the checkpoint folder name)."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def barrier():
    if dist.is_initialized():
        dist.barrier()


def agree(value):
    """rank 0's value on every rank: decisions that must not diverge (stop, checkpoint, the run folder)."""
    return broadcast_object(value)


def all_gather(obj):
    """[every rank's obj] in rank order (small picklable records); single process: [obj]."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def pooled_over_ranks(record, count_key, max_keys=(), sum_keys=()):
    """A record of means over this rank's record[count_key] items -> the same over every rank's items (the count
    and sum_keys summed, max_keys the largest). Single process: the record as is."""
    if not dist.is_initialized():
        return record
    counts = (count_key, *sum_keys)
    pooled = all_reduce_metrics(record, weights=record[count_key], sum_keys=counts, max_keys=max_keys)
    return dict(pooled, **{key: type(record[key])(pooled[key]) for key in counts})


def max_over_ranks(value):
    return value if not dist.is_initialized() else _all_reduce([float(value)], dist.ReduceOp.MAX)[0]


# ------------------------------------------------------------------------------------ the launch

def launched_by_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env():
    """The number of processes torchrun started (1 outside torchrun): checked before any process group."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def restart_count():
    """How often torchrun --max-restarts has restarted the ranks (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
