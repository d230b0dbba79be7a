"""The decode step's fused operations, each checked against its plain PyTorch reference before it runs.

Paper Algorithm 1, line 1: sampling must be cheap next to the update. engine/step.py calls five operations through
a `Kernels` record; each is written once in plain PyTorch there (the reference: what a CPU runs, and what every
other implementation is checked against) and, on CUDA, as one Triton kernel (engine/triton_kernels.py) behind a
torch custom op, so that a recorded step launches one kernel where the reference launches several:

  add_rms_norm        residual += x, then RMSNorm of it (Hugging Face's formula)      reference: ~9 kernels
  rotary_cache_write  rotary on q and k; k and v written into the cache column        ~12
  decode_attention    one query per row over the columns it may read (no mask tensor: [0, shared) from row 0,
                      the prefix every row holds, and [start, slot] of its own), grouped query heads, split over
                      columns, then the splits combined: 2 kernels                    SDPA under a mask, ~5
  act_mul             silu(gate) * up                                                 2
  finish_step         the token (argmax or inverse CDF of softmax(logits / T)), its log-prob, EOS bookkeeping,
                      the row's next input and position                               ~25

Which run: the references by default on a CPU; on CUDA with triton importable, the fused ops, each first compared
with its reference on random inputs of every bucket's shapes (`check`, before a bucket's step is recorded): an op
that disagrees or raises is replaced by its reference for the rest of the process, with one warning line. The
top-p nucleus (a sort) and activations other than SiLU always run the reference. `engine.decode.KERNELS` (the
PODS_DECODE_KERNELS environment variable) forces one set: "reference" (the step as plain PyTorch, separate
projections included) or "fused" (the custom ops on any device; a CPU runs each one's reference behind the op, or
its Triton kernel under TRITON_INTERPRET=1).
"""

import copy
import functools
import importlib.util
import os
import warnings
from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

import engine.gpu_paths as gpu_paths
from engine.step import Bounds, Kernels, add_rms_norm, decode_attention, finish_step, rotary_cache_write

OPS = ("add_rms_norm", "rotary_cache_write", "decode_attention", "act_mul", "finish_step")
# Largest |fused - reference| allowed, relative to the largest |reference| value, by dtype: one or two roundings of
# the dtype (bf16 keeps 8 bits); a wrong column, sign or scale is off by far more.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DISABLED = {}   # op name -> why its fused version is off for this process (check failed)


# ------------------------------------------------------------------------- the fused ops (torch custom ops)

def interpreting():
    """Triton's interpreter is on (TRITON_INTERPRET=1) and triton importable: its kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


@functools.cache
def triton_available():
    return importlib.util.find_spec("triton") is not None


def implementation(name, device):
    """What custom op `name` runs on `device`: its Triton kernel on CUDA (or on a CPU under the interpreter),
    else its reference on tensors (TENSOR_REFERENCE)."""
    if device.type == "cuda" or interpreting():
        import engine.triton_kernels as triton_kernels

        return getattr(triton_kernels, name)
    return TENSOR_REFERENCE[name]


def _state_view(temperature, draws, step, stop_at, eos, pad, done, out, logprobs, tokens, positions, sample):
    """The fields finish_step reads and writes, from the custom op's tensors."""
    scalars = dict(temperature=temperature, step=step, eos=eos, pad=pad)
    return SimpleNamespace(scalars=scalars, draws=draws, stop_at=stop_at, done=done, out=out, logprobs=logprobs,
                           tokens=tokens, positions=positions, sample=sample, nucleus=False)


def _reference_finish(logits, temperature, draws, step, stop_at, eos, pad, done, out, logprobs, tokens, positions,
                      sample):
    finish_step(logits, _state_view(temperature, draws, step, stop_at, eos, pad, done, out, logprobs, tokens,
                                    positions, sample))


