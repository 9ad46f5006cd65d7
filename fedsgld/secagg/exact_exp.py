"""Exact Bernoulli(exp(-a/b)) trials from 32-bit words, by lazy comparison.

A Bernoulli(p) trial is the event U < p for U uniform on [0, 1). Its bits are revealed
lazily: after a word w of ``k`` bits, U lies in [w, w + 1) / 2^k. With integers
lo <= 2^k p <= hi (:func:`exp_bounds`, exact integer arithmetic), the trial is decided

    U < p   when w + 1 <= lo,        U >= p   when w >= hi,

and otherwise (lo <= w < hi: at most hi - lo of the 2^k words, hi - lo <= 4) 64 more bits
of the same U are drawn and compared at precision k + 64, and so on
(:class:`LazyUniform`). The outcome is exactly U < p: no floating point decides it, and
each trial reads fresh words. At k = 16 the fast path decides all but about 2^-15 of
the trials; the rest go through Python's unbounded integers.

The bounds come from the alternating Taylor series of exp(-r/b), 0 <= r/b < 1 (its
partial sums alternate around the limit, terms non-increasing), and powers of exp(-1)
in fixed point with every product rounded down for the lower bound and up for the
upper one. :func:`exp_table` builds the bounds of a whole family exp(-j s) by the same
directed rounding, for the sampler's tables (:mod:`fedsgld.secagg.discrete_gaussian`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

FAST_BITS = 16  #: the default width of the fast path's words


class WordSource(Protocol):
    def words(self, n: int, bits: int) -> np.ndarray: ...


def _series_bounds(r: int, b: int, q: int) -> tuple[int, int]:
    """lo <= 2^q exp(-r/b) <= hi for 0 <= r <= b, from the partial sums S_(k-1), S_k that
    bracket it once the term x^k / k! is below 2^-q; each term in fixed point 2^q rounded
    down (lo) and up (hi), added or subtracted so that the sums stay bounds."""
    one = 1 << q
    if r == 0:
        return one, one
    t_lo = t_hi = one  # bounds on 2^q x^k / k!
    s_lo = s_hi = one  # bounds on 2^q S_k
    k = 0
    while True:
        k += 1
        t_lo, t_hi = (t_lo * r) // (b * k), -((-t_hi * r) // (b * k))
        prev_lo, prev_hi = s_lo, s_hi
        if k % 2:
            s_lo, s_hi = s_lo - t_hi, s_hi - t_lo
        else:
            s_lo, s_hi = s_lo + t_lo, s_hi + t_hi
        if t_hi <= 1:
            return max(min(prev_lo, s_lo), 0), max(prev_hi, s_hi)


def _mul(x: int, y: int, q: int, up: bool) -> int:
    p = x * y
    return -((-p) >> q) if up else p >> q


def _pow(x: int, n: int, q: int, up: bool) -> int:
    """x^n in fixed point 2^q (x <= 2^q), every product rounded down (or up)."""
    out = 1 << q
    while n:
        if n & 1:
            out = _mul(out, x, q, up)
        x = _mul(x, x, q, up)
        n >>= 1
    return out


def exp_bounds(a: int, b: int, prec: int) -> tuple[int, int]:
    """Integers lo <= 2^prec exp(-a/b) <= hi (a >= 0, b >= 1), hi - lo <= 4."""
    if a < 0 or b < 1:
        raise ValueError(f"exp_bounds needs a >= 0 and b >= 1, got a={a}, b={b}")
    n, r = divmod(a, b)
    q = prec + 2 * n.bit_length() + 16
    lo, hi = _series_bounds(r, b, q)
    if n:
        lo1, hi1 = _series_bounds(1, 1, q)
        lo, hi = (
            _mul(lo, _pow(lo1, n, q, False), q, False),
            _mul(hi, _pow(hi1, n, q, True), q, True),
        )
    shift = q - prec
    return lo >> shift, -((-hi) >> shift)


class LazyUniform:
    """A uniform U on [0, 1) whose first ``bits`` bits are ``w``; more bits (64 at a time)
    from ``src`` only while a comparison with it is undecided. Every comparison is with
    the same U."""

    def __init__(self, w: int, bits: int, src: WordSource) -> None:
        self.w, self.bits, self.src = int(w), int(bits), src

    def below_exp(self, a: int, b: int) -> bool:
        """Whether U < exp(-a/b), exactly."""
        while True:
            lo, hi = exp_bounds(a, b, self.bits)
            if self.w + 1 <= lo:
                return True
            if self.w >= hi:
                return False
            self.w = (self.w << 64) | int(self.src.words(1, 64)[0])
            self.bits += 64


def exp_table(
    count: int, step: tuple[int, int], prec: int = FAST_BITS
) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) uint64 arrays: lo_j <= 2^prec exp(-j s) <= hi_j for j < ``count``,
    s = step[0] / step[1], by the recurrence x_(j+1) = x_j exp(-s) in fixed point 2^q,
    q = prec + bits(count) + 24, every product rounded down (lo) or up (hi); the rounding
    accumulated over ``count`` products stays below 2^-(prec + 20), so hi_j - lo_j <= 2."""
    q = prec + max(count, 1).bit_length() + 24
    s_lo, s_hi = exp_bounds(step[0], step[1], q)
    lo = np.empty(count, dtype=np.uint64)
    hi = np.empty(count, dtype=np.uint64)
    shift = q - prec
    g_lo = g_hi = 1 << q
    for j in range(count):
        lo[j] = g_lo >> shift
        hi[j] = -((-g_hi) >> shift)
        g_lo, g_hi = (g_lo * s_lo) >> q, -((-g_hi * s_hi) >> q)
    return lo, hi
