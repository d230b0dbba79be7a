"""Variants of the selection (pods.py): advantage scaling by group, batch or none, uneven kept counts,
zero-variance prompts, and cross-prompt (batch scope) max-variance selection against brute force; pods.select."""

import itertools

import numpy as np
import pytest
import torch

import pods
import update
from test_pods import reward_families

SCALE_CASE = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 5.0, 5.0, 2.0, 2.0], [3.0] * 6])
SCALE_INDICES = torch.tensor([[0, 1, 4], [0, 2, 4], [1, 2, 3]])


def reference_advantages(rewards, indices, normalize, scale_rewards, eps=1e-4):
    """numpy: statistics set per prompt (kept or all), centre by its mean, divide by the std (ddof 1) of
    the set, of all sets pooled, or by nothing."""
    r = rewards.numpy().astype(np.float64)
    sets = [r[i, indices[i].numpy()] if normalize == "selected" else r[i] for i in range(len(r))]
    pooled_std = np.concatenate(sets).std(ddof=1)
    out = []
    for i, s in enumerate(sets):
        scale = {"group": s.std(ddof=1) + eps, "batch": pooled_std + eps, "none": 1.0}[scale_rewards]
        out.append((r[i, indices[i].numpy()] - s.mean()) / scale)
    return np.array(out)


@pytest.mark.parametrize("normalize", pods.NORMALIZE_MODES)
@pytest.mark.parametrize("scale_rewards", pods.SCALE_MODES)
def test_scale_rewards_match_numpy_reference(normalize, scale_rewards):
    adv = pods.selected_advantages(SCALE_CASE, SCALE_INDICES, normalize, scale_rewards=scale_rewards)
    want = reference_advantages(SCALE_CASE, SCALE_INDICES, normalize, scale_rewards)
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32 and torch.equal(adv[2], torch.zeros(3))  # zero-variance prompt


def test_scale_rewards_hand_made_values():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=torch.float64)
    both = torch.tensor([[0, 1], [0, 1]])
    none = pods.selected_advantages(rewards, both, scale_rewards="none")
    assert torch.equal(none, torch.tensor([[-0.5, 0.5], [-1.5, 1.5]], dtype=torch.float64))
    batch = pods.selected_advantages(rewards, both, scale_rewards="batch")
    assert torch.allclose(batch, none / (float(np.std([0, 1, 0, 3], ddof=1)) + 1e-4))
    group = pods.selected_advantages(rewards, both)  # each prompt divided by its own std
    own_std = torch.tensor([[0.5**0.5], [4.5**0.5]], dtype=torch.float64)
    assert torch.allclose(group, none / (own_std + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        pods.selected_advantages(rewards, both, scale_rewards="prompt")


def test_masked_advantages_with_uneven_kept_counts():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [2.0, 0.0, 1.0, 5.0], [1.0, 0.0, 0.0, 0.0]])
    keep = torch.tensor([[True, True, True, False], [True, True, False, False], [True, False, False, False]])
    adv = pods.masked_advantages(rewards, keep)
    assert torch.all(adv[~keep] == 0) and torch.all(adv[2] == 0)  # a prompt with one kept rollout: no baseline
    assert torch.allclose(adv[0, :3], pods.group_advantages(rewards[0, :3]))
    assert torch.allclose(adv[1, :2], pods.group_advantages(rewards[1, :2]))
    # The index form is the masked form gathered at the indices.
    idx = pods.max_variance_indices(rewards, 2)
    mask = torch.zeros_like(keep).scatter(-1, idx, True)
    for scale in pods.SCALE_MODES:
        assert torch.equal(pods.selected_advantages(rewards, idx, scale_rewards=scale),
                           pods.masked_advantages(rewards, mask, scale_rewards=scale).gather(-1, idx))
    with pytest.raises(ValueError, match="keep must be a bool tensor"):
        pods.masked_advantages(rewards, keep.long())


