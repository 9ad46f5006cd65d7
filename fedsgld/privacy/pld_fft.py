"""A fast, rigorous PLD accountant for ledgers of Poisson-subsampled Gaussian steps.

DP-SGLD's noise multiplier sigma_t changes every step, so its ledger holds thousands of
distinct mechanisms. This module composes all of them at once:

1. **One shared grid.** Every step's privacy loss distribution (PLD), in both directions of
   add/remove adjacency, is discretised onto the same grid of losses ``k * h`` by the
   pessimistic connect-the-dots rule, all steps in one vectorised pass. Each step uses
   every grid point near zero, where its mass is, and a geometrically coarser subset of
   them in its tails (support points k with spacing 2^l for |k| in (K1 2^(l-1), K1 2^l],
   K1 about 6 standard deviations of the step's loss).
2. **Fourier domain.** The composed PLD is the convolution of the steps' PLDs; it is
   computed as the product of their discrete Fourier transforms (integer powers for
   repeated steps) and one inverse transform per direction, on a circular window of
   ``N`` grid points.
3. **Read-out.** ``delta(epsilon)`` and ``epsilon(delta)`` come from the composed PMF plus
   every mass that the construction moved out of the window, so the result is an upper
   bound.

Mechanism and directions: see :mod:`fedsgld.privacy.pld_steps` (both directions of
add/remove adjacency are composed separately over all steps and the larger delta is
reported).

Why the result is an upper bound
--------------------------------
* **Connect-the-dots discretisation** of every step (:mod:`fedsgld.privacy.pld_steps`):
  the discrete pair dominates the step, and composing dominating pairs dominates the
  composition.
* **Merged sigmas.** Steps with the same q whose sigmas fall in one bin of relative width
  ``sigma_merge`` (1e-3) are all accounted at the smallest sigma of the bin. A Gaussian
  with more noise is a post-processing of one with less, so this only raises delta.
* **Truncation of each step** (:mod:`fedsgld.privacy.pld_steps`): the outputs far out in
  a step's tails go to the loss +infinity or are rounded up onto the grid: both only
  raise delta(epsilon).
* **The window.** The composed PMF is computed modulo ``N`` grid points (circular
  convolution), which folds the mass outside the window ``[A, A + N h)`` back into it:
  folding only ADDS mass inside the window. The mass at or above the top ``B = A + N h``
  is bounded by a Chernoff bound from the exact moment generating functions of the
  discretised steps, ``P(loss >= B) <= exp(sum_t log E[e^{lambda loss_t}] - lambda B)``,
  and added to delta in full. ``A`` and ``N`` are chosen by the same kind of bound so
  that both the folded and the added mass are below ``window_mass`` (a tightness choice;
  the result is an upper bound whatever the window).

So ``delta(epsilon) = 1 - prod_t (1 - inf_t) + sum_{window losses x > epsilon}
p(x) (1 - e^{epsilon - x}) + tail_bound`` is an upper bound on the true delta of the
ledger, and ``epsilon(delta)`` (the smallest epsilon with that bound <= delta) is an upper
bound on the true epsilon. The remaining caveat is floating point: the Gaussian masses
are computed to about 1e-16 relative error per interval and the FFT to about 1e-16 of
the total mass, so values of delta below ~1e-12 are not resolved (the same limits as
dp_accounting's FFT-based PLD).

How far above exact the result lies, and how the grid is chosen for that: docs/architecture.md,
"Design notes".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from scipy import fft as sp_fft

from fedsgld.privacy.pld_steps import build_rows, loss_variance

__all__ = [
    "DEFAULT_RHO",
    "DEFAULT_SIGMA_MERGE",
    "DEFAULT_TAIL",
    "DEFAULT_WINDOW_MASS",
    "ComposedPLD",
    "compose",
    "ledger_delta",
    "ledger_epsilon",
]

#: target relative growth of the composed loss variance from the discretisation (sets h)
DEFAULT_RHO = 2e-3
#: steps whose sigmas differ by less than this relative amount are accounted together at
#: the smallest of their sigmas (conservative)
DEFAULT_SIGMA_MERGE = 1e-3
#: per-step mass left out of the connect-the-dots split (moved to +infinity or rounded up)
DEFAULT_TAIL = 1e-17
#: bound on the composed mass above the window (added to delta) and below it (folded in),
#: relative to the smallest delta of interest
DEFAULT_WINDOW_MASS = 1e-6

H_MIN, H_MAX = 1e-6, 1e-2
_N_MAX = 1 << 22  # largest transform; beyond it h grows
# Chernoff exponents tried for the window's tail bounds: lambda_c 2^k, k = _K_LOW.._K_HIGH,
# lambda_c the optimal exponent for a Gaussian of the ledger's (proxy) variance
_K_LOW, _K_HIGH = -7, 1
_ROW_CHUNK = 256  # steps per vectorised block


def _log_mgf(p: np.ndarray, x: np.ndarray, last: np.ndarray, lambda0: float, n: int) -> np.ndarray:
    """An upper bound on log sum_c p[i, c] exp(lambda x[i, c]) per row i, for the
    exponents lambda = lambda0 2^k, k = 0..n-1; shape (rows, n).

    Each row is scaled by its largest exponent and the factors exp(lambda (x - top))
    are obtained by squaring; a factor below e^-700 is raised to e^-700 (no underflow to a
    zero sum), which can only increase the result."""
    top = np.max(np.where(np.arange(x.shape[1])[None, :] <= last[:, None], x, -np.inf), axis=1)
    d = np.minimum(x - top[:, None], 0.0)  # padding lies above the top: no mass
    floor = math.exp(-700.0)
    f = np.maximum(np.exp(np.maximum(lambda0 * d, -700.0)), floor)
    out = np.empty((p.shape[0], n))
    for k in range(n):
        if k:
            f = np.maximum(f * f, floor)
        out[:, k] = np.einsum("rc,rc->r", p, f)
    lambdas = lambda0 * 2.0 ** np.arange(n)
    with np.errstate(divide="ignore"):
        return np.log(out) + top[:, None] * lambdas[None, :]


def _product_of_powers(spec: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """prod_i spec[i] ** counts[i] (integer counts >= 1), by binary powers (Horner in 2)."""
    c = counts.astype(np.int64)
    if np.all(c == 1):
        return np.prod(spec, axis=0)
    out = np.ones(spec.shape[1], dtype=spec.dtype)
    for bit in reversed(range(int(c.max()).bit_length())):
        out *= out
        sel = ((c >> bit) & 1) == 1
        if np.any(sel):
            out *= np.prod(spec[sel], axis=0)
    return out


class ComposedPLD:
    """The composed, discretised PLD of a ledger in both directions (see the module docstring).

    Build it with :func:`compose`. ``delta(epsilon)`` and ``epsilon(delta)`` are upper bounds
    for the ledger under add/remove adjacency (the larger of the two directions).
    """

    def __init__(
        self,
        *,
        h: float,
        low: Sequence[int],
        pmfs: Sequence[np.ndarray],
        infinity: Sequence[float],
        log_upper: Sequence[np.ndarray],
        lambdas: np.ndarray,
        groups: int = 0,
    ) -> None:
        self.h = h
        self.groups = groups
        self._low = list(low)  # grid index of each direction's first window point
        self._pmf = list(pmfs)
        self._inf = list(infinity)
        self._extra = []
        for lo, pmf, inf, lu in zip(self._low, self._pmf, self._inf, log_upper):
            top = (lo + pmf.size) * h
            log_tail = float(np.min(lu - lambdas * top)) if lambdas.size else -math.inf
            self._extra.append(min(1.0, inf + math.exp(min(log_tail, 0.0))))
        self._losses = [(lo + np.arange(p.size)) * h for lo, p in zip(self._low, self._pmf)]

    @property
    def size(self) -> int:
        """Points of the transform (N)."""
        return self._pmf[0].size

    @property
    def window(self) -> list[tuple[float, float]]:
        """[(A, B)] loss window of each direction (remove, add)."""
        return [(lo * self.h, (lo + p.size) * self.h) for lo, p in zip(self._low, self._pmf)]

    @property
    def extra_mass(self) -> list[float]:
        """Mass counted in delta in full, per direction: +infinity plus the tail bound above B."""
        return list(self._extra)

    def distributions(self) -> list[tuple[np.ndarray, np.ndarray, float]]:
        """Per direction (remove, add): the window's losses (ascending), their masses under
        the first distribution of the dominating pair, and the mass counted at +infinity
        (:attr:`extra_mass`). Copies: the trade-off curve of the pair is built from them."""
        return [(x.copy(), p.copy(), e) for x, p, e in zip(self._losses, self._pmf, self._extra)]

    def _delta_one(self, d: int, epsilon: float) -> float:
        x, p = self._losses[d], self._pmf[d]
        sel = x > epsilon
        return min(1.0, self._extra[d] + float(np.sum(p[sel] * -np.expm1(epsilon - x[sel]))))

    def delta(self, epsilon: float) -> float:
        """Upper bound on delta at ``epsilon`` >= 0 (the larger of the two directions)."""
        epsilon = float(epsilon)
        if math.isnan(epsilon) or epsilon < 0.0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        if epsilon == math.inf:
            return max(self._inf)
        return max(self._delta_one(d, epsilon) for d in range(len(self._pmf)))

    def _epsilon_one(self, d: int, delta: float) -> float:
        x, p, extra = self._losses[d], self._pmf[d], self._extra[d]
        if extra >= delta:
            return math.inf
        n = p.size

        def delta_at(i: int) -> float:  # delta at the loss x[i]
            if i + 1 >= n:
                return extra
            return extra + float(np.sum(p[i + 1 :] * -np.expm1(x[i] - x[i + 1 :])))

        if delta_at(0) <= delta:
            return max(0.0, float(x[0]))
        lo, hi = 0, n - 1  # delta_at(lo) > delta >= delta_at(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if delta_at(mid) > delta:
                lo = mid
            else:
                hi = mid
        # on (x[lo], x[hi]]: delta(eps) = extra + S1 - e^eps S2, sums over losses >= x[hi]
        s1 = float(np.sum(p[hi:]))
        s2 = float(np.sum(p[hi:] * np.exp(x[hi] - x[hi:])))  # S2 e^{x[hi]}
        num = extra + s1 - delta
        eps = float(x[hi]) + math.log(num / s2) if (s2 > 0.0 and num > 0.0) else float(x[hi])
        eps = min(max(eps, float(x[lo])), float(x[hi]))
        return max(0.0, eps)

    def epsilon(self, delta: float) -> float:
        """Upper bound on the smallest epsilon whose delta is <= ``delta`` (``inf`` if none)."""
        delta = float(delta)
        if not (0.0 < delta < 1.0):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        return max(self._epsilon_one(d, delta) for d in range(len(self._pmf)))


def _groups(
    ledger: Iterable[tuple[float, float, int]], merge: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, sigma, count) of the step groups: equal q and sigmas within a factor (1 + merge)
    of each other, accounted at the group's smallest sigma (epsilon is non-increasing in
    sigma, so this can only raise the bound)."""
    arr = np.asarray([(float(q), float(s), float(c)) for q, s, c in ledger], dtype=np.float64)
    if arr.size == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    q, s, c = arr[:, 0], arr[:, 1], arr[:, 2]
    if not np.all((q > 0.0) & (q <= 1.0)):
        raise ValueError("every sample rate q must be in (0, 1]")
    if not np.all((s > 0.0) & np.isfinite(s)):
        raise ValueError("every noise multiplier sigma must be finite and > 0")
    if not np.all((c >= 0.0) & (c == np.round(c))):
        raise ValueError("every step count must be an integer >= 0")
    keep = c > 0
    q, s, c = q[keep], s[keep], c[keep]
    if merge > 0.0:
        key = np.floor(np.log(s) / math.log1p(merge))
    else:
        key = s
    order = np.lexsort((s, key, q))
    q, s, c, key = q[order], s[order], c[order], key[order]
    new = np.ones(q.size, dtype=bool)
    new[1:] = (q[1:] != q[:-1]) | (key[1:] != key[:-1])
    start = np.flatnonzero(new)
    return q[start], s[start], np.add.reduceat(c, start)


