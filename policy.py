"""The policy model's calls (paper §3.1: log pi_theta of each completion token, what the GRPO-PODS objective weighs),
as the update, generation and the sampler check make them. `hf_model`: the transformers model behind a PEFT wrapper;
`dropout_off`: eval mode for a block, gradients still flowing; `native_bf16`: whether a device computes in bf16 (what
the demo's --bf16 auto and the bf16 LoRA product ask); `position_ids_from_mask`: the positions of left-padded rows;
`token_logprobs`: the float32 log-probs (and, asked, entropies) of the completion tokens from one forward pass that
projects only the completion's positions on the vocabulary, the log-softmax chunked over rows (`picked_logprobs`). On
a plain LM head that does not train (LoRA: `fused_head`) the head's product is taken here, chunk by chunk, so no
[rows, tokens, vocabulary] logits or gradient are held. The objective these log-probs go to is grpo_loss.py's.

The sampler check (paper Algorithm 1, line 1 against the update's log pi_theta: GRPO's policy gradient assumes the
rollouts were sampled from pi_theta): the sampler's log-probs of every kept token against the policy's, every step
(`SamplerGap`, `LOGPROB_GAP_LIMIT`, `off_policy`; the section at the end says why and how).

Simplifications: every row is scored whole (engine/prefix.py computes each distinct prompt once, to the same numbers);
the fused head serves the families whose logits are the head's product alone (PLAIN_HEAD_FAMILIES), in one process;
the sampler check has one threshold on the mean gap (the max is dominated by rare tokens in bf16), no per-token alarm.
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

# Completion logits are converted to float32 this many elements at a time (~256 MiB), which bounds
# the transient memory of the log-softmax on top of the [B, C+1, V] logits the model returns.
_LOGSUMEXP_CHUNK_ELEMENTS = 1 << 26


# ------------------------------------------------ the policy's forward passes: the HF model, dropout off

def hf_model(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def dropout_off(model, keep_checkpointing=False):
    """Every module in eval mode for the block (no dropout; gradients still flow), each module's own flag restored
    afterwards. keep_checkpointing=True (the update) leaves gradient-checkpointed layers in training mode: their
    flag is what switches checkpointing on (transformers), and they hold no dropout of their own. Generation
    wants them in eval mode too: a checkpointed layer in training mode turns the KV cache off.
    The flags are written in place (a module's `training` attribute), not through Module.train(), whose walk and
    attribute checks took ~20 ms a call at 36 layers: host time a GPU waits for, at every update and generation."""
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
    """The modules of `model` that transformers' gradient checkpointing can be switched on for (those with a
    `gradient_checkpointing` flag: the decoder layers, the decoder), found once per model; whether each is on is read
    from its flag. (A walk of every module took ~8 ms at 36 layers, several times an update.)"""
    found = model.__dict__.get("_checkpointing_modules")
    if found is None:
        found = model.__dict__["_checkpointing_modules"] = [module for module in model.modules()
                                                            if hasattr(module, "gradient_checkpointing")]
    return found


# ------------------------------------------------ the precision a device computes the policy in

def native_bf16(device) -> bool:
    """Whether `device` has bf16 arithmetic of its own: a CUDA GPU that supports it, or a CPU with AVX-512 BF16 or
    AMX instructions (elsewhere bf16 products are emulated: slower than float32)."""
    if str(device).startswith("cuda"):
        # is_bf16_supported() is True where bf16 is only emulated (T4, V100: slower than fp32); Ampere (8.0) on is
        # native
        return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability(torch.device(device))) >= (8, 0)
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


# ------------------------------------------------ the completion tokens' log-probs (and entropies)

def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids for left-padded rows: 0 at the first real token, counting up; pads get 0.

    transformers 5 forward() falls back to arange(T) when position_ids is None, shifting every real
    token of a left-padded row by its pad count. RoPE models (Llama, Qwen2) only see position
    differences, so that changes logits by float rounding only; absolute position embeddings (GPT-2)
    would be wrong. Passing these makes both exact and matches the positions generate() uses.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def kept_positions(length: int, count: int, device=None):
    """transformers' `logits_to_keep` for the last `count` of `length` positions: an index tensor when fewer than all
    are kept. (An int makes the model slice its hidden states, a strided view whose LM-head product on a CPU copies
    the whole [vocabulary, hidden] weight once per row, forward and backward: 36x slower at the demo's sizes.)"""
    return count if count >= length else torch.arange(length - count, length, device=device)


def check_logprob_inputs(input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                         temperature: float) -> None:
    """The checks of `token_logprobs`' arguments (ValueError naming the bad one)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    seq_len = input_ids.shape[1]
    if isinstance(num_completion_tokens, bool) or not isinstance(num_completion_tokens, int):
        raise ValueError(f"num_completion_tokens must be an int, got {num_completion_tokens!r}")
    if not 1 <= num_completion_tokens <= seq_len - 1:
        raise ValueError(
            f"num_completion_tokens = {num_completion_tokens} must be in [1, T-1] = [1, {seq_len - 1}] "
            "(at least one prompt token precedes the completion)"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def picked_logprobs(values: Tensor, targets: Tensor, temperature: float = 1.0, with_entropies: bool = False,
                    head: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """float32 log-softmax(logits / temperature) at `targets` [B, C] -> [B, C], from values [B, C, V] logits, or with
    `head` (`fused_head`: the LM head's weight [V, H]) from values [B, C, H] hidden states, the head's product taken
    here chunk by chunk (`_head_logprobs`). In float32, chunked over rows (`_LOGSUMEXP_CHUNK_ELEMENTS`).
    with_entropies: also the entropy of each position's distribution at that temperature, [B, C], with no gradient
    (what loss_options.high_entropy_mask ranks; TRL's entropy_from_logits), from the same chunks: (logprobs,
    entropies)."""
    if head is not None:
        flat = _head_logprobs().apply(values.reshape(-1, values.shape[-1]), head, targets.reshape(-1), temperature,
                                      with_entropies)
        return tuple(t.view(targets.shape) for t in flat) if with_entropies else flat[0].view(targets.shape)
    c = max(1, values.shape[1])
    rows_per_chunk = max(1, _LOGSUMEXP_CHUNK_ELEMENTS // (c * values.shape[-1]))
    chunks, entropies = [], []
    for start in range(0, values.shape[0], rows_per_chunk):
        part = slice(start, start + rows_per_chunk)
        logprobs, entropy = _chunk_logprobs(values[part], targets[part], temperature, with_entropies)
        chunks.append(logprobs)
        entropies.append(entropy)
    logprobs = torch.cat(chunks, dim=0)
    return (logprobs, torch.cat(entropies, dim=0)) if with_entropies else logprobs


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
    """The autograd Function of `picked_logprobs` with a head (made at first use: torch is imported lazily here):
    log p(targets) of hidden states [N, H] under a frozen LM head [V, H] at temperature T, never holding more than
    one chunk of [N, V] logits: each chunk's product, float32 log-softmax and gradient factor are made and dropped at
    once. The gradient a token's log-prob sends to its hidden state is (onehot - p) / T @ W times the incoming
    gradient (a number per token), so the forward keeps that [N, H] factor and the backward only scales it: as many
    matrix products as the logits path (one forward, one backward), nothing saved at [N, V]. (Liger-Kernel's fused
    linear cross-entropy does the same for a loss; here the head does not train, as with LoRA: no weight gradient.)"""

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


# Families whose causal LM's logits are lm_head(hidden states) and nothing more (no soft-cap, no scale): the update
# may take the head's product itself (`fused_head`).
PLAIN_HEAD_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "qwen3")


def fused_head(model) -> Tensor | None:
    """The LM head's weight [V, H] where the completion log-probs take its product themselves (`picked_logprobs` with
    head=, on the hidden states of the decoder: `kept_outputs`): a plain bias-free linear head that does not train
    (LoRA), of a PLAIN_HEAD_FAMILIES model, in one process (FSDP gathers the head in the whole model's forward);
    else None (the model's own forward gives the logits)."""
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
    """(values at the last `keep` positions, head) of one forward pass of `model` on `inputs` (input_ids,
    attention_mask, position_ids, the cache...): with a `fused_head`, the decoder's hidden states [B, keep, H] and that
    head; else the model's logits [B, keep, V] and None. Either goes to `picked_logprobs(values, ..., head=head)`."""
    head = fused_head(model)
    length = inputs["input_ids"].shape[1]
    if head is None:
        out = model(logits_to_keep=kept_positions(length, keep, inputs["input_ids"].device), **inputs)
        return out.logits[:, -keep:], None  # -keep: also a model that ignores logits_to_keep and returns them all
    hidden = hf_model(model).model(**inputs).last_hidden_state
    return hidden[:, kept_positions(length, keep, hidden.device) if keep < length else slice(None)], head


def token_logprobs(
    model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int, temperature: float = 1.0,
    with_entropies: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """float32 log p(input_ids[:, -C:]) under `model` at sampling temperature, shape [B, C].

    Rows are prompt + completion, left padded; C = num_completion_tokens is the (right-aligned)
    completion width. Only the last C+1 positions are projected on the vocabulary
    (`logits_to_keep`); the logits at position t predict token t+1, so the last C tokens are scored
    by logits[:, :-1]. log p = logit[token] / T - logsumexp(logits / T), in float32, chunked over rows
    (`picked_logprobs`). Gradients flow into `model` unless the caller wraps the call in torch.no_grad().
    prefix.completion_logprobs gives the same with each distinct prompt run once. with_entropies: (logprobs, the
    entropies [B, C] of those positions' distributions, no gradient; `picked_logprobs`).
    """
    check_logprob_inputs(input_ids, attention_mask, num_completion_tokens, temperature)
    c = num_completion_tokens
    values, head = kept_outputs(model, c + 1, input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    # Drop the last position: it predicts past the row.
    return picked_logprobs(values[:, :-1], input_ids[:, -c:], temperature, with_entropies, head)


# ------------------------------------------------ the sampler check: are the rollouts on-policy?
# The decode engine (engine/) samples from its own code path: a merged weight copy, hand-written layers, CUDA graphs.
# If anything in it drifts from the policy being trained (a stale copy, a wrong position, a graph replaying old
# addresses), GRPO quietly trains on off-policy data. So every generated token carries its log-prob under the sampler
# (sampling.Rollouts.sampler_logprobs), and the update's own forward pass (the policy before its optimizer step) gives
# the trainer's log-prob of the same token: no extra pass. `SamplerGap` sums their difference; its metrics go to
# metrics.jsonl every step; when the mean gap exceeds `LOGPROB_GAP_LIMIT`, a bound no correct sampler reaches
# (docs/generation.md: the measurements it comes from), the step is not applied (the gap is known before the
# optimizer step: update.update_policy's max_sampler_gap) and generation falls back to Hugging Face generate()
# (`off_policy` says why; sampling.after_gap makes the switch). Evaluation, which has no update pass, measures its
# first chunk with one forward pass (eval.measure_sampler_gap).
#
# Metrics, per token t of a kept completion, delta_t = log pi_trainer(t) - log pi_sampler(t):
#   sampler/logprob_diff_mean  mean |delta|          sampler/logprob_diff_max  max |delta|
#   sampler/kl                 mean exp(delta) - delta - 1   (k3 estimate of KL(sampler || policy) per token)
#   sampler/ratio_max          max exp(delta)        (the importance ratio; --importance-sampling-correction's)

# Mean |log pi_trainer - log pi_sampler| per token above which the sampler is taken to be broken. Measured on the
# demo's SmolLM2-135M + LoRA policy on CPU (python -m bench sampler; table in docs/generation.md and BENCHMARKS.md):
# every correct path 1e-6 in fp32 and 0.014-0.018 in bf16 (the bf16 merged copy vs the bf16 unmerged adapter is the
# proxy for a GPU run); the engine at 1.25 T 0.34. 0.1 is 5x the largest correct figure and 3x below that fault;
# slower faults (a merged copy stale by 20 steps: 0.02-0.04; 2% noise in the copy: 0.06) stay logged, not acted on.
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
        """The gap over the tokens where `mask` [B, C] is set (log-probs [B, C], any device)."""
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
    """SamplerGap's fields over the tokens where `mask` [B, C] is set, as one float32 tensor [5] on the trainer's
    device (tokens, sum |delta|, sum k3, max |delta|, max ratio; 0 without a token): the update reads it with its
    loss, in its one host sync per optimizer step."""
    keep = mask.bool().to(trainer_logprobs.device)
    delta = (trainer_logprobs.detach().float() - sampler_logprobs.to(trainer_logprobs.device).float()).masked_fill(
        ~keep, 0.0)
    k3 = (delta.exp() - delta - 1).clamp(min=0)   # >= 0 exactly; float rounding can dip below; 0 where masked
    ratio = delta.exp().masked_fill(~keep, 0.0)
    return torch.stack([keep.sum().float(), delta.abs().sum(), k3.sum(), delta.abs().amax() if delta.numel()
                        else delta.new_zeros(()), ratio.amax() if ratio.numel() else ratio.new_zeros(())])


def add_gap_sums(total, sums):
    """Two `gap_sums` as one (None: none yet)."""
    if total is None:
        return sums
    return torch.cat([total[:3] + sums[:3], torch.maximum(total[3:], sums[3:])])


def row_mean_ratios(trainer_logprobs, sampler_logprobs, mask):
    """[B] each row's mean importance ratio exp(trainer - sampler) over its masked tokens (NaN: none), for the
    completions log."""
    keep = mask.bool()
    ratio = (trainer_logprobs.detach().float() - sampler_logprobs.to(trainer_logprobs.device).float()).exp()
    return torch.where(keep, ratio, 0.0).sum(-1) / keep.sum(-1).where(keep.any(-1), torch.nan)


def total(gaps):
    """The sum of SamplerGaps (e.g. of every process)."""
    result = SamplerGap()
    for gap in gaps:
        result = result + gap
    return result


def off_policy(gap, where, rejected=False):
    """Why rollouts whose sampler log-probs are `gap` from the trainer's come from another policy than the one
    trained ("`where`: mean |log-prob difference| ... > LOGPROB_GAP_LIMIT ..."), or None when the sampler can be
    trusted. rejected: the step's update was not applied (update.update_policy's max_sampler_gap), which the reason
    says. What follows (generation falls back to Hugging Face generate()) is sampling.after_gap's."""
    if not math.isfinite(gap.mean) or gap.mean <= LOGPROB_GAP_LIMIT:
        return None
    return f"{where}: {gap.describe()}" + ("; the step's update is not applied" if rejected else "")
