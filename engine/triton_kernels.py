"""The decode step's fused operations as Triton kernels (engine/ops.py registers them as torch custom ops on CUDA and
checks each against its PyTorch reference before a bucket runs it; a CPU runs them only under TRITON_INTERPRET=1,
in the tests). Paper Algorithm 1, line 1: one token for every rollout, at the speed the GPU's memory allows.

Each function here takes and returns what its reference in engine/step.py does (ops.TENSOR_REFERENCE) and
launches one kernel, except decode_attention: one pass split over the columns, then one combining the splits
(flash-decoding). Elementwise results are rounded to the tensors' dtype after each operation, as PyTorch rounds
them, so bf16 outputs match the reference's bit for bit or to one rounding.
Simplifications: the cache's last dimension and the projections' outputs are contiguous; one query per row.
"""

import os

import torch
import triton
import triton.language as tl

import engine.gpu_paths as gpu_paths


def interpreting():
    """Triton's interpreter is on (TRITON_INTERPRET=1): the kernels run on CPU tensors (engine/ops.py's check)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


BLOCK_N = 64        # cache columns per step of the attention's loop (32 for float32 caches: shared memory)
BLOCK_V = 4096      # vocabulary entries per step of the sampler's loops
PROGRAMS_PER_SM = 4  # attention splits: enough (row, KV head, split) programs to fill the GPU at small batches


def pow2(n, floor=1):
    return max(triton.next_power_of_2(int(n)), floor)


def dot_in_fp32(tensor):
    """fp32 operands for tl.dot (ieee, not TF32) in fp32 models, and under the interpreter, which holds bf16 as
    integers (its bf16 dot is wrong, its casts to bf16 truncate); bf16 / fp16 operands go to the tensor cores."""
    return tensor.dtype == torch.float32 or interpreting()


# ------------------------------------------------------------------------- residual add + RMSNorm

@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, columns, eps,
                  HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < columns
    hidden = tl.load(residual_ptr + row * residual_stride + offsets, mask=inside, other=0.0)
    if HAS_X:
        added = tl.load(x_ptr + row * x_stride + offsets, mask=inside, other=0.0)
        hidden = (hidden.to(tl.float32) + added.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * residual_stride + offsets, hidden, mask=inside)
    value = hidden.to(tl.float32)
    normed = value * tl.rsqrt(tl.sum(value * value, axis=0) / columns + eps)
    normed = normed.to(residual_ptr.dtype.element_ty).to(tl.float32)   # HF: back to the input dtype, then * weight
    weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offsets, (weight * normed).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x, residual, weight, eps):
    columns = residual.shape[-1]
    rows = residual.view(-1, columns)   # the residual stream is one buffer: updated in place
    added = rows if x is None else x.reshape(-1, columns)
    out = torch.empty(residual.shape, dtype=torch.promote_types(weight.dtype, residual.dtype), device=residual.device)
    block = pow2(columns)
    _add_rms_norm[(rows.shape[0],)](added, rows, weight, out, added.stride(0), rows.stride(0), columns, columns, eps,
                                    HAS_X=x is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out


# ------------------------------------------------------------------------- rotary + KV-cache write

@triton.jit
def _rotate_heads(source, destination, source_head, destination_head, heads, cos_ptr, sin_ptr,
                  HEAD_DIM: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """destination = source * cos + rotate_half(source) * sin for `heads` heads at once, each product and the sum
    rounded to the destination's dtype (as PyTorch computes it in that dtype); dims past the rotary ones (Phi-3
    may rotate part of a head) are copied."""
    head, half = tl.arange(0, BLOCK_H)[:, None], tl.arange(0, BLOCK_HALF)[None, :]
    inside = (head < heads) & (half < ROTARY_HALF)
    dtype = destination.dtype.element_ty
    source_at, destination_at = source + head * source_head + half, destination + head * destination_head + half
    first = tl.load(source_at, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(source_at + ROTARY_HALF, mask=inside, other=0.0).to(tl.float32)
    cos_first = tl.load(cos_ptr + half, mask=half < ROTARY_HALF, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + ROTARY_HALF + half, mask=half < ROTARY_HALF, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + half, mask=half < ROTARY_HALF, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + ROTARY_HALF + half, mask=half < ROTARY_HALF, other=0.0).to(tl.float32)
    out_first = (first * cos_first).to(dtype).to(tl.float32) + (-second * sin_first).to(dtype).to(tl.float32)
    out_second = (second * cos_second).to(dtype).to(tl.float32) + (first * sin_second).to(dtype).to(tl.float32)
    tl.store(destination_at, out_first.to(dtype), mask=inside)
    tl.store(destination_at + ROTARY_HALF, out_second.to(dtype), mask=inside)
    dims = tl.arange(0, BLOCK_D)[None, :]
    kept = (head < heads) & (dims >= 2 * ROTARY_HALF) & (dims < HEAD_DIM)
    tl.store(destination + head * destination_head + dims,
             tl.load(source + head * source_head + dims, mask=kept, other=0.0), mask=kept)


@triton.jit
def _rotary_cache_write(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, key_ptr, value_ptr, slots_ptr,
                        tokens, q_heads, kv_heads, q_row, q_token, k_row, k_token, v_row, v_token, cos_row,
                        cos_token, sin_row, sin_token, key_row, key_head, key_column, value_row, value_head,
                        value_column, HEAD_DIM: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                        BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row * tokens + token, part): part 0 rotates q's heads into q_out [B, Hq, T, hd], part 1 k's into
    the key cache at the token's slot, part 2 copies v's into the value cache."""
    position, part = tl.program_id(0), tl.program_id(1)
    row, token = (position // tokens).to(tl.int64), position % tokens
    slot = tl.load(slots_ptr + token)
    cos_at, sin_at = cos_ptr + row * cos_row + token * cos_token, sin_ptr + row * sin_row + token * sin_token
    if part == 0:
        _rotate_heads(q_ptr + row * q_row + token * q_token, q_out_ptr + (row * q_heads * tokens + token) * HEAD_DIM,
                      HEAD_DIM, tokens * HEAD_DIM, q_heads, cos_at, sin_at, HEAD_DIM, ROTARY_HALF, BLOCK_HQ,
                      BLOCK_HALF, BLOCK_D)
    elif part == 1:
        _rotate_heads(k_ptr + row * k_row + token * k_token, key_ptr + row * key_row + slot * key_column, HEAD_DIM,
                      key_head, kv_heads, cos_at, sin_at, HEAD_DIM, ROTARY_HALF, BLOCK_HKV, BLOCK_HALF, BLOCK_D)
    else:
        head, dims = tl.arange(0, BLOCK_HKV)[:, None], tl.arange(0, BLOCK_D)[None, :]
        inside = (head < kv_heads) & (dims < HEAD_DIM)
        values = tl.load(v_ptr + row * v_row + token * v_token + head * HEAD_DIM + dims, mask=inside, other=0.0)
        tl.store(value_ptr + row * value_row + head * value_head + slot * value_column + dims, values, mask=inside)


def rotary_cache_write(q, k, v, cos, sin, key_cache, value_cache, slots):
    batch, tokens, head_dim = q.shape[0], q.shape[1], key_cache.shape[-1]
    q_heads, kv_heads = q.shape[2] // head_dim, key_cache.shape[1]
    if not all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, key_cache, value_cache)):
        raise ValueError("rotary_cache_write needs contiguous last dimensions")
    q_out = torch.empty(batch, q_heads, tokens, head_dim, dtype=q.dtype, device=q.device)
    _rotary_cache_write[(batch * tokens, 3)](
        q, k, v, cos, sin, q_out, key_cache, value_cache, slots, tokens, q_heads, kv_heads, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), cos.stride(1), sin.stride(0),
        sin.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
        value_cache.stride(1), value_cache.stride(2), HEAD_DIM=head_dim, ROTARY_HALF=cos.shape[-1] // 2,
        BLOCK_HQ=pow2(q_heads), BLOCK_HKV=pow2(kv_heads), BLOCK_HALF=pow2(cos.shape[-1] // 2),
        BLOCK_D=pow2(head_dim), num_warps=4)
    return q_out


