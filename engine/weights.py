"""The decode engine's weights: LoRA merged into a separate copy of each adapted projection (paper §4 setting (a):
LoRA r=64 on q,k,v,o,gate,up,down, whose unmerged adapter would add two small GEMMs per projection and token).

The copy is refreshed at every generation call (the adapter changes at every optimizer step); the training weights
are never touched (peft's in-place merge_adapter() / unmerge_adapter() would leave a bf16 rounding error in the
frozen base weights at every step). bitsandbytes 4-bit projections are dequantized into the copy.
Simplification: adapters that are not a plain additive update (DoRA, LoRA bias) run unmerged, as in training.
"""

import functools

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


def base_weight(module):
    """A projection's base weight; bitsandbytes 4-bit weights (CUDA only) dequantized to their compute dtype."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if hasattr(base.weight, "quant_state"):
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
    return base.weight


def projection(module, generation_copy, copies):
    """What the engine calls for one projection: F.linear over a merged (dequantized) copy where one is made,
    else the base layer (nothing to merge) or the module itself (adapter run unmerged, as in training)."""
    deltas = mergeable_deltas(module)
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if deltas is None or not generation_copy:
        return module
    if not deltas and not hasattr(base.weight, "quant_state"):
        return base
    copies.append((module, torch.empty_like(base_weight(module))))
    return functools.partial(linear_in_copy_dtype, weight=copies[-1][1], bias=base.bias)


def linear_in_copy_dtype(x, weight, bias):
    """F.linear in the copy's dtype, the result in the input's: what a bitsandbytes 4-bit layer computes (input
    and bias cast to its compute dtype, output cast back). peft's prepare_model_for_kbit_training keeps the
    embeddings and norms, so the residual stream, in float32 while the dequantized copy is bf16; where the dtypes
    agree both casts are no-ops."""
    return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)


@torch.no_grad()
def refresh_copies(copies):
    """copy = base weight + the adapters' deltas: what peft's merge computes, in a separate buffer."""
    for module, weight in copies:
        weight.copy_(base_weight(module))
        for delta in mergeable_deltas(module) or []:
            weight.add_(delta)


def model_signature(model):
    """Changes when parameters move (CUDA graphs hold addresses) or adapters are switched on or off."""
    adapters = [(m.disable_adapters, tuple(m.active_adapters), m.merged)
                for m in model.modules() if hasattr(m, "lora_A")]
    return tuple(p.data_ptr() for p in model.parameters()), tuple(adapters)
