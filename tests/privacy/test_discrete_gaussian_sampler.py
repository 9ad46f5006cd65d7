"""The exact discrete Gaussian sampler: its law, its entropy, its integer uniforms."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy import stats

from fedsgld.secagg.discrete_gaussian import Entropy, discrete_gaussian, uniform_below


def dg_pmf(s2: float, z: np.ndarray) -> np.ndarray:
    """Exact N_Z(0, s2) probabilities of the integers z (normaliser summed to 12 sd)."""
    w = int(12 * math.sqrt(s2)) + 12
    norm = np.exp(-(np.arange(-w, w + 1, dtype=np.float64) ** 2) / (2 * s2)).sum()
    return np.exp(-(z.astype(np.float64) ** 2) / (2 * s2)) / norm


def binned_chisquare(x: np.ndarray, s2: float, scale: float = 1.0) -> float:
    """p-value of the draws against N_Z(0, scale * s2), bins of about s / 4 integers."""
    s = math.sqrt(s2)
    width = max(1, int(s / 4))
    edges = np.arange(-int(4 * s) - width, int(4 * s) + 2 * width, width)
    z = np.arange(edges[0], edges[-1])
    p = dg_pmf(scale * s2, z)
    expected = np.add.reduceat(p, edges[:-1] - edges[0])
    observed = np.histogram(x, bins=edges)[0]
    keep = expected * x.size > 20
    exp = expected[keep] / expected[keep].sum() * observed[keep].sum()
    return float(stats.chisquare(observed[keep], exp).pvalue)


@pytest.mark.parametrize("t", [2, 3, 11, 26_430])
def test_histogram_matches_the_exact_pmf_and_a_wrong_scale_fails(t):
    """200,000 draws of N_Z(0, t (t - 1)): chi-square against the exact pmf accepts it;
    against the pmf of 0.96 or 1.04 times the variance it rejects (the test can fail)."""
    s2 = t * (t - 1)
    x = discrete_gaussian(s2, 200_000)
    assert binned_chisquare(x, s2) > 1e-4
    assert binned_chisquare(x, s2, 0.96) < 1e-6
    assert binned_chisquare(x, s2, 1.04) < 1e-6
    assert abs(x.mean()) < 5 * math.sqrt(s2 / x.size)


@pytest.mark.parametrize("t, size", [(26_430, 131_072), (2, 50_000), (1 << 20, 1000), (7, 1)])
def test_one_batch_reads_the_operating_system_once(t, size):
    calls = []

    def counted(n: int) -> bytes:
        calls.append(n)
        return os.urandom(n)

    s2 = t * (t - 1)
    x = discrete_gaussian(s2, size, counted)
    assert len(calls) == 1 and x.size == size
    if size > 10_000:
        assert abs(x.var() / s2 - 1) < 0.03


def feed(*chunks: bytes):
    """A randbytes that hands out ``chunks`` in order, then zeros."""
    data = bytearray(b"".join(chunks))

    def randbytes(n: int) -> bytes:
        out = bytes(data[:n]).ljust(n, b"\0")
        del data[:n]
        return out

    return randbytes


def test_uniform_below_rejects_the_biased_words_and_redraws():
    """m = 3 with 8-bit words: 255 (>= 256 - 256 mod 3) must be redrawn from fresh bytes,
    never folded (255 mod 3 = 0 would favour 0). Takes are 8-byte aligned."""
    pad = bytes(6)
    src = Entropy(feed(bytes([255, 4]) + pad, bytes([8]) + bytes(15)), 8)
    assert uniform_below(np.array([3, 3]), src).tolist() == [8 % 3, 4 % 3]
    src = Entropy(feed(bytes([254, 255]) + pad, bytes([7]) + bytes(15)), 8)
    assert uniform_below(3, src, 2).tolist() == [254 % 3, 7 % 3]
    assert src.calls == 2


@pytest.mark.parametrize("m", [2, 3, 7, 255, 256, 1000, 65_537, (1 << 33) + 1])
def test_uniform_below_is_uniform(m):
    draws = uniform_below(m, Entropy(os.urandom, 1 << 20), 60_000)
    assert draws.min() >= 0 and draws.max() < m
    bins = min(m, 50)
    edges = np.linspace(0, m, bins + 1)
    counts = np.histogram(draws, bins=edges)[0]
    expected = np.diff(np.ceil(edges)) / m * draws.size
    assert stats.chisquare(counts, expected).pvalue > 1e-5


def test_entropy_hands_out_each_byte_once():
    counter = iter(range(1 << 30))

    def randbytes(n: int) -> bytes:
        return np.fromiter(counter, dtype="<u4", count=n // 4).tobytes()

    src = Entropy(randbytes, 32)
    seen = np.concatenate([src.words(3, 32), src.words(6, 32), src.words(20, 32)])
    assert np.unique(seen).size == seen.size
    assert src.calls == 3
