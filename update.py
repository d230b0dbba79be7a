"""The update phase of GRPO-PODS (paper Algorithm 1, policy update on the m kept rollouts per prompt, §3.1-3.2):
the one implementation train.py and the benchmarks both call.

- `kept_batch`: a selection (pods.py: [P, m] indices, a [P, n] mask, or rows) as rollout rows -> an `UpdateBatch`.
- `fill_logprobs`: one no-grad pass for what the loss compares against: old log-probs (only when needed: with one
  update per batch pi_old = pi and the ratio is 1) and reference log-probs (only KL beta > 0: the LoRA adapter
  switched off is the reference policy, so no second model is held).
- `update_policy`: mu optimizer steps, each accumulated over micro-batches whose padding columns are cut. Every
  micro-batch's loss is a *sum* (grpo_loss.grpo_loss_sum) divided by one normaliser of the whole step
  (`loss_denominator`), so the accumulated gradient is that of one batch of all kept rows whatever the micro-batch
  size. Then gradient clipping and the optimizer step; no rows (every prompt dropped): no optimizer step. Its options
  are named parts it calls in that order: `check_batches`, `_SamplerCheck` (the sampler gap), `checkpoint_plan`,
  `_accumulate` (the entropies only for --top-entropy-quantile), `_gradient_norm`, `_read_step` (the step's one host
  sync), `_finish_step` (a non-finite step skipped); the optimizers: OPTIMIZER_FACTORIES.

Choices: dropout is off during the update and the log-prob pass, as in TRL (the ratio and the KL compare
deterministic policies). Full fine-tuning in bf16 keeps fp32 master weights under bf16 autocast
(`UpdateSettings.autocast_dtype`): bf16 weights cannot hold updates of lr ~ 1e-6. An optimizer step whose loss or
gradient norm is not finite is not taken and is counted (`UpdateMetrics.skipped_steps`); the caller decides when to
stop. The sampler check (policy.py): the first pass (the policy that sampled) is compared with the sampler's
log-probs at no extra forward pass (`UpdateMetrics.sampler_gap`); --importance-sampling-correction also weights the
loss by pi_old / pi_sampler (its "token_reject" needs pi_old before the first backward: one more no-grad pass).
The GPU's pace: every decision about the batch's layout is made on the host (micro-batch widths, token counts,
prefix.completion_logprobs' layout), the batch goes to the device without waiting, and the device is read once per
optimizer step (loss, gradient norm, metrics, the sampler check: one copy). AdamW runs over all tensors at once
(foreach); on CUDA, TF32 float32 products, Liger-Kernel's fused RMSNorm, rotary and SiLU x up (checked against the
plain path first; one failing later in the step turns them off and the step runs again on the plain path), and as
little checkpoint replay as the memory needs (`checkpoint_plan`: MLPs first, then whole layers, to fit
MEMORY_CEILING): engine/kernels.py. Elsewhere the model runs as built (tests and benchmarks take the GPU paths on a
CPU: engine/gpu_paths.py). A bf16 base's LoRA adapter is computed in bf16 there (`lora_forward`, which
models.lora_in_base_dtype puts in place at loading), from copies that follow every optimizer step (OPTIMIZER_STEPS).
Several processes (multigpu/) hook in at one seam, `sum_over_processes`: the normaliser and the loss are summed over
processes, so the update is that of the global batch, and a non-finite loss anywhere skips the step everywhere.
"""

import contextlib
import functools
import math
import resource
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import grpo_loss
import loss_options
import policy
from engine import gpu_paths
from engine import kernels
from engine import prefix

ADAM_BETAS = (0.9, 0.99)  # the authors' released config
# Optimizer steps taken in this process, by any torch optimizer (a hook after every step): what tells the bf16 copies
# of a LoRA adapter (`lora_forward`) that the fp32 masters moved, since fused AdamW and bitsandbytes' 8-bit
# AdamW write them without bumping their version counters.
OPTIMIZER_STEPS = [0]


def _count_step(optimizer, args, kwargs):
    OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


class TrainingError(RuntimeError):
    """The run cannot go on for a reason the user can act on (train.py prints it as one line)."""


