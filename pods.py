"""Down-sampling rules of PODS (paper §3.2-3.3, Lemma 1, Algorithm 2, Theorems 1-2): of n rollouts per prompt, keep
m, picked from the rewards alone, and give the kept ones group-relative advantages.

Lemma 1: some maximum-variance m-subset is always "the k highest + the (m-k) lowest" for some k in 0..m, so
`max_variance_indices` (Algorithm 2) scores all m+1 candidates with one sort and prefix sums of r and r^2, O(n log n)
per row; with binary rewards this is Theorem 2 (m/2 ones + m/2 zeros, given enough of each). Also: the ablation's
baselines, the advantages over the kept subset (§3.2), and `select_across_prompts`, the cross-prompt scope the paper
leaves as future work. `select` is what a step calls; `RULES` is the rules' registry (docs/method.md).

Simplifications: one scalar reward per rollout (already summed over reward functions); ties broken deterministically
(stable sort by reward, then position; the smallest k among equal-variance candidates), not randomly. Rules return
distinct positions (..., m) in ascending-reward order (max_reward: descending; random: random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): the flags read RULES without it
if TYPE_CHECKING:
    from torch import Tensor

SELECTION_SCOPES = ("prompt", "batch")
NORMALIZE_MODES = ("selected", "group")
SCALE_MODES = ("group", "batch", "none")


@dataclass(frozen=True)
class SelectionRule:
    """A down-sampling rule: `indices(rewards (..., n), m)` -> LongTensor (..., m) of distinct positions."""
    name: str
    indices: Callable[..., Tensor]
    summary: str                 # one line of markdown: the rules table of docs/method.md
    random: bool = False         # also takes generator= (seeded per round: a resumed step draws the same subset)
    batch_scope: bool = False    # fills each prompt's budget in the batch scope (select_across_prompts)


RULES: dict[str, SelectionRule] = {}  # name -> rule, in registration order (the paper's rule first)


def register_rule(name: str, summary: str, *, random: bool = False, batch_scope: bool = False):
    """Decorator: add `indices(rewards, m[, generator])` to RULES under `name` (the --rule value)."""
    def add(indices):
        RULES[name] = SelectionRule(name, indices, summary, random, batch_scope)
        return indices
    return add


def batch_scope_rules() -> tuple[str, ...]:
    """The rules the batch selection scope can fill each prompt's budget with."""
    return tuple(name for name, rule in RULES.items() if rule.batch_scope)


