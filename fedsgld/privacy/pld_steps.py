"""One Poisson-subsampled Gaussian step's privacy loss distribution, discretised.

:mod:`fedsgld.privacy.pld_fft` composes ledgers of thousands of distinct steps on one
shared grid of losses ``k * h``; this module builds each step's discrete PMF on that grid,
many steps at once (:func:`build_rows`, vectorised over the steps).

Mechanism and directions
------------------------
A step with sampling rate q and noise multiplier sigma releases S + N(0, sigma^2) (the sum
S of clipped records, sensitivity 1) where each record is present with probability q.
With mix = (1 - q) N(0, sigma^2) + q N(1, sigma^2) and base = N(0, sigma^2), removing a
record gives the pair (P, Q) = (mix, base) and adding one (base, mix) (Zhu, Dong & Wang
2022 show these pairs dominate the step and compose adaptively). Both directions are
composed separately over all steps (the same record is added, or removed, at every step)
and the larger delta (larger epsilon) is reported. The remove-direction loss is
``L(o) = log(1 - q + q exp((2 o - 1) / (2 sigma^2)))``, increasing in the output o; the
add-direction loss is ``-L(o)`` with o drawn from base.

Support points
--------------
Each step uses every grid point near zero, where its mass is, and a geometrically
coarser subset in its tails: support points k with spacing 2^l for |k| in
(K1 2^(l-1), K1 2^l], K1 about 6 standard deviations of the step's loss (:func:`_template`).

Why the discrete step dominates the true one
--------------------------------------------
* **Connect-the-dots discretisation** (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi
  2022). For each interval ``(x_k, x_{k+1}]`` between neighbouring support points of the
  loss, its P-mass m and Q-mass n (Gaussian probabilities of the matching interval of
  outputs, computed exactly) are split between the two end points so that both masses
  are kept: ``m = a + b`` and ``n = a e^{-x_k} + b e^{-x_{k+1}}``. Seen as a function of
  e^epsilon, the hockey-stick divergence of the result is the chord of the true (convex)
  one between support points, hence >= the true one for every epsilon: the discrete pair
  dominates the step, and composing dominating pairs dominates the composition.
* **Truncation of each step.** Outputs beyond ``sigma * z`` standard deviations of both
  Gaussians (``z`` from the per-step mass ``tail``) are not split: the part whose loss
  would lie above the grid goes to the loss +infinity (counted in delta in full), the part
  below the grid is moved UP to the lowest grid point. Both only raise delta(epsilon).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

__all__ = ["build_rows", "loss_variance"]

_BULK = 6.0  # fine grid up to this many per-step standard deviations of the loss
_K1_MIN = 16


@dataclass
class _Rows:
    """Connect-the-dots PMFs of a block of distinct steps on per-row support points.

    Column c of row i is the grid index ``pos[i, c]`` (loss ``pos * h`` in the remove
    direction, ``-pos * h`` in the add direction); columns past ``last[i]`` are padding
    (zero mass). ``inf_remove`` / ``inf_add``: masses at +infinity.
    """

    pos: np.ndarray
    last: np.ndarray
    remove: np.ndarray
    add: np.ndarray
    inf_remove: np.ndarray
    inf_add: np.ndarray


def _loss(o: np.ndarray, q: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Remove-direction privacy loss log(1 - q + q exp((2 o - 1) / (2 sigma^2)))."""
    x = (2.0 * o - 1.0) / (2.0 * sigma * sigma)
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log1p(-q), np.log(q) + x)