@dataclass
class UpdateBatch:
    """Kept rollouts: prompt part (left padded) and completion part (right padded), plus what the loss needs."""
    prompt_ids: torch.Tensor        # [B, Tp]
    prompt_mask: torch.Tensor       # [B, Tp]
    completion_ids: torch.Tensor    # [B, C]
    completion_mask: torch.Tensor   # [B, C], 1 up to and including the first EOS
    advantages: torch.Tensor        # [B] float
    truncated: torch.Tensor         # [B] bool, no EOS within the completion budget
    old_logprobs: torch.Tensor | None = None  # [B, C] (fill_logprobs, mu > 1)
    ref_logprobs: torch.Tensor | None = None  # [B, C] (fill_logprobs, kl_coef > 0)
    sampler_logprobs: torch.Tensor | None = None  # [B, C] the sampler's (sampling.Rollouts), checked every step
    engine_made: bool = False       # generated by the decode engine: an off-policy gap rejects the update


@dataclass
class UpdateSettings:
    micro_batch_size: int = 4       # sequences per forward/backward
    temperature: float = 1.0        # the sampling temperature: log-probs are of the policy that sampled
    updates_per_batch: int = 1      # mu
    max_grad_norm: float = 1.0      # <= 0: no clipping
    autocast_dtype: torch.dtype | None = None  # bf16 compute over fp32 weights (full fine-tuning)
    loss: loss_options.LossSettings = loss_options.LossSettings()  # every option of the loss, passed to it unchanged
    prefix_sharing: bool = True     # each distinct prompt token computed once (prefix.py); False: every row in full


@dataclass
class UpdateMetrics:
    loss: float                 # mean over the mu optimizer steps of the full-batch loss (all processes)
    grad_norm: float            # mean over the mu steps of the gradient norm before clipping
    token_means: dict           # grpo_loss metrics (clip ratios, ratio_mean, kl), token-weighted over the batch
    rows: int                   # kept rows trained on (this process)
    optimizer_steps: int        # optimizer steps taken
    skipped_steps: int          # optimizer steps not taken: non-finite loss or gradient norm
    tokens: int = 0             # kept tokens the token means are over (this process; merged across processes)
    sampler_gap: policy.SamplerGap | None = None  # the sampler's log-probs vs this update's (first pass)
    sampler_ratios: list | None = None  # per batch, [B] each kept row's mean pi / pi_sampler (NaN: no tokens)
    sampler_rejected: bool = False  # the gap exceeded max_sampler_gap: no optimizer step taken (off-policy rollouts)


@dataclass
class MicroBatch:
    """A slice of rows of an UpdateBatch on the device, without the padding columns no row of it needs."""
    rows: slice
    input_ids: torch.Tensor         # [b, Tp' + C']
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor   # [b, C'], the loss mask (truncated rows zeroed with mask_truncated)
    advantages: torch.Tensor        # [b]
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sampler_logprobs: torch.Tensor | None = None
    host: tuple = ()                # (input_ids, attention_mask) on the host: what the host decides from
    tokens: int = 0                 # tokens of the loss mask

    @property
    def width(self):
        return self.completion_mask.shape[1]


def kept_rows(kept, n):
    """Rollout rows (sampling.Rollouts order: row i*n + j is rollout j of prompt i) of a selection: kept [P, m]
    indices into each prompt's n rollouts (row i*n + kept[i, j]), a bool mask [P, n], or already a row list [R]."""
    if kept.dtype == torch.bool and kept.dim() == 2 and kept.shape[1] == n:
        return kept.cpu().flatten().nonzero().squeeze(1)
    if kept.dtype == torch.bool or kept.dim() not in (1, 2):
        raise ValueError(f"kept must be [P, m] indices, a [P, n = {n}] bool mask or a row list [R]; got "
                         f"{kept.dtype} {tuple(kept.shape)}")
    if kept.dim() == 2 and kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n):
        raise ValueError(f"kept indices must lie in [0, n = {n})")
    return kept.cpu() if kept.dim() == 1 else (torch.arange(kept.shape[0])[:, None] * n + kept.cpu()).flatten()


