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

Speed without changing the algorithm (entropy read in bulk, narrow words, proposals in
bulk, and for t <= 2^16 a binned envelope settled by exact trials): see
docs/architecture.md, "Design notes".
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .exact_exp import LazyUniform, exp_bounds, exp_table

FAST_BITS = 16  #: the width of the binned path's words (undecided: 2 in 2^16 at most)

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


#: draws per pass of a batch: the passes' temporaries stay at 64 KiB, which the allocator
#: recycles, where a pass over the whole share (256 KiB arrays at d = 2^15) had glibc hand
#: pages back and fault them in again at every array (about 2x the sampler's time)
BLOCK = 8192


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


_TABLE_T = 1 << 16  #: the largest t sampled from the binned envelope
_BIN_SPAN = 6  #: the bins cover |x| < T with T >= _BIN_SPAN t; beyond is the tail (P < e^-17)
_BIN_STEPS = 16  #: the bin width W is the largest power of two <= (t - 1) / _BIN_STEPS
_GRAIN_BITS = 6  #: every bin's weight is a multiple of 2^_GRAIN_BITS, so one look-up finds it
_DIGIT_MAX = 1 << 13  #: the largest factor table of the in-bin acceptance


@dataclass(frozen=True)
class _Factor:
    """Bounds at precision 2^FAST_BITS of exp(-j num / den) for j < len(lo)."""

    lo: np.ndarray
    hi: np.ndarray
    num: int
    den: int


def _factor(count: int, num: int, den: int) -> _Factor:
    lo, hi = exp_table(count, (num, den))
    lo, hi = lo.astype(np.int32), hi.astype(np.int32)  # <= 2^16: compared with 16-bit words
    lo.flags.writeable = hi.flags.writeable = False
    return _Factor(lo, hi, num, den)


@dataclass(frozen=True)
class _Bins:
    """The envelope of N_Z(0, t (t - 1)) on |x| < T = count W: bin i holds iW <= |x| <
    (i + 1) W, and each of its integers (either sign) has the proposal weight ``weight[i]``
    >= 2^FAST_BITS exp(-(iW)^2 / den), den = 2 t (t - 1): the target's largest value in
    the bin, rounded up to a multiple of 2^_GRAIN_BITS. Index ``count`` is the tail |x| >= T,
    last, of weight ``weight[count]`` W (see :func:`_tail_draw`)."""

    t: int
    width_bits: int  # W = 2^width_bits
    count: int
    lo: np.ndarray  # lo_i <= 2^FAST_BITS exp(-(iW)^2 / den) <= hi_i; index count: 0, 0
    hi: np.ndarray
    start: np.ndarray  # the first weight unit of each bin (and of the tail)
    lookup: np.ndarray  # the bin of each 2^_GRAIN_BITS weight units
    total: int  # the weight of one sign, tail included
    tail_pow2: int  # c: the tail's first acceptance factor is 2^c exp(-T^2 / den)
    tail_step_bits: int  # the tail's geometric steps are 2^tail_step_bits long
    digit_bits: int  # the in-bin exponent's digits are base 2^digit_bits
    factors: tuple[_Factor, ...]  # most significant digit first
    rate: float  # the share of proposals accepted (for sizing batches only)

    def bytes_per_draw(self) -> float:
        """Random bytes one accepted draw takes on average: its proposals' 64-bit words and
        one 16-bit word per digit of each proposal that reaches them; 10 % more for the
        proposals a batch asks for beyond its expected need."""
        return 1.1 * (8 + 2 * len(self.factors)) / self.rate


