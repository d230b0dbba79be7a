"""Each distinct prompt token computed once in the update (paper Algorithm 1's policy update, made cheaper, same
result): the m kept rollouts of a prompt all repeat that prompt, and every prompt of a batch repeats the same chat
template, system prompt and worked example.

`completion_logprobs` gives what policy.token_logprobs gives (float32 log p of each completion token, [B, C])
from the same [prompt | completion] rows, with each distinct prompt run once:
1. rows with identical prompt tokens (and mask) are one group (`prompt_groups`);
2. the longest run of real tokens every distinct prompt starts with (`common_prefix_length`, found from the ids, not
   from the template) runs once, [1, L], its keys and values repeated for the distinct prompts' suffixes
   ([prefix][suffix, left padded]: the pads between are masked, positions come from the mask);
3. the distinct prompts' keys and values (the KV cache) are repeated for the B rows (index_select) and the
   completions run on them; the prompt's last logits score the first completion token. Where the rows repeat few
   prompt tokens (`folds`: one prompt per step), 2 and 3 are one model call.
The layout is decided on the host, from host copies of the rows (`layout`): no device value is read back. Repeating
keys and values is differentiable (index_select's backward sums), so loss and gradients equal the per-row
computation up to float rounding (tests/test_prefix.py). Only the last prompt position reaches the vocabulary.

Gradient checkpointing replays each layer's forward, cache writes included: the cache's layers (`_PastLayer`) hold a
fixed past, so a replayed write gives the same tensors. `unsupported_reason` says when this cannot run (reentrant
checkpointing, a transformers release whose checkpointed layers drop the cache, a cache of other than plain
key/value tensors, a model that is not a transformers causal LM): update.py then runs every row in full. With
several processes (FSDP: every rank must make the same forward calls) the prefix level is off.
Across micro-batches, the prefix every prompt of an optimizer step shares runs once per step (`step_prefix`: each
micro-batch attends to detached copies of its keys and values, whose gradients go back through it once,
`backward_step_prefix`); with one prompt per step (the paper's presets) that is all of the prompt but its last token.
Simplification: distinct prompts are found per micro-batch; a prompt whose rows fall into two micro-batches runs its
own suffix once in each.
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
    """(first [G]: a row of each distinct prompt, in order of first appearance; group [B]: each row's group index)
    for prompts [B, Tp] with their mask (pad tokens do not count: only ids where the mask is set, and the mask)."""
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
    """The number of leading real tokens every left-padded prompt [G, Tp] shares (found from the ids, no template
    knowledge), at most the shortest prompt's length - 1: each prompt keeps one token of its own (in the update its
    last position scores the first completion token; in generation the first decode step consumes it)."""
    lengths = prompt_mask.sum(1)
    shortest = int(lengths.min()) if len(lengths) else 0
    if shortest < 2:
        return 0
    starts = prompt_ids.shape[1] - lengths
    real = prompt_ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=prompt_ids.device))
    same = (real == real[:1]).all(0)
    return int(same.long().cumprod(0).sum())


def shared_prefix_layout(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """(ids, mask, shared): the left-padded prompts [D, W] re-laid out as [shared prefix][suffix, left padded], the
    prefix being `common_prefix_length` (a prompt that IS the prefix keeps a suffix of one token). Pads sit between
    prefix and suffix; the mask marks them, so position ids from the mask (policy.position_ids_from_mask) count
    the same real tokens as before. The width becomes shared + the longest suffix (<= W); shared = 0 gives the
    prompts unchanged (bar all-pad columns). Generation (the engine's prefill, sampling's generate() path) runs the
    prefix once for every row."""
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
    """The name of the KV-cache argument of the transformers model inside `model` ("cache" in transformers >= 5.x
    releases that renamed it, else "past_key_values")."""
    parameters = inspect.signature(policy.hf_model(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _checkpointed_layers(model):
    """The modules of `model` that gradient checkpointing replays in the backward (transformers' flag, in training
    mode: policy.dropout_off keeps them so in the update)."""
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
    """`completion_logprobs` where prefix_sharing is asked for and `unsupported_reason` allows it on `model` (in the
    current grad mode), else policy.token_logprobs (every row in full) with one warning line per reason, once:
    the update's passes and the evaluation's sampler check choose alike."""
    if not prefix_sharing:
        return policy.token_logprobs
    reason = unsupported_reason(model)
    if reason is None:
        return completion_logprobs
    if reason not in _SAID:
        _SAID.add(reason)
        warnings.warn(f"prefix sharing: {reason}; every row's prompt runs in full (--prefix-sharing off silences "
                      "this)")
    return policy.token_logprobs


class _PastLayer(DynamicLayer):
    """A cache layer with a fixed past (keys/values [b, heads, T, d] given at construction, or none): update(k, v)
    holds and returns past + (k, v). The same call twice gives the same, so gradient checkpointing may replay a layer
    (its backward recomputes the forward, update included) where a growing DynamicLayer would append twice."""

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
    """(values at the last logits_to_keep positions, head: policy.kept_outputs, then `cache` holding its past and
    ids' keys and values) of one forward pass. mask None: no padding and no past (the model's causal mask alone: no
    mask tensor, nothing for the host to check)."""
    with _cache_under_checkpointing(model) as checkpointing:
        # The layers read and write `cache` whenever one is passed; use_cache=True under checkpointing would only
        # make transformers warn that it turns use_cache off.
        values, head = policy.kept_outputs(model, logits_to_keep, input_ids=ids, attention_mask=mask,
                                           position_ids=positions, use_cache=not checkpointing,
                                           **{cache_argument(model): cache})
    length = ids.shape[1] if mask is None else mask.shape[1]
    if cache.get_seq_length() != length:
        raise RuntimeError(f"the model left a KV cache of {cache.get_seq_length()} positions, not {length} "
                           "(prefix sharing needs the cache in the update: --prefix-sharing off)")
    return values, head, cache


def repeat_cache(model, cache, index: Tensor):
    """A new cache whose row i holds `cache`'s row index[i] (every layer's keys and values index_selected:
    differentiable, the gradients of repeated rows sum back)."""
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
    """The longest run of tokens every prompt of `prompts` ((prompt_ids [B, Tp], prompt_mask) pairs, left padded)
    starts with, each prompt keeping one token of its own (`common_prefix_length`); None if some are not left
    padded."""
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
    """Run the prefix ids [L] (host) once (with gradients in grad mode): the keys and values every micro-batch of the
    step then reads (completion_logprobs(..., step=...)); `backward_step_prefix` after the last micro-batch's
    backward."""
    on_device = ids.to(next(model.parameters()).device, non_blocking=True)[None]
    _, _, cache = _forward(model, on_device, None, None, _cache(model), 1)
    outputs = [(layer.keys, layer.values) for layer in cache.layers]
    inputs = [tuple(t.detach().requires_grad_(t.requires_grad) for t in kv) for kv in outputs]
    return StepPrefix(ids, outputs, inputs)


def backward_step_prefix(step: StepPrefix):
    """Send the gradients the micro-batches left on the prefix's keys and values through its forward, once: the
    parameters then hold what every row's backward through its own copy of the prefix would have given."""
    pairs = [(output, given.grad) for kv, given_kv in zip(step.outputs, step.inputs) for output, given in
             zip(kv, given_kv) if given.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])


