"""The decode engine's weights: LoRA merged into a separate copy of each adapted projection (paper §4 setting (a):
LoRA r=64 on q,k,v,o,gate,up,down, whose unmerged adapter would add two small GEMMs per projection and token).

The projections one input feeds are merged into one copy, stacked: q|k|v and gate|up, so a decode step runs 4 GEMMs
per layer instead of 7 (the k and v ones alone are small and latency-bound) and splits the output into views.
The copy is refreshed at every generation call (the adapter changes at every optimizer step); the training weights
are never touched (peft's in-place merge_adapter() / unmerge_adapter() would leave a bf16 rounding error in the
frozen base weights at every step). bitsandbytes 4-bit projections are dequantized into the copy.
Simplification: adapters that are not a plain additive update (DoRA, LoRA bias) run unmerged, as in training; a
model without adapters runs its own modules (a copy would only fuse them, at the cost of the weights' memory again).
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def mergeable_deltas(module):
    """The weight updates peft's merge would add to this projection ([] if none), or None where an adapter is
    not a plain additive update (DoRA and other variants, LoRA bias): then the module itself is called."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return []
    names = [name for name in module.active_adapters if name in module.lora_A]
    variants = set(getattr(module, "lora_variant", {})) | {n for n, on in getattr(module, "use_dora", {}).items() if on}
    if any(name in variants or getattr(module, "lora_bias", {}).get(name, False) for name in names):
        return None
    return [module.get_delta_weight(name) for name in names]


def base_layer(module):
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def base_weight(module):
    """A projection's base weight; bitsandbytes 4-bit weights (CUDA only) dequantized to their compute dtype."""
    base = base_layer(module)
    if hasattr(base.weight, "quant_state"):
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
    return base.weight


@dataclass(frozen=True)
class CopySource:
    """What one merged copy holds, its rows in this order: the projections' weights stacked (+ their adapters'
    deltas), and the stacked copy of their biases (None when none has one)."""
    modules: tuple
    bias: torch.Tensor | None


def stacked_copy(modules, generation_copy, copies):
    """F.linear over one merged copy of `modules` stacked (they read the same input; their outputs concatenated),
    appended to `copies`; None where no copy is made: generation_copy off, an adapter that is not a plain
    additive update, or nothing to merge nor dequantize."""
    deltas = [mergeable_deltas(module) for module in modules]
    bases = [base_layer(module) for module in modules]
    quantized = any(hasattr(base.weight, "quant_state") for base in bases)
    if not generation_copy or any(delta is None for delta in deltas) or not (quantized or any(deltas)):
        return None
    first = base_weight(modules[0])   # the copy's dtype: the weight's, or a 4-bit weight's compute dtype
    rows = sum(base.out_features for base in bases)
    weight = torch.empty(rows, first.shape[1], dtype=first.dtype, device=first.device)
    bias = None if all(base.bias is None for base in bases) else torch.empty(rows, dtype=first.dtype,
                                                                            device=first.device)
    copies.append((CopySource(tuple(modules), bias), weight))
    return functools.partial(linear_in_copy_dtype, weight=weight, bias=bias)


def unmerged_call(module):
    """The module itself (its adapter run unmerged, as in training), or its base layer where it has nothing to
    merge (no adapter, or adapters switched off)."""
    return base_layer(module) if mergeable_deltas(module) == [] else module


def projection(module, generation_copy, copies):
    """What the engine calls for one projection: F.linear over a merged (dequantized) copy where one is made,
    else the base layer (nothing to merge) or the module itself (adapter run unmerged, as in training)."""
    return stacked_copy((module,), generation_copy, copies) or unmerged_call(module)


def projections(modules, sizes, generation_copy, copies, stacked=True):
    """What the engine calls for projections that read one input (q, k, v; gate, up; or one already fused):
    x -> the tuple of outputs of `sizes` their outputs make, concatenated. With a merged copy (stacked), one GEMM
    over the copies stacked and views of its output; else each module in turn (one fused module's output split),
    from its own merged copy where one is made."""
    linear = stacked_copy(modules, generation_copy, copies) if stacked else None
    if linear is not None:
        return lambda x: linear(x).split(sizes, -1)
    calls = [projection(module, generation_copy, copies) for module in modules]
    if len(calls) == len(sizes):
        return lambda x: tuple(call(x) for call in calls)
    return lambda x: calls[0](x).split(sizes, -1)


def linear_in_copy_dtype(x, weight, bias):
    """F.linear in the copy's dtype, the result in the input's: what a bitsandbytes 4-bit layer computes (input
    and bias cast to its compute dtype, output cast back). peft's prepare_model_for_kbit_training keeps the
    embeddings and norms, so the residual stream, in float32 while the dequantized copy is bf16; where the dtypes
    agree both casts are no-ops."""
    return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)


@torch.no_grad()
def refresh_copies(copies):
    """copy = base weights + the adapters' deltas, stacked: what peft's merge computes, in a separate buffer."""
    for source, weight in copies:
        row = 0
        for module in source.modules:
            base = base_layer(module)
            rows = weight[row:row + base.out_features]
            rows.copy_(base_weight(module))
            for delta in mergeable_deltas(module) or []:
                rows.add_(delta)
            if source.bias is not None:
                bias = source.bias[row:row + base.out_features]
                bias.zero_() if base.bias is None else bias.copy_(base.bias)
            row += base.out_features


def model_signature(model):
    """Changes when parameters move (CUDA graphs hold addresses) or adapters are switched on or off."""
    adapters = [(m.disable_adapters, tuple(m.active_adapters), m.merged)
                for m in model.modules() if hasattr(m, "lora_A")]
    return tuple(p.data_ptr() for p in model.parameters()), tuple(adapters)
