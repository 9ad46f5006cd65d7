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
  demo's d = 32,768): each Bernoulli(exp(-x)) of the same algorithm is the event
  U < exp(-x) for a uniform U whose first 16 bits are one fresh word, compared with
  integer bounds lo <= 2^16 exp(-x) <= hi computed in exact integer arithmetic
  (:mod:`.exact_exp`); a word between the bounds (about 2^-15 of the trials) draws 64
  more bits of the same U and compares exactly at the higher precision, as often as
  needed. The Laplace step's exp(-u/t) is the product of two factors and the Gaussian
  step's exp(-a^2 / (2 t (t - 1))) of three (base-B digits of u and of a^2), each factor
  its own independent trial (the AND of independent Bernoullis is the Bernoulli of the
  product), so the tables of a t hold a few thousand entries and take milliseconds to
  build: t changes every round of DP-SGLD. The geometric part, max{v : U < exp(-v)}, takes
  one word. One comparison, not a chain of trials, decides each factor; the law is exactly
  the same.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .exact_exp import LazyUniform, exp_table

FAST_BITS = 16  #: the width of the tabled path's words (undecided: 2 in 2^16 at most)

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


_TABLE_T = 1 << 16  #: the largest t sampled with tables
#: bytes one draw takes on the tabled path, by t (measured: 24.2 at t = 3 and 25.4 at
#: t = 13,215 over 32,768 draws, 23.6 and 24.8 over 131,072)
_TABLED_BYTES_PER_DRAW = ((256, 27), (_TABLE_T, 27))
_GAUSS_TAIL = 23  # exp(-23) < 2^-32: a Gaussian step beyond 23 (2 t (t - 1)) never accepts
# but with probability below 2^-32, which the bounds (0, 1) leave to the exact fallback


@dataclass(frozen=True)
class _Factor:
    """Bounds at precision 2^FAST_BITS of exp(-j num / den) for j < len(lo)."""

    lo: np.ndarray
    hi: np.ndarray
    num: int
    den: int


def _factor(count: int, num: int, den: int) -> _Factor:
    lo, hi = exp_table(count, (num, den))
    lo.flags.writeable = hi.flags.writeable = False
    return _Factor(lo, hi, num, den)


@functools.lru_cache(maxsize=16)
def _tables(t: int) -> tuple[tuple[_Factor, ...], tuple[_Factor, ...]]:
    """The factors of the two acceptance probabilities of one t, each a few thousand
    entries at most (built in milliseconds: t changes every round of DP-SGLD):

    * exp(-u/t), u < t, as exp(-u1 B / t) exp(-u0 / t), u = u1 B + u0, B the least power
      of two >= sqrt t;
    * exp(-m / (2 t (t - 1))), m = a^2 < M = 23 (2 t (t - 1)), as the product of
      exp(-m_i C^i / den) over the base-C digits m_2 m_1 m_0 of m, C the least power of
      two with C^3 >= M.

    Powers of two, so that the digits are shifts and masks (numpy's integer division is
    several times slower than the rest of a trial)."""
    b = 1 << ((t - 1).bit_length() + 1) // 2  # b * b >= t
    lap = (_factor(-(-t // b), b, t), _factor(b, 1, t))
    den = 2 * t * (t - 1)
    top = _GAUSS_TAIL * den
    c = 1 << -(-(top - 1).bit_length() // 3)  # c^3 >= top
    gauss = (_factor(-(-top // (c * c)), c * c, den), _factor(c, c, den), _factor(c, 1, den))
    return lap, gauss


@functools.lru_cache(maxsize=1)
def _geometric_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Bounds on 2^FAST_BITS exp(-v), v = 1, 2, ... while exp(-v) >= 2^-FAST_BITS."""
    lo, hi = exp_table(13, (1, 1))  # exp(-12) < 2^-16
    return lo[1:], hi[1:]


def _bernoulli_product(digits: list[np.ndarray], factors, src: Entropy) -> np.ndarray:
    """Bernoulli(prod_i exp(-d_i num_i / den_i)) per row: the AND of independent trials,
    one per factor (a product of independent Bernoullis is the Bernoulli of the product),
    each a fresh word against the factor's bounds, undecided words settled exactly
    (:class:`~.exact_exp.LazyUniform`); a row stops at its first failure."""
    out = np.ones(digits[0].size, dtype=bool)
    live = np.arange(out.size)
    for d, f in zip(digits, factors, strict=True):
        j = d[live]
        w = src.words(live.size, FAST_BITS)
        ok = w < f.lo[j]
        for i in np.flatnonzero(~ok & (w < f.hi[j])):
            ok[i] = LazyUniform(int(w[i]), FAST_BITS, src).below_exp(int(j[i]) * f.num, f.den)
        out[live[~ok]] = False
        live = live[ok]
    return out


def _geometric(n: int, src: Entropy) -> np.ndarray:
    """n draws of V = max{v : U < exp(-v)}, one word each: j = #{v : w < lo_v} thresholds
    are passed for sure (they fall with v); V = j when w >= hi_(j+1), else exactly."""
    lo, hi = _geometric_bounds()
    w = src.words(n, FAST_BITS)
    j = (lo.size - np.searchsorted(lo[::-1], w, side="right")).astype(np.int64)
    for i in np.flatnonzero((j == lo.size) | (w < hi[np.minimum(j, lo.size - 1)])):
        j[i] = LazyUniform(int(w[i]), FAST_BITS, src).geometric(start=int(j[i]))
    return j


def _tabled_gaussian(t: int, size: int, src: Entropy) -> np.ndarray:
    """:func:`discrete_gaussian` for t <= _TABLE_T: the same rejection sampler (a Laplace
    proposal y = +-(u + t V), accepted with probability exp(-u/t), then with probability
    exp(-(|y| - t + 1)^2 / (2 t (t - 1)))), each Bernoulli(exp(-x)) decided by words of
    FAST_BITS bits against exact bounds (:mod:`.exact_exp`)."""
    lap, gauss = _tables(t)
    den = 2 * t * (t - 1)
    kb, kc = lap[1].lo.size.bit_length() - 1, gauss[1].lo.size.bit_length() - 1  # B, C = 2^k
    mask_b, mask_c = (1 << kb) - 1, (1 << kc) - 1
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        y = np.empty(0, dtype=np.int64)
        need = _proposals(size - done, _GAUSS_ACCEPT)
        while y.size < need:  # Laplace proposals
            u = uniform_below(t, src, _proposals(need - y.size, _LAPLACE_ACCEPT))
            u = u[_bernoulli_product([u >> kb, u & mask_b], lap, src)]
            x = u + t * _geometric(u.size, src)
            sign = src.bits(u.size)
            y = np.concatenate([y, np.where(sign == 1, -x, x)[~((sign == 1) & (x == 0))]])
        y = y[:need]
        m = (np.abs(y) - (t - 1)) ** 2  # a^2 < 2^62 for every |y| the Laplace step reaches
        far = m >= _GAUSS_TAIL * den
        mc = np.where(far, 0, m)
        digits = [mc >> (2 * kc), (mc >> kc) & mask_c, mc & mask_c]
        accept = _bernoulli_product(digits, gauss, src) & ~far
        # p < 2^-32 there: a fresh 32-bit word above 0 rejects (U >= 2^-32 > p); a zero
        # word is settled by the exact comparison
        far_i = np.flatnonzero(far)
        for i in far_i[src.words(far_i.size, 32) == 0]:
            accept[i] = LazyUniform(0, 32, src).below_exp(int(abs(y[i]) - (t - 1)) ** 2, den)
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
