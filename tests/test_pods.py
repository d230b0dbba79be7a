"""Down-sampling rules (pods.py): brute-force optimality of max-variance selection, Theorem 2, the
baseline rules, advantages, and input validation. The variants (scaling, batch scope): test_pods_variants.py."""

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pods

DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@lru_cache(maxsize=None)
def all_subsets(n, m):
    return torch.tensor(list(itertools.combinations(range(n), m)), dtype=torch.long)


def reward_families(n, rows_per_family, seed):
    """Binary, discrete {0..3} (many ties), continuous and all-equal rows, stacked: (4*rows, n)."""
    gen = torch.Generator().manual_seed(seed)
    binary = torch.randint(0, 2, (rows_per_family, n), generator=gen).double()
    discrete = torch.randint(0, 4, (rows_per_family, n), generator=gen).double()
    continuous = torch.randn(rows_per_family, n, generator=gen, dtype=torch.float64) * 3 + 1
    equal = torch.full((rows_per_family, n), 0.7, dtype=torch.float64)
    return torch.cat([binary, discrete, continuous, equal])


def subset_variance(values, idx):
    """Population variance of values[..., idx] in float64 (any normaliser gives the same argmax)."""
    return values.double().gather(-1, idx).var(dim=-1, correction=0)


def assert_valid_indices(idx, n, m):
    assert idx.dtype == torch.long and idx.shape[-1] == m
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all(), "indices must be distinct"


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_variance_matches_brute_force_for_every_small_n_and_m(dtype):
    for n in range(1, 13):
        rewards = reward_families(n, rows_per_family=3, seed=n).to(dtype)
        exact = rewards.double()  # the values the selector actually sees
        for m in range(1, n + 1):
            idx = pods.max_variance_indices(rewards, m)
            assert_valid_indices(idx, n, m)
            subsets = all_subsets(n, m)  # (C, m)
            best = exact[:, subsets].var(dim=-1, correction=0).amax(dim=-1)
            got = subset_variance(exact, idx)
            assert torch.allclose(got, best, rtol=1e-9, atol=1e-12), (n, m, dtype, got, best)


def swap_gain(values, idx):
    """Largest variance increase from swapping one selected element with one unselected element."""
    x = values.double()
    n, m = x.shape[-1], idx.shape[-1]
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[idx] = True
    s, u = x[chosen], x[~chosen]
    if u.numel() == 0:
        return 0.0
    s1, s2 = s.sum(), (s * s).sum()
    new_s1 = s1 - s[:, None] + u[None, :]
    new_s2 = s2 - s[:, None] ** 2 + u[None, :] ** 2
    new_var = new_s2 / m - (new_s1 / m) ** 2
    return float((new_var - s.var(correction=0)).max())