# ------------------------------------------------------------------------- decode attention (split over columns)

@triton.jit
def _attend_block(first, q, best, total, acc, key_ptr, value_ptr, row, kv_head, start, shared, high, key_row,
                  key_head, key_column, value_row, value_head, value_column, scaling, dims, in_dims,
                  BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    """One block of columns from `first` into the online softmax (best: running maximum, total: running sum of
    exp(score - best), acc: running sum of probabilities x values, per query head)."""
    columns = first + tl.arange(0, BLOCK_N)
    in_prefix = columns < shared
    readable = (in_prefix | (columns >= start)) & (columns < high)
    source_row = tl.where(in_prefix, 0, row).to(tl.int64)   # 64-bit offsets: a cache may pass 2**31 elements
    where = readable[:, None] & in_dims[None, :]
    keys = tl.load(key_ptr + source_row[:, None] * key_row + kv_head * key_head + columns[:, None] * key_column
                   + dims[None, :], mask=where, other=0.0)
    if DOT_FP32:
        scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys))
    scores = tl.where(readable[None, :], scores * scaling, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    safe = tl.where(new_best == float("-inf"), 0.0, new_best)   # nothing readable yet: no NaN
    probs = tl.exp(scores - safe[:, None])
    rescale = tl.exp(best - safe)
    values = tl.load(value_ptr + source_row[:, None] * value_row + kv_head * value_head
                     + columns[:, None] * value_column + dims[None, :], mask=where, other=0.0)
    if DOT_FP32:
        acc = acc * rescale[:, None] + tl.dot(probs, values.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values)
    return new_best, total * rescale + tl.sum(probs, 1), acc


@triton.jit
def _attention_split(q_ptr, key_ptr, value_ptr, start_ptr, shared_ptr, slot_ptr, out_ptr, part_ptr, max_ptr,
                     sum_ptr, q_row, q_head, key_row, key_head, key_column, value_row, value_head, value_column,
                     scaling, q_heads, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
                     WHILE_LOOP: tl.constexpr):
    """Program (row, KV head, split): the GROUP query heads of one KV head over 1/SPLITS of the columns written so
    far. Readable: [0, shared) from row 0 (the prefix every row holds: read once, from one place) and
    [start[row], slot] of the row's own. Online softmax in float32; one split writes the output itself.
    WHILE_LOOP: the interpreter's loop (its range() cannot take bounds loaded from memory)."""
    row, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    group, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    in_group, in_dims = group < GROUP, dims < HEAD_DIM
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + row * q_row + heads[:, None] * q_head + dims[None, :],
                mask=in_group[:, None] & in_dims[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    shared, start, end = tl.load(shared_ptr), tl.load(start_ptr + row), tl.load(slot_ptr) + 1
    per_split = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    low = split * per_split
    high = tl.minimum(low + per_split, end)
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if WHILE_LOOP:
        first = low
        while first < high:
            best, total, acc = _attend_block(first, q, best, total, acc, key_ptr, value_ptr, row, kv_head, start,
                                             shared, high, key_row, key_head, key_column, value_row, value_head,
                                             value_column, scaling, dims, in_dims, BLOCK_N, DOT_FP32)
            first += BLOCK_N
    else:
        for first in range(low, high, BLOCK_N):
            best, total, acc = _attend_block(first, q, best, total, acc, key_ptr, value_ptr, row, kv_head, start,
                                             shared, high, key_row, key_head, key_column, value_row, value_head,
                                             value_column, scaling, dims, in_dims, BLOCK_N, DOT_FP32)
    if SPLITS == 1:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row * q_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None] & in_dims[None, :])
    else:
        index = (row * q_heads + heads) * SPLITS + split
        tl.store(part_ptr + index[:, None] * HEAD_DIM + dims[None, :], acc, mask=in_group[:, None] & in_dims[None, :])
        tl.store(max_ptr + index, best, mask=in_group)
        tl.store(sum_ptr + index, total, mask=in_group)


