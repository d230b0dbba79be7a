"""Each distinct prompt token computed once in the update (paper Algorithm 1's policy update, made cheaper, same
result): a prompt's m kept rollouts all repeat it, and every prompt repeats the chat template and worked example.

`completion_logprobs` gives what policy.token_logprobs gives: the prefix all distinct prompts share runs once, then
each distinct prompt's suffix, then the completions on their keys and values repeated for the rows (index_select,
whose backward sums the rows' gradients); the prefix an optimizer step's prompts share runs once for all its
micro-batches (`step_prefix`). Where this cannot run (`unsupported_reason`) every row runs in full.
Simplifications: no shared prefix with several processes (FSDP); distinct prompts are found per micro-batch, so a
prompt whose rows fall into two micro-batches runs its own suffix once in each.
"""

import contextlib
import inspect
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # older transformers: checkpointed layers always drop the cache
    GradientCheckpointingLayer = None

import policy


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first [G]: a row of each distinct prompt, in order of appearance; group [B]: each row's); pads do not count."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1 if len(inverse) else 0,), len(inverse), device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, "amin")
    order = torch.argsort(first)  # groups in order of first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    return first[order], rank[inverse]


def is_left_padded(mask: Tensor) -> bool:
    """Every row of `mask` [B, T] is 0...0 1...1 (the layout of prompts in sampling.Rollouts)."""
    lengths = mask.sum(1, keepdim=True)
    return bool((mask.long() == (torch.arange(mask.shape[1], device=mask.device) >= mask.shape[1] - lengths)).all())


def common_prefix_length(prompt_ids: Tensor, prompt_mask: Tensor) -> int:
    """The number of leading real tokens every left-padded prompt [G, Tp] shares, at most the shortest length - 1:
    each prompt keeps a token of its own (its last position scores the first completion token)."""
    lengths = prompt_mask.sum(1)
    shortest = int(lengths.min()) if len(lengths) else 0
    if shortest < 2:
        return 0
    starts = prompt_ids.shape[1] - lengths
    real = prompt_ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=prompt_ids.device))
    same = (real == real[:1]).all(0)
    return int(same.long().cumprod(0).sum())


