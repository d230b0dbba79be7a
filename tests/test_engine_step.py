"""engine/step.py: the hash behind sampling draws, and token choice on hand-made logits."""

import torch

import engine.step as decode_step
from test_engine import chi_square_p_value


def test_hash_arithmetic_is_exact_and_draws_are_uniform():
    def lowbias32(x):  # the reference hash on Python ints
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2 ** 32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2 ** 32
        return x ^ (x >> 16)

    values = torch.cat([torch.randint(0, 2 ** 32, (1000,)), torch.tensor([0, 2 ** 32 - 1])])
    assert decode_step.mix32(values).tolist() == [lowbias32(v) for v in values.tolist()]
    draws = torch.stack([decode_step.uniform_draws(decode_step.row_noise_keys(7, 64), torch.tensor([step]))
                         for step in range(64)])   # [steps, rows]
    assert bool(((draws > 0) & (draws < 1)).all())
    histogram = torch.histc(draws.double(), bins=16, min=0, max=1)
    assert chi_square_p_value(histogram, torch.full((16,), 1 / 16, dtype=torch.float64)) > 1e-3
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[:, 0], draws[:, 1])


def test_choose_tokens_inverts_the_cdf_inside_the_nucleus():
    """Rows whose uniform draw lands in a known CDF interval pick that token; tokens cut by top-p never appear."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4096, 1)
    scalars = dict(temperature=torch.tensor(1.0), top_p=torch.tensor(0.8), step=torch.tensor([5]))

    class State:  # the fields choose_tokens reads
        sample, nucleus, row_keys = True, True, decode_step.row_noise_keys(3, 4096)
    State.scalars = scalars
    tokens = decode_step.choose_tokens(logits, State)
    counts = torch.bincount(tokens, minlength=4).double()
    # Nucleus at 0.8: {0.5, 0.3} (0.15 would start at cumulative 0.8 >= top_p), renormalised to 0.625 / 0.375.
    assert chi_square_p_value(counts, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)) > 1e-3
    State.nucleus = False
    counts = torch.bincount(decode_step.choose_tokens(logits, State), minlength=4).double()
    assert chi_square_p_value(counts, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)) > 1e-3
    assert chi_square_p_value(counts, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)) == 0.0
