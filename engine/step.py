"""One decode step of a Llama-family model, written by hand over its Hugging Face modules (engine/decode.py).

Paper Algorithm 1, line 1 (sampling rollouts), at the level of one token: the decoder layers over a preallocated
KV cache (attention by SDPA over the valid positions), the prefill of distinct prompts, and the choice of the next
token (greedy, or softmax(logits / T) within the top-p nucleus, sampled by inverse CDF from a hashed uniform) with its
log-probability under the sampler (what the trainer checks it against).
Everything here works in place on fixed-shape tensors, so the engine can record a step as one CUDA graph.
Simplifications: Llama/Qwen2/Mistral layouts only (pre-norm, rotary, gated MLP); no sliding window.
"""

import torch
import torch.nn.functional as F

from grpo_loss import position_ids_from_mask


def mix32(x):
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values in [0, 2**32); each product
    mod 2**32 is formed from 16-bit halves of the constant, so none overflows int64."""
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
    and a row's draws do not depend on which bucket it runs in."""
    bits = mix32(row_keys ^ mix32(step))
    return ((bits >> 8).float() + 0.5) * 2.0 ** -24   # 24 random bits, in (0, 1): never 0 or 1


def choose_tokens(logits, state):
    """Greedy argmax, or a draw from softmax(logits / T) restricted to the top-p nucleus: the most likely tokens
    whose probabilities before them sum to < top_p (as transformers' TopPLogitsWarper).

    Sampling inverts the CDF with one uniform per row (first token whose cumulative probability reaches it):
    ~4 passes over [rows, vocab], where Gumbel-max would need a keyed hash of every logit (tens of passes)."""
    if not state.sample:
        return logits.argmax(-1)
    logits = logits / state.scalars["temperature"]
    if state.nucleus:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        remove = probs.cumsum(-1) - probs >= state.scalars["top_p"]
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    cdf = logits.softmax(-1).cumsum(-1)
    target = uniform_draws(state.row_keys, state.scalars["step"]) * cdf[:, -1]   # cdf[-1] ~ 1 up to rounding
    # cdf[i-1] < target <= cdf[i] implies p[i] > 0: a token outside the nucleus is never drawn.
    return torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def sampler_logprob(logits, token, state):
    """log p(token) under softmax(logits / T) over the whole vocabulary (before the top-p cut; greedy: T = 1): the
    definition of grpo_loss.token_logprobs, so the trainer can check the sampler token by token. [rows] float32,
    gathered here so no [rows, vocab] tensor outlives the step."""
    scaled = logits / state.scalars["temperature"] if state.sample else logits
    return scaled.gather(-1, token[:, None]).squeeze(-1) - scaled.logsumexp(-1)


def attend(q, keys, values, mask, scaling):
    """q [B, heads, T, hd] over the cache [B, kv_heads, L, hd] where mask [B, 1, T, L] -> [B, T, heads * hd].
    The query heads sharing a KV head (transformers' repeat_kv) act as that head's group * T queries, so the
    cache is read once per KV head and never copied."""
    batch, heads, length, head_dim = q.shape
    grouped_mask = mask.repeat(1, 1, heads // keys.shape[1], 1)   # row g * T + t is query t of head g
    out = F.scaled_dot_product_attention(q.reshape(batch, keys.shape[1], -1, head_dim), keys, values,
                                         attn_mask=grouped_mask, scale=scaling)
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).reshape(batch, length, heads * head_dim)


def attend_shared(q, keys, values, mask, scaling, shared):
    """`attend` where the first `shared` cache columns hold the same keys and values in every row (the prefix all
    prompts start with, prefix.shared_prefix_layout): they are read once, from row 0, as one matrix product for
    every row's queries, and the softmax runs over [prefix | the row's own columns] together. Eager decoding
    only (the prefix length changes from call to call; a recorded graph has fixed shapes)."""
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


