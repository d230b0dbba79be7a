"""One decode step of a Llama-family model, written by hand in plain PyTorch over its Hugging Face modules (the
reference of every fused kernel: engine/ops.py; the loop around it: engine/decode.py), and the weights it multiplies.

Paper Algorithm 1, line 1 (sampling rollouts), one token at a time: the layers over a preallocated KV cache, the
prefill, and the next token (greedy, or top-p by inverse CDF from a hashed uniform) with its sampler log-prob. Each
operation goes through a `Kernels` record, in place on fixed-shape tensors, so a step records as one CUDA graph.
The weights: LoRA merged into a separate copy (q|k|v and gate|up stacked, 4-bit weights dequantized, laid out for
oneDNN on a CPU), refreshed at every call; the training weights are untouched (peft's in-place merge rounds them).
Simplifications: decode.FAMILIES' layouts only; no sliding window; adapters that are not a plain additive update
(DoRA, LoRA bias) run unmerged; a model without adapters runs its own modules.
"""

import functools
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from policy import position_ids_from_mask


def mix32(x):
    """Wellons' lowbias32 hash of int64 tensors in [0, 2**32), products split in 16-bit halves: no int64 overflow."""
    for shift, constant in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = x ^ (x >> shift)
        x = (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return x ^ (x >> 16)


def row_noise_keys(seed, rows):
    """32-bit noise keys of rows 0..rows-1 of a chunk sampled with `seed` (any int, e.g. sampling.derived_seed)."""
    seed = int(seed) % 2 ** 64
    return mix32(mix32(mix32(torch.tensor(seed & 0xFFFFFFFF)) ^ (seed >> 32)) ^ torch.arange(rows))


def uniform_draws(row_keys, step):
    """One U(0, 1) draw per row, a pure function of (row key, step): no generator state for a CUDA graph to hold,
    and a row's draws do not depend on its bucket. row_keys [R, 1], step [L] give the [R, L] table of a call."""
    bits = mix32(row_keys ^ mix32(step))
    return ((bits >> 8).float() + 0.5) * 2.0 ** -24   # 24 random bits, never 0 or 1


def add_rms_norm(x, residual, norm):
    """residual += x (None: nothing to add), then the norm module of it: the pre-norm layer's residual stream."""
    if x is not None:
        residual.add_(x)
    return norm(residual)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def rotate(x, cos, sin):
    """Rotary embedding of x [B, heads, T, hd] by cos / sin [B, T, rd] (rd < hd: Phi-3 rotates part of a head)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, kept = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, kept], -1)


def head_norm(x, norm, head_dim):
    """Qwen3's q_norm / k_norm: the norm over each head of x [B, T, heads * hd], before rotary."""
    return norm(x.unflatten(-1, (-1, head_dim))).flatten(-2)


def rotary_cache_write(q, k, v, cos, sin, key_cache, value_cache, slots):
    """q [B, T, Hq * hd], k and v [B, T, Hkv * hd] -> q rotated [B, Hq, T, hd]; k rotated and v are written into
    cache columns `slots` [T] of key_cache / value_cache [B, Hkv, L, hd]."""
    batch, length, head_dim = q.shape[0], q.shape[1], key_cache.shape[-1]
    q, k, v = (t.view(batch, length, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    key_cache.index_copy_(2, slots, rotate(k, cos, sin))
    value_cache.index_copy_(2, slots, v)
    return rotate(q, cos, sin)


def attend(q, keys, values, mask, scaling):
    """q [B, heads, T, hd] over the cache [B, kv_heads, L, hd] where mask [B, 1, T, L] -> [B, T, heads * hd], the
    cache never copied; not torch's CPU flash attention, whose rounding depends on the thread count."""
    batch, heads, length, head_dim = q.shape
    grouped = q.reshape(batch, keys.shape[1], -1, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling
    grouped_mask = mask.repeat(1, 1, heads // keys.shape[1], 1)   # row g * T + t is query t of head g
    probs = scores.masked_fill(~grouped_mask, float("-inf")).softmax(-1).to(values.dtype)
    out = torch.matmul(probs, values)
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).reshape(batch, length, heads * head_dim)


def attend_shared(q, keys, values, mask, scaling, shared):
    """`attend` where the first `shared` cache columns are the same in every row (the prompts' common prefix): read
    once, from row 0, for every row's queries, in one softmax with the row's own columns. Eager decoding only."""
    batch, heads, length, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads * length
    grouped = q.reshape(batch, kv_heads, group, head_dim)
    by_head = grouped.transpose(0, 1).reshape(kv_heads, batch * group, head_dim)    # every row's queries, per KV head
    prefix_scores = torch.matmul(by_head, keys[0, :, :shared].transpose(-1, -2))
    prefix_scores = prefix_scores.reshape(kv_heads, batch, group, shared).transpose(0, 1)
    own_scores = torch.matmul(grouped, keys[:, :, shared:].transpose(-1, -2))
    scores = torch.cat([prefix_scores, own_scores], -1).float() * scaling
    grouped_mask = mask.repeat(1, 1, heads // kv_heads, 1)   # row g * T + t is query t of head g
    probs = scores.masked_fill(~grouped_mask, float("-inf")).softmax(-1).to(values.dtype)
    prefix_probs = probs[..., :shared].transpose(0, 1).reshape(kv_heads, batch * group, shared)
    out = torch.matmul(prefix_probs, values[0, :, :shared]).reshape(kv_heads, batch, group, head_dim).transpose(0, 1)
    out = out + torch.matmul(probs[..., shared:], values[:, :, shared:])
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).reshape(batch, length, heads * head_dim)


@dataclass
class Bounds:
    """The cache columns each row reads: [0, shared) (the common prefix) and [start[row], slot]; length: those the
    reference reads (eager: written so far; a graph: all); shared_len: the prefix length if on the host, else 0."""
    start: torch.Tensor     # [B] int64
    shared: torch.Tensor    # [1] int64
    slot: torch.Tensor      # [1] int64: the column this step writes, the last one read
    scaling: float
    length: int
    shared_len: int = 0
    cached_mask: torch.Tensor = field(default=None, repr=False)

    def mask(self):
        """[B, 1, 1, length] bool, built once per step for every layer (the fused kernel needs none)."""
        if self.cached_mask is None:
            columns = torch.arange(self.length, device=self.start.device)
            own = (columns >= self.start[:, None]) & (columns <= self.slot)
            self.cached_mask = (own | (columns < self.shared))[:, None, None, :]
        return self.cached_mask


def decode_attention(q, key_cache, value_cache, bounds):
    """q [B, heads, 1, hd] over the columns `bounds` allows -> [B, 1, heads * hd]."""
    keys, values = key_cache[:, :, :bounds.length], value_cache[:, :, :bounds.length]
    if bounds.shared_len:
        return attend_shared(q, keys, values, bounds.mask(), bounds.scaling, bounds.shared_len)
    return attend(q, keys, values, bounds.mask(), bounds.scaling)


def act_mul(gate, up, act):
    return act(gate) * up


def choose_tokens(logits, state, draws=None):
    """Greedy argmax, or softmax(logits / T) within the top-p nucleus sampled by inverse CDF of the row's uniform
    `draws` (None: hashed here): ~4 passes over [rows, vocab], where Gumbel-max would hash every logit."""
    if not state.sample:
        return logits.argmax(-1)
    logits = logits / state.scalars["temperature"]
    if state.nucleus:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        remove = probs.cumsum(-1) - probs >= state.scalars["top_p"]
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    if draws is None:
        draws = uniform_draws(state.row_keys, state.scalars["step"])
    cdf = logits.softmax(-1).cumsum(-1)
    target = draws * cdf[:, -1]   # cdf[-1] ~ 1 up to rounding
    # cdf[i-1] < target <= cdf[i] implies p[i] > 0: a token outside the nucleus is never drawn.
    return torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def sampler_logprob(logits, token, state):
    """log p(token) under softmax(logits / T) over the whole vocabulary (before the top-p cut; greedy: T = 1), as
    policy.token_logprobs defines it; [rows] float32, so no [rows, vocab] tensor outlives the step."""
    scaled = logits / state.scalars["temperature"] if state.sample else logits
    return scaled.gather(-1, token[:, None]).squeeze(-1) - scaled.logsumexp(-1)


def finish_step(logits, state):
    """After the LM head: each row's token (EOS at its forced length, pad once done) and log-prob recorded in
    column `step`, rows that emitted an EOS marked done, the token made the next input."""
    scalars, logits = state.scalars, logits.float()
    token = choose_tokens(logits, state, state.draws.index_select(1, scalars["step"]).squeeze(1))
    token = torch.where(state.stop_at == scalars["step"], scalars["eos"][0], token)
    token = torch.where(state.done, scalars["pad"], token)
    state.out.index_copy_(1, scalars["step"], token[:, None])
    logprob = torch.where(state.done, 0.0, sampler_logprob(logits, token, state))
    state.logprobs.index_copy_(1, scalars["step"], logprob[:, None])
    state.done |= (token[:, None] == scalars["eos"]).any(-1)
    state.tokens.copy_(token)
    state.positions += 1


@dataclass(frozen=True)
class Kernels:
    """A step's operations: these references, or engine/ops.py's ops named in `fused`; stacked: q|k|v, gate|up."""
    add_rms_norm: object = add_rms_norm
    rotary_cache_write: object = rotary_cache_write
    decode_attention: object = decode_attention
    act_mul: object = act_mul
    finish_step: object = finish_step
    fused: frozenset = field(default=frozenset())
    stacked: bool = True


PLAIN = Kernels()


def run_layers(dec, hidden, positions, keys, values, slots, attention, kernels=PLAIN):
    """hidden [B, T, H] (the residual stream, updated in place) through every layer, K/V written to cache columns
    `slots`; attention(q, layer keys, layer values) -> [B, T, heads * hd]. Returns (last MLP output, residual)."""
    cos, sin = dec.rotary(hidden, positions)
    x = None
    for layer, layer_keys, layer_values in zip(dec.layers, keys, values):
        q, k, v = layer.qkv(kernels.add_rms_norm(x, hidden, layer.input_norm))
        if layer.q_norm is not None:
            q, k = head_norm(q, layer.q_norm, dec.head_dim), head_norm(k, layer.k_norm, dec.head_dim)
        q = kernels.rotary_cache_write(q, k, v, cos, sin, layer_keys, layer_values, slots)
        normed = kernels.add_rms_norm(layer.o(attention(q, layer_keys, layer_values)), hidden, layer.post_norm)
        x = layer.down(kernels.act_mul(*layer.gate_up(normed), layer.act))
    return x, hidden


def decode_step(dec, state):
    """One token for every row of the bucket, all in place on `state`: the function a CUDA graph records."""
    kernels, scalars = dec.kernels, state.scalars
    bounds = Bounds(state.start, scalars["shared"], scalars["slot"], dec.scaling,
                    state.attend_len or state.out.shape[1], state.shared_len)
    x, residual = run_layers(dec, dec.embed(state.tokens[:, None]), state.positions[:, None], state.keys,
                             state.values, scalars["slot"], lambda q, k, v: kernels.decode_attention(q, k, v, bounds),
                             kernels)
    kernels.finish_step(dec.lm_head(kernels.add_rms_norm(x, residual, dec.norm))[:, -1], state)
    scalars["counters"] += 1   # the slot and step counters, one tensor


def prefill(dec, prompt_ids, prompt_mask, shared=0):
    """K/V of every prompt but its last token (the first decode step's input), [D, kv_heads, W - 1, hd], in plain
    PyTorch. The first `shared` columns (the same in every row, a host number) run once, as one row."""
    distinct, length, device = prompt_ids.shape[0], prompt_ids.shape[1] - 1, prompt_ids.device
    if not 0 <= shared <= length:
        raise ValueError(f"a shared prefix of {shared} tokens needs {shared} columns before the last")
    keys = [torch.zeros(distinct, dec.num_kv_heads, length, dec.head_dim, dtype=dec.embed.weight.dtype,
                        device=device) for _ in range(2 * len(dec.layers))]
    if shared > 0:   # the prefix once, then its K/V broadcast into every prompt's row
        once = [cache[:1, :, :shared].clone() for cache in keys]
        causal = torch.ones(shared, shared, dtype=torch.bool, device=device).tril()
        run_layers(dec, dec.embed(prompt_ids[:1, :shared]), torch.arange(shared, device=device)[None], once[::2],
                   once[1::2], torch.arange(shared, device=device),
                   functools.partial(attend, mask=causal[None, None], scaling=dec.scaling))
        for cache, prefix in zip(keys, once):
            cache[:, :, :shared] = prefix
    if length > shared:
        mask = prompt_mask[:, :length].bool()
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        # A padding query sees itself, so no softmax row is empty (no NaN); no real query sees padding.
        allowed = ((causal & mask[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device))[:, shared:]
        run_layers(dec, dec.embed(prompt_ids[:, shared:length]), position_ids_from_mask(mask)[:, shared:],
                   keys[::2], keys[1::2], torch.arange(shared, length, device=device),
                   functools.partial(attend, mask=allowed[:, None], scaling=dec.scaling))
    return keys[::2], keys[1::2]


# ---------------------------------------------------------------- the weights a step multiplies


def mergeable_deltas(module):
    """The updates peft's merge adds to this projection ([]: none), or None for adapters not plainly additive."""
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
    """The projections one merged copy stacks, in row order, and its stacked bias (None when none has one)."""
    modules: tuple
    bias: torch.Tensor | None


def stacked_copy(modules, generation_copy, copies, layouts=None):
    """F.linear over one merged copy of `modules` stacked (appended to `copies`), or None where no copy is made:
    generation_copy off, an adapter not a plain additive update, or nothing to merge nor dequantize."""
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


def projection(module, generation_copy, copies, layouts=None):
    """One projection's call: a merged copy, else its base layer (nothing to merge) or itself (adapter unmerged)."""
    return stacked_copy((module,), generation_copy, copies, layouts) or \
        (base_layer(module) if mergeable_deltas(module) == [] else module)


def projections(modules, sizes, generation_copy, copies, stacked=True, layouts=None):
    """x -> the outputs (of `sizes`) of projections that read one input: one GEMM over a stacked copy split into
    views, else each module in turn (`projection`; one already fused module's output split)."""
    linear = stacked_copy(modules, generation_copy, copies, layouts) if stacked else None
    if linear is not None:
        return lambda x: linear(x).split(sizes, -1)
    calls = [projection(module, generation_copy, copies, layouts) for module in modules]
    if len(calls) == len(sizes):
        return lambda x: tuple(call(x) for call in calls)
    return lambda x: calls[0](x).split(sizes, -1)


def linear_in_copy_dtype(x, weight, bias, layout=(None,)):
    """F.linear in the copy's dtype, the result in the input's, as a bitsandbytes 4-bit layer computes (its
    embeddings and norms stay float32 while the copy is bf16). layout: a slot holding the copy's `cpu_layout`."""
    return linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype), layout).to(x.dtype)


# ---------------------------------------------------------------- a CPU's weights laid out for its matrix products

CPU_LAYOUT = {"usable": None}   # whether oneDNN's layout is used (None: not yet checked against F.linear)


def laid_out(weight, layouts):
    """A slot for `weight`'s `cpu_layout`, listed in `layouts` for `lay_out` to fill; [None] where layouts is None."""
    slot = [None]
    if layouts is not None:
        layouts.append((weight, slot))
    return slot


def head(module, layouts):
    """The LM head's call: on a CPU its weight in `cpu_layout`, unless hooks are registered on it; else the module."""
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
    """`weight` [out, in] in oneDNN's blocked format for products of ~`rows` rows (1.3-2.2x faster: BENCHMARKS.md),
    or None where not possible (no oneDNN, not a CPU float32 / bf16) or unequal to F.linear (said once)."""
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