def several_processes() -> bool:
    """A multi-process run (multigpu/): FSDP runs the same collectives on every rank, so every rank must make the
    same forward calls, and the prefix level (used or not by each rank's own prompts) stays off."""
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


# Each row's own prompt tokens (after the prefix) run with its completion, one model call in all instead of one for
# the distinct prompts and one for the completions, when the tokens it repeats (a prompt's own tokens once per row,
# not once per prompt) are at most one per row or this fraction of the completion tokens the call runs anyway: the
# paper's presets (one prompt per step, m rows) repeat the prompt's last token m - 1 times for a model call less
# (a whole forward and backward of kernels); prompts whose own parts are long (the demo's questions) keep theirs.
FOLD_LIMIT = 1 / 8


def folds(rows: int, prompts: int, suffix: int, completion_tokens: int) -> bool:
    """Whether rows of `prompts` distinct prompts, whose own parts are at most `suffix` tokens, run them with their
    completions in one model call (FOLD_LIMIT)."""
    return (rows - prompts) * suffix <= max(rows, FOLD_LIMIT * rows * max(completion_tokens - 1, 1))


def layout(prompt_ids: Tensor, prompt_mask: Tensor, completion_tokens: int, shared_prefix: bool = True,
           step_ids: Tensor | None = None) -> Layout:
    """The Layout of rows whose prompts are prompt_ids / prompt_mask [B, Tp] (host tensors: nothing is read back
    from a device), with completion_tokens columns. step_ids: the step's prefix [L] every prompt starts with and
    goes past (ValueError otherwise); else with shared_prefix the prefix the distinct prompts share."""
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
    """The forward of rows [n, W] after a prefix of prefix_length tokens whose keys and values `cache` holds (one row;
    None: no prefix): each row's last `own` [n] prompt tokens, right-aligned in its first `suffix` columns (the
    columns before them hold prefix tokens or padding: masked), then whatever follows (a completion, masked where the
    mask says). -> (values [n, logits_to_keep, ...] and head (`_forward`), the cache with every row's keys and values,
    its mask)."""
    width = ids.shape[1]
    run_mask = mask.masked_fill(torch.arange(width, device=mask.device) < suffix - own[:, None], 0)
    full_mask = torch.cat([mask.new_ones(len(ids), prefix_length), run_mask], 1)
    cache = _cache(model) if cache is None else repeat_cache(model, cache, own.new_zeros(len(ids)))
    positions = policy.position_ids_from_mask(full_mask)[:, -width:]
    return (*_forward(model, ids, full_mask, positions, cache, logits_to_keep), full_mask)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, shared_prefix: bool = True, step: StepPrefix | None = None,
                        host: tuple[Tensor, Tensor] | None = None, with_entropies: bool = False):
    """policy.token_logprobs (same arguments: rows [left-padded prompt | completion], C = num_completion_tokens)
    with each distinct prompt run once (its keys and values repeated for its rows), and with shared_prefix the
    prefix every prompt shares run once (not with several processes: `several_processes`), or with `step` read from
    the step's prefix (every prompt must start with it). float32 [B, C]; gradients flow into `model` unless under
    no_grad (with `step`, into step.inputs until `backward_step_prefix`). host: input_ids and attention_mask on the
    host (update.py has them), where the layout is found (else they are copied there: a host sync).
    Model calls: the prefix (unless `step`), then, folded (`FOLD_LIMIT`), every row's own prompt tokens and its
    completion in one; else the distinct prompts' own tokens, then the completions on their repeated keys and values."""
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
    # The last completion token only predicts past the row: the first C - 1 go in (1 when C = 1, its logits unused,
    # so that the calls never depend on C).
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
