"""Exact Bernoulli(exp(-x)) by lazy comparison, and the binned discrete Gaussian sampler.

The bounds are checked against 120-digit decimal arithmetic; the lazy comparison against
the uniform its words spell out; the sampler's law by chi-square against the exact pmf,
with its bounds widened so that the exact fallback decides thousands of trials, with its
tail made common, and with a wrong table or a wrong tail, which the same test rejects."""

from __future__ import annotations

import dataclasses
import math
import os
import random
from decimal import Decimal, localcontext

import numpy as np
import pytest
from scipy import stats

from fedsgld.secagg import discrete_gaussian as dg
from fedsgld.secagg.exact_exp import LazyUniform, exp_bounds

BUILD_BINS = dg._bins.__wrapped__  # uncached, unaffected by monkeypatching


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


@pytest.mark.parametrize("t", [2, 11, 300, 13_215, 1 << 16])
def test_every_bound_of_the_envelope_brackets_its_exact_value(t):
    """The sampler's envelope of t: every bin's bounds and every entry of every in-bin
    factor (at most 400 checked per factor) within [lo, hi], hi - lo <= 2 at 16 bits; each
    bin's weight at least its upper bound, a multiple of the grain, found by the look-up;
    the factors cover every exponent l (2 i W + l); the tail's factors at most 1."""
    bins = dg._bins(t)
    den = 2 * t * (t - 1)
    width, count = 1 << bins.width_bits, bins.count
    weight = np.diff(np.append(bins.start, bins.total))
    for i in range(count):
        v = exact((i * width) ** 2, den, 16)
        assert int(bins.lo[i]) <= v <= int(bins.hi[i]) <= int(bins.lo[i]) + 2
        assert weight[i] >= bins.hi[i] and weight[i] % (1 << dg._GRAIN_BITS) == 0
    slots = np.arange(bins.lookup.size) << dg._GRAIN_BITS
    b = bins.lookup
    assert np.all((bins.start[b] <= slots) & (slots < bins.start[b] + weight[b]))
    for f in bins.factors:
        for j in range(0, f.lo.size, max(1, f.lo.size // 400)):
            assert int(f.lo[j]) <= exact(j * f.num, f.den, 16) <= int(f.hi[j]) <= int(f.lo[j]) + 2
    top_m = (2 * count - 1) * width * width
    assert bins.factors[0].lo.size * bins.factors[0].num >= top_m
    assert all(f.lo.size == 1 << bins.digit_bits for f in bins.factors[1:])
    top = count * width
    assert top >= dg._BIN_SPAN * t
    c = bins.tail_pow2
    assert exact(top * top, den, 0) * Decimal(2) ** c <= 1
    assert 2 * exact(2 * top << bins.tail_step_bits, den, 0) <= 1


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


def widened(t: int, by: int, *, valid: bool = True, span: int = dg._BIN_SPAN):
    """The envelope of t with every bound (the bins' and the factors') moved out by ``by``
    (still valid bounds: the exact fallback then decides about by / 2^15 of the trials).
    ``valid`` False moves the factors' lower bounds up and the bins' bounds down by
    ``by`` instead: a wrong sampler."""
    bins = BUILD_BINS(t, span)

    def wide(lo, hi, top):
        lo, hi = lo.astype(np.int64), hi.astype(np.int64)
        return np.maximum(lo - by, 0), np.minimum(hi + by, top)

    def factor(f):
        if valid:
            lo, hi = wide(f.lo, f.hi, 1 << 16)
        else:
            lo = np.minimum(f.lo.astype(np.int64) + by, 1 << 16)
            hi = np.maximum(lo, f.hi)
        return dg._Factor(lo.astype(np.int32), hi.astype(np.int32), f.num, f.den)

    weight = np.diff(np.append(bins.start, bins.total))
    lo, hi = wide(bins.lo, bins.hi, weight)
    if not valid:
        lo, hi = np.maximum(bins.lo - by, 0), np.maximum(bins.hi - by, 0)
    hi[bins.count] = lo[bins.count] = 0
    return dataclasses.replace(bins, lo=lo, hi=hi, factors=tuple(map(factor, bins.factors)))


@pytest.mark.parametrize("t", [3, 300])
def test_sampler_is_exact_when_the_fallback_decides_many_trials(t, monkeypatch):
    """Bounds widened by 2^10 (about 3 % of the trials undecided at 16 bits, all decided
    by the exact fallback): chi-square against the exact pmf accepts; a sampler whose
    acceptances are 2^13 / 2^16 off is rejected by the same test."""
    s2 = t * (t - 1)
    calls = []

    class Counted(LazyUniform):
        def below_exp(self, a: int, b: int) -> bool:
            calls.append(1)
            return super().below_exp(a, b)

    monkeypatch.setattr(dg, "LazyUniform", Counted)
    monkeypatch.setattr(dg, "_bins", lambda t_: widened(t_, 1 << 10))
    x = dg.discrete_gaussian(s2, 60_000)
    assert chisquare_p(x, s2) > 1e-4
    assert len(calls) > 2000  # the fallback decided thousands of trials
    monkeypatch.setattr(dg, "_bins", lambda t_: widened(t_, 1 << 13, valid=False))
    assert chisquare_p(dg.discrete_gaussian(s2, 60_000), s2) < 1e-6


@pytest.mark.parametrize("t", [3, 40])
def test_the_tail_is_exact_when_it_is_common(t, monkeypatch):
    """Bins up to T = t only (span 1: about a third of the mass in the tail, which
    :func:`_tail_draw` proposes and accepts in Python): chi-square accepts, with thousands
    of tail draws; a tail that accepts every proposal is rejected by the same test."""
    s2 = t * (t - 1)
    monkeypatch.setattr(dg, "_bins", lambda t_: BUILD_BINS(t_, 1))
    tails = []
    real = dg._tail_draw

    def counted(bins, src):
        y = real(bins, src)
        tails.append(y)
        return y

    monkeypatch.setattr(dg, "_tail_draw", counted)
    x = dg.discrete_gaussian(s2, 20_000)
    assert chisquare_p(x, s2) > 1e-4
    assert sum(y is not None for y in tails) > 1000
    assert min(y for y in tails if y is not None) == dg._bins(t).count << dg._bins(t).width_bits

    class Accepts(LazyUniform):
        def below_exp(self, a: int, b: int) -> bool:
            return True

    def accepts_every_tail_proposal(bins, src):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(dg, "LazyUniform", Accepts)
            return real(bins, src)

    monkeypatch.setattr(dg, "_tail_draw", accepts_every_tail_proposal)
    assert chisquare_p(dg.discrete_gaussian(s2, 20_000), s2) < 1e-6


def test_binned_and_unbinned_paths_draw_the_same_law():
    """t = 2^16 (the last binned t) and t = 2^16 + 1 (the rejection chains): both
    within 3 % of their variance over 30,000 draws."""
    for t in (dg._TABLE_T, dg._TABLE_T + 1):
        x = dg.discrete_gaussian(t * (t - 1), 30_000, os.urandom)
        assert abs(x.var() / (t * (t - 1)) - 1) < 0.03 and abs(x.mean()) < 0.03 * t