def test_zero_variance_prompts():
    rewards = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], [[0.5, 0.5, 0.5], [2.0, 2.0, 2.5]]])
    assert pods.zero_variance_prompts(rewards).tolist() == [[True, False], [True, False]]
    with pytest.raises(ValueError, match="non-finite"):
        pods.zero_variance_prompts(torch.tensor([[float("nan")] * 3]))


def best_sum_sq_by_count(row):
    """Brute force: the largest within-group sum of squared deviations of a c-subset, for c = 0..n."""
    x = np.asarray(row, dtype=np.float64)
    best = [0.0]
    for c in range(1, len(x) + 1):
        best.append(max(((s := x[list(sub)]) - s.mean()) @ (s - s.mean())
                        for sub in itertools.combinations(range(len(x)), c)))
    return best


def kept_sum_sq(rewards, keep):
    total = 0.0
    for row, k in zip(rewards.double(), keep):
        s = row[k]
        total += float(((s - s.mean()) ** 2).sum()) if len(s) else 0.0
    return total


@pytest.mark.parametrize("num_prompts,n", [(2, 4), (3, 5), (4, 4), (5, 3)])
def test_batch_selection_is_the_exact_balanced_optimum(num_prompts, n):
    for seed in range(4):
        rewards = reward_families(n, rows_per_family=num_prompts, seed=seed)[
            torch.randperm(4 * num_prompts, generator=torch.Generator().manual_seed(seed))[:num_prompts]]
        if seed == 0:
            rewards[0] = 1.0  # at least one zero-variance prompt
        zero = pods.zero_variance_prompts(rewards).tolist()
        informative = [i for i, z in enumerate(zero) if not z]
        tables = [best_sum_sq_by_count(row.tolist()) for row in rewards]
        for m in range(1, n + 1):
            keep = pods.select_across_prompts(rewards, m)
            counts = keep.sum(-1).tolist()
            total = min(m * num_prompts, len(informative) * n)
            assert keep.shape == rewards.shape and keep.dtype == torch.bool and sum(counts) == total
            assert all(counts[i] == 0 for i, z in enumerate(zero) if z)
            inf_counts = [counts[i] for i in informative]
            assert not inf_counts or max(inf_counts) - min(inf_counts) <= 1
            best = max((sum(tables[i][c] for i, c in zip(informative, cs))
                        for cs in itertools.product(range(n + 1), repeat=len(informative))
                        if sum(cs) == total and max(cs, default=0) - min(cs, default=0) <= 1), default=0.0)
            assert kept_sum_sq(rewards, keep) == pytest.approx(best, rel=1e-9, abs=1e-12), (seed, m)
            assert torch.equal(keep, pods.select_across_prompts(rewards, m))  # deterministic


def test_batch_selection_gives_extra_slots_by_variance_gain_and_zero_variance_budget_away():
    rewards = torch.tensor([[0.0, 1, 2, 3], [0, 0, 0, 10], [5, 5, 5, 5]])
    # 3 slots, 2 informative prompts: 1 each + 1 extra; 2 slots gain 4.5 on prompt 0, 50 on prompt 1.
    assert pods.batch_budgets(rewards, 1).tolist() == [1, 2, 0]
    keep = pods.select_across_prompts(rewards, 1)
    assert sorted(rewards[1, keep[1]].tolist()) == [0.0, 10.0] and not keep[2].any()
    assert pods.batch_budgets(rewards, 3).tolist() == [4, 4, 0]  # min(9, 2 x 4) slots: all of both
    assert not pods.select_across_prompts(torch.ones(3, 4), 2).any()  # nothing informative: nothing kept