@triton.jit
def _attention_combine(out_ptr, part_ptr, max_ptr, sum_ptr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Program (row * q_heads + head): the splits' partial sums rescaled to their common maximum and normalised."""
    index = tl.program_id(0)
    splits, dims = tl.arange(0, SPLITS), tl.arange(0, BLOCK_D)
    best = tl.load(max_ptr + index * SPLITS + splits)
    overall = tl.max(best, 0)
    weight = tl.exp(best - tl.where(overall == float("-inf"), 0.0, overall))
    total = tl.sum(tl.load(sum_ptr + index * SPLITS + splits) * weight, 0)
    parts = tl.load(part_ptr + (index * SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=dims[None, :] < HEAD_DIM, other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + index * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def attention_splits(rows, kv_heads, columns, multiprocessors):
    """Splits per (row, KV head): enough programs for every SM (`multiprocessors` of them) at small batches, each
    split >= one block; multiprocessors None (the interpreter on a CPU): two, so the combining kernel runs too."""
    programs = 2 * rows * kv_heads if multiprocessors is None else PROGRAMS_PER_SM * multiprocessors
    most = max(columns // BLOCK_N, 1)
    return min(pow2(max(programs // (rows * kv_heads), 1)), pow2(most) // 2 if most > 1 else 1, 16)


def decode_attention(q, key_cache, value_cache, start, shared, slot, scaling, splits=None):
    batch, q_heads, _, head_dim = q.shape
    kv_heads, columns = key_cache.shape[1], key_cache.shape[2]
    if q.shape[2] != 1 or not all(t.stride(-1) == 1 for t in (q, key_cache, value_cache)):
        raise ValueError("decode_attention takes one query per row and contiguous last dimensions")
    block = BLOCK_N if q.element_size() < 4 else BLOCK_N // 2
    splits = splits or attention_splits(batch, kv_heads, columns, gpu_paths.multiprocessors(q.device))
    out = torch.empty(batch, 1, q_heads * head_dim, dtype=q.dtype, device=q.device)
    partial = torch.empty(batch * q_heads * splits, head_dim if splits > 1 else 1, dtype=torch.float32,
                          device=q.device)
    maxima, sums = (torch.empty(batch * q_heads * splits, dtype=torch.float32, device=q.device) for _ in range(2))
    group = q_heads // kv_heads
    _attention_split[(batch, kv_heads, splits)](
        q, key_cache, value_cache, start, shared, slot, out, partial, maxima, sums, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), scaling, q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_G=pow2(group, 16),
        BLOCK_D=pow2(head_dim, 16), BLOCK_N=block, SPLITS=splits, DOT_FP32=dot_in_fp32(q),
        WHILE_LOOP=interpreting(), num_warps=4)
    if splits > 1:
        _attention_combine[(batch * q_heads,)](out, partial, maxima, sums, HEAD_DIM=head_dim, SPLITS=splits,
                                               BLOCK_D=pow2(head_dim), num_warps=1)
    return out


# ------------------------------------------------------------------------- SiLU(gate) * up

@triton.jit
def _silu_mul(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, columns, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < columns
    gate = tl.load(gate_ptr + row * gate_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * columns + offsets, (activated * up).to(dtype), mask=inside)


def act_mul(gate, up):
    columns = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, columns), up.reshape(-1, columns)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(pow2(columns), 2048)
    _silu_mul[(gate_rows.shape[0], triton.cdiv(columns, block))](gate_rows, up_rows, out, gate_rows.stride(0),
                                                                 up_rows.stride(0), columns, BLOCK=block,
                                                                 num_warps=4)
    return out


# ------------------------------------------------------------------------- token choice and the step's bookkeeping

@triton.jit
def _finish_step(logits_ptr, temperature_ptr, draws_ptr, step_ptr, stop_at_ptr, eos_ptr, pad_ptr, done_ptr, out_ptr,
                 logprobs_ptr, tokens_ptr, positions_ptr, logits_row, draws_row, out_row, logprobs_row, eos_count,
                 VOCAB: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (row): pass 1, the maximum and the sum of exp(logits / T - max) (online), and the argmax; pass 2
    (sampling), the first token whose running sum reaches the row's draw x the sum (inverse CDF). Then EOS forced
    or pad for a finished row, the token and its log-prob written to column `step`, done, next input, position."""
    row = tl.program_id(0)
    step = tl.load(step_ptr)
    temperature = tl.load(temperature_ptr) if SAMPLE else 1.0   # greedy: log-probs at T = 1
    offsets = tl.arange(0, BLOCK_V)
    best = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    argmax = tl.zeros([], tl.int64)
    for first in range(0, VOCAB, BLOCK_V):
        inside = first + offsets < VOCAB
        scaled = tl.load(logits_ptr + row * logits_row + first + offsets, mask=inside,
                         other=float("-inf")).to(tl.float32) / temperature
        block_best = tl.max(scaled, 0)
        argmax = tl.where(block_best > best, first + tl.argmax(scaled, 0).to(tl.int64), argmax)
        new_best = tl.maximum(best, block_best)
        total = total * tl.exp(best - new_best) + tl.sum(tl.exp(scaled - new_best), 0)
        best = new_best
    token = argmax
    if SAMPLE:
        target = tl.load(draws_ptr + row * draws_row + step) * total
        carry = tl.zeros([], tl.float32)
        found = tl.zeros([], tl.int64) - 1
        last = tl.zeros([], tl.int64)
        for first in range(0, VOCAB, BLOCK_V):
            inside = first + offsets < VOCAB
            scaled = tl.load(logits_ptr + row * logits_row + first + offsets, mask=inside,
                             other=float("-inf")).to(tl.float32) / temperature
            probs = tl.exp(scaled - best)
            running = tl.cumsum(probs, 0) + carry
            index = (first + offsets).to(tl.int64)
            hit = tl.min(tl.where((running >= target) & inside, index, VOCAB), 0)
            found = tl.where((found < 0) & (hit < VOCAB), hit, found)
            last = tl.maximum(last, tl.max(tl.where((probs > 0) & inside, index, 0), 0))
            carry += tl.sum(probs, 0)
        token = tl.where(found >= 0, found, last)   # past the last token by rounding: the last one possible
    done = tl.load(done_ptr + row) != 0
    token = tl.where(tl.load(stop_at_ptr + row) == step, tl.load(eos_ptr), token)
    token = tl.where(done, tl.load(pad_ptr), token)
    chosen = tl.load(logits_ptr + row * logits_row + token).to(tl.float32) / temperature
    logprob = tl.where(done, 0.0, chosen - best - tl.log(total))
    tl.store(out_ptr + row * out_row + step, token)
    tl.store(logprobs_ptr + row * logprobs_row + step, logprob)
    eos = tl.load(eos_ptr + tl.arange(0, BLOCK_E), mask=tl.arange(0, BLOCK_E) < eos_count, other=-1)
    tl.store(done_ptr + row, done | (tl.sum((eos == token).to(tl.int32), 0) > 0))
    tl.store(tokens_ptr + row, token)
    tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)


def finish_step(logits, temperature, draws, step, stop_at, eos, pad, done, out, logprobs, tokens, positions, sample):
    if logits.stride(-1) != 1:
        raise ValueError("finish_step needs logits contiguous over the vocabulary")
    vocab = logits.shape[-1]
    _finish_step[(logits.shape[0],)](logits, temperature, draws, step, stop_at, eos, pad, done, out, logprobs, tokens,
                                     positions, logits.stride(0), draws.stride(0), out.stride(0), logprobs.stride(0),
                                     eos.numel(), VOCAB=vocab, SAMPLE=bool(sample), BLOCK_V=min(pow2(vocab), BLOCK_V),
                                     BLOCK_E=pow2(eos.numel()), num_warps=8)
