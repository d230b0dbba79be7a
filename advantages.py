"""Group-relative advantages of the kept rollouts (paper §3.2), and the check of a reward tensor that pods.py's rules
share.

GRPO advantages are (r - mean) / (std + eps) with the *unbiased* sample std and eps = 1e-4, as in the authors' code
and TRL. The paper (§3.2) normalises with the statistics of the selected subset (normalize="selected", the default);
normalize="group" uses the full group of n instead (the appendix ablation). `scale_rewards` "group" (the paper),
"batch" (one std over the whole batch's statistics sets, TRL's scale_rewards="batch") or "none" (centred only,
Dr. GRPO). `masked_advantages` takes any kept mask (uneven counts per prompt: the batch selection scope).
pods.py re-exports every name here, so `pods.selected_advantages` etc. are the same functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): the flags read the modes without it
if TYPE_CHECKING:
    from torch import Tensor

NORMALIZE_MODES = ("selected", "group")
SCALE_MODES = ("group", "batch", "none")


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
    raise ValueError(
        f"rewards contain {bad.numel()} non-finite value(s) (e.g. {bad[0].item()}) "
        f"in a tensor of shape {tuple(rewards.shape)}"
    )


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """GRPO advantages (r - mean) / (std + eps) along the last dim, with the unbiased sample std.

    Computed in float32 (float64 stays float64). A group of one has no baseline, so its advantage is 0
    (the unbiased std of one sample is undefined; we never return NaN).
    """
    k = check_rewards(rewards)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 so the division is defined, got {eps}")
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if k == 1 or r.numel() == 0:
        return torch.zeros_like(r)
    mean = r.mean(dim=-1, keepdim=True)
    std = r.std(dim=-1, keepdim=True, correction=1)
    return (r - mean) / (std + eps)


def masked_advantages(
    rewards: Tensor, keep: Tensor, normalize: str = "selected", scale_rewards: str = "group", eps: float = 1e-4
) -> Tensor:
    """Advantages (..., n) of the rollouts where `keep` (..., n, bool) is True; 0 elsewhere.

    Statistics set of each prompt: its kept rewards (normalize="selected", paper §3.2) or all n
    (normalize="group"). Advantage = (r - mean of the set) / (std + eps), std (unbiased) of the set
    (scale_rewards="group"), of the union of every prompt's set (="batch"), or no division (="none").
    A set of one has no baseline: advantage 0. Statistics in float64; returns float32 (float64 input:
    float64). Works for any number of kept rollouts per prompt (the batch selection scope).
    """
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


def selected_advantages(
    rewards: Tensor, indices: Tensor, normalize: str = "selected", eps: float = 1e-4, scale_rewards: str = "group"
) -> Tensor:
    """Advantages (..., m) of the rollouts `indices` (..., m) picked from `rewards` (..., n).

    normalize="selected" (default, paper §3.2): mean/std of the m kept rewards.
    normalize="group" (appendix ablation): mean/std of all n rewards, then gather the kept ones.
    scale_rewards: see `masked_advantages` ("group" = the paper).
    """
    n = check_rewards(rewards)
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.long:
        raise ValueError(f"indices must be a LongTensor, got {getattr(indices, 'dtype', type(indices))}")
    if indices.shape[:-1] != rewards.shape[:-1] or indices.dim() != rewards.dim():
        raise ValueError(
            f"indices shape {tuple(indices.shape)} does not match rewards shape {tuple(rewards.shape)} "
            "in the leading dims"
        )
    if indices.shape[-1] == 0:
        raise ValueError("indices select no rollouts (m = 0)")
    if indices.numel() > 0 and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise ValueError(
            f"indices must lie in [0, {n}), got range [{int(indices.min())}, {int(indices.max())}]"
        )
    keep = torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device).scatter(-1, indices, True)
    return masked_advantages(rewards, keep, normalize, scale_rewards, eps).gather(-1, indices)