def _spacing(q: np.ndarray, sigma: np.ndarray, count: np.ndarray, rho: float) -> float:
    """h with (steps) h^2 / 6 = rho * (sum of the steps' loss variances), clipped."""
    var = float(np.sum(count * loss_variance(q, sigma)) / np.sum(count))
    h = float(np.clip(math.sqrt(6.0 * rho * var), H_MIN, H_MAX))
    # rounded down onto 2^(k/4): the same h for similar ledgers (e.g. a ledger and the
    # same ledger one step longer), so that epsilon moves smoothly with the ledger
    return max(H_MIN, 2.0 ** (math.floor(4.0 * math.log2(h)) / 4.0))


def compose(
    ledger: Iterable[tuple[float, float, int]],
    *,
    delta: float = 1e-12,
    value_interval: float | None = None,
    rho: float = DEFAULT_RHO,
    sigma_merge: float = DEFAULT_SIGMA_MERGE,
    tail: float = DEFAULT_TAIL,
    window_mass: float = DEFAULT_WINDOW_MASS,
) -> ComposedPLD:
    """Compose a ledger [(q, sigma, count), ...] of Poisson-subsampled Gaussian steps.

    Args:
        ledger: (sampling rate q in (0, 1], noise multiplier sigma > 0, count >= 0) entries.
        delta: the smallest delta the result will be asked about; the window is sized so
            that the masses it drops or folds are below ``window_mass * delta``.
        value_interval: grid spacing h of the privacy loss, in [1e-6, 1e-2]; None chooses
            it from ``rho``.
        rho: with ``value_interval=None``, h is set so that the variance the discretisation
            adds, (steps) h^2 / 6, is ``rho`` times the ledger's loss variance.
        sigma_merge: steps with the same q whose sigmas share a bin of relative width
            ``sigma_merge`` are accounted together at the smallest of their sigmas; 0 keeps
            every distinct sigma.
        tail: per-step probability of the outputs left out of the split, in (0, 1e-6].
        window_mass: see ``delta``; in (0, 1).
    """
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not (0.0 < rho <= 1.0):
        raise ValueError(f"rho must be in (0, 1], got {rho!r}")
    if not (0.0 <= sigma_merge < 0.5):
        raise ValueError(f"sigma_merge must be in [0, 0.5), got {sigma_merge!r}")
    if not (0.0 < tail <= 1e-6):
        raise ValueError(f"tail must be in (0, 1e-6], got {tail!r}")
    if not (0.0 < window_mass < 1.0):
        raise ValueError(f"window_mass must be in (0, 1), got {window_mass!r}")
    q, sigma, count = _groups(ledger, sigma_merge)
    if q.size == 0:
        one = np.ones(1)
        return ComposedPLD(
            h=H_MAX, low=[0, 0], pmfs=[one, one.copy()], infinity=[0.0, 0.0],
            log_upper=[np.zeros(0), np.zeros(0)], lambdas=np.zeros(0),
        )  # fmt: skip
    if value_interval is None:
        h = _spacing(q, sigma, count, rho)
    else:
        h = float(value_interval)
        if not (H_MIN <= h <= H_MAX):
            raise ValueError(f"value_interval must be in [{H_MIN:g}, {H_MAX:g}], got {h!r}")
    while True:
        result = _compose_at(q, sigma, count, h, delta * window_mass, tail)
        if result is not None:
            return result
        h *= 2.0  # the window needs more than _N_MAX points: coarser grid


