"""Exact Bernoulli(exp(-x)) by lazy comparison, and the tabled discrete Gaussian sampler.

The bounds are checked against 120-digit decimal arithmetic; the lazy comparison against
the uniform its words spell out; the sampler's law by chi-square against the exact pmf,
with its tables widened so that the exact fallback decides thousands of trials, and with
a wrong table, which the same test rejects."""

from __future__ import annotations

import math
import os
import random
from decimal import Decimal, localcontext

import numpy as np
import pytest
from scipy import stats

from fedsgld.secagg import discrete_gaussian as dg
from fedsgld.secagg.exact_exp import LazyUniform, exp_bounds

BUILD_TABLES = dg._tables.__wrapped__  # uncached, unaffected by monkeypatching


def exact(a: int, b: int, prec: int) -> Decimal:
    """2^prec exp(-a/b) to 120 digits."""
    with localcontext() as ctx:
        ctx.prec = 120
        return (Decimal(-a) / Decimal(b)).exp() * (Decimal(2) ** prec)


def test_exp_bounds_bracket_the_exact_value_and_are_tight():
    rnd = random.Random(7)
    for _ in range(300):
        b = rnd.choice([1, 2, 3, 7, 1000, 2 * 13215 * 13214, rnd.randrange(1, 10**9)])
        a = rnd.choice([0, b, b - 1, rnd.randrange(0, 3 * b), rnd.randrange(0, 60 * b)])
        prec = rnd.choice([32, 96, 160])
        lo, hi = exp_bounds(a, b, prec)
        v = exact(a, b, prec)
        assert lo <= v <= hi and hi - lo <= 4, (a, b, prec)
    with pytest.raises(ValueError, match="a >= 0"):
        exp_bounds(-1, 2, 32)