@functools.lru_cache(maxsize=16)
def _bins(t: int, span: int = _BIN_SPAN) -> _Bins:
    """The envelope of one t (a few milliseconds: t changes every round of DP-SGLD)."""
    den = 2 * t * (t - 1)
    wbits = max(0, ((t - 1) // _BIN_STEPS).bit_length() - 1)
    width = 1 << wbits
    count = -(-span * t // width)
    top = count * width  # T
    lo = np.zeros(count + 1, dtype=np.int64)
    hi = np.zeros(count + 1, dtype=np.int64)
    hi[:count] = 1
    for i in range(count):  # bounds fall with i; from the first hi = 1 on: (0, 1)
        lo[i], hi[i] = exp_bounds((i * width) ** 2, den, FAST_BITS)
        if hi[i] <= 1:
            break
    grain = 1 << _GRAIN_BITS
    weight = -(-np.maximum(hi, 1) // grain) * grain
    # the tail: x = T + U + 2^q G, U < 2^q uniform, P(G = g) = 2^-(g + 1), with 2^q 2 T >= den
    # so that each step's factor 2 exp(-2 T 2^q / den) <= 2/e; its weight 2^e (last: it
    # need not be a multiple of the grain) makes its first factor 2^c exp(-T^2 / den),
    # c = 17 + q - wbits - e, at most 1: c <= (T^2 / den) / ln 2, taking ln 2 < 0.6932
    q = max(0, (-(-den // (2 * top)) - 1).bit_length())
    c_max = (top * top * 10_000) // (den * 6932)
    e = max(0, FAST_BITS + 1 + q - wbits - c_max)
    weight[count] = 1 << e
    start = np.concatenate([[0], np.cumsum(weight)[:-1]])
    lookup = np.repeat(np.arange(count + 1, dtype=np.int64), -(-weight // grain))
    m_top = (2 * count - 1) * width * width  # m = l (2 i W + l) < (2 count - 1) W^2
    k = 1
    while 1 << -(-(m_top - 1).bit_length() // k) > _DIGIT_MAX:
        k += 1
    kc = -(-(m_top - 1).bit_length() // k)
    c = 1 << kc
    factors = tuple(
        _factor(-(-m_top // c ** (k - 1)) if j == 0 else c, c ** (k - 1 - j), den) for j in range(k)
    )
    for a in (lo, hi, start, lookup):
        a.flags.writeable = False
    total = int(weight.sum())
    # the target's mass sum_x exp(-x^2 / den) is sqrt(pi den) to within e^(-pi^2 den / 2)
    rate = (1 << FAST_BITS) * math.sqrt(math.pi * den) / (2 * total << wbits)
    return _Bins(
        t, wbits, count, lo, hi, start, lookup, total,
        FAST_BITS + 1 + q - wbits - e, q, kc, factors, rate,
    )  # fmt: skip


def _scaled_below_exp(c: int, a: int, b: int, src: Entropy) -> bool:
    """Bernoulli(2^c exp(-a/b)), given 2^c exp(-a/b) <= 1: for c >= 0, U < exp(-a/b) for U
    uniform on [0, 2^-c); for c < 0, -c fresh zero bits (Bernoulli(2^c)) and U < exp(-a/b)."""
    if c < 0:
        if src.bits(-c).any():
            return False
        c = 0
    return LazyUniform(0, c, src).below_exp(a, b)


def _tail_draw(bins: _Bins, src: Entropy) -> int | None:
    """One proposal from the tail |x| >= T (either sign, chosen by the caller) and its
    acceptance; None when rejected. The proposal x = T + y, y = U + 2^q G has the weight
    2^-q 2^-(G + 1) of the tail's total 2^e W; the target's 2^FAST_BITS
    exp(-x^2 / den) over it is

        2^c exp(-T^2 / den) * exp(-(y^2 + 2 T U) / den) * (2 exp(-2 T 2^q / den))^G

    (x^2 = T^2 + 2 T U + 2 T 2^q G + y^2), each factor at most 1 and its own trial."""
    t, q = bins.t, bins.tail_step_bits
    den = 2 * t * (t - 1)
    top = bins.count << bins.width_bits
    g = 0
    while src.bits(1)[0]:
        g += 1
    u = int(uniform_below(1 << q, src, 1)[0]) if q else 0
    y = u + (g << q)
    if not _scaled_below_exp(bins.tail_pow2, top * top, den, src):
        return None
    if not LazyUniform(0, 0, src).below_exp(y * y + 2 * top * u, den):
        return None
    for _ in range(g):
        if not LazyUniform(0, 1, src).below_exp(2 * top << q, den):
            return None
    return top + y


def _factors_accept(m: np.ndarray, bins: _Bins, src: Entropy) -> np.ndarray:
    """Bernoulli(exp(-m / den)) per row, as the AND of one independent trial per base-C
    digit of m (a product of independent Bernoullis is the Bernoulli of the product):
    a fresh word against the digit's bounds, undecided words settled exactly."""
    k, kc = len(bins.factors), bins.digit_bits
    out = np.ones(m.size, dtype=bool)
    for j, f in enumerate(bins.factors):
        d = m >> (kc * (k - 1 - j))
        if j:
            d &= (1 << kc) - 1
        w = src.words(m.size, FAST_BITS)
        ok = w < f.lo[d]
        for i in np.flatnonzero(~ok & (w < f.hi[d])):
            ok[i] = LazyUniform(int(w[i]), FAST_BITS, src).below_exp(int(d[i]) * f.num, f.den)
        out &= ok
    return out


def _binned_gaussian(t: int, size: int, src: Entropy) -> np.ndarray:
    """:func:`discrete_gaussian` for t <= _TABLE_T: rejection from a piecewise-constant
    envelope (:class:`_Bins`). One uniform integer u below 2 W total (from a 64-bit word)
    picks a proposal: its low bits the offset l < W, the next the sign, the rest v < total
    a weight unit, whose bin i is a look-up; r = v - start_i is uniform below weight_i. The
    proposal x = iW + l is accepted with probability 2^FAST_BITS exp(-x^2 / den) /
    weight_i, the product of two independent trials: r + U < 2^FAST_BITS exp(-(iW)^2 / den) (r against
    the bin's bounds, settled exactly between them) and exp(-l (2 i W + l) / den), by its
    digits. Negative zero is rejected (zero would count twice); the tail is
    :func:`_tail_draw`. From 0.78 (t = 2) to 0.98 of the proposals are accepted."""
    bins = _bins(t)
    wbits, mask = bins.width_bits, (1 << bins.width_bits) - 1
    den = 2 * t * (t - 1)
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        n = _proposals(min(size - done, BLOCK), bins.rate)
        # a 64-bit word w below the largest multiple of m = 2 W total is uniform mod m (the
        # rest are rejected below): no redraws, and no 32-bit word losing up to half its
        # draws to rejection when m is near 2^32
        m = 2 * bins.total << wbits
        w = src.words(n, 64)
        u = (w % np.uint64(m)).astype(np.int64)
        neg = ((u >> wbits) & 1).astype(bool)
        v = u >> (wbits + 1)
        b = bins.lookup[v >> _GRAIN_BITS]
        r = v - bins.start[b]
        x = (b << wbits) | (u & mask)
        # words past the last multiple of m (below m / 2^64 <= 2^-29 of them) are rejected
        valid = w < np.uint64((1 << 64) - (1 << 64) % m)
        accept = (r < bins.lo[b]) & valid
        for i in np.flatnonzero(~accept & valid & (r < bins.hi[b])):
            edge = int(b[i]) << wbits
            accept[i] = LazyUniform(int(r[i]), FAST_BITS, src).below_exp(edge * edge, den)
        accept &= ~(neg & (x == 0))
        idx = np.flatnonzero(accept)
        low = x[idx] & mask
        accept[idx] = _factors_accept(low * (2 * x[idx] - low), bins, src)
        for i in np.flatnonzero((b == bins.count) & valid):  # the tail: 1 in about 10^6
            y = _tail_draw(bins, src)
            accept[i], x[i] = y is not None, y or 0
        got = np.where(neg, -x, x)[accept][: size - done]
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
    binned = t <= _TABLE_T
    per_draw = (_bins(t).bytes_per_draw() if binned
                else next(b for top, b in _BYTES_PER_DRAW if t <= top))  # fmt: skip
    # proposals beyond the expected ones grow like sqrt(size) (:func:`_proposals`)
    src = Entropy(randbytes, int(1.05 * per_draw * (size + 20 * math.sqrt(size) + 100)) + 4096)
    if binned:
        return _binned_gaussian(t, size, src)
    den = 2 * t * (t - 1)
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        y = discrete_laplace(t, _proposals(min(size - done, BLOCK), _GAUSS_ACCEPT), src)
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