def kept_batch(rollouts, kept, advantages):
    """UpdateBatch of the selected rollouts (`kept_rows`). advantages: one per kept rollout in that order ([P, m]
    or [R]), or [P, n] with a mask (read at the mask)."""
    num_prompts = rollouts.prompt_ids.shape[0]
    n = rollouts.completion_ids.shape[0] // max(num_prompts, 1)
    rows = kept_rows(kept, n)
    if kept.dtype == torch.bool and advantages.shape == kept.shape:
        advantages = advantages[kept]
    if (kept.dim() == 2 and kept.shape[0] != num_prompts) or advantages.numel() != len(rows):
        raise ValueError(f"kept {tuple(kept.shape)} and advantages {tuple(advantages.shape)} do not match "
                         f"P = {num_prompts} prompts and each other")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_prompts * n):
        raise ValueError(f"kept rows must lie in [0, P*n = {num_prompts * n})")
    prompt_rows = rollouts.prompt_index[rows]
    sampler = None if rollouts.sampler_logprobs is None else rollouts.sampler_logprobs[rows]
    return UpdateBatch(rollouts.prompt_ids[prompt_rows], rollouts.prompt_mask[prompt_rows],
                       rollouts.completion_ids[rows], rollouts.completion_mask[rows],
                       advantages.flatten().float().cpu(), rollouts.truncated[rows], sampler_logprobs=sampler,
                       engine_made=rollouts.backend != "hf")


def loss_mask(batch, mask_truncated=False):
    """The completion tokens that count in the loss: completion_mask, truncated rows zeroed with mask_truncated."""
    return loss_options.mask_truncated(batch.completion_mask, batch.truncated) if mask_truncated else \
        batch.completion_mask


def micro_batches(batch, size, device, mask_truncated=False):
    """MicroBatches of at most `size` rows, padding columns no row of the slice needs cut off (left of the
    prompts, right of the completions): a short micro-batch costs what its own longest row costs. Their
    completion_mask is the loss mask (`loss_mask`); the attention still sees every generated token."""
    mask = loss_mask(batch, mask_truncated)

    def to_device(tensor):  # asynchronous: the host goes on queueing work (the batch stays in host memory)
        return None if tensor is None else tensor.to(device, non_blocking=True)

    for rows, prompt_width, width in _micro_batch_widths(batch, size):
        input_ids = torch.cat([batch.prompt_ids[rows, -prompt_width:], batch.completion_ids[rows, :width]], 1)
        attention_mask = torch.cat([batch.prompt_mask[rows, -prompt_width:], batch.completion_mask[rows, :width]], 1)
        old, ref, sampler = (None if logprobs is None else to_device(logprobs[rows, :width])
                             for logprobs in (batch.old_logprobs, batch.ref_logprobs, batch.sampler_logprobs))
        yield MicroBatch(rows, to_device(input_ids), to_device(attention_mask), to_device(mask[rows, :width]),
                         to_device(batch.advantages[rows]), old, ref, sampler, host=(input_ids, attention_mask),
                         tokens=int(mask[rows, :width].sum()))


def _micro_batch_widths(batch, size):
    """(rows, prompt columns, completion columns) of each micro-batch of `size` rows: the columns its longest
    prompt and its longest completion need (at least one)."""
    for start in range(0, len(batch.advantages), size):
        rows = slice(start, start + size)
        yield rows, int(batch.prompt_mask[rows].sum(1).max()), max(1, int(batch.completion_mask[rows].sum(1).max()))


# Of a CUDA device's memory, what the update's plan leaves aside for what it does not count (the allocator's
# fragmentation, the estimate's own error); and what it plans for whatever the card: a 48 GB L40S with margin (the
# weights, the engine's copy and cache, the logits and the saved activations).
MEMORY_MARGIN = 0.25
MEMORY_CEILING = 40 * 2 ** 30


def activation_budget(device):
    """Bytes the update's saved activations and logits may take on `device`: the least of its free memory (with what
    torch holds unused) less MEMORY_MARGIN of the card, and MEMORY_CEILING less what is allocated; None where the GPU
    paths do not run (nothing is decided from memory there; gpu_paths: an emulated card's memory)."""
    if torch.device(device).type not in gpu_paths.DEVICE_TYPES:
        return None
    free, total, allocated, reserved = gpu_paths.memory(device)
    unused = reserved - allocated   # held by torch's allocator, free to reuse
    return min(free + unused - MEMORY_MARGIN * total, MEMORY_CEILING - allocated)