def shared_prefix_layout(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """(ids, mask, shared): left-padded prompts [D, W] re-laid out as [shared prefix][suffix, left padded], shared =
    `common_prefix_length`; the pads between are masked, so positions from the mask are unchanged."""
    lengths, width = prompt_mask.sum(1), prompt_mask.shape[1]
    shared = common_prefix_length(prompt_ids, prompt_mask)
    suffix_width = int(lengths.max()) - shared
    suffix_mask = (torch.arange(suffix_width, device=prompt_mask.device) >= suffix_width - (lengths - shared)[:, None])
    start = int(width - lengths[0])
    prefix = prompt_ids[:1, start:start + shared].expand(len(prompt_ids), -1)
    ids = torch.cat([prefix, prompt_ids[:, width - suffix_width:]], 1)
    mask = torch.cat([torch.ones_like(prompt_mask[:, :shared]), suffix_mask.to(prompt_mask.dtype)], 1)
    return ids, mask, shared


def cache_argument(model):
    """The model's KV-cache argument: "cache" in transformers releases that renamed it, else "past_key_values"."""
    parameters = inspect.signature(policy.hf_model(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _checkpointed_layers(model):
    """The modules of `model` that gradient checkpointing replays in the backward (flag on, in training mode)."""
    return [m for m in policy.checkpointing_modules(model) if m.gradient_checkpointing is True and m.training]


def unsupported_reason(model) -> str | None:
    """None when `completion_logprobs` can run on `model` in the current grad mode, else why not (one line)."""
    hf = policy.hf_model(model)
    if not hasattr(hf, "config") or "logits_to_keep" not in inspect.signature(hf.forward).parameters:
        return f"{type(hf).__name__} is not a transformers causal LM with logits_to_keep"
    layers = getattr(DynamicCache(config=hf.config), "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or ["no layers"]
        return f"the model's KV cache ({', '.join(kinds)}) is not plain key/value tensors that can be repeated"
    checkpointed = _checkpointed_layers(model) if torch.is_grad_enabled() else []
    if checkpointed and not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        return "gradient checkpointing drops the KV cache in this transformers release"
    reentrant = [m for m in checkpointed if getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords",
                                                    {}).get("use_reentrant") is not False]
    if reentrant:  # its forward runs under no_grad: keys and values written to the cache would carry no gradient
        return "reentrant gradient checkpointing (use_reentrant=True) cuts the gradient through the cache"
    return None


_SAID = set()  # the reasons `logprobs_function` could not share, each said once per process


def logprobs_function(model, prefix_sharing=True):
    """`completion_logprobs` if asked for and allowed (`unsupported_reason`), else policy.token_logprobs (a warning)."""
    if not prefix_sharing:
        return policy.token_logprobs
    reason = unsupported_reason(model)
    if reason is None:
        return completion_logprobs
    if reason not in _SAID:
        _SAID.add(reason)
        warnings.warn(f"prefix sharing: {reason}; every row's prompt runs in full (--prefix-sharing off silences this)")
    return policy.token_logprobs


class _PastLayer(DynamicLayer):
    """A cache layer with a fixed past (keys/values [b, heads, T, d], or none): update(k, v) returns past + (k, v),
    the same again when gradient checkpointing replays the layer (a DynamicLayer would append twice)."""

    def __init__(self, keys=None, values=None):
        super().__init__()
        self.past = (keys, values)
        if keys is not None:
            self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        past_keys, past_values = self.past
        self.keys = key_states if past_keys is None else torch.cat([past_keys, key_states], -2)
        self.values = value_states if past_values is None else torch.cat([past_values, value_states], -2)
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values


def _cache(model, past=None):
    """A DynamicCache of `_PastLayer`s: empty, or with past [(keys, values)] per layer."""
    cache = DynamicCache()
    layers = policy.hf_model(model).config.get_text_config(decoder=True).num_hidden_layers
    cache.layers = [_PastLayer(*kv) for kv in past] if past is not None else [_PastLayer() for _ in range(layers)]
    return cache


@contextlib.contextmanager
def _cache_under_checkpointing(model):
    """transformers drops the cache of a checkpointed layer (a replay would write it twice); `_PastLayer` writes are
    idempotent, so the layers may keep it for the block. Yields whether layers are checkpointed."""
    layers = _checkpointed_layers(model) if torch.is_grad_enabled() else []
    before = [layer.__dict__.get("_can_checkpoint_with_cache") for layer in layers]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield bool(layers)
    finally:
        for layer, value in zip(layers, before):
            if value is None:
                del layer._can_checkpoint_with_cache  # the class's value again
            else:
                layer._can_checkpoint_with_cache = value


def _forward(model, ids, mask, positions, cache, logits_to_keep):
    """(values, head: policy.kept_outputs, then `cache` holding its past and ids' keys and values) of one forward
    pass. mask None: no padding and no past (the model's causal mask alone)."""
    with _cache_under_checkpointing(model) as checkpointing:
        # The layers use `cache` whenever passed; use_cache=True under checkpointing would only make transformers warn.
        values, head = policy.kept_outputs(model, logits_to_keep, input_ids=ids, attention_mask=mask,
                                           position_ids=positions, use_cache=not checkpointing,
                                           **{cache_argument(model): cache})
    length = ids.shape[1] if mask is None else mask.shape[1]
    if cache.get_seq_length() != length:
        raise RuntimeError(f"the model left a KV cache of {cache.get_seq_length()} positions, not {length} "
                           "(prefix sharing needs the cache in the update: --prefix-sharing off)")
    return values, head, cache


def repeat_cache(model, cache, index: Tensor):
    """A new cache whose row i holds `cache`'s row index[i] (index_select: the repeated rows' gradients sum back)."""
    return _cache(model, [(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                          for layer in cache.layers])


def starts_with(prompt_ids: Tensor, prompt_mask: Tensor, prefix_ids: Tensor) -> bool:
    """Every left-padded prompt [B, Tp] starts with the tokens prefix_ids [L] and has at least one token past them."""
    length, lengths = len(prefix_ids), prompt_mask.sum(1)
    if not is_left_padded(prompt_mask) or (len(lengths) and int(lengths.min()) <= length):
        return False
    starts = prompt_ids.shape[1] - lengths
    real = prompt_ids.gather(1, starts[:, None] + torch.arange(length, device=prompt_ids.device))
    return bool((real == (prefix_ids if prefix_ids.device == real.device else prefix_ids.to(real.device))).all())


@dataclass
class StepPrefix:
    """The prefix every prompt of an optimizer step shares, run once for all its micro-batches (`step_prefix`)."""
    ids: Tensor                           # [L] its token ids, on the host
    outputs: list[tuple[Tensor, Tensor]]  # per layer, its keys and values [1, kv_heads, L, head_dim] as computed
    inputs: list[tuple[Tensor, Tensor]]   # the same, detached, each micro-batch's past: their .grad sums its rows'


def step_prefix_ids(prompts) -> Tensor | None:
    """The longest run of tokens all `prompts` ((ids, mask) pairs) start with, each keeping one token of its own (None:
    some are not left padded)."""
    found = None
    for ids, mask in prompts:
        if len(ids) == 0:
            continue
        if not is_left_padded(mask):
            return None
        length = common_prefix_length(ids, mask)
        start = ids.shape[1] - int(mask[0].sum())
        own = ids[0, start:start + length]
        if found is not None:
            shortest = min(len(found), len(own))
            own = own[:int((own[:shortest] == found[:shortest].to(own.device)).long().cumprod(0).sum())]
        found = own
    return found


def step_prefix(model, ids: Tensor) -> StepPrefix:
    """Run the prefix ids [L] (host) once for every micro-batch of the step; `backward_step_prefix` after the last."""
    on_device = ids.to(next(model.parameters()).device, non_blocking=True)[None]
    _, _, cache = _forward(model, on_device, None, None, _cache(model), 1)
    outputs = [(layer.keys, layer.values) for layer in cache.layers]
    inputs = [tuple(t.detach().requires_grad_(t.requires_grad) for t in kv) for kv in outputs]
    return StepPrefix(ids, outputs, inputs)


def backward_step_prefix(step: StepPrefix):
    """Send the gradients the micro-batches left on the prefix's keys and values back through its forward, once."""
    pairs = [(output, given.grad) for kv, given_kv in zip(step.outputs, step.inputs) for output, given in
             zip(kv, given_kv) if given.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])


def several_processes() -> bool:
    """A multi-process run: FSDP needs the same forward calls on every rank, so the prefix level stays off."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


@dataclass
class Layout:
    """How `completion_logprobs` runs B rows [left-padded prompt | completion], found on the host (`layout`)."""
    first: Tensor       # [G] a row of each distinct prompt (prompt_groups)
    group: Tensor       # [B] each row's distinct prompt
    prefix: int         # the tokens every prompt starts with, run once (or the step's: read); 0: none
    prefix_start: int   # the column where the first distinct prompt's prefix starts
    suffix: int         # the widest part of a prompt after the prefix
    folded: bool        # each row runs its own suffix and its completion in one call (FOLD_LIMIT)


# Rows fold (own prompt tokens and completion in one model call, not two) when the tokens this repeats are at most one
# per row or this fraction of the completion tokens: the paper's presets repeat one token m - 1 times for a call less.
FOLD_LIMIT = 1 / 8


def folds(rows: int, prompts: int, suffix: int, completion_tokens: int) -> bool:
    """Whether `rows` rows of `prompts` distinct prompts, own parts <= `suffix` tokens, fold (FOLD_LIMIT)."""
    return (rows - prompts) * suffix <= max(rows, FOLD_LIMIT * rows * max(completion_tokens - 1, 1))


def layout(prompt_ids: Tensor, prompt_mask: Tensor, completion_tokens: int, shared_prefix: bool = True,
           step_ids: Tensor | None = None) -> Layout:
    """The Layout of rows whose prompts are prompt_ids / prompt_mask [B, Tp] (host tensors). step_ids: the step's
    prefix [L] every prompt goes past (ValueError otherwise); else with shared_prefix the distinct prompts' prefix."""
    first, group = prompt_groups(prompt_ids, prompt_mask)
    lengths = prompt_mask.sum(1)
    if step_ids is not None:
        if not starts_with(prompt_ids, prompt_mask, step_ids):
            raise ValueError(f"the micro-batch's prompts do not all start with the step's {len(step_ids)}-token prefix "
                             "and go past it (prefix.step_prefix_ids of these rows)")
        length = len(step_ids)
    elif shared_prefix and is_left_padded(prompt_mask[first]):
        length = common_prefix_length(prompt_ids[first], prompt_mask[first])
    else:
        length = 0
    suffix = int(lengths.max()) - length if len(lengths) else 0
    folded = length > 0 and folds(len(group), len(first), suffix, completion_tokens)
    if not folded and step_ids is None and len(first) == 1:  # one prompt: run whole, then its rows' completions
        length, suffix = 0, int(lengths.max())
    start = prompt_ids.shape[1] - int(lengths[first[0]]) if len(first) else 0
    return Layout(first, group, length, start, suffix, folded)


def _own_tokens(model, ids, mask, own, suffix, prefix_length, cache, logits_to_keep):
    """(values, head, cache, mask) of rows [n, W] after the one-row prefix `cache` holds (None: none): each row's last
    `own` [n] prompt tokens right-aligned in its first `suffix` columns (masked before), then what follows."""
    width = ids.shape[1]
    run_mask = mask.masked_fill(torch.arange(width, device=mask.device) < suffix - own[:, None], 0)
    full_mask = torch.cat([mask.new_ones(len(ids), prefix_length), run_mask], 1)
    cache = _cache(model) if cache is None else repeat_cache(model, cache, own.new_zeros(len(ids)))
    positions = policy.position_ids_from_mask(full_mask)[:, -width:]
    return (*_forward(model, ids, full_mask, positions, cache, logits_to_keep), full_mask)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, shared_prefix: bool = True, step: StepPrefix | None = None,
                        host: tuple[Tensor, Tensor] | None = None, with_entropies: bool = False):
    """policy.token_logprobs with each distinct prompt run once and, with shared_prefix, their shared prefix once (or
    `step`'s: its gradients go to step.inputs). host: host copies of input_ids, attention_mask (else a host sync)."""
    policy.check_logprob_inputs(input_ids, attention_mask, num_completion_tokens, temperature)
    c = num_completion_tokens
    host_ids, host_mask = host if host is not None else (input_ids.cpu(), attention_mask.cpu())
    plan = layout(host_ids[:, :-c], host_mask[:, :-c], c, shared_prefix and not several_processes(),
                  None if step is None else step.ids)
    prompt_ids, prompt_mask = input_ids[:, :-c], attention_mask[:, :-c]
    completion_ids, completion_mask = input_ids[:, -c:], attention_mask[:, -c:]
    cache = None
    if step is not None:
        cache = _cache(model, step.inputs)
    elif plan.prefix > 0:
        first = int(plan.first[0])
        ids = prompt_ids[first:first + 1, plan.prefix_start:plan.prefix_start + plan.prefix]
        _, _, cache = _forward(model, ids, None, None, _cache(model), 1)
    own = prompt_mask.sum(1) - plan.prefix
    if plan.folded:  # [own prompt tokens | completion but its last token]: the last prompt position scores the first
        ids = torch.cat([prompt_ids[:, -plan.suffix:], completion_ids[:, :c - 1]], 1)
        mask = torch.cat([prompt_mask[:, -plan.suffix:], completion_mask[:, :c - 1]], 1)
        values, head, _, _ = _own_tokens(model, ids, mask, own, plan.suffix, plan.prefix, cache, c)
        return policy.picked_logprobs(values, completion_ids, temperature, with_entropies, head)
    first, group = (index.to(input_ids.device, non_blocking=True) for index in (plan.first, plan.group))
    last, head, cache, cache_mask = _own_tokens(model, prompt_ids[first, -plan.suffix:],
                                                prompt_mask[first, -plan.suffix:], own[first], plan.suffix,
                                                plan.prefix, cache, 1)
    # The last completion token only predicts past the row (C = 1: one goes in, unused, so calls never depend on C).
    inputs = max(c - 1, 1)
    mask = torch.cat([cache_mask.index_select(0, group), completion_mask[:, :inputs]], 1)
    positions = policy.position_ids_from_mask(mask)[:, -inputs:]
    values, _, _ = _forward(model, completion_ids[:, :inputs], mask, positions, repeat_cache(model, cache, group),
                            inputs)
    first = policy.picked_logprobs(last.index_select(0, group), completion_ids[:, :1], temperature, with_entropies,
                                   head)
    rest = policy.picked_logprobs(values[:, :c - 1], completion_ids[:, 1:], temperature, with_entropies, head)
    if with_entropies:  # (logprobs, entropies), each in two parts
        return tuple(torch.cat(parts, 1) for parts in zip(first, rest))
    return torch.cat([first, rest], 1)