def _compose_at(
    q: np.ndarray, sigma: np.ndarray, count: np.ndarray, h: float, eta: float, tail: float
) -> ComposedPLD | None:
    # 1. the steps' PMFs block by block; their masses at +infinity and their MGFs
    blocks = []
    log_fin = [0.0, 0.0]
    var = float(np.sum(count * loss_variance(q, sigma)))
    lam_c = math.sqrt(-2.0 * math.log(eta) / max(var, 1e-300))
    lambda0 = min(max(lam_c * 2.0**_K_LOW, 1e-4), 1e3)
    n_lam = _K_HIGH - _K_LOW + 1
    lambdas = lambda0 * 2.0 ** np.arange(n_lam)
    mgf = np.zeros((4, n_lam))
    span = 0
    for start in range(0, q.size, _ROW_CHUNK):
        sl = slice(start, start + _ROW_CHUNK)
        rows = build_rows(q[sl], sigma[sl], h, tail)
        c = count[sl]
        log_fin[0] += float(np.sum(c * np.log1p(-np.minimum(rows.inf_remove, 1.0))))
        log_fin[1] += float(np.sum(c * np.log1p(-np.minimum(rows.inf_add, 1.0))))
        x = rows.pos * h
        cc = c[:, None]
        # remove: loss x; add: loss -x. Upper tails E e^{lambda loss}, lower E e^{-lambda loss}
        for i, (p, sign) in enumerate(
            ((rows.remove, 1.0), (rows.remove, -1.0), (rows.add, -1.0), (rows.add, 1.0))
        ):
            mgf[i] += np.sum(cc * _log_mgf(p, sign * x, rows.last, lambda0, n_lam), axis=0)
        first = rows.pos[:, 0]
        final = np.take_along_axis(rows.pos, rows.last[:, None], axis=1)[:, 0]
        span = max(span, int(np.max(final - first)) + 1)
        blocks.append((sl, rows))

    # 2. the windows: P(loss >= B), P(loss < A) <= eta by Chernoff bounds
    log_eta = math.log(eta)
    lows, widths = [], []
    for up, down in ((mgf[0], mgf[1]), (mgf[2], mgf[3])):
        b = float(np.min((up - log_eta) / lambdas))
        a = min(float(np.max((log_eta - down) / lambdas)), 0.0)
        b = max(b, a + h)
        lows.append(math.floor(a / h))
        widths.append(int(math.ceil((b - a) / h)) + 2)
    n_fft = sp_fft.next_fast_len(max(max(widths), span + 1), real=True)
    if n_fft > _N_MAX:
        return None

    # 3. product of the transforms, one inverse transform per direction
    spectra = [np.ones(n_fft // 2 + 1, dtype=np.complex128) for _ in range(2)]
    for sl, rows in blocks:
        m = rows.pos.shape[0]
        valid = np.arange(rows.pos.shape[1])[None, :] <= rows.last[:, None]
        r_idx = np.broadcast_to(np.arange(m)[:, None], rows.pos.shape)[valid]
        for d, (p, sign) in enumerate(((rows.remove, 1), (rows.add, -1))):
            buf = np.zeros((m, n_fft))
            buf[r_idx, (sign * rows.pos[valid]) % n_fft] = p[valid]
            spectra[d] *= _product_of_powers(sp_fft.rfft(buf, axis=1), count[sl])
    pmfs = []
    for d in range(2):
        circ = sp_fft.irfft(spectra[d], n=n_fft)
        pmfs.append(np.maximum(circ[(lows[d] + np.arange(n_fft)) % n_fft], 0.0))
    return ComposedPLD(
        h=h,
        low=lows,
        pmfs=pmfs,
        infinity=[-math.expm1(log_fin[0]), -math.expm1(log_fin[1])],
        log_upper=[mgf[0], mgf[2]],
        lambdas=lambdas,
        groups=int(q.size),
    )


def ledger_epsilon(ledger: Iterable[tuple[float, float, int]], delta: float, **kwargs) -> float:
    """Upper bound on epsilon at ``delta`` of the ledger [(q, sigma, count), ...]."""
    return compose(ledger, delta=delta, **kwargs).epsilon(delta)


def ledger_delta(
    ledger: Iterable[tuple[float, float, int]],
    epsilon: float,
    *,
    delta_floor: float = 1e-12,
    **kwargs,
) -> float:
    """Upper bound on delta at ``epsilon`` of the ledger (resolved down to ``delta_floor``)."""
    return compose(ledger, delta=delta_floor, **kwargs).delta(epsilon)