def checkpoint_plan(model, batches, settings, device):
    """(layers replayed whole, layers whose MLP alone replays) in this update's backward (kernels.checkpointing), for
    a model built with gradient checkpointing: as little replay as the largest micro-batch's saved activations
    (kernels.saved_bytes_per_token) and logits (with a fused head, one chunk of them) need to fit `activation_budget`
    (kernels.checkpoint_plan); (None, 0):
    every layer whole, as built, where no budget is known (off CUDA) or with several processes (they would have to
    measure together)."""
    budget = activation_budget(device)  # first: off CUDA nothing is planned (engine/kernels.py not entered)
    layers = 0 if budget is None or prefix.several_processes() else len(kernels.checkpointable_layers(model))
    if not layers:
        return None, 0
    parts = [(min(rows.stop, len(batch.advantages)) - rows.start, prompt, completion) for batch in batches
             for rows, prompt, completion in _micro_batch_widths(batch, settings.micro_batch_size)]
    tokens = max(rows * (prompt + completion) for rows, prompt, completion in parts)
    logits = 4 * 4 * policy._LOGSUMEXP_CHUNK_ELEMENTS  # the log-softmax's float32 chunks
    if policy.fused_head(model) is None:  # the model's own logits, and their gradient, whole
        logits += max(rows * completion for rows, _, completion in parts) * \
            policy.hf_model(model).config.vocab_size * 2 * next(model.parameters()).element_size()
    return kernels.checkpoint_plan(layers, kernels.saved_bytes_per_token(model), tokens, budget - logits)


def on_gpu(device):
    """Whether the update's GPU fast paths act on `device` (engine/kernels.py): CUDA, or the device engine/gpu_paths.py
    emulates one on."""
    return torch.device(device).type in gpu_paths.DEVICE_TYPES


@contextlib.contextmanager
def _gpu_paths(model, device, settings, plan=(None, 0)):
    """For the block, on a GPU: the fused kernels and the activation checkpointing plan (engine/kernels.py);
    elsewhere the model as built (off CUDA the plan is (None, 0): every checkpointed layer whole, as built). Yields
    how to run the block's work: once (on a GPU, again on the plain path if a fused kernel fails in it:
    kernels.with_fallback)."""
    if not on_gpu(device):
        yield lambda work: work()
        return
    with kernels.fused_kernels(model, device, settings.autocast_dtype) as fall_back, \
            kernels.checkpointing(model, *plan):
        yield functools.partial(kernels.with_fallback, fall_back)


@contextlib.contextmanager
def _compute(settings, device):
    """The update's numerics: bf16 autocast for full fine-tuning in bf16 (settings.autocast_dtype); on CUDA, TF32 for
    any float32 matrix product (kernels.tf32_matmuls)."""
    with contextlib.ExitStack() as stack:
        if settings.autocast_dtype is not None:
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=settings.autocast_dtype))
        if on_gpu(device):
            stack.enter_context(kernels.tf32_matmuls(device))
        yield


def _logprobs(model, micro, settings, device, step=None, with_entropies=False):
    """The micro-batch's completion log-probs [b, C'] (grad mode as the caller's), each distinct prompt run once
    where prefix.logprobs_function allows it, reading the step's shared prefix where `_step_prefix` ran one: the same
    numbers either way, up to float rounding."""
    logprobs = prefix.logprobs_function(model, settings.prefix_sharing)
    options = {} if logprobs is policy.token_logprobs else dict(host=micro.host)
    if step is not None:
        options["step"] = step
    if with_entropies:  # (logprobs, entropies): --top-entropy-quantile
        options["with_entropies"] = True
    with _compute(settings, device):
        return logprobs(model, micro.input_ids, micro.attention_mask, micro.width, settings.temperature, **options)


def _step_prefix(model, batches, settings, device):
    """The prefix every prompt of the step shares, run once for all its micro-batches (prefix.step_prefix; in grad
    mode its gradient goes back after the last micro-batch: prefix.backward_step_prefix), or None: one micro-batch
    (it shares its own prefix), prefix sharing off or not possible here, several processes (prefix.several_processes),
    or no shared token."""
    micro_batch_count = sum(math.ceil(len(batch.advantages) / settings.micro_batch_size) for batch in batches)
    if micro_batch_count < 2 or prefix.several_processes() or \
            prefix.logprobs_function(model, settings.prefix_sharing) is not prefix.completion_logprobs:
        return None
    ids = prefix.step_prefix_ids((batch.prompt_ids, batch.prompt_mask) for batch in batches)
    if ids is None or len(ids) == 0:
        return None
    with _compute(settings, device):
        return prefix.step_prefix(model, ids)