def reference_per_split(values, m):
    """Naive Lemma-1 reference: numpy variance of every 'k highest + (m-k) lowest' candidate."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    return max(np.concatenate([x[: m - k], x[len(x) - k :]]).var() for k in range(m + 1))


reward_lists = st.one_of(
    st.lists(st.integers(0, 1).map(float), min_size=13, max_size=120),
    st.lists(st.integers(0, 3).map(float), min_size=13, max_size=120),
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=13, max_size=120),
)


@settings(max_examples=60, deadline=None)
@given(values=reward_lists, data=st.data())
def test_max_variance_is_swap_optimal_and_matches_per_split_reference(values, data):
    m = data.draw(st.integers(1, len(values)))
    rewards = torch.tensor(values, dtype=torch.float32)
    idx = pods.max_variance_indices(rewards, m)
    assert_valid_indices(idx, len(values), m)
    scale = 1e-9 * (1 + float(rewards.double().var(correction=0)))
    assert swap_gain(rewards, idx) <= scale
    assert abs(float(subset_variance(rewards, idx)) - reference_per_split(values, m)) <= scale


@settings(max_examples=40, deadline=None)
@given(ones=st.integers(0, 40), zeros=st.integers(0, 40), half_m=st.integers(1, 20), seed=st.integers(0, 99))
def test_theorem_2_binary_rewards_take_half_highest_half_lowest(ones, zeros, half_m, seed):
    m = 2 * half_m
    if ones + zeros < m:
        return
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.cat([torch.ones(ones), torch.zeros(zeros)])[torch.randperm(ones + zeros, generator=gen)]
    chosen_ones = int(rewards[pods.max_variance_indices(rewards, m)].sum())
    # m/2 of each value when both are plentiful; otherwise as balanced as the counts allow.
    assert chosen_ones == min(max(half_m, m - zeros), ones)


def test_large_offset_does_not_break_selection():
    # Float64 accumulation on centred values: an offset of 1e6 must not change the chosen subset.
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2, (8, 64), generator=gen).float()
    for offset in (1e6, -3e5):
        shifted = pods.max_variance_indices(base + offset, 16)
        assert torch.equal(shifted, pods.max_variance_indices(base, 16))
        assert torch.equal(base.gather(-1, shifted).sum(-1), torch.full((8,), 8.0))


def test_ties_are_deterministic_and_all_equal_rows_keep_the_first_m():
    rewards = torch.full((3, 10), 0.25)
    idx = pods.max_variance_indices(rewards, 4)
    assert torch.equal(idx, torch.arange(4).expand(3, 4))
    binary = torch.tensor([[1.0, 0, 1, 0, 1, 0, 1, 0]])
    first = pods.max_variance_indices(binary, 4)
    assert all(torch.equal(first, pods.max_variance_indices(binary, 4)) for _ in range(3))
    # Stable sort: the lowest come from the front of the tie order, the highest from its back.
    assert torch.equal(first.sort().values, torch.tensor([[1, 3, 4, 6]]))


def test_exact_ties_between_splits_resolve_to_the_smallest_k():
    # 2c copies each of a < b, m = 2c + 1: "c+1 lowest + c highest" and "c lowest + c+1 highest" have
    # the same variance, but float rounding of the two prefix-sum paths differs; the documented
    # choice is the smaller k (fewer highest), i.e. c + 1 copies of a, on every row.
    gen = torch.Generator().manual_seed(0)
    for c in range(1, 6):
        a, b = (torch.rand(2, 300, 1, generator=gen) * 10 - 5).sort(dim=0).values
        rewards = torch.cat([a.expand(300, 2 * c), b.expand(300, 2 * c)], dim=-1)
        rewards = rewards.gather(-1, torch.rand(rewards.shape, generator=gen).argsort(-1))
        chosen = rewards.gather(-1, pods.max_variance_indices(rewards, 2 * c + 1))
        distinct = (a != b).squeeze(-1)
        assert torch.all((chosen == a).sum(-1)[distinct] == c + 1)


DETERMINISTIC_RULES = [name for name, rule in pods.RULES.items() if not rule.random]


@pytest.mark.parametrize("rule", DETERMINISTIC_RULES)
def test_batched_call_equals_per_row_calls(rule):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 4, (2, 3, 16), generator=gen).float() + torch.rand(2, 3, 16, generator=gen)
    m = 16 if rule == "none" else 5
    batched = pods.downsample(rewards, m, rule)
    assert batched.shape == (2, 3, m)
    for i, j in itertools.product(range(2), range(3)):
        assert torch.equal(batched[i, j], pods.downsample(rewards[i, j], m, rule))


def test_random_indices_without_replacement_reproducible_and_uniform():
    rewards = torch.zeros(4000, 8)
    idx = pods.random_indices(rewards, 3, generator=torch.Generator().manual_seed(0))
    assert_valid_indices(idx, 8, 3)
    again = pods.random_indices(rewards, 3, generator=torch.Generator().manual_seed(0))
    other = pods.random_indices(rewards, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    inclusion = torch.bincount(idx.flatten(), minlength=8).double() / 4000
    assert torch.allclose(inclusion, torch.full((8,), 3 / 8, dtype=torch.float64), atol=0.03)


@pytest.mark.parametrize("n,m", [(1, 1), (7, 3), (16, 4), (16, 16), (64, 16), (5, 2)])
def test_percentile_indices_take_the_midpoint_quantiles(n, m):
    rewards = torch.randn(3, n, generator=torch.Generator().manual_seed(n + m))
    idx = pods.percentile_indices(rewards, m)
    assert_valid_indices(idx, n, m)
    sorted_r = rewards.sort(-1).values
    want = sorted_r[:, [int(np.floor((j + 0.5) / m * n)) for j in range(m)]]
    assert torch.equal(rewards.gather(-1, idx), want)


def test_max_reward_indices_take_the_top_m():
    rewards = torch.tensor([[0.0, 3, 1, 3, 2, 0], [5, 4, 3, 2, 1, 0]])
    idx = pods.max_reward_indices(rewards, 3)
    assert torch.equal(rewards.gather(-1, idx), torch.tensor([[3.0, 3, 2], [5, 4, 3]]))
    assert torch.equal(idx[0, :2], torch.tensor([1, 3]))  # ties: lower position first


def test_downsample_dispatches_and_none_is_plain_grpo():
    rewards = torch.rand(4, 12, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pods.downsample(rewards, 12, "none"), torch.arange(12).expand(4, 12))
    assert torch.equal(pods.downsample(rewards, 4, "max_variance"), pods.max_variance_indices(rewards, 4))
    assert torch.equal(pods.downsample(rewards, 4, "percentile"), pods.percentile_indices(rewards, 4))
    assert torch.equal(pods.downsample(rewards, 4, "max_reward"), pods.max_reward_indices(rewards, 4))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    via_rule = pods.downsample(rewards, 4, "random", generator=g1)
    assert torch.equal(via_rule, pods.random_indices(rewards, 4, g2))
    with pytest.raises(ValueError, match="m = 4, n = 12"):
        pods.downsample(rewards, 4, "none")
    unknown = "not_" + "_or_".join(pods.RULES)  # derived from the registry: never a registered rule
    with pytest.raises(ValueError, match=f"unknown down-sampling rule '{unknown}'"):
        pods.downsample(rewards, 4, unknown)


@pytest.mark.parametrize("rule", pods.RULES)
def test_every_registered_rule_returns_m_distinct_positions_through_downsample(rule):
    """What every rule promises, so a rule added to pods.RULES is checked here: downsample calls its function
    (with the generator when it draws), and it returns m distinct in-range positions for every valid m, any
    leading dims and a zero-prompt batch; random rules are reproducible from the generator."""
    entry = pods.RULES[rule]
    rewards = torch.randint(0, 3, (2, 3, 7), generator=torch.Generator().manual_seed(4)).float()
    for m in ([7] if rule == "none" else range(1, 8)):
        extra = lambda: dict(generator=torch.Generator().manual_seed(m)) if entry.random else {}  # noqa: E731
        idx = pods.downsample(rewards, m, rule, **extra())
        assert idx.shape == (2, 3, m) and torch.equal(idx, entry.indices(rewards, m, **extra()))
        assert_valid_indices(idx, 7, m)
        assert pods.downsample(torch.zeros(0, 7), m, rule, **extra()).shape == (0, m)
    assert entry.name == rule and entry.summary


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_low_precision_and_integer_rewards(dtype):
    rewards = torch.tensor([[3, 0, 2, 1, 3, 0, 1, 2]]).to(dtype)
    idx = pods.max_variance_indices(rewards, 4)
    assert sorted(rewards[0, idx[0]].tolist()) == [0, 0, 3, 3]
    for rule in pods.RULES:
        if rule not in ("max_variance", "none"):  # max_variance: above; none: needs m == n
            assert_valid_indices(pods.downsample(rewards, 4, rule), 8, 4)


def test_group_advantages_use_unbiased_std_plus_eps():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    adv = pods.group_advantages(rewards)
    r = rewards.numpy().astype(np.float64)
    want = (r - r.mean(-1, keepdims=True)) / (r.std(-1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(adv[1], torch.zeros(5))  # zero-variance group: zero advantages, no NaN
    assert torch.equal(pods.group_advantages(torch.tensor([[0.3], [1.0]])), torch.zeros(2, 1))
    assert pods.group_advantages(rewards.bfloat16()).dtype == torch.float32


def test_selected_advantages_selected_vs_group_statistics():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5, 1.0]])
    idx = torch.tensor([[0, 1, 4]])
    sel = pods.selected_advantages(rewards, idx)
    grp = pods.selected_advantages(rewards, idx, normalize="group")
    assert torch.allclose(sel, pods.group_advantages(torch.tensor([[0.0, 1.0, 0.5]])))
    assert torch.allclose(grp, pods.group_advantages(rewards)[:, [0, 1, 4]])
    assert not torch.allclose(sel, grp)
    assert torch.equal(pods.selected_advantages(rewards, idx[:, :1]), torch.zeros(1, 1))  # m == 1
    with pytest.raises(ValueError, match="normalize"):
        pods.selected_advantages(rewards, idx, normalize="batch")
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        pods.selected_advantages(rewards, torch.tensor([[0, 6, 1]]))


BAD_M = [(9, "m = 9 must satisfy 1 <= m <= n = 8"), (0, "m = 0"), (2.0, "m must be an int")]
BAD_REWARDS = [
    (torch.zeros(3, 0), r"empty rows: shape \(3, 0\)"),
    (torch.tensor([0.0, float("nan"), 1.0]), "1 non-finite value.*nan"),
    (torch.tensor([[0.0, float("inf")], [float("-inf"), 1.0]]), "2 non-finite"),
    (torch.tensor(1.0), "0-d"),
    (torch.arange(100.0).index_fill(0, torch.tensor([50]), float("nan")).expand(3, 100), "3 non-finite"),
    (torch.arange(100.0).index_fill(0, torch.tensor([7]), -float("inf")), "1 non-finite value.*-inf"),
]


@pytest.mark.parametrize("m,message", BAD_M)
def test_bad_subset_size_raises_value_error_naming_it(m, message):
    for rule in pods.RULES:
        with pytest.raises(ValueError, match=message):
            pods.downsample(torch.zeros(2, 8), m, rule)


@pytest.mark.parametrize("rewards,message", BAD_REWARDS)
def test_bad_rewards_raise_value_error_naming_them(rewards, message):
    for rule in pods.RULES:
        if rule != "none":  # m = 1 < n: "none" refuses m itself
            with pytest.raises(ValueError, match=message):
                pods.downsample(rewards, 1, rule)
    with pytest.raises(ValueError, match=message):
        pods.group_advantages(rewards)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    rewards = reward_families(40, rows_per_family=4, seed=0).to(dtype)
    for m in (1, 7, 16, 40):
        on_gpu = pods.max_variance_indices(rewards.cuda(), m).cpu()
        on_cpu = pods.max_variance_indices(rewards, m)
        assert torch.allclose(subset_variance(rewards, on_gpu), subset_variance(rewards, on_cpu))
    assert pods.random_indices(rewards.cuda(), 5, generator=torch.Generator().manual_seed(0)).is_cuda
