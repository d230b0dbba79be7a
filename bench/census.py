"""The update's and the decode step's kernels, host syncs, bytes and FLOPs, counted on a CPU (paper §1: generation
and the update at the GPU's pace, not the host's): `python -m bench census [--preset a] [--json]`.

A GPU idles while the host issues kernels one by one and whenever the host waits for a value it computed; what the
GPU itself must do is read and write bytes and run FLOPs. None of that needs a GPU to count. The census runs one
update of a preset's shapes (update.fill_logprobs + update.update_policy, as train.py calls them, after a warm-up
update) and one decode step of the engine (the step function the engine records as a CUDA graph) under a
TorchDispatchMode, on a model with the preset's layer structure (layers, query and key-value heads, LoRA targets,
precision, gradient checkpointing, micro-batch, prefix sharing) at narrow widths, and records every aten operation:

- kernels: operations that are not views and touch a device tensor: about one CUDA kernel each;
- host syncs: a device value read by the host (`.item()`, `float()`, `bool()`, `.cpu()`, `.tolist()`, `nonzero`,
  `unique`, boolean indexing) and a host-to-device copy without non_blocking (PyTorch synchronises the stream);
- bytes and FLOPs: each tensor dimension is mapped from its narrow width onto the real one (`width_map`: hidden
  544 -> 2048, ...), so each operation reads and writes the real model's bytes, and each matrix product and
  attention counts the real FLOPs, at the real token counts;
- a roofline for named cards (`CARDS`): each kernel takes max(bytes / bandwidth, FLOPs / rate) + a per-kernel floor.

Device tensors (a CPU has only host memory): those derived from the model's parameters and buffers, from
`.to(device)` copies and from factory calls given a device; the rest (the host's batch bookkeeping) is host work.
Layers: the census runs 1 and 2 layers of the model; a figure of L layers is one + (L - 1) x (two - one), per phase.
Simplifications: an aten operation is taken as one kernel (a few launch two; fused Triton kernels are not aten
operations); attention FLOPs ignore the causal mask; the CPU's operations stand for CUDA's (the same Python code
dispatches the same aten operations, bar the attention kernel's name).
"""

import argparse
import collections
import contextlib
import datetime
import functools
import json
import math
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from bench import host_time
from bench.narrow import Narrow, narrow_policy, random_batch, sampler_check, trainer_args


@dataclass(frozen=True)
class Card:
    """What one GPU sustains (not its data-sheet peak): HBM bytes/s, dense matrix-product FLOP/s in bf16, in fp32
    (CUDA cores) and in TF32, and the shortest time of one kernel (launch to completion, queued back to back)."""
    bytes_per_s: float
    bf16_flops: float
    fp32_flops: float
    tf32_flops: float
    kernel_floor_s: float
    memory_bytes: float = 0.0   # what torch.cuda.mem_get_info reports as the total
    multiprocessors: int = 0    # SMs: how many splits the decode attention's columns take (0: not known, one launch)


# Data-sheet figures x what copies and large bf16 GEMMs reach (~75 % of bandwidth, ~60 % of dense peak): H200 4.8 TB/s
# and 989 TFLOP/s bf16 (measured copy 4.2-4.3 TB/s); H100 SXM 3.35 TB/s, same SMs; L40S 864 GB/s, 362 TFLOP/s bf16,
# 91.6 fp32, 183 TF32. fp32 GEMMs on CUDA cores reach ~40 TFLOP/s on an H100/H200 (67 peak). Memory: H200 143 771 MiB
# (BENCHMARKS.md's H200), H100 81 559 MiB, L40S 46 068 MiB. SMs: H100 SXM and H200 132, L40S 142.
CARDS = {"H100": Card(2.5e12, 600e12, 40e12, 300e12, 2.5e-6, 81559 * 2 ** 20, 132),
         "H200": Card(3.6e12, 600e12, 40e12, 300e12, 2.5e-6, 143771 * 2 ** 20, 132),
         "L40S": Card(0.65e12, 220e12, 40e12, 110e12, 2.5e-6, 46068 * 2 ** 20, 142)}


def allows_tf32():
    """Whether the update's float32 matrix products run in TF32 on CUDA (engine.kernels.tf32_matmuls, formerly
    models.tf32_matmuls; older code: no)."""
    import importlib.util

    import models

    return hasattr(models, "tf32_matmuls") or importlib.util.find_spec("engine.kernels") is not None


MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot"}
NOT_KERNELS = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
               "detach", "alias", "set_", "resolve_conj", "resolve_neg", "_local_scalar_dense", "equal", "is_same_size",
               "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
               "_reshape_alias", "_to_copy_noop", "is_nonzero", "_nested_tensor_size", "record_stream"}
SYNC_OPS = {"_local_scalar_dense": "item", "equal": "item", "nonzero": "nonzero", "masked_select": "nonzero",
            "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique", "_unique": "unique",
            "repeat_interleave": "repeat_interleave"}
# In-place writes of a few positions of their first argument (a KV cache column): it is neither read nor written whole.
SCATTERS = {"index_copy_", "index_put_", "index_add_", "index_fill_", "scatter_", "scatter_add_", "scatter_reduce_",
            "masked_scatter_"}
# Reads of a few rows of their first argument (an embedding table, the vocabulary axis): it is not read whole.
GATHERS = {"embedding", "index_select", "gather"}
FACTORIES = ("arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "rand", "randn", "randint", "eye",
             "linspace", "scalar_tensor")


