"""A bf16 base's LoRA adapter computed in bf16 (paper settings (a)-(d): LoRA over a bf16 3B model), the same update,
faster: models.lora_in_base_dtype puts `lora_forward` in place of each peft LoRA Linear's forward at loading. Where
the GPU paths run, or a CPU computes bf16 natively (`computes_in_bf16`), the fp32 adapter is computed in bf16 in three
matrix products (`LoRAProduct`) from bf16 copies of A and B, refreshed after every optimizer step (a step counter
handed in: update.OPTIMIZER_STEPS); the adapter's weights, gradients and optimizer state stay fp32 (master weights).
Elsewhere, and for what peft's forward does that this does not (dropout, a LoRA variant, merged weights), peft's own.
Simplification: one active adapter; the input is flattened to 2-D."""

import torch

import policy
from engine import gpu_paths


class LoRAProduct(torch.autograd.Function):
    """x W^T (+ bias) + s (x A^T) B^T for 2-D x in the base weights' dtype, in three matrix products (the last one
    adds the adapter's product, scaled, to the base's); A and B arrive in that dtype (`_low_precision_copies`) and
    their gradients leave in the adapter's own dtype (fp32 master weights). W and the bias are frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, a_low, b_low, scaling):
        xa = x @ a_low.t()
        out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
        out = torch.addmm(out, xa, b_low.t(), alpha=scaling)
        ctx.save_for_backward(x, xa, weight, a_low, b_low)
        ctx.scaling, ctx.adapter_dtype = scaling, lora_a.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        # The scaling rides on the matrix products (addmm's alpha; beta = 0: its first argument, of the right
        # shape, is not read): one kernel each, not a product and then a multiplication.
        x, xa, weight, a_low, b_low = ctx.saved_tensors
        scaled = torch.addmm(xa, grad, b_low, beta=0, alpha=ctx.scaling)   # dL/d(xA^T), [N, r]
        grad_x = torch.addmm(grad @ weight, scaled, a_low) if ctx.needs_input_grad[0] else None
        grad_a = (scaled.t() @ x).to(ctx.adapter_dtype) if ctx.needs_input_grad[3] else None
        grad_b = torch.addmm(b_low, grad.t(), xa, beta=0, alpha=ctx.scaling).to(ctx.adapter_dtype) \
            if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None, None, None


def computes_in_bf16(device) -> bool:
    """Whether a bf16 base's LoRA adapter is computed in bf16 on `device` (`lora_forward`): where the GPU paths run
    (engine/gpu_paths.py), and on a CPU with bf16 instructions of its own (policy.native_bf16), whose bf16 products are
    its fastest; elsewhere peft's float32 adapter."""
    device = torch.device(device)
    return device.type in gpu_paths.DEVICE_TYPES or (device.type == "cpu" and policy.native_bf16(device))


def _low_precision_copies(module, adapter, dtype, optimizer_steps):
    """The adapter's A and B weights in `dtype`, cast once per change of the weights and reused until then: an
    optimizer step (optimizer_steps[0] moved: fused AdamW and 8-bit AdamW write without bumping versions) or an
    in-place write that bumps their version (a checkpoint loaded)."""
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    key = (optimizer_steps[0], a._version, b._version, dtype, a.data_ptr(), b.data_ptr())
    cached = module.__dict__.get("_low_precision_lora")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, a.to(dtype), b.to(dtype))
        module.__dict__["_low_precision_lora"] = cached
    return cached[1], cached[2]


def lora_forward(module, peft_forward, optimizer_steps):
    """The forward of a peft LoRA Linear `module`: where the input has the base weights' dtype and the adapter
    another (bf16 base, fp32 adapter), `LoRAProduct` in the base dtype; elsewhere (float32 throughout, the adapter
    off or merged, dropout active, a LoRA variant) peft's own forward, unchanged."""
    def forward(x, *args, **kwargs):
        adapters = module.active_adapters
        adapter = adapters[0] if len(adapters) == 1 else None
        base = module.base_layer
        if (args or kwargs or not computes_in_bf16(x.device) or adapter not in module.lora_A
                or module.disable_adapters or module.merged
                or module.lora_variant or getattr(module, "fan_in_fan_out", False) or x.dtype != base.weight.dtype
                or x.dtype == module.lora_A[adapter].weight.dtype
                or (module.lora_dropout[adapter].training and not isinstance(module.lora_dropout[adapter],
                                                                             torch.nn.Identity))):
            return peft_forward(x, *args, **kwargs)
        a_low, b_low = _low_precision_copies(module, adapter, x.dtype, optimizer_steps)
        flat = x.reshape(-1, x.shape[-1])
        out = LoRAProduct.apply(flat, base.weight, base.bias, module.lora_A[adapter].weight,
                                module.lora_B[adapter].weight, a_low, b_low, module.scaling[adapter])
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return forward