def needs_old_logprobs(settings):
    """mu > 1 (pi_old is the policy before the first step), or --importance-sampling-correction token_reject, whose
    rejected tokens leave the loss normaliser, which must be known before the first micro-batch's backward."""
    return settings.updates_per_batch > 1 or settings.loss.importance_sampling_correction == "token_reject"


def fill_logprobs(model, batches, settings):
    """Set each batch's old_logprobs (only `needs_old_logprobs`) and ref_logprobs (only kl_coef > 0; LoRA adapter
    disabled = the reference policy), each in one no-grad pass over the update's micro-batches (the step's shared
    prefix run once per pass); None where not needed."""
    need_old, need_ref = needs_old_logprobs(settings), settings.loss.kl_coef > 0
    if need_ref and not hasattr(model, "disable_adapter"):
        raise ValueError("kl_coef > 0 needs a LoRA model: the adapter switched off is the reference policy")
    device = next(model.parameters()).device
    passes = {"ref_logprobs": model.disable_adapter if need_ref else None,
              "old_logprobs": contextlib.nullcontext if need_old else None}
    def fill():
        for name, which in passes.items():
            for batch in batches:
                setattr(batch, name, None if which is None else torch.zeros(batch.completion_ids.shape, device=device))
            if which is None:
                continue
            with which():
                step = _step_prefix(model, batches, settings, device)
                for batch in batches:
                    for micro in micro_batches(batch, settings.micro_batch_size, device):
                        getattr(batch, name)[micro.rows, :micro.width] = _logprobs(model, micro, settings, device, step)

    with torch.no_grad(), policy.dropout_off(model, keep_checkpointing=True), \
            _gpu_paths(model, device, settings) as run:
        run(fill)


def micro_batch_loss(logprobs, micro, settings, entropies=None):
    """(the micro-batch's loss numerator, grpo_loss metrics): divided by `loss_normaliser` it adds up to the
    step's loss. mu == 1 and no old log-probs: pi_old = pi, so the ratio is 1 with no extra forward pass."""
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    return grpo_loss.grpo_loss_sum(logprobs, old, micro.advantages, micro.completion_mask, settings.loss,
                                   micro.ref_logprobs, micro.sampler_logprobs, entropies)


def loss_denominator(batches, settings):
    """What the step's loss numerators are divided by (grpo_loss.loss_denominator over every batch's loss mask):
    kept rows ("sequence", paper §3.1), kept tokens ("token") or rows x max completion tokens ("fixed"), a number
    known on the host. With --importance-sampling-correction token_reject, "token" counts the tokens it accepts
    (grpo_loss.loss_tokens), which pi_old decides on the device: a 0-dim tensor there, read with the loss (no sync of
    its own). A sum over rows: several processes sum their values."""
    loss = settings.loss
    masks = [loss_mask(batch, loss.mask_truncated) for batch in batches]
    if loss.importance_sampling_correction != "token_reject" or loss.aggregation != "token":
        return grpo_loss.loss_denominator(masks, loss.aggregation, loss.max_completion_tokens)
    kept = []
    for batch, mask in zip(batches, masks):
        device = mask.device if batch.old_logprobs is None else batch.old_logprobs.device
        sampler = None if batch.sampler_logprobs is None else batch.sampler_logprobs.to(device, non_blocking=True)
        kept.append(grpo_loss.loss_tokens(mask.to(device, non_blocking=True), batch.old_logprobs, sampler, loss)
                    .bool().sum())
    return sum(kept)