@pytest.mark.parametrize("t", [2, 11, 300, 13_215])
def test_every_table_entry_brackets_its_exact_value(t):
    """The sampler's tables of t: every entry of every factor (at most 400 checked per
    factor) within [lo, hi], hi - lo <= 2 at 16 bits; the geometric thresholds too."""
    lap, gauss = dg._tables(t)
    for f in (*lap, *gauss):
        for j in range(0, f.lo.size, max(1, f.lo.size // 400)):
            assert int(f.lo[j]) <= exact(j * f.num, f.den, 16) <= int(f.hi[j]) <= int(f.lo[j]) + 2
    # the factors cover every a^2 below 23 (2 t (t - 1)) and every u < t
    assert gauss[0].lo.size * gauss[0].num >= 23 * 2 * t * (t - 1)
    assert lap[0].lo.size * lap[0].num >= t and lap[1].lo.size == lap[0].num
    lo, hi = dg._geometric_bounds()
    for v in range(1, lo.size + 1):
        assert int(lo[v - 1]) <= exact(v, 1, 16) <= int(hi[v - 1])
    assert exact(lo.size + 1, 1, 16) < 1  # beyond the last threshold: below 2^-16


class Words:
    """A word source that hands out given 64-bit words."""

    def __init__(self, *words: int) -> None:
        self.left = list(words)

    def words(self, n: int, bits: int) -> np.ndarray:
        assert n == 1 and bits == 64
        return np.array([self.left.pop(0)], dtype=np.uint64)


def test_lazy_comparison_refines_the_same_uniform_when_the_first_word_is_undecided():
    a, b = 5, 7
    lo, hi = exp_bounds(a, b, 32)
    assert hi > lo  # the word lo is undecided at 32 bits
    assert LazyUniform(lo - 1, 32, Words()).below_exp(a, b)  # decided: no more bits read
    assert not LazyUniform(hi, 32, Words()).below_exp(a, b)
    for tail in (0, 1 << 63, (1 << 64) - 1):
        u = (Decimal(lo) * 2**64 + tail) / Decimal(2) ** 96  # the uniform's first 96 bits
        src = Words(tail, 0, 0)
        got = LazyUniform(lo, 32, src).below_exp(a, b)
        with localcontext() as ctx:
            ctx.prec = 120
            p = (Decimal(-a) / b).exp()
            assert got == (u < p) and (u + Decimal(2) ** -96 <= p or u >= p)
        assert len(src.left) == 2  # one more word decided it
    # the geometric count of one uniform: V = max{v : U < exp(-v)}
    for w, v in ((0xFFFFFFFF, 0), (int(2**32 * 0.3), 1), (int(2**32 * 0.1), 2)):
        assert LazyUniform(w, 32, Words()).geometric() == v


def dg_pmf(s2: float, z: np.ndarray) -> np.ndarray:
    w = int(12 * math.sqrt(s2)) + 12
    norm = np.exp(-(np.arange(-w, w + 1, dtype=np.float64) ** 2) / (2 * s2)).sum()
    return np.exp(-(z.astype(np.float64) ** 2) / (2 * s2)) / norm


def chisquare_p(x: np.ndarray, s2: float) -> float:
    z = np.arange(-int(6 * math.sqrt(s2)) - 2, int(6 * math.sqrt(s2)) + 3)
    p = dg_pmf(s2, z)
    keep = p * x.size > 20
    obs = np.array([(x == v).sum() for v in z[keep]])
    return float(stats.chisquare(obs, p[keep] / p[keep].sum() * obs.sum()).pvalue)


def widened(t: int, by: int, *, valid: bool = True):
    """The tables of t with every bound moved out by ``by`` (still valid bounds: the
    exact fallback then decides about by / 2^15 of the trials). ``valid`` False moves the
    lower bounds of the Gaussian step's factors UP instead: a wrong sampler."""
    lap, gauss = BUILD_TABLES(t)

    def wide(f):
        lo, hi = f.lo.astype(np.int64), f.hi.astype(np.int64)
        lo, hi = np.maximum(lo - by, 0), np.minimum(hi + by, 1 << 16)
        return dg._Factor(lo.astype(np.uint64), hi.astype(np.uint64), f.num, f.den)

    if not valid:

        def bad(f):
            lo = np.minimum(f.lo.astype(np.int64) + by, 1 << 16).astype(np.uint64)
            return dg._Factor(lo, np.maximum(lo, f.hi), f.num, f.den)

        return lap, tuple(map(bad, gauss))
    return tuple(map(wide, lap)), tuple(map(wide, gauss))


@pytest.mark.parametrize("t", [3, 11])
def test_sampler_is_exact_when_the_fallback_decides_many_trials(t, monkeypatch):
    """Bounds widened by 2^10 (about 3 % of the trials undecided at 16 bits, all decided
    by the exact fallback): chi-square against the exact pmf accepts; a sampler whose
    Gaussian acceptance is 2^13 / 2^16 too generous is rejected by the same test."""
    s2 = t * (t - 1)
    calls = []

    class Counted(LazyUniform):
        def below_exp(self, a: int, b: int) -> bool:
            calls.append(1)
            return super().below_exp(a, b)

    monkeypatch.setattr(dg, "LazyUniform", Counted)
    monkeypatch.setattr(dg, "_tables", lambda t_: widened(t_, 1 << 10))
    x = dg.discrete_gaussian(s2, 60_000)
    assert chisquare_p(x, s2) > 1e-4
    assert len(calls) > 2000  # the fallback decided thousands of trials
    monkeypatch.setattr(dg, "_tables", lambda t_: widened(t_, 1 << 13, valid=False))
    assert chisquare_p(dg.discrete_gaussian(s2, 60_000), s2) < 1e-6


def test_tabled_and_untabled_paths_draw_the_same_law():
    """t = 2^16 (the last tabled t) and t = 2^16 + 1 (the rejection chains): both
    within 3 % of their variance over 30,000 draws."""
    for t in (dg._TABLE_T, dg._TABLE_T + 1):
        x = dg.discrete_gaussian(t * (t - 1), 30_000, os.urandom)
        assert abs(x.var() / (t * (t - 1)) - 1) < 0.03 and abs(x.mean()) < 0.03 * t


def test_a_geometric_count_resumed_from_a_known_start_is_the_same_count():
    """The sampler's fast path knows U < exp(-j) from its word and resumes the count at j:
    the same V as counting from 0, for uniforms near every threshold."""
    for v in range(1, 12):
        edge = int(2**32 * math.exp(-v))
        for w in (edge - 1, edge, edge + 1):
            full = LazyUniform(w, 32, Words(0, 1 << 63, (1 << 64) - 1)).geometric()
            for start in range(0, full + 1):
                src = Words(0, 1 << 63, (1 << 64) - 1)
                assert LazyUniform(w, 32, src).geometric(start=start) == full


def test_a_far_gaussian_proposal_is_rejected_by_any_nonzero_32_bit_word():
    """The premise of the sampler's far-tail shortcut: exp(-a/den) <= exp(-23) < 2^-32 for
    a >= 23 den, so a 32-bit word w >= 1 (U >= 2^-32) rejects, and only w = 0 is refined."""
    for t in (2, 3, 1000, dg._TABLE_T):
        den = 2 * t * (t - 1)
        lo, hi = exp_bounds(dg._GAUSS_TAIL * den, den, 32)
        assert (lo, hi) == (0, 1)