def loss_variance(q: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """A proxy for the per-step variance of the privacy loss: min(q^2 (e^{1/s^2} - 1), 1/s^2).

    (The first is the small-q limit, the second the variance for q = 1.) It only sets the
    grid spacing, never the bound."""
    inv = 1.0 / (np.asarray(sigma, dtype=np.float64) ** 2)
    with np.errstate(over="ignore"):
        sub = np.asarray(q, dtype=np.float64) ** 2 * np.expm1(np.minimum(inv, 700.0))
    return np.minimum(sub, inv)


def _template(n: np.ndarray, k1: np.ndarray) -> np.ndarray:
    """Support-point grid index of template position n: n itself for |n| <= k1, then
    spacing 2^l for |grid index| in (k1 2^(l-1), k1 2^l] (k1 even), odd in n."""
    a = np.abs(n)
    half = k1 // 2
    r = np.maximum(a - k1 - 1, 0)
    level = r // half + 1
    i = r % half + 1
    g = np.where(a <= k1, a, k1 * (1 << (level - 1)) + i * (1 << level))
    return np.sign(n) * g


def _template_ceil_pos(k: np.ndarray, k1: np.ndarray) -> np.ndarray:
    """Smallest n >= 0 with template(n) >= k, for k >= 0."""
    half = k1 // 2
    big = k > k1
    ratio = np.where(big, k, k1) / k1
    level = np.maximum(np.ceil(np.log2(ratio) - 1e-12).astype(np.int64), 1)
    # settle the level exactly: k1 2^(level-1) < k <= k1 2^level
    level = np.where(big & (k1 * (1 << level) < k), level + 1, level)
    level = np.where(big & (level > 1) & (k1 * (1 << (level - 1)) >= k), level - 1, level)
    step = 1 << level
    i = -((-(k - k1 * (1 << (level - 1)))) // step)  # ceil division
    return np.where(big, k1 + (level - 1) * half + i, k)


def _template_floor_pos(k: np.ndarray, k1: np.ndarray) -> np.ndarray:
    """Largest n >= 0 with template(n) <= k, for k >= 0."""
    n = _template_ceil_pos(k, k1)
    return np.where(_template(n, k1) > k, n - 1, n)


def build_rows(q: np.ndarray, sigma: np.ndarray, h: float, tail: float) -> _Rows:
    """Both directions' connect-the-dots PMFs for the steps (q[i], sigma[i]), vectorised."""
    q = np.asarray(q, dtype=np.float64)
    sigma = np.asarray(sigma, dtype=np.float64)
    z = float(-ndtri(tail))
    k_lo = np.floor(_loss(-sigma * z, q, sigma) / h).astype(np.int64)
    k_hi = np.ceil(_loss(1.0 + sigma * z, q, sigma) / h).astype(np.int64)
    k_hi = np.maximum(k_hi, k_lo + 1)
    k1 = np.ceil(_BULK * np.sqrt(loss_variance(q, sigma)) / h).astype(np.int64)
    k1 = np.maximum(k1 + (k1 % 2), _K1_MIN)
    n_lo = np.where(
        k_lo >= 0, _template_floor_pos(np.abs(k_lo), k1), -_template_ceil_pos(np.abs(k_lo), k1)
    )
    n_hi = np.where(
        k_hi >= 0, _template_ceil_pos(np.abs(k_hi), k1), -_template_floor_pos(np.abs(k_hi), k1)
    )
    last = n_hi - n_lo
    n_cols = int(last.max()) + 1
    col = np.arange(n_cols)
    pos = _template(n_lo[:, None] + col[None, :], k1[:, None])
    real = np.take_along_axis(pos, np.minimum(col[None, :], last[:, None]), axis=1)
    eps = real * h  # thresholds repeat past the last real point: zero-mass padding
    qc, sc = q[:, None], sigma[:, None]
    # output thresholds o_k with L(o_k) = eps_k: (e^eps - 1 + q) / q = exp((2o - 1)/(2 s^2))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        g = np.expm1(eps) + qc  # > 0 iff eps > log(1 - q)
        big = eps > 30.0
        log_g = np.where(big, eps + np.log1p((qc - 1.0) * np.exp(-np.minimum(eps, 700.0))), 0.0)
        log_g = np.where(big, log_g, np.log(np.where(g > 0.0, g, 1.0)))
        o = np.where(g > 0.0, 0.5 + sc * sc * (log_g - np.log(qc)), -np.inf)
    u0, u1 = o / sc, (o - 1.0) / sc
    s0, s1 = ndtr(-np.abs(u0)), ndtr(-np.abs(u1))  # tails, accurate far out

    def dphi(u: np.ndarray, s: np.ndarray) -> np.ndarray:  # Phi(u[c+1]) - Phi(u[c])
        a, b, sa, sb = u[:, :-1], u[:, 1:], s[:, :-1], s[:, 1:]
        d = np.where(a >= 0.0, sa - sb, np.where(b <= 0.0, sb - sa, 1.0 - sa - sb))
        return np.maximum(d, 0.0)

    a0, a1 = dphi(u0, s0), dphi(u1, s1)  # base and N(1) masses of the intervals
    mix = (1.0 - qc) * a0 + qc * a1
    # D = mix - base e^{eps_k} = q a1 - a0 (e^{eps_k} - 1 + q), in [0, mix (1 - e^{-gap})]
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.maximum(qc * a1 - a0 * g[:, :-1], 0.0)
        gap = np.diff(pos, axis=1) * h
        # remove: mix mass to the right end, D / (1 - e^{-gap}); the rest to the left end
        right = np.minimum(np.nan_to_num(d / -np.expm1(-gap), nan=0.0, posinf=0.0), mix)
        # add: base mass to the lower end -(k+1): D e^{-eps_k} / (e^{gap} - 1)
        lower = d * np.exp(-eps[:, :-1]) / np.expm1(gap)
    lower = np.minimum(np.nan_to_num(lower, nan=0.0, posinf=0.0), a0)
    remove = np.zeros(pos.shape)
    remove[:, :-1] += mix - right
    remove[:, 1:] += right
    add = np.zeros(pos.shape)
    add[:, :-1] += a0 - lower
    add[:, 1:] += lower
    # below the first threshold: remove rounds the loss up to the first point, add -> +inf
    below0 = np.where(u0[:, 0] < 0.0, s0[:, 0], 1.0 - s0[:, 0])
    below1 = np.where(u1[:, 0] < 0.0, s1[:, 0], 1.0 - s1[:, 0])
    remove[:, 0] += (1.0 - q) * below0 + q * below1
    # above the last threshold: remove -> +inf, add rounds the loss up to -(last point)
    above0 = np.where(u0[:, -1] > 0.0, s0[:, -1], 1.0 - s0[:, -1])
    above1 = np.where(u1[:, -1] > 0.0, s1[:, -1], 1.0 - s1[:, -1])
    add[np.arange(q.size), last] += above0
    return _Rows(
        pos=pos,
        last=last,
        remove=remove,
        add=add,
        inf_remove=(1.0 - q) * above0 + q * above1,
        inf_add=below0,
    )