def _sorted_ascending(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Stable ascending sort along the last dim (ties keep position order): (values, indices)."""
    return torch.sort(rewards, dim=-1, stable=True)


@register_rule("max_variance", "a maximum-variance m-subset of each row (the paper's rule, Algorithm 2)",
               batch_scope=True)
def max_variance_indices(rewards: Tensor, m: int) -> Tensor:
    """Indices (..., m) of a maximum-variance m-subset of each row of rewards (..., n) (Algorithm 2): candidate k (the k
    highest + the m-k lowest) scores S2 - S1^2/m from prefix sums, in float64 on values shifted by one of the row's own
    so cancellation cannot pick a wrong k. Scores within 1e-12 x (the ends' sum of squares) of the best count as tied;
    the smallest k wins."""
    n = check_rewards(rewards, m, check_finite=False)  # finiteness is checked on the ends below
    sorted_r, order = _sorted_ascending(rewards)
    ends = torch.cat([sorted_r[..., :m], sorted_r[..., n - m :]], dim=-1) if 2 * m < n else sorted_r
    ends = ends.to(torch.float64)  # [m lowest, m highest]: the only values a candidate can hold
    width = ends.shape[-1]
    x = ends - ends[..., m - 1 : m]  # variance is shift invariant; shifting avoids cancellation
    prefix1 = torch.nn.functional.pad(x.cumsum(-1), (1, 0))
    prefix2 = torch.nn.functional.pad((x * x).cumsum(-1), (1, 0))
    total_ss = prefix2[..., width:]
    # sort puts NaN and +-inf at a row's ends, so a non-finite reward makes these sums non-finite
    if not bool(torch.isfinite(total_ss).all()):
        raise_non_finite(rewards)
    k = torch.arange(m + 1, device=x.device)
    low_end, high_start = m - k, width - k
    # Candidate k = ends[:m-k] + ends[width-k:]: its sums are prefix[m-k] + prefix[width] - prefix[width-k].
    s1 = prefix1.index_select(-1, low_end) + prefix1[..., width:] - prefix1.index_select(-1, high_start)
    s2 = prefix2.index_select(-1, low_end) + total_ss - prefix2.index_select(-1, high_start)
    score = s2 - s1 * s1 / m  # (..., m+1): m * population variance of candidate k
    near_best = score >= score.amax(dim=-1, keepdim=True) - 1e-12 * total_ss
    best_k = near_best.to(torch.uint8).argmax(dim=-1, keepdim=True)  # first True = smallest k
    # Subset position j (in sorted order) is j in the low part and j + (n - m) in the high part.
    j = torch.arange(m, device=x.device)
    return order.gather(-1, torch.where(j >= m - best_k, j + (n - m), j))


@register_rule("random", "m positions per row, uniform without replacement", random=True)
def random_indices(rewards: Tensor, m: int, generator: torch.Generator | None = None) -> Tensor:
    """m distinct positions per row drawn uniformly without replacement (random-subset baseline)."""
    check_rewards(rewards, m)
    rand_device = generator.device if generator is not None else rewards.device
    keys = torch.rand(rewards.shape, generator=generator, device=rand_device)
    return keys.argsort(dim=-1)[..., :m].to(rewards.device)


@register_rule("percentile", "the rewards at sorted positions `floor((2j+1)·n / (2m))`, j = 0..m−1 (the (j+0.5)/m "
               "quantiles; always distinct)")
def percentile_indices(rewards: Tensor, m: int) -> Tensor:
    """The rewards at sorted positions floor((2j + 1) n / (2m)), j = 0..m-1: the (j + 0.5)/m quantiles of each row
    (distinct, as consecutive positions differ by n/m >= 1)."""
    n = check_rewards(rewards, m)
    _, order = _sorted_ascending(rewards)
    j = torch.arange(m, device=rewards.device)
    return order[..., ((2 * j + 1) * n) // (2 * m)]


@register_rule("max_reward", "the m highest rewards (descending; ties: lower position first)")
def max_reward_indices(rewards: Tensor, m: int) -> Tensor:
    """The m highest rewards of each row, in descending order (ties: lower position first)."""
    check_rewards(rewards, m)
    return torch.sort(rewards, dim=-1, descending=True, stable=True).indices[..., :m]


@register_rule("none", "every rollout, `arange(n)`: plain GRPO (needs m == n)")
def all_indices(rewards: Tensor, m: int) -> Tensor:
    """Every position of each row, arange(n): plain GRPO, so m must equal n."""
    n = check_rewards(rewards, m)
    if m != n:
        raise ValueError(f"rule 'none' keeps every rollout, so it needs m == n; got m = {m}, n = {n}")
    return torch.arange(n, device=rewards.device).expand(rewards.shape).clone()


def downsample(rewards: Tensor, m: int, rule: str, generator: torch.Generator | None = None) -> Tensor:
    """Indices (..., m) of the rollouts to train on under `rule`, a name in RULES."""
    if rule not in RULES:
        raise ValueError(f"unknown down-sampling rule {rule!r}; expected one of {tuple(RULES)}")
    entry = RULES[rule]
    return entry.indices(rewards, m, generator=generator) if entry.random else entry.indices(rewards, m)


def zero_variance_prompts(rewards: Tensor) -> Tensor:
    """Bool (...): True where all n rewards of a prompt are equal (every advantage is 0, whatever is kept)."""
    check_rewards(rewards)
    return (rewards == rewards[..., :1]).all(dim=-1)


def _subset_sum_sq(rewards: Tensor, size: int) -> Tensor:
    """Sum of squared deviations of each row's max-variance `size`-subset, float64 (rows,)."""
    chosen = rewards.gather(-1, max_variance_indices(rewards, size)).to(torch.float64)
    return ((chosen - chosen.mean(-1, keepdim=True)) ** 2).sum(-1)


def batch_budgets(rewards: Tensor, m: int) -> Tensor:
    """Rollouts kept per prompt (P,) by `select_across_prompts` for rewards [P, n] (rule there)."""
    if rewards.dim() != 2:
        raise ValueError(f"batch selection needs rewards [P, n], got shape {tuple(rewards.shape)}")
    n = check_rewards(rewards, m)
    informative = (~zero_variance_prompts(rewards)).nonzero().squeeze(1)
    budgets = torch.zeros(rewards.shape[0], dtype=torch.long, device=rewards.device)
    if len(informative) == 0:
        return budgets
    base, extra = divmod(min(m * rewards.shape[0], len(informative) * n), len(informative))
    budgets[informative] = base
    if extra:  # base < n here, so base + 1 is a valid size
        group = rewards[informative]
        gain = _subset_sum_sq(group, base + 1) - _subset_sum_sq(group, base)
        best = torch.sort(gain, descending=True, stable=True).indices[:extra]  # ties: lower prompt first
        budgets[informative[best]] += 1
    return budgets


def select_across_prompts(rewards: Tensor, m: int, rule: str = "max_variance",
                          generator: torch.Generator | None = None) -> Tensor:
    """Batch selection scope: bool mask [P, n] of the rollouts to train on, m x P slots in all.

    Prompts whose n rewards are all equal get nothing; the other P' share M' = min(m P, P' n) slots: q = M' // P' each,
    q + 1 for the r = M' mod P' whose sum of squared deviations grows most from q to q + 1 (ties: lower index), each
    filling its budget with `rule` (one of `batch_scope_rules()`). With max-variance this exactly maximises the total
    within-group sum of squared deviations (the centred advantages' squared norm) over selections of M' rollouts, none
    on a zero-variance prompt, counts differing by at most one: only which r prompts get q + 1 is free, and that choice
    is separable (tested against brute force). With no zero-variance prompt it is the prompt scope.
    """
    _check_batch_rule(rule)
    budgets = batch_budgets(rewards, m)
    keep = torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device)
    for size in budgets.unique().tolist():
        rows = (budgets == size).nonzero().squeeze(1)
        if size > 0:
            keep[rows] = keep[rows].scatter(-1, downsample(rewards[rows], size, rule, generator), True)
    return keep


def _check_batch_rule(rule: str, scope: str = "batch") -> None:
    if scope not in SELECTION_SCOPES or (scope == "batch" and rule not in batch_scope_rules()):
        raise ValueError(f"selection scope {scope!r} with rule {rule!r}: expected one of {SELECTION_SCOPES}, "
                         f"'batch' only with {' or '.join(batch_scope_rules())}")


@dataclass(frozen=True)
class SelectSettings:
    """What `select` reads besides the rewards, built once per run (train.step_settings): its keywords by name."""
    m: int                             # --update-size
    rule: str = "max_variance"         # --rule
    normalize: str = "selected"        # --advantage-normalization
    scale_rewards: str = "group"       # --scale-rewards
    scope: str = "prompt"              # --selection-scope
    drop_zero_variance: bool = False   # --drop-zero-variance


def select(rewards: Tensor, m: int, rule: str, *, normalize: str = "selected", scale_rewards: str = "group",
           scope: str = "prompt", drop_zero_variance: bool = False,
           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, int]:
    """What one rollout batch trains on, from rewards [P, n]: (kept, advantages, number of prompts dropped). The paper
    (scope "prompt", nothing dropped): kept [P, m] indices, advantages [P, m]; otherwise a bool mask [P, n] and
    advantages [P, n] (0 where not kept). drop_zero_variance leaves out prompts whose n rewards are all equal; scope
    "batch" never gives them a slot anyway, so there the flag only counts them."""
    _check_batch_rule(rule, scope)
    if scope == "prompt" and not drop_zero_variance:
        kept = downsample(rewards, m, rule, generator=generator)
        return kept, selected_advantages(rewards, kept, normalize, scale_rewards=scale_rewards), 0
    zero_variance = zero_variance_prompts(rewards)
    dropped = int(zero_variance.sum()) if drop_zero_variance else 0
    if scope == "batch":
        keep = select_across_prompts(rewards, m, rule, generator)
        return keep, masked_advantages(rewards, keep, normalize, scale_rewards), dropped
    prompts = ~zero_variance
    keep, advantages = torch.zeros(rewards.shape, dtype=torch.bool), torch.zeros(rewards.shape)
    if prompts.any():
        group = rewards[prompts]
        group_keep = keep[prompts].scatter(-1, downsample(group, m, rule, generator=generator), True)
        keep[prompts] = group_keep
        advantages[prompts] = masked_advantages(group, group_keep, normalize, scale_rewards).to(advantages.dtype)
    return keep, advantages, dropped


def check_rewards(rewards: Tensor, m: int | None = None, check_finite: bool = True) -> int:
    """Validate rewards (..., n) and subset size m; return n. Raises ValueError naming the problem."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() == 0:
        raise ValueError("rewards must have shape (..., n), got a 0-d tensor")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be real numbers, got dtype {rewards.dtype}")
    n = rewards.shape[-1]
    if n == 0:
        raise ValueError(f"rewards has empty rows: shape {tuple(rewards.shape)} (n = 0)")
    if check_finite and rewards.is_floating_point() and not bool(torch.isfinite(rewards).all()):
        raise_non_finite(rewards)
    if m is not None:
        if isinstance(m, bool) or not isinstance(m, int):
            raise ValueError(f"m must be an int, got {m!r}")
        if m < 1 or m > n:
            raise ValueError(f"subset size m = {m} must satisfy 1 <= m <= n = {n}")
    return n


def raise_non_finite(rewards: Tensor) -> None:
    bad = rewards[~torch.isfinite(rewards)]
    raise ValueError(f"rewards contain {bad.numel()} non-finite value(s) (e.g. {bad[0].item()}) "
                     f"in a tensor of shape {tuple(rewards.shape)}")


# ------------------------------------------------------------------ advantages over the kept subset (§3.2)

def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """GRPO advantages (r - mean) / (std + eps) along the last dim, unbiased std, in float32 (float64 stays float64).
    A group of one has no baseline: advantage 0, never NaN."""
    k = check_rewards(rewards)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 so the division is defined, got {eps}")
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if k == 1 or r.numel() == 0:
        return torch.zeros_like(r)
    mean = r.mean(dim=-1, keepdim=True)
    std = r.std(dim=-1, keepdim=True, correction=1)
    return (r - mean) / (std + eps)


def masked_advantages(rewards: Tensor, keep: Tensor, normalize: str = "selected", scale_rewards: str = "group",
                      eps: float = 1e-4) -> Tensor:
    """Advantages (..., n) where `keep` (..., n, bool) is True, 0 elsewhere: (r - mean) / (std + eps) over each
    prompt's kept rewards (normalize="selected", the paper) or all n ("group", the appendix ablation); unbiased std of
    that set (scale_rewards="group", the paper), of all sets ("batch", TRL) or 1 ("none", Dr. GRPO). A set of one:
    advantage 0. Statistics in float64; returns float32 (float64 input: float64)."""
    check_rewards(rewards)
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    if scale_rewards not in SCALE_MODES:
        raise ValueError(f"scale_rewards must be one of {SCALE_MODES}, got {scale_rewards!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 so the division is defined, got {eps}")
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != rewards.shape:
        raise ValueError(f"keep must be a bool tensor of the rewards' shape {tuple(rewards.shape)}, got "
                         f"{getattr(keep, 'dtype', type(keep))} {tuple(getattr(keep, 'shape', ()))}")
    r = rewards.to(torch.float64)
    stats = keep if normalize == "selected" else torch.ones_like(keep)
    count = stats.sum(-1, keepdim=True)
    mean = (r * stats).sum(-1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(stats, r - mean, 0.0)
    scale = r.new_ones(())  # scale_rewards == "none": centred only
    if scale_rewards == "group":
        scale = ((centred * centred).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt() + eps
    elif scale_rewards == "batch":
        scale = (r[stats].std(correction=1) if int(stats.sum()) > 1 else r.new_zeros(())) + eps
    advantages = torch.where(keep & (count > 1), (r - mean) / scale, 0.0)
    return advantages.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def selected_advantages(rewards: Tensor, indices: Tensor, normalize: str = "selected", eps: float = 1e-4,
                        scale_rewards: str = "group") -> Tensor:
    """Advantages (..., m) of the rollouts `indices` (..., m) picked from `rewards` (..., n), statistics as in
    `masked_advantages` (normalize="selected": of the m kept, the paper; "group": of all n)."""
    n = check_rewards(rewards)
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.long:
        raise ValueError(f"indices must be a LongTensor, got {getattr(indices, 'dtype', type(indices))}")
    if indices.shape[:-1] != rewards.shape[:-1] or indices.dim() != rewards.dim():
        raise ValueError(f"indices shape {tuple(indices.shape)} does not match rewards shape {tuple(rewards.shape)} "
                         "in the leading dims")
    if indices.shape[-1] == 0:
        raise ValueError("indices select no rollouts (m = 0)")
    if indices.numel() > 0 and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise ValueError(f"indices must lie in [0, {n}), got range [{int(indices.min())}, {int(indices.max())}]")
    keep = torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device).scatter(-1, indices, True)
    return masked_advantages(rewards, keep, normalize, scale_rewards, eps).gather(-1, indices)
