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
import warnings
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


def stacked_copy(modules, generation_copy, copies, layouts=None):
    """F.linear over one merged copy of `modules` stacked (they read the same input; their outputs concatenated),
    appended to `copies` (and, on a CPU, its slot for `cpu_layout` to `layouts`); None where no copy is made:
    generation_copy off, an adapter that is not a plain additive update, or nothing to merge nor dequantize."""
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
    return functools.partial(linear_in_copy_dtype, weight=weight, bias=bias, layout=laid_out(weight, layouts))


def unmerged_call(module):
    """The module itself (its adapter run unmerged, as in training), or its base layer where it has nothing to
    merge (no adapter, or adapters switched off)."""
    return base_layer(module) if mergeable_deltas(module) == [] else module


def projection(module, generation_copy, copies, layouts=None):
    """What the engine calls for one projection: F.linear over a merged (dequantized) copy where one is made,
    else the base layer (nothing to merge) or the module itself (adapter run unmerged, as in training)."""
    return stacked_copy((module,), generation_copy, copies, layouts) or unmerged_call(module)


def projections(modules, sizes, generation_copy, copies, stacked=True, layouts=None):
    """What the engine calls for projections that read one input (q, k, v; gate, up; or one already fused):
    x -> the tuple of outputs of `sizes` their outputs make, concatenated. With a merged copy (stacked), one GEMM
    over the copies stacked and views of its output; else each module in turn (one fused module's output split),
    from its own merged copy where one is made."""
    linear = stacked_copy(modules, generation_copy, copies, layouts) if stacked else None
    if linear is not None:
        return lambda x: linear(x).split(sizes, -1)
    calls = [projection(module, generation_copy, copies, layouts) for module in modules]
    if len(calls) == len(sizes):
        return lambda x: tuple(call(x) for call in calls)
    return lambda x: calls[0](x).split(sizes, -1)


def linear_in_copy_dtype(x, weight, bias, layout=(None,)):
    """F.linear in the copy's dtype, the result in the input's: what a bitsandbytes 4-bit layer computes (input
    and bias cast to its compute dtype, output cast back). peft's prepare_model_for_kbit_training keeps the
    embeddings and norms, so the residual stream, in float32 while the dequantized copy is bf16; where the dtypes
    agree both casts are no-ops. layout: a slot holding the copy's `cpu_layout` (None: F.linear)."""
    return linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype), layout).to(x.dtype)


# ---------------------------------------------------------------- a CPU's weights laid out for its matrix products

# Whether oneDNN's weight layout is used on this CPU (None: not checked yet): checked once against F.linear.
CPU_LAYOUT = {"usable": None}


def laid_out(weight, layouts):
    """A slot for `weight`'s `cpu_layout`, listed in `layouts` to be filled whenever the weights change
    (`lay_out`); None (F.linear) where layouts is None (not a CPU)."""
    slot = [None]
    if layouts is not None:
        layouts.append((weight, slot))
    return slot


def head(module, layouts):
    """What the engine calls for the LM head: on a CPU the head's weight in `cpu_layout` (its slot in `layouts`),
    unless hooks are registered on the module (they see its calls); else the module itself."""
    if layouts is None or type(module) is not torch.nn.Linear:
        return module
    slot = laid_out(module.weight, layouts)

    def call(x):
        if module._forward_hooks or module._forward_pre_hooks:
            return module(x)
        return linear(x, module.weight, module.bias, slot)
    return call


def linear(x, weight, bias, layout=(None,)):
    """x @ weight.T + bias: F.linear, or oneDNN's product over the weight's `cpu_layout` held in `layout`."""
    if layout[0] is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, layout[0], bias, "none", [], "")


def cpu_layout(weight, rows=64):
    """`weight` [out, in] re-laid out in oneDNN's blocked format for products of about `rows` rows on a CPU, or None
    where that is not possible (no oneDNN, another dtype than float32 or bf16, a CUDA tensor) or not checked equal
    to F.linear (said once). A decode step's products of 64 rows then skip laying the weight out at every call:
    bf16 1.3-1.5x, float32 1.4-2.2x faster at the demo's shapes on 2 threads (BENCHMARKS.md, "The demo's step on a
    CPU"); bf16 products give F.linear's numbers, float32 ones differ by rounding."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or \
            CPU_LAYOUT["usable"] is False or not torch.backends.mkldnn.is_available():
        return None
    try:
        laid = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        if CPU_LAYOUT["usable"] is None:
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            tolerance = 2e-2 if weight.dtype == torch.bfloat16 else 1e-4
            got = linear(x, weight, None, (laid,)).float()
            want = F.linear(x, weight).float()
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max())):
                raise ValueError(f"its products differ from F.linear's by up to {float((got - want).abs().max()):.3g}")
            CPU_LAYOUT["usable"] = True
        return laid
    except (RuntimeError, ValueError, AttributeError) as error:
        CPU_LAYOUT["usable"] = False
        warnings.warn(f"oneDNN's weight layout is not used for the decode engine's products on this CPU "
                      f"({type(error).__name__}: {str(error).splitlines()[0][:120]}); they run F.linear")
        return None


@torch.no_grad()
def lay_out(layouts):
    """Every (weight, slot) of `layouts` given the weight's `cpu_layout` as it is now (after the copies' refresh)."""
    for weight, slot in layouts:
        slot[0] = cpu_layout(weight)


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
