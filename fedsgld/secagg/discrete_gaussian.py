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

Speed without changing the algorithm:

* **Entropy in bulk.** A batch reads its random bytes from one ``randbytes`` call sized for
  the whole batch (:class:`Entropy`; a further call only if the batch's rejections ran
  past that estimate). Every uniform integer still comes from fresh, unused bytes.
* **Narrow words.** A uniform integer below m <= 2^32 takes a 32-bit word, above a 64-bit
  one; both by rejection (no modulo bias).
* **Proposals in bulk.** The Laplace and Gaussian rejection steps draw enough proposals
  for the whole batch at once (their acceptance rates are known lower bounds), so that
  few passes remain; accepted proposals are kept in proposal order (iid whatever the
  order). Randomness drawn and not needed is discarded, never reused.
* Trials whose outcome is certain (Bernoulli(exp(0)), the first trial of
  Bernoulli(exp(-1))) draw nothing.
* **Tables, for t <= 2^16** (every realistic share: t is about 26,430 / sqrt(K) at the
  demo's d = 32,768): each Bernoulli(exp(-x)) of the same algorithm is the event U < exp(-x)
  for a uniform U whose first 32 bits are one fresh word, compared with integer bounds
  lo <= 2^32 exp(-x) <= hi computed once per t in exact integer arithmetic
  (:mod:`.exact_exp`: the Laplace step's exp(-u/t) for every u < t, exp(-v) for the
  geometric part, drawn as max{v : U < exp(-v)} from one word, and the Gaussian step's
  exp(-a^2 / (2 t (t - 1))) for every |a| until it falls below 2^-32). A word between the
  bounds (about 2^-31 of the trials) draws 64 more bits of the same U and compares exactly
  at the higher precision, as often as needed. So one comparison, not a chain of trials,
  decides each Bernoulli, and the law is exactly the same. The tables are built on the
  first batch of a t (about 0.5 s at t = 13,215 on a busy machine) and kept (four t at
  most).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .exact_exp import FAST_BITS, LazyUniform, exp_table

RandBytes = Callable[[int], bytes]
_MAX_T = 1 << 26  # 2 t (t - 1) * k stays far below 2^63
#: bytes one draw uses, by t (measured over 131,072 draws, within 0.1: 12.1 at t = 2,
#: 20.1 at 255, 25.2 at 1000, 29.9 at 26,430, 35.4 at 65,536, 45.2 from 70,000 to 2^26);
#: a batch asks for 5 % more than this, and calls again only if it runs out
_BYTES_PER_DRAW = ((256, 21), (4096, 26), (32_768, 31), (65_536, 36), (_MAX_T, 46))
_LAPLACE_ACCEPT = 0.6  # P(accept) of a Laplace proposal: 1 - e^-1 at large t, more below
_GAUSS_ACCEPT = 0.7  # of a Gaussian proposal: e^(-1/2) sqrt(pi/2) = 0.76 at large t


class Entropy:
    """Uniform words from a buffer of ``randbytes`` output: one call for ``nbytes``, and
    another (at least as large as the buffer) only when the buffer runs out. ``calls``
    counts them. Bytes are handed out once each."""

    def __init__(self, randbytes: RandBytes, nbytes: int) -> None:
        self._randbytes = randbytes
        self._buf = np.frombuffer(randbytes(max(8, nbytes)), dtype=np.uint8)
        self._pos = 0
        self.calls = 1

    def _take(self, nbytes: int) -> np.ndarray:
        nbytes = -(-nbytes // 8) * 8  # keep word alignment
        if self._pos + nbytes > self._buf.size:
            rest = self._buf[self._pos :]
            size = max(2 * nbytes, self._buf.size)  # geometric: few refills in all
            more = np.frombuffer(self._randbytes(size), dtype=np.uint8)
            self._buf, self._pos = np.concatenate([rest, more]), 0
            self.calls += 1
        out = self._buf[self._pos : self._pos + nbytes]
        self._pos += nbytes
        return out

    def words(self, n: int, bits: int) -> np.ndarray:
        """``n`` uniform words of ``bits`` = 8, 16, 32 or 64 bits (unsigned, that width)."""
        dtype = _WORD[bits]
        return self._take(n * (bits // 8)).view(dtype)[:n]

    def bits(self, n: int) -> np.ndarray:
        """``n`` uniform bits (0 or 1, int64)."""
        return np.unpackbits(self._take(-(-n // 8)))[:n].astype(np.int64)


_WORD = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4"), 64: np.dtype("<u8")}


def uniform_below(m: np.ndarray | int, src: Entropy, size: int | None = None) -> np.ndarray:
    """Independent uniform integers in [0, m_i) for each m_i in 1 .. 2^62 (int64 array);
    ``m`` an int and ``size`` for ``size`` draws below one m.

    Words of the narrowest width w in (8, 16, 32, 64) with 2^w >= max m; a word is
    accepted below 2^w - (2^w mod m_i) (every residue equally often; 2^64 - (2^64 mod m)
    wraps to 0 when m divides 2^64, which accepts every word) and rejected words are
    replaced by fresh ones."""
    scalar = size is not None
    m = np.asarray(m, dtype=np.uint64)
    if not scalar:
        m = m.ravel()
        size = m.size
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    top = int(m.max())
    bits = next(w for w in (8, 16, 32, 64) if top <= 1 << w)
    wide = np.dtype({8: np.uint16, 16: np.uint32, 32: np.uint64, 64: np.uint64}[bits])
    if bits < 64:
        span = np.uint64(1 << bits)
        limit = (span - span % m).astype(wide)
    else:  # wraps to 0 when m divides 2^64: every word is accepted
        with np.errstate(over="ignore"):
            limit = np.uint64(0) - (np.uint64(0) - m) % m
    m = m.astype(wide)

    def draw(n: int) -> np.ndarray:
        return src.words(n, bits).astype(wide)

    w = draw(size)
    out = w % m
    bad = np.flatnonzero((w >= limit) & (limit != 0))
    while bad.size:  # rare: redraw the rejected words only
        mb, lb = (m, limit) if scalar else (m[bad], limit[bad])
        w = draw(bad.size)
        out[bad] = w % mb
        bad = bad[(w >= lb) & (lb != 0)]
    return out.astype(np.int64)


def _bernoulli_exp_fraction(num: np.ndarray, den: int, src: Entropy) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS Algorithm 1, first case): count the
    k = 1, 2, ... for which Bernoulli(num / (den k)) succeeds, i.e. a uniform integer below
    den k falls below num; odd stopping k means 1. (num = 0: always 1; num = den: the first
    trial always succeeds.)"""
    k = np.where(num == den, 2, 1).astype(np.int64)
    live = np.flatnonzero((num > 0) & (num < den))
    if live.size:  # the first trial, one m = den for all
        hit = uniform_below(den, src, live.size) < num[live]
        live = live[hit]
        k[live] = 2
    live = np.flatnonzero(k == 2)
    trial = 2
    while live.size:  # trial k = trial for the rows still going: m = den * trial
        hit = uniform_below(den * trial, src, live.size) < num[live]
        live = live[hit]
        trial += 1
        k[live] = trial
    return ((k % 2) == 1) | (num == 0)


def bernoulli_exp(num: np.ndarray, den: int, src: Entropy) -> np.ndarray:
    """Bernoulli(exp(-num/den)) elementwise, exactly (num >= 0 int64 array, den >= 1)."""
    num = np.asarray(num, dtype=np.int64)
    den = int(den)
    whole, rest = num // den, num % den
    out = np.ones(num.shape, dtype=bool)
    live, j = np.flatnonzero(whole > 0), 0
    while live.size:  # exp(-whole) as `whole` successes of Bernoulli(exp(-1))
        ok = _bernoulli_exp_fraction(np.ones(live.size, dtype=np.int64), 1, src)
        out[live[~ok]] = False
        j += 1
        live = live[ok & (whole[live] > j)]
    live = np.flatnonzero(out)
    out[live] = _bernoulli_exp_fraction(rest[live], den, src)
    return out


def _bernoulli_exp_big(num: int, den: int, src: Entropy) -> bool:
    """The same as :func:`bernoulli_exp` for one ratio of unbounded Python integers."""

    def below(m: int) -> int:
        nwords = (m.bit_length() + 63) // 64 + 1
        span = 1 << (64 * nwords)
        while True:
            w = int.from_bytes(src.words(nwords, 64).tobytes(), "little")
            if w < span - span % m:
                return w % m

    for _ in range(num // den):
        if not _bernoulli_exp_big(1, 1, src):
            return False
    rest, k = num % den, 1
    while below(den * k) < rest:
        k += 1
    return k % 2 == 1


def _proposals(n: int, rate: float) -> int:
    """Proposals enough for n acceptances at acceptance ``rate`` but for ~1e-9."""
    return math.ceil((n + 6.0 * math.sqrt(n) + 8.0) / rate)


def discrete_laplace(t: int, size: int, src: Entropy) -> np.ndarray:
    """``size`` draws with P(y) proportional to exp(-|y| / t) (CKS Algorithm 2, scale t/1)."""
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        n = _proposals(size - done, _LAPLACE_ACCEPT)
        u = uniform_below(t, src, n)
        keep = bernoulli_exp(u, t, src)
        v = np.zeros(n, dtype=np.int64)
        live = np.flatnonzero(keep)
        while live.size:  # V: how many Bernoulli(exp(-1)) succeed in a row
            ok = _bernoulli_exp_fraction(np.ones(live.size, dtype=np.int64), 1, src)
            v[live[ok]] += 1
            live = live[ok]
        x = u + t * v
        sign = src.bits(n)
        keep &= ~((sign == 1) & (x == 0))  # -0 would count 0 twice
        got = np.where(sign == 1, -x, x)[keep][: size - done]
        out[done : done + got.size] = got
        done += got.size
    return out


_TABLE_T = 1 << 16  #: the largest t sampled with tables (their size grows like 7.7 t)
#: bytes one draw takes on the tabled path, by t (measured over 131,072 draws: 26.8 at
#: t = 2, 24.5 at 255, 27.0 at 1000, 28.1 at 13,215 and 26,430, 26.9 at 65,536)
_TABLED_BYTES_PER_DRAW = ((256, 28), (_TABLE_T, 30))


@dataclass(frozen=True)
class _Tables:
    """Bounds at precision 2^32 of every exp(-x) the sampler of one t compares with:
    ``lap``: exp(-u/t), u < t (the Laplace proposal's acceptance); ``geo``: exp(-v),
    v = 1, 2, ... (its geometric part), down to below 2^-32; ``gauss``: exp(-a^2 / (2 t
    (t - 1))), a = |Y| - (t - 1) in absolute value, down to below 2^-32 (the last entry's
    lower bound set to 0, so that it bounds every larger a too)."""

    lap: tuple[np.ndarray, np.ndarray]
    geo: tuple[np.ndarray, np.ndarray]
    gauss: tuple[np.ndarray, np.ndarray]


@functools.lru_cache(maxsize=4)
def _tables(t: int) -> _Tables:
    geo_lo, geo_hi = exp_table(24, (1, 1))  # exp(-23) < 2^-32
    gauss_count = math.isqrt(23 * 2 * t * (t - 1)) + 2  # exp(-23) < 2^-32 at the end
    g_lo, g_hi = exp_table(gauss_count, (1, 2 * t * (t - 1)), quadratic=True)
    g_lo[-1] = 0
    for a in (geo_lo, geo_hi, g_lo, g_hi):
        a.flags.writeable = False
    lap = exp_table(t, (1, t))
    for a in lap:
        a.flags.writeable = False
    return _Tables(lap=lap, geo=(geo_lo[1:], geo_hi[1:]), gauss=(g_lo, g_hi))


def _decide(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, exact) -> np.ndarray:
    """U < p for every row: ``w`` the first 32 bits of each U, [lo, hi] bounds on 2^32 p;
    ``exact(i)`` decides row i where the bounds do not (lo <= w < hi)."""
    out = w < lo
    for i in np.flatnonzero(~out & (w < hi)):
        out[i] = exact(i)
    return out


def _geometric(w: np.ndarray, tab: _Tables, src: Entropy) -> np.ndarray:
    """V = max{v : U < exp(-v)} per word: j = #{v : w < lo_v} thresholds are passed for
    sure (the thresholds fall with v); V = j when w >= hi_(j+1), else decided exactly."""
    lo, hi = tab.geo
    j = (lo.size - np.searchsorted(lo[::-1], w, side="right")).astype(np.int64)
    unsure = np.flatnonzero((j == lo.size) | (w < hi[np.minimum(j, lo.size - 1)]))
    for i in unsure:
        j[i] = LazyUniform(int(w[i]), FAST_BITS, src).geometric()
    return j


def _tabled_laplace(t: int, size: int, tab: _Tables, src: Entropy) -> np.ndarray:
    """:func:`discrete_laplace`'s law, each Bernoulli decided by one 32-bit word against
    the tables (exactly: :mod:`.exact_exp`)."""
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        n = _proposals(size - done, _LAPLACE_ACCEPT)
        u = uniform_below(t, src, n)
        w = src.words(n, FAST_BITS)
        keep = _decide(w, tab.lap[0][u], tab.lap[1][u],
                       lambda i, w=w, u=u: LazyUniform(int(w[i]), FAST_BITS, src).below_exp(
                           int(u[i]), t))  # fmt: skip
        u = u[keep]
        x = u + t * _geometric(src.words(u.size, FAST_BITS), tab, src)
        sign = src.bits(u.size)
        got = np.where(sign == 1, -x, x)[~((sign == 1) & (x == 0))][: size - done]
        out[done : done + got.size] = got
        done += got.size
    return out


def _tabled_gaussian(t: int, size: int, src: Entropy) -> np.ndarray:
    """:func:`discrete_gaussian` for t <= _TABLE_T: the same rejection sampler, each
    Bernoulli(exp(-x)) decided by a 32-bit word against exact bounds on 2^32 exp(-x)."""
    tab = _tables(t)
    den = 2 * t * (t - 1)
    last = tab.gauss[0].size - 1
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        y = _tabled_laplace(t, _proposals(size - done, _GAUSS_ACCEPT), tab, src)
        a = np.abs(np.abs(y) - (t - 1))
        idx = np.minimum(a, last)
        w = src.words(y.size, FAST_BITS)
        accept = _decide(w, tab.gauss[0][idx], tab.gauss[1][idx],
                         lambda i, w=w, a=a: LazyUniform(int(w[i]), FAST_BITS, src).below_exp(
                             int(a[i]) ** 2, den))  # fmt: skip
        got = y[accept][: size - done]
        out[done : done + got.size] = got
        done += got.size
    return out


def discrete_gaussian(
    share_variance: int, size: int, randbytes: RandBytes = os.urandom
) -> np.ndarray:
    """``size`` independent draws of N_Z(0, s^2), s^2 = ``share_variance`` = t (t - 1),
    from one ``randbytes`` call (more only if the batch's rejections ran long)."""
    t = math.isqrt(share_variance) + 1
    if share_variance < 2 or t * (t - 1) != share_variance or t > _MAX_T:
        raise ValueError(
            f"share_variance must be t (t - 1) with 2 <= t <= {_MAX_T}, got {share_variance!r}"
        )
    tabled = t <= _TABLE_T
    per_draw = next(b for top, b in (_TABLED_BYTES_PER_DRAW if tabled else _BYTES_PER_DRAW)
                    if t <= top)  # fmt: skip
    # proposals beyond the expected ones grow like sqrt(size) (:func:`_proposals`)
    src = Entropy(randbytes, int(1.05 * per_draw * (size + 20 * math.sqrt(size) + 100)) + 4096)
    if tabled:
        return _tabled_gaussian(t, size, src)
    den = 2 * t * (t - 1)
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        y = discrete_laplace(t, _proposals(size - done, _GAUSS_ACCEPT), src)
        dev = np.abs(y) - (t - 1)
        small = np.abs(dev) < (1 << 31)
        accept = np.zeros(y.size, dtype=bool)
        accept[small] = bernoulli_exp(dev[small] * dev[small], den, src)
        for i in np.flatnonzero(~small):  # astronomically rare: exact in Python integers
            accept[i] = _bernoulli_exp_big(int(dev[i]) ** 2, den, src)
        got = y[accept][: size - done]
        out[done : done + got.size] = got
        done += got.size
    return out