def hf_rms_norm(hidden, weight, eps):
    """transformers' LlamaRMSNorm (Qwen2, Mistral and Phi-3 copy it): float32 statistics, weight * normed."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def _reference_attention(q, key_cache, value_cache, start, shared, slot, scaling):
    return decode_attention(q, key_cache, value_cache, Bounds(start, shared, slot, scaling, key_cache.shape[2]))


TENSOR_REFERENCE = {
    "add_rms_norm": lambda x, residual, weight, eps: add_rms_norm(
        x, residual, functools.partial(hf_rms_norm, weight=weight, eps=eps)),
    "rotary_cache_write": rotary_cache_write,
    "decode_attention": _reference_attention,
    "act_mul": lambda gate, up: F.silu(gate) * up,
    "finish_step": _reference_finish,
}


def _fake_like_rotated_q(q, k, v, cos, sin, key_cache, value_cache, slots):
    return q.new_empty(q.shape[0], q.shape[2] // key_cache.shape[-1], q.shape[1], key_cache.shape[-1])


@torch.library.custom_op("pods::add_rms_norm", mutates_args=("residual",))
def add_rms_norm_op(x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    return implementation("add_rms_norm", residual.device)(x, residual, weight, eps)


@torch.library.custom_op("pods::rotary_cache_write", mutates_args=("key_cache", "value_cache"))
def rotary_cache_write_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return implementation("rotary_cache_write", q.device)(q, k, v, cos, sin, key_cache, value_cache,
                                                           slots).contiguous()


@torch.library.custom_op("pods::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, start: torch.Tensor,
                        shared: torch.Tensor, slot: torch.Tensor, scaling: float) -> torch.Tensor:
    return implementation("decode_attention", q.device)(q, key_cache, value_cache, start, shared, slot, scaling)


@torch.library.custom_op("pods::silu_mul", mutates_args=())
def silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return implementation("act_mul", gate.device)(gate, up)


@torch.library.custom_op("pods::finish_step", mutates_args=("done", "out", "logprobs", "tokens", "positions"))
def finish_step_op(logits: torch.Tensor, temperature: torch.Tensor, draws: torch.Tensor, step: torch.Tensor,
                   stop_at: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor, done: torch.Tensor,
                   out: torch.Tensor, logprobs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   sample: bool) -> None:
    implementation("finish_step", logits.device)(logits, temperature, draws, step, stop_at, eos, pad, done, out,
                                                 logprobs, tokens, positions, sample)


# Shapes for torch.compile (the ops are opaque to it).
add_rms_norm_op.register_fake(lambda x, residual, weight, eps: residual.new_empty(
    residual.shape, dtype=torch.promote_types(weight.dtype, residual.dtype)))
rotary_cache_write_op.register_fake(_fake_like_rotated_q)
decode_attention_op.register_fake(lambda q, key_cache, value_cache, start, shared, slot, scaling: q.new_empty(
    q.shape[0], 1, q.shape[1] * q.shape[3]))
silu_mul_op.register_fake(lambda gate, up: gate.new_empty(gate.shape))
finish_step_op.register_fake(lambda *args: None)


# ------------------------------------------------------------------------- the sets a step calls

def fused_add_rms_norm(x, residual, norm):
    return add_rms_norm_op(x, residual, norm.weight, norm.variance_epsilon)


def fused_decode_attention(q, key_cache, value_cache, bounds):
    return decode_attention_op(q, key_cache, value_cache, bounds.start, bounds.shared, bounds.slot, bounds.scaling)


SILU = ("SiLU", "SiLUActivation")   # torch's module and transformers' (F.silu): the activations fused


def fused_act_mul(gate, up, act):
    return silu_mul_op(gate, up) if type(act).__name__ in SILU else act(gate) * up


def fused_finish_step(logits, state):
    if state.nucleus:   # top-p needs a sort: the reference's
        return finish_step(logits, state)
    scalars = state.scalars
    finish_step_op(logits, scalars["temperature"], state.draws, scalars["step"], state.stop_at, scalars["eos"],
                   scalars["pad"], state.done, state.out, state.logprobs, state.tokens, state.positions, state.sample)


FUSED_CALLS = {"add_rms_norm": fused_add_rms_norm, "rotary_cache_write": rotary_cache_write_op,
               "decode_attention": fused_decode_attention, "act_mul": fused_act_mul,
               "finish_step": fused_finish_step}
REFERENCE = Kernels(stacked=False)   # the plain-PyTorch step (what every fused op is checked against)


def with_fused(names):
    """The Kernels running `names` fused and the rest as their reference."""
    names = frozenset(names)
    return replace(Kernels(), fused=names, **{name: FUSED_CALLS[name] for name in names})


def kernels_for(device, mode=None):
    """mode None: on CUDA (or an emulated GPU: engine/gpu_paths.py) with triton importable every op fused but those
    DISABLED, else the reference ops (with stacked projections); "reference": REFERENCE; "fused": every op fused but
    those DISABLED, on any device."""
    if mode not in (None, "reference", "fused"):
        raise ValueError(f"PODS_DECODE_KERNELS (engine.decode.KERNELS) must be unset, 'reference' or 'fused', "
                         f"got {mode!r}")
    if mode == "reference":
        return REFERENCE
    if mode is None and not (device.type in gpu_paths.DEVICE_TYPES and triton_available()):
        return Kernels()   # the plain step, projections stacked (a CPU; a GPU without triton)
    return with_fused(set(OPS) - set(DISABLED))


# ------------------------------------------------------------------------- the run-time check

def check(dec, state, seed=0):
    """Each fused op of dec.kernels against its reference on random inputs of `state`'s shapes (one bucket: rows,
    cache length, sampling mode), before anything runs it there. An op that disagrees beyond TOLERANCE, or
    raises, is DISABLED for the rest of the process with one warning line. Returns the names disabled."""
    generator = torch.Generator().manual_seed(seed)
    failed = []
    for name in sorted(dec.kernels.fused):
        try:
            detail = CHECKS[name](dec, state, generator)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run here is a failed check
            detail = f"raised {type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if detail:
            DISABLED[name] = detail
            failed.append(name)
            warnings.warn(f"decode engine: the fused {name} {detail}; it runs as plain PyTorch from now on")
    return failed


def random(generator, shape, dtype, device, scale=1.0):
    """Normal noise drawn on `device` (a GPU draws a bucket's caches and logits in no time), seeded from `generator`
    (a device without generators, such as a stand-in's, draws unseeded)."""
    seed = int(torch.randint(2 ** 62, (), generator=generator))
    on_device = torch.Generator(device=device).manual_seed(seed) if device.type in ("cpu", "cuda") else None
    return (torch.randn(shape, generator=on_device, device=device) * scale).to(dtype)


def differs(what, got, want, dtype):
    """None if got equals want within TOLERANCE[dtype] of want's largest |value|, else how they differ."""
    if got.shape != want.shape:
        return f"gives {what} of shape {tuple(got.shape)}, not {tuple(want.shape)}"
    error = float((got.double() - want.double()).abs().max())
    scale = max(float(want.double().abs().max()), 1e-6)
    if not error <= TOLERANCE[dtype] * scale:   # NaN fails too
        return f"differs from the reference in {what} by up to {error:.3g} (values up to {scale:.3g})"
    return None


def check_add_rms_norm(dec, state, generator):
    """The first layer's norm with a random weight (a new model's are ones: a dropped weight would pass)."""
    norm, dtype, device = copy.deepcopy(dec.layers[0].input_norm), dec.embed.weight.dtype, state.tokens.device
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
    shape = (len(state.tokens), 1, norm.weight.shape[0])
    x, residual = random(generator, shape, dtype, device), random(generator, shape, dtype, device, 4.0)
    fused, plain = residual.clone(), residual.clone()
    return (differs("the norm of the first layer", FUSED_CALLS["add_rms_norm"](None, fused, norm), norm(plain), dtype)
            or differs("the normed sum", FUSED_CALLS["add_rms_norm"](x, fused, norm), add_rms_norm(x, plain, norm),
                       dtype)
            or differs("the residual stream", fused, plain, dtype))


def check_rotary_cache_write(dec, state, generator):
    (rows, kv_heads, length, head_dim), dtype, device = state.keys[0].shape, state.keys[0].dtype, state.tokens.device
    projected = random(generator, (rows, 1, (dec.num_heads + 2 * kv_heads) * head_dim), dtype, device)
    q, k, v = projected.split([dec.num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    cos, sin = dec.rotary(projected, torch.randint(0, 4 * length, (rows, 1), generator=generator).to(device))
    slots = torch.randint(0, length, (1,), generator=generator).to(device)
    fused = [random(generator, state.keys[0].shape, dtype, device) for _ in range(2)]
    plain = [cache.clone() for cache in fused]
    got = FUSED_CALLS["rotary_cache_write"](q, k, v, cos, sin, *fused, slots)
    return (differs("q", got, rotary_cache_write(q, k, v, cos, sin, *plain, slots), dtype)
            or differs("the keys cached", fused[0], plain[0], dtype)
            or differs("the values cached", fused[1], plain[1], dtype))


def check_decode_attention(dec, state, generator):
    """Random queries and cache (numbers), then probes (which columns): a few columns around each boundary (the
    shared prefix's end, each row's start, the slot) get keys aligned with the query and their own values, so
    reading one column too many or too few moves the output by O(1)."""
    (rows, kv_heads, length, head_dim), dtype, device = state.keys[0].shape, state.keys[0].dtype, state.tokens.device
    for probe in (False, True):
        q = random(generator, (rows, dec.num_heads, 1, head_dim), dtype, device)
        keys, values = (random(generator, state.keys[0].shape, dtype, device, 2.0) for _ in range(2))
        shared = int(torch.randint(0, length // 4 + 1, (1,), generator=generator))
        slot = length - 1 if probe else int(torch.randint(max(shared, length // 2), length, (1,), generator=generator))
        start = torch.randint(shared, slot + 1, (rows,), generator=generator)
        start[-1] = slot   # a row that reads one column of its own
        if probe:
            q = torch.zeros_like(q)
            q[..., 0] = 1
            keys = keys * 0.01
            columns = torch.arange(length)
            near = lambda edges: ((columns[None] - edges[:, None]).abs() <= 1)   # noqa: E731
            probed = (near(start) | near(torch.tensor([shared, slot])).any(0)).to(device)   # [rows, length]
            keys[..., 0] = torch.where(probed[:, None], 20 / dec.scaling, keys[..., 0].float()).to(dtype)
        for cache in (keys, values):
            cache[:, :, :shared] = cache[:1, :, :shared]   # the prefix, the same in every row
        bounds = [Bounds(start.to(device), torch.tensor([shared], device=device), torch.tensor([slot], device=device),
                         dec.scaling, length) for _ in range(2)]
        detail = differs("the attention output" + (" (column probes)" if probe else ""),
                         FUSED_CALLS["decode_attention"](q, keys, values, bounds[0]),
                         decode_attention(q, keys, values, bounds[1]), dtype)
        if detail:
            return detail
    return None


def check_act_mul(dec, state, generator):
    dtype, device, shape = dec.embed.weight.dtype, state.tokens.device, (len(state.tokens), 1, dec.intermediate_size)
    gate, up = random(generator, shape, dtype, device, 3.0), random(generator, shape, dtype, device)
    act = dec.layers[0].act
    return differs("act(gate) * up", FUSED_CALLS["act_mul"](gate, up, act), act(gate) * up, dtype)


def check_finish_step(dec, state, generator):
    """Random logits (peaked, as a trained model's), rows forced to EOS and rows already done: the fused op's token
    must be the argmax (greedy) or lie where the inverse CDF puts the row's draw (sampled; float64 CDF, up to
    float32 rounding), with the reference's log-prob, and the bookkeeping must follow from it."""
    if state.nucleus:
        return None   # the fused op runs the reference there
    rows, length, device = len(state.tokens), state.out.shape[1], state.tokens.device
    head = getattr(dec.lm_head, "weight", dec.embed.weight)
    vocab, dtype = head.shape[0], head.dtype
    logits = random(generator, (rows, vocab), dtype, device, 5.0)
    step = torch.randint(0, length, (1,), generator=generator).to(device)
    eos = torch.full((len(state.scalars["eos"]),), -1, device=device)
    eos[:2] = torch.stack([logits[0].float().argmax(), torch.randint(0, vocab, (), generator=generator).to(device)])
    done = (torch.rand(rows, generator=generator) < 0.25).to(device)
    forced = (torch.rand(rows, generator=generator) < 0.25).to(device)
    temperature = 0.7 if state.sample else 1e-6
    before = dict(draws=torch.rand(rows, length, generator=generator).clamp(2 ** -24, 1 - 2 ** -24).to(device),
                  stop_at=torch.where(forced, step, 2 ** 62), done=done,
                  logprobs=torch.zeros(rows, length, device=device),
                  out=torch.zeros(rows, length, dtype=torch.long, device=device),
                  tokens=torch.zeros(rows, dtype=torch.long, device=device),
                  positions=torch.randint(0, length, (rows,), generator=generator).to(device))
    after = SimpleNamespace(sample=state.sample, nucleus=False, **{name: value.clone() for name, value in
                                                                    before.items()}, scalars=dict(
        temperature=torch.tensor(temperature, device=device), step=step, eos=eos, pad=torch.tensor(vocab - 1,
                                                                                                   device=device)))
    FUSED_CALLS["finish_step"](logits, after)
    token = after.out.index_select(1, step)[:, 0]
    scaled = logits.double() / (temperature if state.sample else 1.0)
    free = ~done & ~forced
    if state.sample:
        probs = scaled.softmax(-1)
        cdf = probs.cumsum(-1)
        target = before["draws"].index_select(1, step)[:, 0].double() * cdf[:, -1]
        low = torch.where(token > 0, cdf.gather(-1, (token - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        chosen = (probs.gather(-1, token[:, None])[:, 0] > 0) & (low - 1e-5 <= target) & \
            (target <= cdf.gather(-1, token[:, None])[:, 0] + 1e-5)
    else:
        chosen = scaled.gather(-1, token[:, None])[:, 0] == scaled.max(-1).values
    if not bool(chosen[free].all()):
        return f"chooses tokens the {'inverse CDF' if state.sample else 'argmax'} would not " \
               f"({int((~chosen[free]).sum())} of {int(free.sum())} rows)"
    want_token = torch.where(done, vocab - 1, torch.where(forced, eos[0], token))
    want = dict(out=before["out"].index_copy(1, step, want_token[:, None]), done=done | torch.isin(token, eos),
                tokens=want_token, positions=before["positions"] + 1)
    wrong = [name for name, value in want.items() if not torch.equal(getattr(after, name), value)]
    logprob = torch.where(done, 0.0, scaled.gather(-1, token[:, None])[:, 0] - scaled.logsumexp(-1))
    error = float((after.logprobs.index_select(1, step)[:, 0].double() - logprob).abs().max())
    if wrong or not error <= 1e-3 or int(after.logprobs.count_nonzero()) > int((~done).sum()):
        return f"writes {', '.join(wrong) or 'log-probs'} wrongly (log-probs off by up to {error:.3g})"
    return None


CHECKS = {"add_rms_norm": check_add_rms_norm, "rotary_cache_write": check_rotary_cache_write,
          "decode_attention": check_decode_attention, "act_mul": check_act_mul, "finish_step": check_finish_step}
