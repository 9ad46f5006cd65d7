"""An exact discrete Gaussian sampler driven by the operating system's randomness.

N_Z(0, s^2) puts mass proportional to exp(-x^2 / (2 s^2)) on every integer x. The sampler
is the rejection sampler of Canonne, Kamath & Steinke (NeurIPS 2020, "The discrete
Gaussian for differential privacy", Algorithms 1-3), vectorised over coordinates, in
integer arithmetic only: every Bernoulli is decided by comparing a uniform integer with
an exact integer threshold, so the output follows N_Z(0, s^2) exactly (given uniform
random bits), with no floating-point rounding to leak or bias it.

The variance parameter is restricted to s^2 = t (t - 1) for an integer t >= 2: then
floor(s) + 1 = t and s^2 / t = t - 1 are integers, and the acceptance probability of a
discrete Laplace proposal Y (scale t) is exp(-(|Y| - t + 1)^2 / (2 t (t - 1))), a ratio of
integers that fit in 64 bits for every realistic |Y| (the rare larger ones are decided in
Python's unbounded integers). :func:`fedsgld.privacy.distributed.choose_ddg` rounds the
variance a site needs UP to that form.

Randomness: ``randbytes(n)`` (default :func:`os.urandom`), read as 64-bit words; uniform
integers below m are taken by rejection (no modulo bias).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

RandBytes = Callable[[int], bytes]
_MAX_T = 1 << 26  # 2 t (t - 1) * k stays far below 2^63


def uniform_below(m: np.ndarray, randbytes: RandBytes) -> np.ndarray:
    """Independent uniform integers in [0, m_i) for each m_i in 1 .. 2^62 (int64 array)."""
    m = np.asarray(m, dtype=np.uint64)
    out = np.empty(m.shape, dtype=np.uint64)
    todo = np.arange(m.size)
    # accept a word w < 2^64 - (2^64 mod m): every residue equally often
    limit = np.uint64(0) - (np.uint64(0) - m) % m  # 2^64 - (2^64 mod m), wraps to 0 if m | 2^64
    while todo.size:
        w = np.frombuffer(randbytes(8 * todo.size), dtype="<u8").astype(np.uint64)
        lim = limit[todo]
        ok = (lim == 0) | (w < lim)
        out[todo[ok]] = w[ok] % m[todo[ok]]
        todo = todo[~ok]
    return out.astype(np.int64)


def _bernoulli_exp_fraction(num: np.ndarray, den: np.ndarray, randbytes: RandBytes) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS Algorithm 1, first case): count the
    k = 1, 2, ... for which Bernoulli(num / (den k)) succeeds; odd stopping k means 1."""
    k = np.ones(num.shape, dtype=np.int64)
    live = np.arange(num.size)
    while live.size:
        hit = uniform_below(den[live] * k[live], randbytes) < num[live]
        k[live[hit]] += 1
        live = live[hit]
    return (k % 2) == 1


def bernoulli_exp(num: np.ndarray, den: np.ndarray, randbytes: RandBytes) -> np.ndarray:
    """Bernoulli(exp(-num/den)) elementwise, exactly (num >= 0, den >= 1, int64 arrays)."""
    num, den = (
        np.asarray(num, dtype=np.int64),
        np.broadcast_to(np.asarray(den, np.int64), num.shape),
    )
    whole, rest = num // den, num % den
    out = np.ones(num.shape, dtype=bool)
    live, j = np.flatnonzero(whole > 0), 0
    ones = np.ones(1, dtype=np.int64)
    while live.size:  # exp(-whole) as `whole` successes of Bernoulli(exp(-1))
        ok = _bernoulli_exp_fraction(
            np.broadcast_to(ones, live.shape), np.broadcast_to(ones, live.shape), randbytes
        )
        out[live[~ok]] = False
        j += 1
        live = live[ok & (whole[live] > j)]
    live = np.flatnonzero(out)
    out[live] = _bernoulli_exp_fraction(rest[live], den[live], randbytes)
    return out


def _bernoulli_exp_big(num: int, den: int, randbytes: RandBytes) -> bool:
    """The same as :func:`bernoulli_exp` for one ratio of unbounded Python integers."""

    def below(m: int) -> int:
        nbytes = (m.bit_length() + 7) // 8 + 8
        span = 1 << (8 * nbytes)
        while True:
            w = int.from_bytes(randbytes(nbytes), "little")
            if w < span - span % m:
                return w % m

    for _ in range(num // den):
        if not _bernoulli_exp_big(1, 1, randbytes):
            return False
    rest, k = num % den, 1
    while below(den * k) < rest:
        k += 1
    return k % 2 == 1


def discrete_laplace(t: int, size: int, randbytes: RandBytes) -> np.ndarray:
    """``size`` draws with P(y) proportional to exp(-|y| / t) (CKS Algorithm 2, scale t/1)."""
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    one = np.ones(1, dtype=np.int64)
    while todo.size:
        n = todo.size
        u = uniform_below(np.full(n, t, dtype=np.uint64), randbytes)
        keep = bernoulli_exp(u, np.int64(t), randbytes)
        v = np.zeros(n, dtype=np.int64)
        live = np.flatnonzero(keep)
        while live.size:  # V: how many Bernoulli(exp(-1)) succeed in a row
            ok = bernoulli_exp(np.broadcast_to(one, live.shape), one, randbytes)
            v[live[ok]] += 1
            live = live[ok]
        x = u + t * v
        sign = uniform_below(np.full(n, 2, dtype=np.uint64), randbytes)
        keep &= ~((sign == 1) & (x == 0))  # -0 would count 0 twice
        out[todo[keep]] = np.where(sign[keep] == 1, -x[keep], x[keep])
        todo = todo[~keep]
    return out


def discrete_gaussian(
    share_variance: int, size: int, randbytes: RandBytes = os.urandom
) -> np.ndarray:
    """``size`` independent draws of N_Z(0, s^2), s^2 = ``share_variance`` = t (t - 1)."""
    t = math.isqrt(share_variance) + 1
    if share_variance < 2 or t * (t - 1) != share_variance or t > _MAX_T:
        raise ValueError(
            f"share_variance must be t (t - 1) with 2 <= t <= {_MAX_T}, got {share_variance!r}"
        )
    den = 2 * t * (t - 1)
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = discrete_laplace(t, todo.size, randbytes)
        dev = np.abs(y) - (t - 1)
        small = np.abs(dev) < (1 << 31)
        accept = np.zeros(y.size, dtype=bool)
        accept[small] = bernoulli_exp(dev[small] * dev[small], np.int64(den), randbytes)
        for i in np.flatnonzero(~small):  # astronomically rare: exact in Python integers
            accept[i] = _bernoulli_exp_big(int(dev[i]) ** 2, den, randbytes)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out
