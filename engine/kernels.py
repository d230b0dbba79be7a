"""The update's fast paths on a GPU (paper Algorithm 1's policy update, made cheaper, the same result): Liger-Kernel's
fused RMSNorm, rotary embedding and SiLU x up (`fused_kernels`, checked once per model against the plain path, which
runs where they disagree or are absent), TF32 for what is left in float32 (`tf32_matmuls`), and activation
checkpointing sized by the card's free memory (`checkpoint_plan`, `checkpointing`). update.py enters them on CUDA
(and where engine/gpu_paths.py emulates a GPU); elsewhere the model runs as built. A fused kernel failing later, at a
shape its check did not try, turns them off with one warning line and the work runs again on the plain path
(`with_fallback`).
Simplification: the memory plan is per process (several processes keep every checkpointed layer whole)."""

import contextlib
import importlib.util
import math
import sys
import warnings

import policy
from engine import gpu_paths
from policy import checkpointing_modules, dropout_off, hf_model
from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py)


def checkpointable_layers(model):
    """The decoder layers of `model` that gradient checkpointing was switched on for (prepare_for_training), in order;
    [] without it (or with a transformers release that checkpoints no layer by itself)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in checkpointing_modules(model) if isinstance(m, GradientCheckpointingLayer)
            and getattr(m, "_gradient_checkpointing_func", None) is not None]


@contextlib.contextmanager
def checkpointing(model, layers=None, mlps=0):
    """For the block, of `checkpointable_layers`: the first `layers` checkpointed whole (each replays its forward in
    the backward), the next `mlps` their MLP alone (it replays: two thirds of what a layer keeps, a fifth of its
    kernels), the others not at all; layers None: every layer whole, as built. As built again afterwards."""
    every = checkpointable_layers(model)
    layers = len(every) if layers is None else layers
    replayed = []  # (mlp, its forward before)

    def replay(forward):
        def run(x):
            return checkpoint(forward, x, use_reentrant=False) if torch.is_grad_enabled() else forward(x)
        return run

    from torch.utils.checkpoint import checkpoint

    try:
        for index, layer in enumerate(every):
            layer.gradient_checkpointing = index < layers
            if layers <= index < layers + mlps:
                replayed.append((layer.mlp, layer.mlp.__dict__.get("forward")))
                layer.mlp.forward = replay(layer.mlp.forward)
        yield
    finally:
        for mlp, forward in replayed:
            if forward is None:
                del mlp.forward
            else:
                mlp.forward = forward
        for layer in every:
            layer.gradient_checkpointing = True


def saved_bytes_per_token(model, tokens=48, nbytes=None):
    """(plain, MLP replayed, layer replayed): the bytes autograd keeps for the backward per token position of one
    decoder layer as `checkpointing` leaves it, measured on `model` itself: the saved tensors (under saved-tensor
    hooks; parameters, and each storage, once) of forwards of 2 random rows (one padded, as the update's rows are)
    of `tokens` and of 2 x `tokens` positions; the difference of the two sizes leaves out what does not grow with
    the tokens (the adapter's bf16 copies). A layer replayed whole keeps its input. nbytes: the size of a saved
    tensor (default: its storage's). Cached per model."""
    cached = model.__dict__.get("_saved_bytes_per_token")
    if cached is not None:
        return cached
    layers = len(checkpointable_layers(model))
    measure = nbytes or (lambda t: t.untyped_storage().nbytes())
    device = next(model.parameters()).device
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def saved(length, plan):
        ids = torch.randint(3, hf_model(model).config.vocab_size, (2, length), device=device)
        mask = torch.ones_like(ids)
        mask[1, :length // 4] = 0
        seen = {}

        def pack(tensor):
            key = tensor.untyped_storage().data_ptr()
            if key not in skip:
                seen[key] = max(seen.get(key, 0), measure(tensor))
            return tensor

        with dropout_off(model, keep_checkpointing=True), checkpointing(model, *plan), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
        return sum(seen.values())

    plans = {"plain": (0, 0), "mlp": (0, layers), "layer": (layers, 0)}
    grown = {name: saved(2 * tokens, plan) - saved(tokens, plan) for name, plan in plans.items()}
    inputs = measure(torch.empty(1, hf_model(model).config.hidden_size, dtype=next(model.parameters()).dtype))
    result = tuple((grown[name] - grown["layer"]) / max(layers, 1) / (2 * tokens) + inputs for name in plans)
    model.__dict__["_saved_bytes_per_token"] = result
    return result


def checkpoint_plan(layers, per_token, tokens, budget_bytes):
    """(layers replayed whole, layers whose MLP alone replays) for `layers` decoder layers keeping per_token =
    `saved_bytes_per_token` bytes per token position each, so that a micro-batch of `tokens` positions fits
    budget_bytes with as little replay as can: MLPs first (cheap to replay), then whole layers; every layer whole
    if even that does not fit."""
    plain, mlp, whole = per_token
    need = (lambda wholes, mlps: (wholes * whole + mlps * mlp + (layers - wholes - mlps) * plain) * tokens)
    if need(0, 0) <= budget_bytes:
        return 0, 0
    if need(0, layers) <= budget_bytes:
        return 0, min(layers, math.ceil((need(0, 0) - budget_bytes) / max((plain - mlp) * tokens, 1)))
    wholes = min(layers, math.ceil((need(0, layers) - budget_bytes) / max((mlp - whole) * tokens, 1)))
    return wholes, layers - wholes


# Of a card's memory, what the update's plan leaves aside for what it does not count (the allocator's fragmentation,
# the estimate's own error); and what it plans for whatever the card: a 48 GB L40S with margin (the weights, the
# engine's copy and cache, the logits and the saved activations).
MEMORY_MARGIN = 0.25
MEMORY_CEILING = 40 * 2 ** 30


def activation_budget(device):
    """Bytes the update's saved activations and logits may take on `device`, a GPU or one gpu_paths emulates: the
    least of its free memory (with what torch holds unused) less MEMORY_MARGIN of the card, and MEMORY_CEILING less
    what is allocated."""
    free, total, allocated, reserved = gpu_paths.memory(device)
    unused = reserved - allocated   # held by torch's allocator, free to reuse
    return min(free + unused - MEMORY_MARGIN * total, MEMORY_CEILING - allocated)


def update_plan(model, parts, device):
    """`checkpoint_plan` of the update of `model` on `device`, whose micro-batches are `parts` [(rows, prompt columns,
    completion columns)]: the largest one's saved activations (`saved_bytes_per_token`) and logits (with a fused head,
    one chunk of them) within `activation_budget`; (None, 0), every layer whole as built, without checkpointed
    layers."""
    layers = len(checkpointable_layers(model))
    if not layers:
        return None, 0
    tokens = max(rows * (prompt + completion) for rows, prompt, completion in parts)
    logits = 4 * 4 * policy._LOGSUMEXP_CHUNK_ELEMENTS  # the log-softmax's float32 chunks
    if policy.fused_head(model) is None:  # the model's own logits, and their gradient, whole
        logits += max(rows * completion for rows, _, completion in parts) * \
            hf_model(model).config.vocab_size * 2 * next(model.parameters()).element_size()
    return checkpoint_plan(layers, saved_bytes_per_token(model), tokens, activation_budget(device) - logits)


# How far a fused kernel may stray from the plain path on the check's input (the largest difference over the largest
# value, forward and gradients): bf16 rounding differs by a few units of its 8-bit mantissa, a wrong kernel by far more.
KERNEL_TOLERANCE = 3e-2


def plain_kernels():
    """The plain path of each fusable operation (Hugging Face's Llama/Qwen2 formulas): RMSNorm in float32 times the
    weight in the input's dtype, rotary embedding, SiLU(gate) x up."""
    def rms_norm(x, weight, eps):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotary(q, k, cos, sin):
        def rotated(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotated(q) * sin, k * cos + rotated(k) * sin

    return dict(rms_norm=rms_norm, rotary=rotary, silu_mul=lambda gate, up: torch.nn.functional.silu(gate) * up)


def liger_kernels(device):
    """Liger-Kernel's fused Triton kernels (one kernel each, forward and backward) where they run: a CUDA device with
    the package installed (`pip install liger-kernel`, an optional dependency); on a device engine/gpu_paths.py
    emulates a GPU on, the plain path's functions stand in for them (so the check, the patching and the fallback
    run); {} elsewhere."""
    if torch.device(device).type != "cuda":
        return plain_kernels() if torch.device(device).type in gpu_paths.DEVICE_TYPES else {}
    if importlib.util.find_spec("liger_kernel") is None:
        return {}
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return dict(rms_norm=lambda x, weight, eps: LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False),
                rotary=lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin),
                silu_mul=lambda gate, up: LigerSiLUMulFunction.apply(gate, up))


def kernel_inputs(model, autocast_dtype=None, tokens=24):
    """{kernel: a function giving random inputs} at `model`'s widths (hidden, query and key-value heads, head and
    MLP widths) and in the dtypes the update gives each kernel: RMSNorm the residual stream's (the embeddings'),
    rotary and SiLU x up the projections' outputs (autocast_dtype under autocast: full fine-tuning in bf16)."""
    config = hf_model(model).config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    stream = hf_model(model).get_input_embeddings().weight.dtype
    activations = autocast_dtype or stream
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)   # drawn on the host: the same inputs on every device

    def random(dtype, *shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(device=device, dtype=dtype)

    def rotary():
        angles = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2, generator=generator)
        cos, sin = (torch.cat([f(angles), f(angles)], -1).expand(2, -1, -1).to(device=device, dtype=activations)
                    for f in (torch.cos, torch.sin))
        return random(activations, 2, heads, tokens, head_dim), random(activations, 2, kv_heads, tokens, head_dim), \
            cos, sin

    return dict(rms_norm=lambda: (random(stream, 2, tokens, config.hidden_size),
                                  random(stream, config.hidden_size, scale=0.25, shift=1.0), 1e-6),
                rotary=rotary,
                silu_mul=lambda: (random(activations, 2, tokens, config.intermediate_size),
                                  random(activations, 2, tokens, config.intermediate_size)))


def kernels_disagree(kernels, inputs):
    """None when every kernel of `kernels` gives the plain path's outputs and input gradients on the random inputs of
    `inputs` (`kernel_inputs`; within KERNEL_TOLERANCE), else which one does not and by how much (or what it raised),
    in a line. Gradients are taken whatever the caller's grad mode (the check may run under no_grad)."""
    plain = plain_kernels()
    for name, kernel in kernels.items():
        args = inputs[name]()
        results = []
        for function in (kernel, plain[name]):
            leaves = [a.detach().clone().requires_grad_(a.dtype.is_floating_point) if torch.is_tensor(a) else a
                      for a in args]
            try:
                with torch.enable_grad():
                    out = function(*leaves)
                    outs = out if isinstance(out, tuple) else (out,)
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            except Exception as error:  # noqa: BLE001 (any failure of a fused kernel means the plain path)
                return f"{name} raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            results.append([o.detach().float() for o in outs] + [a.grad.float() for a in leaves
                                                               if torch.is_tensor(a) and a.grad is not None])
        for got, want in zip(*results):
            error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            if not error <= KERNEL_TOLERANCE:
                return f"{name} differs from the plain path by {error:.2g} of its largest value"
    return None


