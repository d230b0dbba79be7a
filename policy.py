"""The policy model's calls (paper §3.1: log pi_theta of each completion token, what the GRPO-PODS objective weighs),
as the update, generation and the sampler check make them. `token_logprobs`: the completion tokens' float32 log-probs
from one forward pass that projects only their positions on the vocabulary; with an LM head that does not train
(`fused_head`) the head's product is taken here chunk by chunk, so no [rows, tokens, vocabulary] logits are held.
The sampler check (paper Algorithm 1, line 1: GRPO assumes the rollouts were sampled from pi_theta) compares the
sampler's log-probs of every kept token with the policy's, every step (`SamplerGap`, `off_policy`).

Simplifications: every row is scored whole (engine/prefix.py computes each distinct prompt once, to the same numbers);
the fused head serves PLAIN_HEAD_FAMILIES only, in one process; the sampler check has one threshold on the mean gap
(the max is dominated by rare tokens in bf16), no per-token alarm.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): the flags read models.py, which imports this
if TYPE_CHECKING:
    from torch import Tensor

# Completion logits go to float32 this many elements at a time (~256 MiB): it bounds the log-softmax's extra memory.
_LOGSUMEXP_CHUNK_ELEMENTS = 1 << 26


# ------------------------------------------------ the policy's forward passes: the HF model, dropout off, bf16

def hf_model(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def dropout_off(model, keep_checkpointing=False):
    """Every module in eval mode for the block (gradients still flow); flags set in place (Module.train() took ~20 ms).
    keep_checkpointing: checkpointed layers (no dropout of their own) stay in training mode: checkpointing stays on."""
    modes = [(module, module.training) for module in model.modules()]
    for module, training in modes:
        if training and not (keep_checkpointing and module.__dict__.get("gradient_checkpointing") is True):
            module.__dict__["training"] = False
    try:
        yield model
    finally:
        for module, training in modes:
            module.__dict__["training"] = training


def checkpointing_modules(model):
    """The modules with a `gradient_checkpointing` flag, found once per model (a walk took ~8 ms at 36 layers)."""
    found = model.__dict__.get("_checkpointing_modules")
    if found is None:
        found = model.__dict__["_checkpointing_modules"] = [module for module in model.modules()
                                                            if hasattr(module, "gradient_checkpointing")]
    return found


def native_bf16(device) -> bool:
    """Whether `device` computes bf16 natively (elsewhere it is emulated: slower than float32)."""
    if str(device).startswith("cuda"):
        # is_bf16_supported() is also True where bf16 is emulated (T4, V100); Ampere (8.0) on is native.
        return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability(torch.device(device))) >= (8, 0)
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


# ------------------------------------------------ the completion tokens' log-probs (and entropies)

def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids of left-padded rows as generate() counts them: 0 at the first real token, counting up; pads 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def kept_positions(length: int, count: int, device=None):
    """transformers' `logits_to_keep` for the last `count` of `length` positions: an index tensor when fewer than all
    (an int's strided slice makes a CPU LM-head product copy the whole weight once per row: 36x slower)."""
    return count if count >= length else torch.arange(length - count, length, device=device)


def check_logprob_inputs(input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                         temperature: float) -> None:
    """The checks of `token_logprobs`' arguments (ValueError naming the bad one)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    seq_len = input_ids.shape[1]
    if isinstance(num_completion_tokens, bool) or not isinstance(num_completion_tokens, int):
        raise ValueError(f"num_completion_tokens must be an int, got {num_completion_tokens!r}")
    if not 1 <= num_completion_tokens <= seq_len - 1:
        raise ValueError(f"num_completion_tokens = {num_completion_tokens} must be in [1, T-1] = [1, {seq_len - 1}] "
                         "(at least one prompt token precedes the completion)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def picked_logprobs(values: Tensor, targets: Tensor, temperature: float = 1.0, with_entropies: bool = False,
                    head: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """float32 log p of `targets` [B, C] under softmax(logits / temperature), logits [B, C, V] (with `head`: hidden
    states [B, C, H]), chunked over rows. with_entropies: (logprobs, entropies [B, C] with no gradient)."""
    if head is not None:
        flat = _head_logprobs().apply(values.reshape(-1, values.shape[-1]), head, targets.reshape(-1), temperature,
                                      with_entropies)
        return tuple(t.view(targets.shape) for t in flat) if with_entropies else flat[0].view(targets.shape)
    c = max(1, values.shape[1])
    rows_per_chunk = max(1, _LOGSUMEXP_CHUNK_ELEMENTS // (c * values.shape[-1]))
    parts = [slice(start, start + rows_per_chunk) for start in range(0, values.shape[0], rows_per_chunk)]
    chunks = [_chunk_logprobs(values[part], targets[part], temperature, with_entropies) for part in parts]
    logprobs = torch.cat([chunk[0] for chunk in chunks], dim=0)
    return (logprobs, torch.cat([chunk[1] for chunk in chunks], dim=0)) if with_entropies else logprobs


def _chunk_logprobs(logits, targets, temperature, with_entropies):
    """(log p of targets, entropies or None) of one chunk of logits [..., V], in float32; z = logits / T."""
    scaled = logits.float()
    if temperature != 1.0:  # a pass over [rows, C, V] and its backward saved at the usual temperature 1
        scaled = scaled / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, targets[..., None]).squeeze(-1) - normaliser
    if not with_entropies:
        return picked, None
    with torch.no_grad():  # H = logsumexp(z) - sum_v p_v z_v
        return picked, normaliser - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)


@functools.cache
def _head_logprobs():
    """`picked_logprobs` with a frozen head [V, H], one chunk of logits at a time (made at first use: torch is lazy):
    the forward keeps the gradient factor (onehot - p) / T @ W [N, H], which the backward only scales."""

    class HeadLogprobs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, temperature, with_entropies):
            rows = max(1, _LOGSUMEXP_CHUNK_ELEMENTS // weight.shape[0])
            logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            entropies = torch.empty_like(logprobs) if with_entropies else None
            factor = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                scaled = (hidden[part] @ weight.T).float()
                if temperature != 1.0:
                    scaled = scaled / temperature
                normaliser = torch.logsumexp(scaled, dim=-1)
                logprobs[part] = scaled.gather(-1, targets[part, None]).squeeze(-1) - normaliser
                if entropies is None and factor is None:
                    continue
                probs = (scaled - normaliser[:, None]).exp_()
                if entropies is not None:
                    entropies[part] = normaliser - (probs * scaled).sum(-1)
                if factor is not None:  # d log p / d hidden = (onehot - p) / T @ W
                    probs.scatter_add_(-1, targets[part, None], probs.new_full((len(probs), 1), -1.0))
                    factor[part] = probs.mul_(-1.0 / temperature).to(weight.dtype) @ weight
            ctx.save_for_backward(factor)
            ctx.mark_non_differentiable(*(t for t in (entropies,) if t is not None))
            return (logprobs, entropies) if with_entropies else (logprobs,)

        @staticmethod
        def backward(ctx, grad, *unused):
            (factor,) = ctx.saved_tensors
            return (grad[:, None] * factor).to(factor.dtype), None, None, None, None

    return HeadLogprobs


# Families whose logits are lm_head(hidden states) and nothing more (no soft-cap, no scale): `fused_head` may apply.
PLAIN_HEAD_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "qwen3")


def fused_head(model) -> Tensor | None:
    """The LM head's weight [V, H] where `picked_logprobs` takes its product itself: a bias-free linear head that does
    not train, of a PLAIN_HEAD_FAMILIES model, in one process (FSDP gathers the head in its forward); else None."""
    hf = hf_model(model)
    head = hf.get_output_embeddings()
    if getattr(hf.config, "model_type", None) not in PLAIN_HEAD_FAMILIES or type(head) is not torch.nn.Linear or \
            head.bias is not None or head.weight.requires_grad or getattr(hf, "model", None) is None:
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        return None
    return head.weight


def kept_outputs(model, keep: int, **inputs) -> tuple[Tensor, Tensor | None]:
    """(values at the last `keep` positions, head) of one forward pass on `inputs`, for `picked_logprobs`: with a
    `fused_head`, the decoder's hidden states [B, keep, H] and that head; else the logits [B, keep, V] and None."""
    head = fused_head(model)
    length = inputs["input_ids"].shape[1]
    if head is None:
        out = model(logits_to_keep=kept_positions(length, keep, inputs["input_ids"].device), **inputs)
        return out.logits[:, -keep:], None  # -keep: also a model that ignores logits_to_keep and returns them all
    hidden = hf_model(model).model(**inputs).last_hidden_state
    return hidden[:, kept_positions(length, keep, hidden.device) if keep < length else slice(None)], head


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                   temperature: float = 1.0, with_entropies: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """float32 log p(input_ids[:, -C:]) at the sampling temperature, [B, C], of rows [left-padded prompt | completion],
    C = num_completion_tokens; only the last C + 1 positions reach the vocabulary. with_entropies as picked_logprobs."""
    check_logprob_inputs(input_ids, attention_mask, num_completion_tokens, temperature)
    c = num_completion_tokens
    values, head = kept_outputs(model, c + 1, input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    # Drop the last position: it predicts past the row.
    return picked_logprobs(values[:, :-1], input_ids[:, -c:], temperature, with_entropies, head)


# ------------------------------------------------ the sampler check: are the rollouts on-policy?
# The decode engine samples from its own code path (merged weights, hand-written layers, CUDA graphs): if it drifts
# from the policy trained, GRPO quietly trains off-policy. So each kept token's sampler log-prob is compared with the
# update's own forward pass. Above this mean |delta| = |log pi_trainer - log pi_sampler| (correct samplers: <= 0.018
# in bf16; a wrong temperature: 0.34; docs/generation.md) the step is not applied, generation falls back to generate().
LOGPROB_GAP_LIMIT = 0.1


@dataclass
class SamplerGap:
    """Sums over kept completion tokens (they add over micro-batches, rollout batches and processes)."""
    tokens: int = 0
    abs_sum: float = 0.0      # sum |delta|
    kl_sum: float = 0.0       # sum exp(delta) - delta - 1
    abs_max: float = 0.0
    ratio_max: float = 0.0

    @classmethod
    def of(cls, trainer_logprobs, sampler_logprobs, mask):
        """The gap over the tokens where `mask` [B, C] is set."""
        return cls.from_sums(gap_sums(trainer_logprobs, sampler_logprobs, mask).tolist())

    @classmethod
    def from_sums(cls, sums):
        """The SamplerGap of `gap_sums`' values, read on the host."""
        tokens, abs_sum, kl_sum, abs_max, ratio_max = sums
        return cls(int(tokens), abs_sum, kl_sum, abs_max, ratio_max)

    def __add__(self, other):
        return SamplerGap(self.tokens + other.tokens, self.abs_sum + other.abs_sum, self.kl_sum + other.kl_sum,
                          max(self.abs_max, other.abs_max), max(self.ratio_max, other.ratio_max))

    @property
    def mean(self):
        return self.abs_sum / max(self.tokens, 1)

    def metrics(self):
        """The metrics line's sampler/... fields (all 0 when no token was compared)."""
        return {"sampler/logprob_diff_mean": self.mean, "sampler/logprob_diff_max": self.abs_max,
                "sampler/kl": self.kl_sum / max(self.tokens, 1), "sampler/ratio_max": self.ratio_max}

    def describe(self):
        return (f"mean |log-prob difference| {self.mean:.3g} > {LOGPROB_GAP_LIMIT} (max {self.abs_max:.3g}, "
                f"KL {self.kl_sum / max(self.tokens, 1):.3g}, over {self.tokens} tokens)")


def gap_sums(trainer_logprobs, sampler_logprobs, mask):
    """SamplerGap's fields over the tokens where `mask` [B, C] is set, one float32 tensor [5] on the trainer's device
    (no host sync: the update reads it with its loss)."""
    keep = mask.bool().to(trainer_logprobs.device)
    delta = (trainer_logprobs.detach().float() - sampler_logprobs.to(trainer_logprobs.device).float()).masked_fill(
        ~keep, 0.0)
    k3 = (delta.exp() - delta - 1).clamp(min=0)   # >= 0 exactly; float rounding can dip below; 0 where masked
    ratio = delta.exp().masked_fill(~keep, 0.0)
    return torch.stack([keep.sum().float(), delta.abs().sum(), k3.sum(), delta.abs().amax() if delta.numel()
                        else delta.new_zeros(()), ratio.amax() if ratio.numel() else ratio.new_zeros(())])


def add_gap_sums(total, sums):
    """Two `gap_sums` as one (None: none yet)."""
    return sums if total is None else torch.cat([total[:3] + sums[:3], torch.maximum(total[3:], sums[3:])])


def row_mean_ratios(trainer_logprobs, sampler_logprobs, mask):
    """[B] each row's mean importance ratio exp(trainer - sampler) over its masked tokens (NaN: none)."""
    keep = mask.bool()
    ratio = (trainer_logprobs.detach().float() - sampler_logprobs.to(trainer_logprobs.device).float()).exp()
    return torch.where(keep, ratio, 0.0).sum(-1) / keep.sum(-1).where(keep.any(-1), torch.nan)


def total(gaps):
    """The sum of SamplerGaps (e.g. of every process)."""
    return sum(gaps, SamplerGap())


def off_policy(gap, where, rejected=False):
    """Why rollouts whose sampler log-probs are `gap` from the trainer's come from another policy ("`where`: ..."),
    or None when the sampler can be trusted. rejected: the reason says the step's update was not applied."""
    if not math.isfinite(gap.mean) or gap.mean <= LOGPROB_GAP_LIMIT:
        return None
    return f"{where}: {gap.describe()}" + ("; the step's update is not applied" if rejected else "")
