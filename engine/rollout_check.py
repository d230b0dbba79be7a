"""Are the rollouts on-policy? The sampler's log-probs against the trainer's, every step (paper Algorithm 1, line 1
against the update's log pi_theta: GRPO's policy gradient assumes the rollouts were sampled from pi_theta).

The decode engine (engine/) samples from its own code path: a merged weight copy, hand-written layers, CUDA graphs.
If anything in it drifts from the policy being trained (a stale copy, a wrong position, a graph replaying old
addresses), GRPO quietly trains on off-policy data. So every generated token carries its log-prob under the sampler
(`sampling.Rollouts.sampler_logprobs`), and the update's own forward pass (the policy before its optimizer step)
gives the trainer's log-prob of the same token: no extra pass. `SamplerGap` sums their difference; its metrics go to
metrics.jsonl every step; when the mean gap exceeds `LOGPROB_GAP_LIMIT`, a bound no correct sampler reaches
(docs/generation.md: the measurements it comes from), the step is not applied (the gap is known before the
optimizer step: update.update_policy's max_sampler_gap) and generation falls back to Hugging Face generate()
(`off_policy` says why; sampling.after_gap makes the switch).
Evaluation, which has no update pass, measures its first chunk with one forward pass (eval.measure_sampler_gap).

Metrics, per token t of a kept completion, delta_t = log pi_trainer(t) - log pi_sampler(t):
  sampler/logprob_diff_mean  mean |delta|          sampler/logprob_diff_max  max |delta|
  sampler/kl                 mean exp(delta) - delta - 1   (k3 estimate of KL(sampler || policy) per token)
  sampler/ratio_max          max exp(delta)        (the importance ratio; grpo_loss's --importance-sampling-correction)
Simplification: one threshold on the mean (the max is dominated by rare tokens in bf16); no per-token alarm.
"""

import math
from dataclasses import dataclass

import torch

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