def run_layers(dec, hidden, positions, keys, values, slots, mask, shared=0):
    """hidden [B, T, H] through every decoder layer; this input's K/V are written to cache columns `slots` [T].
    shared: the first columns every row shares (`attend_shared`; 0: `attend`)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = dec.rotary(hidden, positions)
    batch, length, _ = hidden.shape
    for (input_norm, *qkv, o, post_norm, gate, up, down, act), layer_keys, layer_values in zip(
            dec.layers, keys, values):
        x = input_norm(hidden)
        q, k, v = (proj(x).view(batch, length, -1, dec.head_dim).transpose(1, 2) for proj in qkv)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        layer_keys.index_copy_(2, slots, k)
        layer_values.index_copy_(2, slots, v)
        hidden = hidden + o(attend_shared(q, layer_keys, layer_values, mask, dec.scaling, shared) if shared else
                            attend(q, layer_keys, layer_values, mask, dec.scaling))
        x = post_norm(hidden)
        hidden = hidden + down(act(gate(x)) * up(x))
    return hidden


def decode_step(dec, state):
    """One token for every row of the bucket, all in place on `state`: the function a CUDA graph records."""
    scalars, length = state.scalars, state.attend_len or state.valid.shape[1]
    state.valid.index_fill_(1, scalars["slot"], True)
    keys, values = ([cache[:, :, :length] for cache in caches] if state.attend_len else caches
                    for caches in (state.keys, state.values))
    hidden = run_layers(dec, dec.embed(state.tokens[:, None]), state.positions[:, None], keys, values,
                        scalars["slot"], state.valid[:, None, None, :length], state.shared_len)
    logits = dec.lm_head(dec.norm(hidden))[:, -1].float()
    token = choose_tokens(logits, state)
    token = torch.where(state.stop_at == scalars["step"], scalars["eos"][0], token)
    token = torch.where(state.done, scalars["pad"], token)
    state.out.index_copy_(1, scalars["step"], token[:, None])
    logprob = torch.where(state.done, 0.0, sampler_logprob(logits, token, state))
    state.logprobs.index_copy_(1, scalars["step"], logprob[:, None])
    state.done |= (token[:, None] == scalars["eos"]).any(-1)
    state.tokens.copy_(token)
    state.positions += 1
    scalars["slot"] += 1
    scalars["step"] += 1


def prefill(dec, prompt_ids, prompt_mask, shared=0):
    """K/V of every prompt but its last token (the first decode step consumes it), [D, kv_heads, W - 1, hd].
    shared: the first `shared` columns hold the same tokens in every row, unpadded (prefix.shared_prefix_layout):
    they run once, as one row, and every prompt's suffix attends to that row's K/V."""
    distinct, length, device = prompt_ids.shape[0], prompt_ids.shape[1] - 1, prompt_ids.device
    if not 0 <= shared <= length or (shared and not bool(prompt_mask[:, :shared].all())):
        raise ValueError(f"a shared prefix of {shared} tokens needs {shared} unpadded columns before the last")
    keys = [torch.zeros(distinct, dec.num_kv_heads, length, dec.head_dim, dtype=dec.embed.weight.dtype,
                        device=device) for _ in range(2 * len(dec.layers))]
    if shared > 0:   # the prefix once, then its K/V broadcast into every prompt's row
        once = [cache[:1, :, :shared].clone() for cache in keys]
        causal = torch.ones(shared, shared, dtype=torch.bool, device=device).tril()
        run_layers(dec, dec.embed(prompt_ids[:1, :shared]), torch.arange(shared, device=device)[None], once[::2],
                   once[1::2], torch.arange(shared, device=device), causal[None, None])
        for cache, prefix in zip(keys, once):
            cache[:, :, :shared] = prefix
    if length > shared:
        mask = prompt_mask[:, :length].bool()
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        # A padding query sees itself, so no softmax row is empty (no NaN); no real query sees padding.
        allowed = ((causal & mask[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device))[:, shared:]
        run_layers(dec, dec.embed(prompt_ids[:, shared:length]), position_ids_from_mask(mask)[:, shared:],
                   keys[::2], keys[1::2], torch.arange(shared, length, device=device), allowed[:, None])
    return keys[::2], keys[1::2]