# ---------------------------------------------------------------- narrow widths mapped onto real ones

def width_map(real, narrow, lora_rank, prompt, completion, rows, decode_rows, cache):
    """{narrow dimension: real dimension} of every width the update and the decode step use: head dim (and its
    rotary half), hidden, key-value width, LoRA rank, MLP width, vocabulary, the decode cache, the token counts of
    the update's passes (prompt, completion, their sums) and those times every row count up to `rows` (matrix
    products flatten rows x tokens). real: the model's config. ValueError if a narrow width would stand for two real
    ones, or equals a count that stays real (heads, rows)."""
    heads, kv_heads = real.num_attention_heads, real.num_key_value_heads
    head, real_head = narrow.half_head_dim * 2, real.hidden_size // heads
    p, c = narrow.prefix + 1, narrow.completion
    tokens = [(p - 1, prompt - 1), (p, prompt), (c - 1, completion - 1), (c, completion), (c + 1, completion + 1),
              (p - 1 + c, prompt - 1 + completion), (p + c, prompt + completion)]
    pairs = [(narrow.half_head_dim, real_head // 2), (head, real_head), (heads * head, real.hidden_size),
             (kv_heads * head, kv_heads * real_head), (narrow.rank, lora_rank),
             ((heads + 2 * kv_heads) * head, (heads + 2 * kv_heads) * real_head),  # the engine's stacked q|k|v
             (narrow.intermediate, real.intermediate_size), (2 * narrow.intermediate, 2 * real.intermediate_size),
             (narrow.vocab, real.vocab_size),
             (narrow.decode_cache, cache)] + [(k * t, k * r) for k in range(1, rows + 1) for t, r in tokens]
    kept = {1, 2, heads, kv_heads, heads // kv_heads, rows, decode_rows} | set(range(1, 17))
    mapping = {}
    for tiny, full in pairs:
        if mapping.get(tiny, full) != full or tiny in kept:
            raise ValueError(f"narrow width {tiny} would stand for {full} and for {mapping.get(tiny, tiny)}: choose "
                             "other narrow widths (bench.narrow.Narrow)")
        mapping[tiny] = full
    return mapping


# ---------------------------------------------------------------- the recorder

class _DeviceTensors:
    """Which tensors live on the device, by storage (views and in-place writes share it); an entry lasts while one
    of its tensors does, so a storage freed and reused by a host tensor is not taken for a device one."""

    def __init__(self):
        self.refs = {}

    @staticmethod
    def _key(tensor):
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            pointer = 0
        return pointer or ("id", id(tensor))

    def add(self, tensor):
        for t in (tensor, tensor._base):
            if t is not None:
                self.refs.setdefault(self._key(t), []).append(weakref.ref(t))

    def __contains__(self, tensor):
        key = self._key(tensor)
        alive = [ref for ref in self.refs.get(key, ()) if ref() is not None]
        if alive:
            self.refs[key] = alive
        else:
            self.refs.pop(key, None)
        return bool(alive)


def _tensors(value):
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class Census(TorchDispatchMode):
    """Records each aten operation's kernel, sync, bytes and FLOPs under the current `phase` (see the module
    docstring). every_tensor_on_device: no host tensors at all (the decode step works on device buffers only)."""

    def __init__(self, mapping, every_tensor_on_device=False, factories_on_device=False, multiprocessors=0):
        super().__init__()
        self.mapping, self.everything, self.factories_on_device = mapping, every_tensor_on_device, factories_on_device
        self.multiprocessors = multiprocessors   # the card's SMs: the decode attention's splits (`combine_launch`)
        self.device = _DeviceTensors()
        self.phase = "other"
        self.ops = collections.Counter()      # (phase, op, dtype, bytes, flops) -> kernels
        self.syncs = collections.Counter()    # (phase, kind) -> host syncs
        self.making_device_tensor = False

    def on_device(self, tensor):
        return self.everything or tensor in self.device

    def real_bytes(self, tensor):
        return math.prod(self.mapping.get(d, d) for d in tensor.shape) * tensor.element_size()

    def sync(self, kind):
        self.syncs[self.phase, kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        device = self.everything or any(self.on_device(t) for t in inputs) or (not inputs and self.making_device_tensor)
        if not device:
            return out
        written = _tensors(args[0]) if args and name.endswith("_") and not name.startswith("__") else []
        for t in outputs + written + _tensors(kwargs.get("out")):
            self.device.add(t)
        if name in SYNC_OPS:
            self.sync(SYNC_OPS[name])
        elif name in ("index", "index_put_", "index_put") and any(t.dtype == torch.bool for t in _tensors(args[1])):
            self.sync("boolean index")
        if func.is_view or name in NOT_KERNELS:
            return out
        if name in GATHERS:  # reads what it writes (and the indices)
            nbytes = sum(self.real_bytes(t) for t in inputs[1:] + outputs * 2 if t.numel() > 1)
        elif name in SCATTERS:  # reads the new values (and indices), writes as many
            read = [t for t in inputs[1:] if t.numel() > 1]
            nbytes = sum(map(self.real_bytes, read)) + max(map(self.real_bytes, read), default=0)
        elif name == "rotary_cache_write":  # the engine's fused op: q, k, v in, q out, k and v into one cache column
            q, k, v, cos, sin = inputs[:5]
            nbytes = sum(map(self.real_bytes, (q, k, v, cos, sin, *outputs, k, v)))
        elif name == "finish_step":  # the fused sampler: reads the logits, writes one value per row in a few tensors
            nbytes = self.real_bytes(inputs[0]) + 8 * 6 * inputs[0].shape[0]
        else:  # reads every input (not copy_'s destination), writes every output
            read = inputs[1:] if name == "copy_" else inputs
            nbytes = sum(self.real_bytes(t) for t in read + outputs if t.numel() > 1)
        flops, dtype = self.flops(name, args), (outputs[0].dtype if outputs else inputs[0].dtype)
        if name in MATMULS or "attention" in name:
            dtype = _tensors(args)[0].dtype
        self.ops[self.phase, name, str(dtype).replace("torch.", ""), nbytes, flops] += 1
        if name == "decode_attention" and self.multiprocessors:
            self.combine_launch(*args[:2], dtype)
        return out

    def combine_launch(self, q, key_cache, dtype):
        """The engine's fused attention launches a second kernel where it splits the columns (flash-decoding:
        engine.triton_kernels.attention_splits at the real shapes on a card of `multiprocessors` SMs): one that
        reads each split's partial sums (float32) and writes the output."""
        from engine.triton_kernels import attention_splits

        rows, heads, _, head_dim = (self.mapping.get(d, d) for d in q.shape)
        kv_heads, columns = key_cache.shape[1], self.mapping.get(key_cache.shape[2], key_cache.shape[2])
        splits = attention_splits(rows, kv_heads, columns, self.multiprocessors)
        if splits > 1:
            nbytes = rows * heads * splits * (head_dim + 2) * 4 + rows * heads * head_dim * q.element_size()
            self.ops[self.phase, "decode_attention_combine", str(dtype).replace("torch.", ""), nbytes, 0] += 1

    def flops(self, name, args):
        real = lambda d: self.mapping.get(d, d)  # noqa: E731
        if name in MATMULS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm", "_addmm_activation", "addmv") \
                else (args[0], args[1])
            m, k = (1, real(a.shape[-1])) if a.dim() == 1 else (real(a.shape[-2]), real(a.shape[-1]))
            n = real(b.shape[-1]) if b.dim() > 1 else 1
            return 2 * math.prod(real(d) for d in a.shape[:-2]) * m * n * k
        if "attention" in name and len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            # q [b, heads, Lq, d] (its backward's args start with the output's gradient, of q's shape)
            q, k = args[0], args[1]
            batch, heads, length, dim = (real(d) for d in q.shape)
            forward = 4 * batch * heads * length * real(k.shape[-2]) * dim
            return int(forward * (2.5 if "backward" in name else 1))
        return 0

    @contextlib.contextmanager
    def labelled(self, phase):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


def label(census, phase, function):
    """`function` with its operations recorded under `phase` (an inner label wins)."""
    def wrapper(*args, **kwargs):
        with census.labelled(phase):
            return function(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def host_boundary(census, model_device):
    """The copies between host and device, which dispatch no operation on a CPU: `.to(device)` of a host tensor is
    a host-to-device copy (a sync unless non_blocking), `.to(host)`, `.cpu()`, `.tolist()` or `.numpy()` of a device
    tensor a device-to-host one (a sync); `.to` within one side copies nothing; factory calls given a device make
    device tensors. The census's device and host are both this CPU: so that `.to(x.device)` says which side it means,
    a tensor's `.device` is one of two torch.device objects, the device's (a device tensor's) or the host's, told
    apart by identity; a device made otherwise (torch.device("cpu"), torch's own C++ code) is taken as the side the
    tensor is on (no copy)."""
    real = {name: getattr(torch.Tensor, name) for name in ("to", "cpu", "tolist", "numpy")}
    factories = {name: getattr(torch, name) for name in FACTORIES}
    device_side, host_side = torch.device(model_device.type), torch.device(model_device.type)

    def fresh(tensor):
        with _disable_current_modes():
            return tensor.clone()

    def device_of(self):
        here = torch._C.TensorBase.device.__get__(self)
        return here if here.type != model_device.type else device_side if census.on_device(self) else host_side

    def to_device_side(args, kwargs):
        """True: `.to` sends to the device, False: to the host, None: nowhere else (a dtype alone, a device made
        neither by device_of nor a tensor)."""
        target = kwargs.get("device", args[0] if args and not isinstance(args[0], torch.dtype) else None)
        if isinstance(target, torch.Tensor):
            return census.on_device(target)
        return True if target is device_side else False if target is host_side else None

    def to(self, *args, **kwargs):
        target, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if target is None or torch.device(target).type != model_device.type:
            return real["to"](self, *args, **kwargs)
        to_device, on_device = to_device_side(args, kwargs), census.on_device(self)
        if to_device is None or to_device == on_device:   # a cast, or a copy within one side
            return real["to"](self, *args, **kwargs)
        if on_device:
            census.sync("device-to-host copy")
        elif not non_blocking:
            census.sync("host-to-device copy")
        result = real["to"](self, *args, **kwargs)
        result = fresh(result) if result is self else result
        if to_device:
            census.device.add(result)
        return result

    def cpu(self, *args, **kwargs):
        if not census.on_device(self):
            return real["cpu"](self, *args, **kwargs)
        census.sync("device-to-host copy")
        return fresh(self)

    def reader(name):
        def read(self, *args, **kwargs):
            if census.on_device(self):
                census.sync("device-to-host copy")
            return real[name](self, *args, **kwargs)
        return read

    def factory(name):  # given a device inside the model (`factories_on_device`): a device tensor
        def make(*args, **kwargs):
            if kwargs.get("device") is None or isinstance(kwargs["device"], str) or not census.factories_on_device:
                return factories[name](*args, **kwargs)
            if name in ("tensor", "as_tensor") and not (args and isinstance(args[0], torch.Tensor)):
                census.sync("host-to-device copy")  # a Python value copied onto the device, blocking
            previous, census.making_device_tensor = census.making_device_tensor, True
            try:
                result = factories[name](*args, **kwargs)
            finally:
                census.making_device_tensor = previous
            census.device.add(result)
            return result
        return make

    patches = dict(to=to, cpu=cpu, tolist=reader("tolist"), numpy=reader("numpy"), device=property(device_of))
    try:
        for name, method in patches.items():
            setattr(torch.Tensor, name, method)
        for name in FACTORIES:
            setattr(torch, name, factory(name))
        yield
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)
        del torch.Tensor.device   # TensorBase's again
        for name, function in factories.items():
            setattr(torch, name, function)


def records(census):
    """The census's operations as rows [phase, op, dtype, bytes, FLOPs, count] and its syncs [phase, kind, count]."""
    return ([[*key, count] for key, count in sorted(census.ops.items(), key=str)],
            [[*key, count] for key, count in sorted(census.syncs.items())])


# ---------------------------------------------------------------- the roofline and the totals (bench show redoes them)

def op_class(op, dtype):
    if op in MATMULS:
        return f"matrix products, {dtype}"
    if "attention" in op:
        return "attention"
    if op in ("_to_copy", "copy_", "clone"):
        return "casts and copies"
    if op.startswith("_foreach") or op.startswith("_fused"):
        return "multi-tensor (optimizer, clipping)"
    return "elementwise, reductions, indexing"


def kernel_seconds(op, dtype, nbytes, flops, card, tf32=False):
    """The roofline time of one kernel on `card`."""
    rate = card.bf16_flops
    if dtype == "float32" and flops and "attention" not in op:
        rate = card.tf32_flops if tf32 else card.fp32_flops
    return max(nbytes / card.bytes_per_s, flops / rate if flops else 0.0) + card.kernel_floor_s


def totals(rows, key, cards, tf32):
    """{key(row): {kernels, bytes, flops, seconds per card}} over operation rows [phase, op, dtype, bytes, FLOPs, n]."""
    table = {}
    for phase, op, dtype, nbytes, flops, count in rows:
        entry = table.setdefault(key(phase, op, dtype), dict(kernels=0, bytes=0, flops=0, seconds={}))
        entry["kernels"] += count
        entry["bytes"] += nbytes * count
        entry["flops"] += flops * count
        for name, card in cards.items():
            entry["seconds"][name] = entry["seconds"].get(name, 0.0) + count * kernel_seconds(op, dtype, nbytes,
                                                                                               flops, card, tf32)
    return table


def combined(terms):
    """The sum of coefficient x value over terms [(coefficient, value)], entry by entry (nested dicts of numbers)."""
    values = [value for _, value in terms]
    if any(isinstance(value, dict) for value in values):
        keys = dict.fromkeys(key for value in values if isinstance(value, dict) for key in value)
        return {key: combined([(c, v.get(key, 0) if isinstance(v, dict) else 0) for c, v in terms]) for key in keys}
    return sum(coefficient * value for coefficient, value in terms)


def extrapolated(one, two, layers):
    """one + (layers - 1) x (two - one), entry by entry (nested dicts of numbers)."""
    return combined([(2 - layers, one), (layers - 1, two)])


def update_runs(raw, layers):
    """({kind: {"1": run, "2": run}} of REPLAYS' kinds, {card: {"layers": n, "mlps": n}}) of a census's update
    records (one made before the update planned its replay: every layer checkpointed whole)."""
    if "runs" not in raw:
        return {"checkpointed": {"1": raw["1"], "2": raw["2"]}}, None
    plans = {card: plan if isinstance(plan, dict) else {"layers": plan, "mlps": 0}
             for card, plan in raw["checkpointed_layers"].items()}
    return raw["runs"], plans


def figures(saved):
    """The census's figures from its raw records (what `python -m bench show` prints): per phase and per operation
    class of the update and of the decode step, and the headline numbers, for saved["card"]; the update's roofline
    and kernels for every card. Of the update's L layers, some run plain, some replay their MLP, some replay whole,
    as the update plans it on each card (saved["raw"]["update"]["checkpointed_layers"]), each kind's per-layer
    figures from its 1- and 2-layer runs."""
    cards = {name: Card(**values) for name, values in saved["cards"].items()}
    layers = saved["shapes"]["layers"]
    runs, plans = update_runs(saved["raw"]["update"], layers)
    plans = plans or {name: {"layers": layers, "mlps": 0} for name in cards}  # an older census
    result = {name: _figures(saved, cards, runs, plans[name]) for name in cards}
    mine = dict(result[saved.get("card", "H200")])
    mine["update_roofline_s"] = {name: figures["update_roofline_s"][name] for name, figures in result.items()}
    mine["update_kernels_by_card"] = {name: figures["update_kernels"] for name, figures in result.items()}
    mine["update_checkpointed_layers"] = plans
    return mine


def _figures(saved, cards, runs, plan):
    """`figures` with plan["layers"] of the update's layers replayed whole and plan["mlps"] replaying their MLP."""
    layers, tf32 = saved["shapes"]["layers"], saved["tf32"]
    empty = dict(kernels=0, bytes=0, flops=0, seconds={})
    keys = {"phase": lambda p, o, d: p, "class": lambda p, o, d: op_class(o, d), "all": lambda p, o, d: "all"}
    counts = {"checkpointed": plan["layers"], "mlp": plan["mlps"]}
    counts["plain"] = layers - sum(counts.values())
    base = "plain" if "plain" in runs else "checkpointed"  # the constant part: 2 x one - two of either kind
    update_weights = {(base, "1"): 2, (base, "2"): -1}
    for kind, count in counts.items():
        if count:
            update_weights[kind, "1"] = update_weights.get((kind, "1"), 0) - count
            update_weights[kind, "2"] = update_weights.get((kind, "2"), 0) + count
    weights = {"update": update_weights, "decode": {("decode", "1"): 2 - layers, ("decode", "2"): layers - 1}}
    parts = {}
    for part, part_weights in weights.items():
        found = runs if part == "update" else {"decode": saved["raw"]["decode"]}
        terms = [(weight, found[kind][n]) for (kind, n), weight in part_weights.items() if weight]
        tables = {title: [(weight, totals(run["ops"], key, cards, tf32)) for weight, run in terms]
                  for title, key in keys.items()}
        syncs = []
        for weight, run in terms:
            counter = collections.Counter()
            for phase, kind, count in run["syncs"]:
                counter[phase] += count
            syncs.append((weight, dict(counter)))
        per_layer = {kind: sum(n for *_, n in found[kind]["2"]["ops"]) - sum(n for *_, n in found[kind]["1"]["ops"])
                     for kind in found}
        parts[part] = dict(phase=combined(tables["phase"]), classes=combined(tables["class"]),
                           whole=combined([(w, table.get("all", empty)) for w, table in tables["all"]]),
                           syncs=combined(syncs), kernels_per_layer=per_layer)
    update, decode = parts["update"], parts["decode"]
    per_layer = sum(count * update["kernels_per_layer"][kind] for kind, count in counts.items() if count) / layers
    update_syncs, decode_syncs = sum(update["syncs"].values()), sum(decode["syncs"].values())
    return dict(update_kernels=round(update["whole"]["kernels"]), update_host_syncs=round(update_syncs),
                update_host_syncs_per_optimizer_step=update_syncs / max(saved["raw"]["update"]["optimizer_steps"], 1),
                update_gb=round(update["whole"]["bytes"] / 1e9, 1),
                update_tflop=round(update["whole"]["flops"] / 1e12, 2),
                update_roofline_s={name: round(s, 3) for name, s in update["whole"]["seconds"].items()},
                update_kernels_per_layer=round(per_layer),
                decode_kernels_per_step=round(decode["whole"]["kernels"]),
                decode_kernels_per_layer=decode["kernels_per_layer"]["decode"],
                decode_host_syncs_per_step=round(decode_syncs),
                decode_gb_per_step=round(decode["whole"]["bytes"] / 1e9, 2),
                decode_roofline_ms_per_step={name: round(s * 1e3, 3) for name, s in
                                             decode["whole"]["seconds"].items()},
                tables=dict(update_phases=_rows(update["phase"], update["syncs"], "phase"),
                            update_classes=_rows(update["classes"], {}, "operation class"),
                            decode_classes=_rows(decode["classes"], {}, "operation class")))


def _rows(table, syncs, title):
    rows = []
    for key, entry in sorted(table.items(), key=lambda item: -item[1]["kernels"]):
        row = {title: key, "kernels": round(entry["kernels"]), "host syncs": round(syncs.get(key, 0)),
               "GB": round(entry["bytes"] / 1e9, 2), "TFLOP": round(entry["flops"] / 1e12, 3)}
        row.update({f"{name} s": round(s, 4) for name, s in entry["seconds"].items()})
        rows.append(row)
    for key in set(syncs) - set(table):  # a phase with syncs and no kernel
        rows.append({title: key, "kernels": 0, "host syncs": round(syncs[key])})
    return rows


HOST_FIGURES = ("update_host_s", "decode_host_ms_per_step")   # timed (`host_times`), not counted
HEADLINES = ("update_kernels", "update_host_syncs", "update_host_syncs_per_optimizer_step", "update_roofline_s",
             "update_gb", "update_tflop", "update_kernels_per_layer", "update_checkpointed_layers",
             "update_kernels_by_card", "decode_kernels_per_step",
             "decode_kernels_per_layer", "decode_host_syncs_per_step", "decode_gb_per_step",
             "decode_roofline_ms_per_step")


def print_report(saved):
    """The tables and headline figures of a census (recomputed from its raw records)."""
    from bench.common import print_header, print_row

    result = figures(saved)
    shapes = saved["shapes"]
    print(f"# census of preset ({saved['preset']}): {saved['model']}, {shapes['layers']} layers, {shapes['rows']} rows "
          f"x ({shapes['prompt_tokens']} + {shapes['completion_tokens']}) tokens, micro-batch "
          f"{shapes['micro_batch_size']}, {saved['precision']}; decode: {shapes['decode_rows']} rows, cache "
          f"{shapes['decode_cache']}; counted on CPU ({saved['date']}), roofline per card in seconds")
    for name, rows in result["tables"].items():
        columns = list(dict.fromkeys(column for row in rows for column in row))
        print(f"\n## {name}")
        print_header(columns)
        for row in rows:
            print_row(row, columns)
    print()
    for key in HEADLINES:
        print(f"{key}: {result[key]}")
    for record in ("host", "host_compiled"):   # timed, not counted: this CPU's at its load, one thread
        if record in saved:
            host = saved[record]
            compiled = f", decoder layers compiled ({host['backend']})" if "backend" in host else ""
            for key in HOST_FIGURES:
                print(f"{key}{compiled}: {host[key]} (one thread, median of {host['repeats']}, load average "
                      f"{host['load_average']})")
    return result


# ---------------------------------------------------------------- running the update and the decode step

# What each kind of run replays in the backward: (layers whole, layers' MLPs) as fractions of the layers.
REPLAYS = {"plain": (0, 0), "mlp": (0, 1), "checkpointed": (1, 0)}


def as_on_a_gpu(function):
    """`function` run with the GPU's code paths taken on this CPU (engine.gpu_paths.emulated): the bf16 LoRA product,
    the update's replay plan (update.checkpoint_plan, which the census plants per kind), TF32, the fused kernels' check
    and patching (the plain path's functions stand in for Liger's: the census counts the plain path's kernels) and the
    decode engine's fused operations; the census counts what a GPU runs."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        from engine import gpu_paths

        with gpu_paths.emulated("cpu"):
            return function(*args, **kwargs)
    return run


@as_on_a_gpu
def update_run(args, layers, narrow, mapping, rows, kind="checkpointed"):
    """Records of one update (after a warm-up update) of `rows` rows of one prompt on a `layers`-layer narrow
    policy, its layers replaying what `kind` says (REPLAYS; update.checkpoint_plan decides it on a GPU)."""
    from run import config
    import policy
    from engine import prefix
    import update

    check = sampler_check()

    model = narrow_policy(args, layers, narrow).train()
    optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    settings = config.update_settings(args)
    generator = torch.Generator().manual_seed(0)

    def batch():
        return [random_batch(model, narrow, rows, settings.temperature, generator)]

    def run(batches):
        update.fill_logprobs(model, batches, settings)
        return update.update_policy(model, optimizer, batches, settings, max_sampler_gap=check.LOGPROB_GAP_LIMIT)

    run(batch())  # warm-up: the optimizer's state, the allocator
    census, batches = Census(mapping), batch()
    for tensor in [*model.parameters(), *model.buffers()]:
        census.device.add(tensor)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                census.device.add(value)
    phases = [(update, "_logprobs", "forward"), (update, "micro_batch_loss", "loss and metrics"),
              (prefix, "step_prefix", "step prefix forward"), (prefix, "backward_step_prefix", "step prefix backward"),
              (torch.Tensor, "backward", "backward (with checkpoint recompute)"),
              (torch.nn.utils, "clip_grad_norm_", "gradient clipping"), (optimizer, "step", "optimizer"),
              (optimizer, "zero_grad", "optimizer"), (check.SamplerGap, "of", "sampler check"),
              (check, "row_mean_ratios", "sampler check")]
    if hasattr(update, "checkpoint_plan"):  # (older code: every layer as built)
        whole, mlps = REPLAYS[kind]
        phases.append((update, "checkpoint_plan", lambda *a: (whole * layers, mlps * layers)))
    # The decoder's calls: every model call runs it, whether the model's forward or the update's fused LM head
    # (policy.kept_outputs) calls it.
    calls, decoder = [], policy.hf_model(model).model
    hf_forward = decoder.forward

    def forward(*args, **kwargs):  # each model call of the forward phase on its own line: [rows x tokens]
        ids = kwargs.get("input_ids")
        calls.append(tuple(ids.shape))
        phase = census.phase
        if phase == "forward":
            phase = f"forward [{ids.shape[0]} x {mapping.get(ids.shape[1], ids.shape[1])}]"
        census.factories_on_device = True  # the model makes its position ids, masks (...) where it runs
        try:
            with census.labelled(phase):
                return hf_forward(*args, **kwargs)
        finally:
            census.factories_on_device = False

    decoder.forward = functools.wraps(hf_forward)(forward)  # its signature too
    saved = [(owner, name, owner.__dict__[name] if name in vars(owner) else None) for owner, name, _ in phases]
    try:
        for owner, name, phase in phases:
            setattr(owner, name, phase if callable(phase) else label(census, phase, getattr(owner, name)))
        with host_boundary(census, torch.device("cpu")), census, census.labelled("batching and bookkeeping"):
            metrics = run(batches)
    finally:
        del decoder.forward
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
    ops, syncs = records(census)
    return dict(ops=ops, syncs=syncs, model_calls=len(calls), optimizer_steps=metrics.optimizer_steps)


@as_on_a_gpu
def decode_run(args, layers, narrow, mapping, rows, multiprocessors=0):
    """Records of one decode step of the engine (its step function, as a CUDA graph records it: the whole bucketed
    cache) of `rows` rows on a `layers`-layer narrow model, with the ops a GPU runs (the fused ones, each counted as
    the kernels it launches there: one, and the attention's combining one where a card of `multiprocessors` SMs
    splits its columns; PODS_DECODE_KERNELS=reference counts the plain step instead)."""
    import engine

    model = narrow_policy(args, layers, narrow).eval()
    prompts = torch.randint(3, narrow.vocab, (1, narrow.prefix + 1), generator=torch.Generator().manual_seed(0))
    census, counted = Census(mapping, every_tensor_on_device=True, multiprocessors=multiprocessors), []
    kernels, engine.decode.KERNELS = engine.decode.KERNELS, engine.decode.KERNELS or "fused"  # as on a GPU
    eng = engine.engine_for(model, compile_backend=False, capture=False)
    step = eng.step

    def counted_step(*step_args, **step_kwargs):
        if counted:
            return step(*step_args, **step_kwargs)
        counted.append(1)
        with census, census.labelled("decode step"):
            return step(*step_args, **step_kwargs)

    eng.step = counted_step
    window, engine.decode.EAGER_WINDOW = engine.decode.EAGER_WINDOW, False  # read the whole bucketed cache
    try:
        with torch.no_grad():
            engine.generate(model, prompts, torch.ones_like(prompts), torch.zeros(rows, dtype=torch.long), 2, [], 2,
                            temperature=args.temperature, top_p=args.top_p, max_rows=rows, compile_backend=False,
                            capture=False, cache_tokens=narrow.decode_cache)
    finally:
        engine.decode.EAGER_WINDOW, engine.decode.KERNELS = window, kernels
        engine.release(model)
    ops, syncs = records(census)
    return dict(ops=ops, syncs=syncs)


@as_on_a_gpu
def checkpoint_plans(args, real, narrow, mapping, layers, rows, completion, tokens, cache):
    """{card: {"layers": replayed whole, "mlps": replayed MLPs}} as update.checkpoint_plan decides on each card, for a
    micro-batch of `rows` rows and `tokens` positions: its activations (kernels.saved_bytes_per_token at the real
    widths) and logits within the card's memory less kernels.MEMORY_MARGIN and what is resident (`resident_bytes`),
    and within kernels.MEMORY_CEILING."""
    from engine import kernels

    if {48, 96, 192} & set(mapping):
        raise ValueError("narrow widths collide with the memory probe's token counts (48 and 96 per row)")
    probe = narrow_policy(args, 2, narrow).train()
    real_bytes = lambda t: math.prod(mapping.get(d, d) for d in t.shape) * t.element_size()  # noqa: E731
    per_token = kernels.saved_bytes_per_token(probe, tokens=48, nbytes=real_bytes)
    resident = resident_bytes(args, real, cache)
    logits = rows * completion * real.vocab_size * 2 * 2 + 4 * 4 * __import__("policy")._LOGSUMEXP_CHUNK_ELEMENTS
    plans = {}
    for name, card in CARDS.items():
        budget = min(card.memory_bytes * (1 - kernels.MEMORY_MARGIN) - resident, kernels.MEMORY_CEILING - resident)
        whole, mlps = kernels.checkpoint_plan(layers, per_token, tokens, budget - logits)
        plans[name] = {"layers": whole, "mlps": mlps}
    return plans


def resident_bytes(args, real, cache):
    """Device bytes held before the update of a step: the bf16 base weights, the fp32 adapter with its gradient and
    AdamW's two moments, the engine's merged bf16 copies of the adapted projections and its KV cache (rollout batch
    rows x cache columns)."""
    from transformers import AutoModelForCausalLM

    from bench import common

    import models

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(real)
    names = models.lora_targets(model, args.lora_target_modules.split(","))   # "auto": every projection, named
    targets = [m for name, m in model.named_modules() if name.split(".")[-1] in names]
    base = sum(p.numel() for p in model.parameters()) * 2
    adapter = sum(args.lora_rank * (m.in_features + m.out_features) for m in targets) * (4 + 4 + 8)
    copies = sum(m.weight.numel() for m in targets) * 2
    return base + adapter + copies + common.kv_cache_bytes(real, args.rollout_batch_size, cache)


def census_of(preset="a", flags=(), model=None, vocab=49152, narrow=Narrow(), layers=None, prompt_tokens=200,
              completion_tokens=None, rows=None, card="H200"):
    """The census of a preset (a dict: settings, raw records, figures for `card`; see `figures`)."""
    from run import config
    from bench import common

    args = trainer_args(preset, flags)
    if args.load_in_4bit:
        raise ValueError("the census counts a bf16 or fp32 base model (4-bit kernels need CUDA)")
    name = model or next(key for key, file in common.MODEL_CONFIGS.items()
                         if file.removesuffix(".json") == args.model.split("/")[-1].lower())
    args.census_model = name
    real = common.real_config(name)
    real.vocab_size = vocab or real.vocab_size
    completion = completion_tokens or args.max_completion_tokens
    rows = rows or args.update_size * args.prompts_per_step
    cache = -(-max(prompt_tokens - 1 + completion, args.max_prompt_tokens + args.max_completion_tokens) // 256) * 256
    mapping = width_map(real, narrow, args.lora_rank, prompt_tokens, completion, rows, args.rollout_batch_size, cache)
    layers = layers or real.num_hidden_layers
    settings = config.update_settings(args)
    planned = hasattr(__import__("update"), "checkpoint_plan")  # older code replays every layer it can
    kinds = ("plain", "mlp", "checkpointed") if args.gradient_checkpointing and planned else \
        ("checkpointed",) if args.gradient_checkpointing else ("plain",)
    runs = {kind: {str(count): update_run(args, count, narrow, mapping, rows, kind) for count in (1, 2)}
            for kind in kinds}
    micro_rows = min(rows, settings.micro_batch_size)
    if len(kinds) == 3:
        by_card = checkpoint_plans(args, real, narrow, mapping, layers, micro_rows, completion,
                                   micro_rows * (prompt_tokens + completion), cache)
    else:
        by_card = {label: {"layers": layers if kinds == ("checkpointed",) else 0, "mlps": 0} for label in CARDS}
    first = runs[kinds[0]]["1"]
    raw = {"update": dict(runs=runs, checkpointed_layers=by_card, optimizer_steps=first["optimizer_steps"]),
           "decode": {str(count): decode_run(args, count, narrow, mapping, args.rollout_batch_size,
                                             CARDS[card].multiprocessors) for count in (1, 2)}}
    saved = dict(benchmark="census", preset=preset, flags=list(flags), model=name,
                 precision="bf16 base weights" + (" + LoRA" if args.lora_rank else ""),
                 date=datetime.date.today().isoformat(),
                 device="CPU census (narrow widths mapped onto the real ones; no GPU)",
                 versions={lib: __import__(lib).__version__ for lib in ("torch", "transformers", "peft")},
                 shapes=dict(layers=layers, rows=rows, prompt_tokens=prompt_tokens, completion_tokens=completion,
                             vocab=real.vocab_size, lora_rank=args.lora_rank,
                             micro_batch_size=settings.micro_batch_size,
                             gradient_checkpointing=args.gradient_checkpointing,
                             prefix_sharing=settings.prefix_sharing, decode_rows=args.rollout_batch_size,
                             decode_cache=cache, model_calls=first["model_calls"]),
                 narrow=asdict(narrow), cards={label: asdict(values) for label, values in CARDS.items()},
                 tf32=allows_tf32(),
                 card=card, raw=raw)
    result = figures(saved)
    saved.update({key: result[key] for key in HEADLINES})
    return saved


def bench_census(argv):
    """`python -m bench census`: count, print the tables (or, with --json, one JSON object), save the records."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench census", description=__doc__.split("\n\n")[0],
                                     epilog="Any other flag is train.py's, applied over the preset (the loss and "
                                     "update flags: --top-entropy-quantile 0.2, --importance-sampling-level sequence "
                                     "--updates-per-batch 2, --importance-sampling-correction token_reject, ...).")
    parser.add_argument("--preset", default="a", choices=list("abcd"), help="the shapes and settings (default a)")
    parser.add_argument("--vocab", type=int, default=49152,
                        help="vocabulary size (default 49152: the GPU benchmarks' SmolLM2 tokenizer; 0: the model's)")
    parser.add_argument("--rows", type=int, default=None, help="kept rows of the update, all of one prompt (default: "
                        "the preset's m x prompts per step)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="prompt tokens of the update (default 200)")
    parser.add_argument("--completion-tokens", type=int, default=None, help="completion tokens of every row "
                        "(default: the preset's limit)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per micro-batch (default: the "
                        "preset's)")
    parser.add_argument("--card", default="H200", choices=list(CARDS), help="the card whose memory decides the "
                        "checkpointed layers of the kernel count and tables (default H200; the roofline: every card)")
    parser.add_argument("--host-repeats", type=int, default=5, help="timed repeats of the host's time (the update "
                        "and a decode step at the narrowest widths on one thread: `host_times`); 0: not timed")
    parser.add_argument("--host-compile", metavar="BACKEND", help="also time the update with each decoder layer "
                        "compiled by torch.compile(backend=BACKEND) (inductor, aot_eager): host_compiled in the record")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the headline figures, and the "
                        "host's times: update_host_s, decode_host_ms_per_step)")
    parser.add_argument("--out", default="bench_out/bench_census.json", help="where the records go (JSON)")
    args, trainer_flags = parser.parse_known_args(argv)
    if args.host_repeats < 0:
        parser.error(f"argument --host-repeats: must be >= 0, got {args.host_repeats}")
    flags = trainer_flags + ([] if args.micro_batch_size is None else ["--micro-batch-size", str(args.micro_batch_size)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        saved = census_of(args.preset, flags, vocab=args.vocab, prompt_tokens=args.prompt_tokens,
                          completion_tokens=args.completion_tokens, rows=args.rows, card=args.card)
    finally:
        torch.set_num_threads(threads)
    if args.host_repeats:  # timed, not counted: beside the headlines, never compared with a record's
        checkpointed, host_args = saved["update_checkpointed_layers"][args.card], trainer_args(args.preset, flags)
        host_args.census_model = saved["model"]
        plan = (checkpointed["layers"], checkpointed["mlps"])
        saved["host"] = host_time.host_times(host_args, saved["shapes"]["layers"], plan, args.host_repeats)
        if args.host_compile:
            saved["host_compiled"] = {"backend": args.host_compile, **host_time.host_times(
                host_args, saved["shapes"]["layers"], plan, args.host_repeats, compile_backend=args.host_compile)}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=None, separators=(",", ":")) + "\n")
    host = {key: saved["host"][key] for key in HOST_FIGURES} if "host" in saved else {}
    if args.json:
        print(json.dumps({**{key: saved[key] for key in HEADLINES}, **host}))
    else:
        print_report(saved)
        print(f"records: {path}")
    return saved