def _one_line(error):
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


@contextlib.contextmanager
def fused_kernels(model, device, autocast_dtype=None):
    """For the block, `model`'s RMSNorms, rotary embedding and SiLU x up run through fused kernels where they run
    (`liger_kernels`) and agree with the plain path at the model's widths and dtypes (`kernels_disagree` on
    `kernel_inputs`, checked once per model; if not: one warning line, and the plain path); each module's own forward
    comes back afterwards. Elsewhere nothing changes (CPU: the plain path). Yields `fall_back(error)`: a failure the
    check did not see (a shape it did not try) turns the kernels off for the model with one warning line and returns
    True, so the caller runs its work again on the plain path; False where no fused kernel was on."""
    kernels = model.__dict__.get("_fused_kernels")
    if kernels is None:
        kernels = liger_kernels(device)
        reason = kernels_disagree(kernels, kernel_inputs(model, autocast_dtype)) if kernels else None
        if reason is not None:
            warnings.warn(f"fused kernels off: {reason}; the update runs the plain path")
            kernels = {}
        model.__dict__["_fused_kernels"] = kernels
    patched = []  # (owner, name, previous value or None)

    def restore():
        while patched:
            owner, name, previous = patched.pop()
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

    def fall_back(error):
        if not patched:
            return False
        restore()
        model.__dict__["_fused_kernels"] = {}
        warnings.warn(f"fused kernels off: the update raised {_one_line(error)} with them on; it runs the plain "
                      "path from now on")
        return True

    if not kernels:
        yield fall_back
        return

    def patch(owner, name, value):
        patched.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def norm_forward(module):
        return lambda x: kernels["rms_norm"](x, module.weight, module.variance_epsilon)

    def mlp_forward(module):
        return lambda x: module.down_proj(kernels["silu_mul"](module.gate_proj(x), module.up_proj(x)))

    def rotary(plain):
        def apply(q, k, cos, sin, *args, **kwargs):
            return kernels["rotary"](q, k, cos, sin) if not (args or kwargs) else plain(q, k, cos, sin, *args,
                                                                                        **kwargs)
        return apply

    try:
        for kind, owner in fused_targets(model):
            if kind == "rms_norm":
                patch(owner, "forward", norm_forward(owner))
            elif kind == "silu_mul":
                patch(owner, "forward", mlp_forward(owner))
            else:
                patch(owner, "apply_rotary_pos_emb", rotary(owner.apply_rotary_pos_emb))
        yield fall_back
    finally:
        restore()