def _accumulate(model, optimizer, batches, settings, device, normaliser, ratios=None):
    """One optimizer step's gradients, from zero: the forward and backward passes over every micro-batch (the step's
    shared prefix run once, its gradient sent back after the last) -> (the loss on the device, the metrics'
    token-weighted sums, the sampler check's sums or None, the tokens). ratios: per batch, [B] on the device: with
    them (the first pass), the sampler check runs and each kept row's mean ratio is written there."""
    optimizer.zero_grad(set_to_none=True)
    loss, metric_sums, gap_sums, tokens = torch.zeros((), device=device), {}, None, 0
    step = _step_prefix(model, batches, settings, device)
    for index, batch in enumerate(batches):
        for micro in micro_batches(batch, settings.micro_batch_size, device, settings.loss.mask_truncated):
            logprobs, entropies = _logprobs_and_entropies(model, micro, settings, device, step)
            if ratios is not None:
                gap_sums = _check_sampler(gap_sums, ratios[index], logprobs, micro)
            loss_sum, metrics = micro_batch_loss(logprobs, micro, settings, entropies)
            scaled = loss_sum / normaliser
            scaled.backward()
            loss = loss + scaled.detach()
            tokens += micro.tokens
            for key, value in metrics.items():  # token means -> token-weighted over micro-batches
                metric_sums[key] = metric_sums.get(key, 0.0) + value * micro.tokens
    if step is not None:  # every micro-batch's gradient on the shared prefix, through its forward once
        prefix.backward_step_prefix(step)
    return loss, metric_sums, gap_sums, tokens


def _logprobs_and_entropies(model, micro, settings, device, step):
    """(the micro-batch's log-probs, the policy's entropies at them or None): the entropies only where
    --top-entropy-quantile masks the loss by them."""
    if settings.loss.top_entropy_quantile < 1:
        return _logprobs(model, micro, settings, device, step, True)
    return _logprobs(model, micro, settings, device, step), None


def _check_sampler(gap_sums, ratios, logprobs, micro):
    """The sampler check of a micro-batch (policy.py): its gap sums added to `gap_sums`, each of its rows' mean
    ratio pi / pi_sampler written into `ratios` (its batch's, on the device) -> the gap sums."""
    gap_sums = policy.add_gap_sums(gap_sums, policy.gap_sums(logprobs, micro.sampler_logprobs, micro.completion_mask))
    ratios[micro.rows] = policy.row_mean_ratios(logprobs, micro.sampler_logprobs, micro.completion_mask)
    return gap_sums


