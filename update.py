"""The update phase of GRPO-PODS (paper Algorithm 1, policy update on the m kept rollouts per prompt, §3.1-3.2):
the one implementation train.py and the benchmarks both call.

- `kept_batch` maps a selection (pods.py: [P, m] indices, a [P, n] mask, or rows) to rollout rows (row
  i*n + kept[i, j]) -> an `UpdateBatch`.
- `fill_logprobs`: one no-grad pass for what the loss compares against: old log-probs (only mu > 1; with one
  update per batch pi_old = pi and the ratio is 1) and reference log-probs (only KL beta > 0: the LoRA adapter
  switched off is the reference policy, so no second model is held).
- `update_policy`: mu optimizer steps, each accumulated over micro-batches whose padding columns are cut.
  Every micro-batch's loss is a *sum* (grpo_loss.grpo_loss_sum) divided by one normaliser of the whole step
  (`loss_denominator`: its rows, kept tokens or rows x max tokens by the loss aggregation), so the accumulated
  gradient equals the gradient of one batch of all kept rows whatever the micro-batch size. Then gradient
  clipping and the optimizer step. An update with no rows (every prompt dropped) takes no optimizer step.

Choices: dropout is off during the update (and the log-prob pass), as in TRL: the ratio and the KL compare
deterministic policies. Full fine-tuning in bf16 keeps fp32 master weights and runs the forward passes under
bf16 autocast (`UpdateSettings.autocast_dtype`, see models.compute_dtypes): bf16 weights cannot hold updates of
lr ~ 1e-6. Non-finite guard: an optimizer step whose loss or gradient norm is not finite is not taken (its
gradients are dropped) and is counted in `UpdateMetrics.skipped_steps`; the caller decides when to stop.
The sampler check (rollout_check.py): the first pass of `update_policy` (the policy that sampled) is compared
with the sampler's log-probs of the kept tokens, at no extra forward pass (`UpdateMetrics.sampler_gap`); with
`LossSettings.importance_sampling_correction` pi_old / pi_sampler also weights the loss (grpo_loss.importance_weights);
"token_reject" takes its rejected tokens out of the loss mask and the normaliser, which must be known before the
first backward, so `fill_logprobs` computes pi_old for it even with mu = 1 (one more no-grad pass).
The GPU's pace: the batch stays in host memory, where every decision about its layout is made (micro-batch widths,
token counts, prefix.completion_logprobs' layout), and goes to the device without waiting (non_blocking); the device
is read once per optimizer step (loss, gradient norm, metrics, the sampler check: one copy), so the host never waits
for the GPU mid-step. The optimizer is AdamW over all tensors at once (foreach), float32 products may use TF32 on CUDA,
and RMSNorm, rotary embedding and SiLU x up run as fused kernels there when Liger-Kernel is installed
(models.fused_kernels: checked against the plain path first, which is what runs elsewhere). With gradient
checkpointing, the backward replays only what the memory needs (`checkpoint_plan`, models.checkpointing): on CUDA,
MLPs first, then whole layers, for the activations to fit MEMORY_CEILING; elsewhere every layer, as built.
Several processes (multigpu/) hook in at one seam, `sum_over_processes`: the normaliser and the loss are summed over
processes, so the update is that of the global batch, and a non-finite loss anywhere skips the step everywhere.
"""

import contextlib
import math
import resource
from dataclasses import dataclass

import torch

import grpo_loss
import models
from engine import prefix
from engine import rollout_check

OPTIMIZERS = ("adamw", "adamw8bit")
ADAM_BETAS = (0.9, 0.99)  # the authors' released config


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