def fused_targets(model):
    """[(kernel, what it patches)] of `model`: its RMSNorms, its SiLU x up MLPs, and each attention module's module
    of functions (apply_rotary_pos_emb), found once per model (a walk of every module took ~10 ms at 36 layers, at
    every update: host time a GPU waits for)."""
    targets = model.__dict__.get("_fused_targets")
    if targets is None:
        targets, owners = [], set()
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                targets.append(("rms_norm", module))
            elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and \
                    type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
                targets.append(("silu_mul", module))
            elif hasattr(module, "q_proj") and hasattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb"):
                owner = sys.modules[type(module).__module__]
                if owner.__name__ not in owners:
                    owners.add(owner.__name__)
                    targets.append(("rotary", owner))
        model.__dict__["_fused_targets"] = targets
    return targets


def with_fallback(fall_back, work):
    """work() once; if it raises, again on the plain path when `fall_back` (`fused_kernels`) turned fused kernels
    off, else the error as it was."""
    try:
        return work()
    except Exception as error:  # noqa: BLE001 (re-raised unless fused kernels were on)
        if not fall_back(error):
            raise
    return work()


@contextlib.contextmanager
def tf32_matmuls(device):
    """On CUDA, float32 matrix products of the block may use TF32 (a 10-bit mantissa; the update's bf16 products have
    7): what is left in float32 (full fine-tuning without --bf16) runs on tensor cores. Elsewhere nothing changes (an
    emulated GPU sets the switch too, which only CUDA reads)."""
    if torch.device(device).type not in gpu_paths.DEVICE_TYPES:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