def update_policy(model, optimizer, batches, settings, sum_over_processes=None, max_sampler_gap=None):
    """mu = settings.updates_per_batch optimizer steps on `batches` (fill_logprobs first when mu > 1 or
    kl_coef > 0) -> UpdateMetrics. A step whose loss or gradient norm is not finite is skipped (no optimizer step,
    gradients dropped). Gradients of the last step stay on the parameters. No rows (every prompt dropped): nothing
    to train on, no optimizer step (optimizer_steps = 0, loss 0). sum_over_processes: a number summed over the
    processes of a multi-process run (multigpu/); None: this process alone. max_sampler_gap: a mean sampler gap
    (over every process) above which rollouts of the decode engine are off-policy (policy.off_policy): known after the
    first forward pass, so that step is rejected before its optimizer step (sampler_rejected; gradients dropped,
    nothing taken). Rollouts of Hugging Face generate() are checked too but never rejected: nothing to fall back to."""
    total = sum_over_processes or (lambda value: value)
    max_sampler_gap = _engine_gap_limit(batches, max_sampler_gap, total)
    rows = sum(len(batch.advantages) for batch in batches)
    denominator = total(loss_denominator(batches, settings))  # every step's normaliser: the global batch's
    if total(rows) == 0:  # every prompt dropped
        optimizer.zero_grad(set_to_none=True)
        return UpdateMetrics(loss=0.0, grad_norm=0.0, token_means={}, rows=0, optimizer_steps=0, skipped_steps=0)
    check_batches(batches, settings)
    device = next(model.parameters()).device
    check = _SamplerCheck.of(batches, device, max_sampler_gap)
    # no kept token: the numerators are 0 too
    normaliser = denominator.clamp(min=1) if torch.is_tensor(denominator) else max(denominator, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = _Steps()
    plan = checkpoint_plan(model, batches, settings, device) if rows else (None, 0)
    with policy.dropout_off(model, keep_checkpointing=True), _gpu_paths(model, device, settings, plan) as run:
        for _ in range(settings.updates_per_batch):  # mu optimizer steps on the same rollouts
            first_pass = not steps.losses  # the policy before its first optimizer step: the one that sampled
            loss, metric_sums, gap_sums, tokens = run(functools.partial(
                _accumulate, model, optimizer, batches, settings, device, normaliser,
                check.ratios if check.on and first_pass else None))
            grad_norm = _gradient_norm(params, settings.max_grad_norm)
            loss, grad_norm, metric_sums = _read_step(loss, grad_norm, metric_sums, gap_sums, check)  # one sync
            loss = total(loss)  # the global batch's loss: not finite if any process's is
            steps.rejected = first_pass and check.rejects(total)
            steps.add(loss, grad_norm, metric_sums, tokens, _finish_step(optimizer, loss, grad_norm, steps.rejected))
            if steps.rejected:
                break
    return steps.metrics(rows, check)


def _engine_gap_limit(batches, max_sampler_gap, total):
    """max_sampler_gap where some process's batches come from the decode engine, else None: rollouts of Hugging Face
    generate() are checked but never rejected (nothing to fall back to)."""
    if max_sampler_gap is not None and not total(int(any(batch.engine_made for batch in batches))):
        return None
    return max_sampler_gap


def check_batches(batches, settings):
    """A ValueError line for batches the update cannot train on: without the log-probs fill_logprobs sets, without
    the sampler's an importance-sampling correction needs, or with an advantage not finite (on the host: no sync)."""
    for name, needed in (("old_logprobs", needs_old_logprobs(settings)), ("ref_logprobs", settings.loss.kl_coef > 0)):
        if needed and any(getattr(batch, name) is None for batch in batches):
            raise ValueError(f"the batches lack {name}: call fill_logprobs(model, batches, settings) first")
    if settings.loss.importance_sampling_correction != "none" and any(batch.sampler_logprobs is None
                                                                      for batch in batches):
        raise ValueError("importance sampling correction needs the sampler's log-probs (sampling.Rollouts)")
    if not all(bool(torch.isfinite(batch.advantages).all()) for batch in batches):
        raise ValueError(f"advantages contain non-finite values: {[batch.advantages.tolist() for batch in batches]}")


@dataclass
class _SamplerCheck:
    """The first pass against the sampler's log-probs (policy.py), on when every batch has them: the gap, per
    batch each kept row's mean ratio pi / pi_sampler ([B], NaN: no tokens; on the device until read), and the limit
    of the gap above which the step is rejected (None: never)."""
    on: bool
    gap: policy.SamplerGap
    ratios: list
    limit: float | None

    @classmethod
    def of(cls, batches, device, limit):
        return cls(all(batch.sampler_logprobs is not None for batch in batches), policy.SamplerGap(),
                   [torch.full((len(batch.advantages),), math.nan, device=device) for batch in batches], limit)

    def rejects(self, total):
        """Whether the mean gap over every process exceeds the limit (every process decides on the global gap alike):
        trained on, these rollouts would move the policy by another policy's samples."""
        return self.limit is not None and total(self.gap.abs_sum) / max(total(self.gap.tokens), 1) > self.limit


def _gradient_norm(params, max_grad_norm):
    """The gradient norm before clipping (on the device), the gradients clipped to max_grad_norm (<= 0: not clipped);
    with sharded parameters (FSDP2) the norm over every process's shards."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf, foreach=True)
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def _read_step(loss, grad_norm, metric_sums, gap_sums, check):
    """The step's one host sync: the loss, the gradient norm and the metrics' sums and, on the checked first pass
    (gap_sums), the sampler check, in one copy -> (loss, grad_norm, {metric: sum}); the sampler check's gap and rows'
    ratios (on the host) go into `check`."""
    on_device = [loss, grad_norm, *metric_sums.values()]
    if gap_sums is not None:
        on_device += [gap_sums, *check.ratios]
    values = torch.cat([value.detach().float().reshape(-1) for value in on_device]).cpu()
    sums = dict(zip(metric_sums, values[2:].tolist()))
    if gap_sums is not None:
        check.gap = policy.SamplerGap.from_sums(values[2 + len(metric_sums):][:len(gap_sums)].tolist())
        check.ratios = list(values[2 + len(metric_sums) + len(gap_sums):].split([len(r) for r in check.ratios]))
    return float(values[0]), float(values[1]), sums


def _finish_step(optimizer, loss, grad_norm, rejected):
    """The optimizer step on the accumulated gradients, or none, the gradients dropped: rejected (the sampler check),
    or a loss or gradient norm not finite (one bad batch must not write NaN into the weights, and every later
    checkpoint) -> whether it was skipped for that."""
    if not rejected and math.isfinite(loss) and math.isfinite(grad_norm):
        optimizer.step()
        return False
    optimizer.zero_grad(set_to_none=True)
    return not rejected


@dataclass
class _Steps:
    """The update's optimizer steps as read on the host: what UpdateMetrics reports."""
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    token_sums: dict = field(default_factory=dict)
    tokens: int = 0
    skipped: int = 0
    rejected: bool = False

    def add(self, loss, grad_norm, metric_sums, tokens, skipped):
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        for key, value in metric_sums.items():
            self.token_sums[key] = self.token_sums.get(key, 0.0) + value
        self.tokens += tokens
        self.skipped += skipped

    def metrics(self, rows, check):
        passes = len(self.losses)
        return UpdateMetrics(loss=sum(self.losses) / passes, grad_norm=sum(self.grad_norms) / passes,
                             token_means={key: value / max(self.tokens, 1) for key, value in self.token_sums.items()},
                             rows=rows, optimizer_steps=0 if self.rejected else passes - self.skipped,
                             skipped_steps=self.skipped, tokens=self.tokens // passes,
                             sampler_gap=check.gap if check.on else None,
                             sampler_ratios=[r.cpu() for r in check.ratios] if check.on else None,
                             sampler_rejected=self.rejected)


def _adamw(params, **options):
    """torch's AdamW over all tensors at once (foreach: a few kernels over every tensor; CUDA's default, the same
    numbers as one tensor at a time)."""
    return torch.optim.AdamW(params, foreach=True, **options)


def _adamw8bit(params, **options):
    """bitsandbytes' 8-bit AdamW (CUDA)."""
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, **options)