@dataclass
class UpdateSettings:
    micro_batch_size: int = 4       # sequences per forward/backward
    temperature: float = 1.0        # the sampling temperature: log-probs are of the policy that sampled
    updates_per_batch: int = 1      # mu
    max_grad_norm: float = 1.0      # <= 0: no clipping
    autocast_dtype: torch.dtype | None = None  # bf16 compute over fp32 weights (full fine-tuning)
    loss: grpo_loss.LossSettings = grpo_loss.LossSettings()  # every option of the loss, passed to it unchanged
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
    sampler_gap: rollout_check.SamplerGap | None = None  # the sampler's log-probs vs this update's (first pass)
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
                       advantages.flatten().float().cpu(), rollouts.truncated[rows], sampler_logprobs=sampler)


def loss_mask(batch, mask_truncated=False):
    """The completion tokens that count in the loss: completion_mask, truncated rows zeroed with mask_truncated."""
    return grpo_loss.mask_truncated(batch.completion_mask, batch.truncated) if mask_truncated else batch.completion_mask


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
    torch holds unused) less MEMORY_MARGIN of the card, and MEMORY_CEILING less what is allocated; None off CUDA
    (nothing is decided from memory there)."""
    if torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    unused = torch.cuda.memory_reserved(device) - allocated   # held by torch's allocator, free to reuse
    return min(free + unused - MEMORY_MARGIN * total, MEMORY_CEILING - allocated)


def checkpoint_plan(model, batches, settings, device):
    """(layers replayed whole, layers whose MLP alone replays) in this update's backward (models.checkpointing), for
    a model built with gradient checkpointing: as little replay as the largest micro-batch's saved activations
    (models.saved_bytes_per_token) and logits need to fit `activation_budget` (models.checkpoint_plan); (None, 0):
    every layer whole, as built, where no budget is known (off CUDA) or with several processes (they would have to
    measure together)."""
    budget, layers = activation_budget(device), len(models.checkpointable_layers(model))
    if budget is None or prefix.several_processes() or not layers:
        return None, 0
    parts = [(min(rows.stop, len(batch.advantages)) - rows.start, prompt, completion) for batch in batches
             for rows, prompt, completion in _micro_batch_widths(batch, settings.micro_batch_size)]
    tokens = max(rows * (prompt + completion) for rows, prompt, completion in parts)
    logits = max(rows * completion for rows, _, completion in parts) * models.hf_model(model).config.vocab_size * \
        2 * next(model.parameters()).element_size() + 4 * 4 * grpo_loss._LOGSUMEXP_CHUNK_ELEMENTS
    return models.checkpoint_plan(layers, models.saved_bytes_per_token(model), tokens, budget - logits)


@contextlib.contextmanager
def _compute(settings, device):
    """The update's numerics: bf16 autocast for full fine-tuning in bf16 (settings.autocast_dtype); on CUDA, TF32 for
    any float32 matrix product (models.tf32_matmuls)."""
    with contextlib.ExitStack() as stack:
        if settings.autocast_dtype is not None:
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=settings.autocast_dtype))
        stack.enter_context(models.tf32_matmuls(device))
        yield


def _logprobs(model, micro, settings, device, step=None):
    """The micro-batch's completion log-probs [b, C'] (grad mode as the caller's), each distinct prompt run once
    where prefix.logprobs_function allows it, reading the step's shared prefix where `_step_prefix` ran one: the same
    numbers either way, up to float rounding."""
    logprobs = prefix.logprobs_function(model, settings.prefix_sharing)
    options = {} if logprobs is grpo_loss.token_logprobs else dict(host=micro.host)
    if step is not None:
        options["step"] = step
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
    with torch.no_grad(), models.dropout_off(model, keep_checkpointing=True), models.fused_kernels(model, device):
        for name, policy in passes.items():
            for batch in batches:
                setattr(batch, name, None if policy is None else torch.zeros(batch.completion_ids.shape, device=device))
            if policy is None:
                continue
            with policy():
                step = _step_prefix(model, batches, settings, device)
                for batch in batches:
                    for micro in micro_batches(batch, settings.micro_batch_size, device):
                        getattr(batch, name)[micro.rows, :micro.width] = _logprobs(model, micro, settings, device, step)


def micro_batch_loss(logprobs, micro, settings):
    """(the micro-batch's loss numerator, grpo_loss metrics): divided by `loss_normaliser` it adds up to the
    step's loss. mu == 1 and no old log-probs: pi_old = pi, so the ratio is 1 with no extra forward pass."""
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    return grpo_loss.grpo_loss_sum(logprobs, old, micro.advantages, micro.completion_mask, settings.loss,
                                   micro.ref_logprobs, micro.sampler_logprobs)


def loss_denominator(batches, settings):
    """What the step's loss numerators are divided by (grpo_loss.loss_denominator over every batch's loss mask, less
    the tokens --importance-sampling-correction token_reject rejects: grpo_loss.loss_tokens): kept rows
    ("sequence", paper §3.1), kept tokens ("token") or rows x max completion tokens ("fixed"). A sum over rows:
    several processes sum their values."""
    masks = [grpo_loss.loss_tokens(loss_mask(batch, settings.loss.mask_truncated), batch.old_logprobs,
                                   batch.sampler_logprobs, settings.loss) for batch in batches]
    return grpo_loss.loss_denominator(masks, settings.loss.aggregation, settings.loss.max_completion_tokens)


def update_policy(model, optimizer, batches, settings, sum_over_processes=None, max_sampler_gap=None):
    """mu = settings.updates_per_batch optimizer steps on `batches` (fill_logprobs first when mu > 1 or
    kl_coef > 0) -> UpdateMetrics. A step whose loss or gradient norm is not finite is skipped (no optimizer step,
    gradients dropped). Gradients of the last step stay on the parameters. No rows (every prompt dropped): nothing
    to train on, no optimizer step (optimizer_steps = 0, loss 0). sum_over_processes: a number summed over the
    processes of a multi-process run (multigpu/); None: this process alone. max_sampler_gap: a mean sampler gap
    (over every process) above which the rollouts are off-policy (rollout_check): known after the first forward
    pass, so that step is rejected before its optimizer step (sampler_rejected; gradients dropped, nothing taken)."""
    total = sum_over_processes or (lambda value: value)
    rows = sum(len(batch.advantages) for batch in batches)
    denominator = total(loss_denominator(batches, settings))
    if total(rows) == 0:
        optimizer.zero_grad(set_to_none=True)
        return UpdateMetrics(loss=0.0, grad_norm=0.0, token_means={}, rows=0, optimizer_steps=0, skipped_steps=0)
    for name, needed in (("old_logprobs", needs_old_logprobs(settings)), ("ref_logprobs", settings.loss.kl_coef > 0)):
        if needed and any(getattr(batch, name) is None for batch in batches):
            raise ValueError(f"the batches lack {name}: call fill_logprobs(model, batches, settings) first")
    if settings.loss.importance_sampling_correction != "none" and any(batch.sampler_logprobs is None
                                                                      for batch in batches):
        raise ValueError("importance sampling correction needs the sampler's log-probs (sampling.Rollouts)")
    if not all(bool(torch.isfinite(batch.advantages).all()) for batch in batches):  # on the host: no sync
        raise ValueError(f"advantages contain non-finite values: {[batch.advantages.tolist() for batch in batches]}")
    checked = all(batch.sampler_logprobs is not None for batch in batches)
    device = next(model.parameters()).device
    gap, ratios = rollout_check.SamplerGap(), [torch.full((len(batch.advantages),), math.nan, device=device)
                                               for batch in batches]
    normaliser = max(denominator, 1)  # no kept token: the numerators are 0 too
    params = [p for p in model.parameters() if p.requires_grad]
    clip = settings.max_grad_norm if settings.max_grad_norm > 0 else math.inf
    losses, grad_norms, token_sums, token_count, skipped, rejected = [], [], {}, 0, 0, False
    plan = checkpoint_plan(model, batches, settings, device) if rows else (None, 0)
    with models.dropout_off(model, keep_checkpointing=True), models.fused_kernels(model, device), \
            models.checkpointing(model, *plan):
        for _ in range(settings.updates_per_batch):
            optimizer.zero_grad(set_to_none=True)
            first_pass = not losses  # the policy before its first optimizer step: the one that sampled
            loss, metric_sums, gap_sums = torch.zeros((), device=device), {}, None
            step = _step_prefix(model, batches, settings, device)
            for batch, batch_ratios in zip(batches, ratios):
                for micro in micro_batches(batch, settings.micro_batch_size, device, settings.loss.mask_truncated):
                    logprobs = _logprobs(model, micro, settings, device, step)
                    if checked and first_pass:
                        gap_sums = rollout_check.add_gap_sums(gap_sums, rollout_check.gap_sums(
                            logprobs, micro.sampler_logprobs, micro.completion_mask))
                        batch_ratios[micro.rows] = rollout_check.row_mean_ratios(
                            logprobs, micro.sampler_logprobs, micro.completion_mask)
                    loss_sum, metrics = micro_batch_loss(logprobs, micro, settings)
                    scaled = loss_sum / normaliser
                    scaled.backward()
                    loss = loss + scaled.detach()
                    token_count += micro.tokens
                    for key, value in metrics.items():  # token means -> token-weighted over micro-batches
                        metric_sums[key] = metric_sums.get(key, 0.0) + value * micro.tokens
            if step is not None:  # every micro-batch's gradient on the shared prefix, through its forward once
                prefix.backward_step_prefix(step)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            if hasattr(grad_norm, "full_tensor"):  # sharded parameters (FSDP2): the norm over every process's shards
                grad_norm = grad_norm.full_tensor()
            # The step's one host sync: the loss, the gradient norm, the metrics (and, first, the sampler check).
            on_device = [loss, grad_norm, *metric_sums.values()]
            if gap_sums is not None:
                on_device += [gap_sums, *ratios]
            values = torch.cat([value.detach().float().reshape(-1) for value in on_device]).cpu()
            loss, grad_norm = float(values[0]), float(values[1])
            for key, value in zip(metric_sums, values[2:].tolist()):
                token_sums[key] = token_sums.get(key, 0.0) + value
            if gap_sums is not None:
                gap = rollout_check.SamplerGap.from_sums(values[2 + len(metric_sums):][:len(gap_sums)].tolist())
                ratios = list(values[2 + len(metric_sums) + len(gap_sums):].split([len(r) for r in ratios]))
            loss = total(loss)  # the global batch's loss: not finite if any process's is
            if max_sampler_gap is not None and first_pass:  # every process decides on the global gap alike
                rejected = total(gap.abs_sum) / max(total(gap.tokens), 1) > max_sampler_gap
            if rejected:  # trained on, these rollouts would move the policy by another policy's samples
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss)
                grad_norms.append(grad_norm)
                break
            if math.isfinite(loss) and math.isfinite(grad_norm):
                optimizer.step()
            else:  # one bad batch must not write NaN into the weights (and every later checkpoint)
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            losses.append(loss)
            grad_norms.append(grad_norm)
    passes = len(losses)
    return UpdateMetrics(loss=sum(losses) / passes, grad_norm=sum(grad_norms) / passes,
                         token_means={key: value / max(token_count, 1) for key, value in token_sums.items()},
                         rows=rows, optimizer_steps=0 if rejected else passes - skipped, skipped_steps=skipped,
                         tokens=token_count // passes, sampler_gap=gap if checked else None,
                         sampler_ratios=[r.cpu() for r in ratios] if checked else None, sampler_rejected=rejected)


def make_optimizer(model, learning_rate, weight_decay=0.0, optimizer_name="adamw"):
    """AdamW (or bitsandbytes' 8-bit AdamW) over the trainable parameters, the authors' betas."""
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer_name!r}; expected one of {OPTIMIZERS}")
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=learning_rate, betas=ADAM_BETAS, weight_decay=weight_decay)
    if optimizer_name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    # foreach: a few kernels over every tensor at once (CUDA's default; the same numbers as one tensor at a time)
    return torch.optim.AdamW(params, foreach=True, **kwargs)


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
