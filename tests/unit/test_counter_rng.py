"""The counter-based generator: exact against a pure-Python reference, split-invariant, uniform."""

import numpy as np
import pytest
import torch
from scipy import stats

from ft_framework import counter_rng as rng

AWKWARD_INDICES = [0, 1, 2, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 12345, 2**63 - 1]


def reference_bits(seed, stream, step, index):
    """Written from the module's docstring with Python ints only (no torch, no limbs)."""

    def h(x):
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)

    key = h((seed % 2**32) ^ (seed // 2**32) ^ 0x9E3779B9)
    key = h(key ^ stream)
    key = h(key ^ (step % 2**32))
    key = h(key ^ (step // 2**32))
    return h(h(key ^ (index % 2**32)) ^ (index // 2**32))


@pytest.mark.parametrize("seed,stream,step", [(0, 1, 0), (42, 2, 7), (2**32 + 5, 1, 2**33 + 1), (2**64 - 1, 3, 123456)])
def test_bits_equal_python_reference_element_by_element(seed, stream, step):
    index = torch.tensor(AWKWARD_INDICES + list(range(1000, 1037)), dtype=torch.int64)
    got = rng.random_bits(seed, stream, step, index).tolist()
    want = [reference_bits(seed, stream, step, i) for i in index.tolist()]
    assert got == want


def test_draws_do_not_depend_on_how_the_elements_are_split():
    index = torch.arange(10_007, dtype=torch.int64) * 3 + 11
    whole = rng.uniform(5, rng.STREAM_R3F_NOISE, 9, index)
    parts = torch.cat([rng.uniform(5, rng.STREAM_R3F_NOISE, 9, chunk) for chunk in index.split([1, 4999, 5007])])
    assert torch.equal(whole, parts)
    shuffled = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(3))
    assert torch.equal(rng.uniform(5, rng.STREAM_R3F_NOISE, 9, index[shuffled]), whole[shuffled])
    assert torch.equal(rng.uniform(5, rng.STREAM_R3F_NOISE, 9, index[:-2].view(5, -1)).flatten(), whole[:-2])


def test_uniform_is_in_the_open_interval_and_symmetric():
    u = rng.uniform(1, rng.STREAM_STOCHASTIC_ROUNDING, 0, torch.arange(2**18, dtype=torch.int64))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # u = (k + 1/2) / 2**23 exactly: every value times 2**23 is a half-integer.
    scaled = u.double() * 2**23
    assert torch.equal(scaled - scaled.floor(), torch.full_like(scaled, 0.5))


@pytest.mark.parametrize("seed,stream,step", [(0, 1, 0), (1, 1, 0), (0, 2, 0), (0, 1, 1), (12345, 2, 999)])
def test_uniform_passes_distribution_tests(seed, stream, step):
    n = 2**16
    u = rng.uniform(seed, stream, step, torch.arange(n, dtype=torch.int64)).double().numpy()
    # Fixed inputs make these deterministic; the thresholds are 4-5 standard errors wide.
    assert abs(u.mean() - 0.5) < 4.5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(u.var() - 1 / 12) < 5 * (1 / 180) ** 0.5 / n**0.5
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    assert stats.chisquare(counts).pvalue > 1e-4
    neighbour_corr = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(neighbour_corr) < 4.5 / n**0.5


def test_bits_are_balanced_and_keys_independent():
    n = 2**16
    index = torch.arange(n, dtype=torch.int64)
    bits = rng.random_bits(7, 1, 3, index)
    for b in range(32):
        frequency = float(((bits >> b) & 1).double().mean())
        assert abs(frequency - 0.5) < 4.5 * 0.5 / n**0.5, f"bit {b}"
    base = rng.uniform(7, 1, 3, index).double().numpy()
    for other in (rng.uniform(8, 1, 3, index), rng.uniform(7, 2, 3, index), rng.uniform(7, 1, 4, index), rng.uniform(7, 1, 3, index + 2**32)):
        assert abs(np.corrcoef(base, other.double().numpy())[0, 1]) < 4.5 / n**0.5
        assert not torch.equal(torch.from_numpy(base), other.double())


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="int64"):
        rng.random_bits(0, 1, 0, torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="step=-1"):
        rng.stream_key(0, 1, -1)