# --optimizer -> (the trainable parameters, lr, betas, weight_decay) -> the optimizer
OPTIMIZER_FACTORIES = {"adamw": _adamw, "adamw8bit": _adamw8bit}
OPTIMIZERS = tuple(OPTIMIZER_FACTORIES)


def make_optimizer(model, learning_rate, weight_decay=0.0, optimizer_name="adamw"):
    """AdamW (or bitsandbytes' 8-bit AdamW) over the trainable parameters, the authors' betas."""
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer_name!r}; expected one of {OPTIMIZERS}")
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZER_FACTORIES[optimizer_name](params, lr=learning_rate, betas=ADAM_BETAS, weight_decay=weight_decay)


def set_hyperparameters(optimizer, learning_rate, weight_decay):
    """The given learning rate and weight decay in every parameter group: a resumed optimizer state carries the
    old run's values, and the flags of the resumed run must win."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = learning_rate, weight_decay


def peak_memory_gib(device, reserved=False):
    """CUDA: peak allocated (or reserved) memory since the last reset; CPU: the process's peak RSS."""
    if torch.device(device).type == "cuda":
        peak = torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ------------------------------------------------ a bf16 base's LoRA adapter computed in bf16
# models.lora_in_base_dtype puts `lora_forward` in place of each peft LoRA Linear's forward when the policy is loaded:
# where the GPU paths run (or a CPU computes bf16 natively), a bf16 base's fp32 adapter is computed in bf16, from
# copies refreshed after every optimizer step (OPTIMIZER_STEPS), in three matrix products.

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


def _low_precision_copies(module, adapter, dtype):
    """The adapter's A and B weights in `dtype`, cast once per change of the weights and reused by every forward until
    then: an optimizer step (OPTIMIZER_STEPS: fused AdamW and bitsandbytes' 8-bit AdamW write the weights without
    bumping their versions) or an in-place write that bumps their version (a checkpoint loaded)."""
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    key = (OPTIMIZER_STEPS[0], a._version, b._version, dtype, a.data_ptr(), b.data_ptr())
    cached = module.__dict__.get("_low_precision_lora")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, a.to(dtype), b.to(dtype))
        module.__dict__["_low_precision_lora"] = cached
    return cached[1], cached[2]


def lora_forward(module, peft_forward):
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
        a_low, b_low = _low_precision_copies(module, adapter, x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        out = LoRAProduct.apply(flat, base.weight, base.bias, module.lora_A[adapter].weight,
                                module.lora_B[adapter].weight, a_low, b_low, module.scaling[adapter])
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return forward