def test_batch_selection_equals_prompt_scope_without_zero_variance_prompts_and_balances_large_batches():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (64, 16), generator=gen).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # every prompt informative
    keep = pods.select_across_prompts(rewards, 4)
    assert torch.equal(keep, torch.zeros_like(keep).scatter(-1, pods.max_variance_indices(rewards, 4), True))
    rewards[::3] = 1.0  # 22 zero-variance prompts hand 88 slots to the other 42
    counts = pods.select_across_prompts(rewards, 4).sum(-1)
    assert int(counts.sum()) == 256 and torch.all(counts[::3] == 0)
    assert set(counts[pods.zero_variance_prompts(rewards) == 0].tolist()) == {6, 7}
    for bad, message in ((rewards[0], r"needs rewards \[P, n\]"), (rewards[None], r"needs rewards \[P, n\]")):
        with pytest.raises(ValueError, match=message):
            pods.select_across_prompts(bad, 4)
    with pytest.raises(ValueError, match="m = 17"):
        pods.select_across_prompts(rewards, 17)


@pytest.mark.parametrize("rule", pods.RULES)
def test_batch_scope_fills_the_balanced_budgets_with_the_rule_or_refuses_it(rule):
    """Every registered rule: one the registry marks batch_scope fills each prompt's budget (batch_budgets) with its
    own subset of that size; any other is refused in one line naming the rules that can."""
    rewards = torch.tensor([[0.0, 1, 2, 3, 1], [0, 0, 0, 10, 2], [5, 5, 5, 5, 5], [1, 0, 1, 0, 1]])
    generator = torch.Generator().manual_seed(0)
    if not pods.RULES[rule].batch_scope:
        with pytest.raises(ValueError, match="'batch' only with " + " or ".join(pods.batch_scope_rules())):
            pods.select(rewards, 2, rule, scope="batch", generator=generator)
        return
    keep, _, _ = pods.select(rewards, 2, rule, scope="batch", generator=generator)
    budgets = pods.batch_budgets(rewards, 2)
    assert keep.sum(-1).tolist() == budgets.tolist() and int(budgets.sum()) == 8
    for row, budget in zip(range(4), budgets.tolist()):
        if budget and not pods.RULES[rule].random:  # a random rule's draw depends on the other prompts
            expected = pods.downsample(rewards[row:row + 1], budget, rule)
            assert sorted(rewards[row, keep[row]].tolist()) == sorted(rewards[row, expected[0]].tolist())


def test_select_paper_default_drop_and_batch_scope():
    rewards_matrix = torch.tensor([[0.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 3.0, 1.0]])
    kept, advantages, dropped = pods.select(rewards_matrix, 2, "max_variance")
    assert torch.equal(kept, pods.max_variance_indices(rewards_matrix, 2)) and dropped == 0  # the paper, [P, m]
    torch.testing.assert_close(advantages, pods.selected_advantages(rewards_matrix, kept))
    keep, advantages, dropped = pods.select(rewards_matrix, 2, "max_variance", drop_zero_variance=True,
                                             scale_rewards="none")
    assert dropped == 1 and keep.sum(1).tolist() == [2, 0, 2]  # prompt 1 (all rewards equal) left out
    assert update.kept_rows(keep, 4).tolist() == [i * 4 + int(j) for i in (0, 2) for j in sorted(kept[i].tolist())]
    assert advantages[keep].tolist() == [-0.5, 0.5, -1.5, 1.5]  # centred only
    keep, advantages, _ = pods.select(rewards_matrix, 2, "max_variance", scope="batch")
    assert torch.equal(keep, pods.select_across_prompts(rewards_matrix, 2)) and keep.sum() == 6  # m x P slots
    torch.testing.assert_close(advantages, pods.masked_advantages(rewards_matrix, keep))
    with pytest.raises(ValueError, match="'batch' only with max_variance"):
        pods.select(rewards_matrix, 2, "random", scope="batch")
    # Batch scope gives a zero-variance prompt no slot, so dropping it must not shrink the m x P budget.
    uneven = torch.tensor([[1.0, 0, 0, 1, 1, 0, 0, 0], [1.0] * 8, [0.0, 0, 0, 0, 0, 1, 0, 0]])
    for drop in (False, True):
        keep, _, dropped = pods.select(uneven, 2, "max_variance", scope="batch", drop_zero_variance=drop)
        assert keep.sum(1).tolist() == [3, 0, 3] and dropped == int(drop)
