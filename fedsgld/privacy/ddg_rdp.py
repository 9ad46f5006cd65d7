"""The Renyi-DP route for the distributed discrete Gaussian (kept for comparison).

Kairouz, Liu & Steinke (ICML 2021), Theorem 1 / Proposition 14 (and
``compute_rdp_dgaussian`` of google-research/federated distributed_dp): the RDP at order
alpha of the sum of n independent N_Z(0, s^2)^d shares added to a query with integer
sensitivities Delta_2, Delta_1, with sigma^2 = n s^2 and
tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k/(k+1)):

    eps(alpha) = min( alpha D2^2 / (2 sigma^2) + tau d,
                      alpha/2 (D2^2/sigma^2 + 2 D1 tau / sigma + tau^2 d),
                      alpha/2 (D2/sigma + tau sqrt(d))^2 )

Poisson subsampling with rate q (integer orders alpha >= 2): the general upper bound of
Zhu & Wang (ICML 2019, "Poisson subsampled Renyi differential privacy"), which
distributed_dp uses too,

    (alpha - 1) eps'(alpha) <= log( (1-q)^(alpha-1) (alpha q - q + 1)
                                   + C(alpha,2) q^2 (1-q)^(alpha-2) e^{eps(2)}
                                   + 3 sum_{l=3}^{alpha} C(alpha,l) q^l (1-q)^(alpha-l) e^{(l-1) eps(l)} ),

never above eps(alpha) itself. Steps compose by adding RDP; the (epsilon, delta)
conversion is :func:`fedsgld.privacy.rdp.rdp_epsilon` (Canonne, Kamath & Steinke 2020).

This route is a valid upper bound but 1.4 to 1.6 times the central Gaussian's PLD epsilon
at fedsgld's settings; the accountant uses the dominating-pair PLD of
:mod:`fedsgld.privacy.ddg_dominance` instead (:func:`fedsgld.privacy.distributed.ddg_epsilon`).
``benchmarks/secagg_accounting_gap.py`` prints both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
from scipy.special import gammaln, logsumexp

from .rdp import DEFAULT_ORDERS, rdp_epsilon, subsampled_gaussian_rdp


class RoundRdp(Protocol):
    """What this module needs of a round (:class:`fedsgld.privacy.distributed.DDGParameters`
    has it): its Poisson-subsampled RDP curve. A protocol, so that this module does not
    import :mod:`.distributed`, which imports it."""

    def subsampled_rdp(self, q: float, orders: np.ndarray) -> np.ndarray: ...


__all__ = [
    "INTEGER_ORDERS",
    "ddg_rdp",
    "ddg_rdp_epsilon",
    "ddg_tau",
    "poisson_subsampled_rdp",
]

#: the integer orders of :data:`fedsgld.privacy.rdp.DEFAULT_ORDERS` (2, ..., 63, 128, ..., 1024)
INTEGER_ORDERS: np.ndarray = DEFAULT_ORDERS[DEFAULT_ORDERS == np.round(DEFAULT_ORDERS)]


def ddg_tau(share_variance: float, shares: int) -> float:
    """tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k / (k + 1)) (Kairouz et al. Theorem 1):
    how far the sum of n shares N_Z(0, s^2) may be from one N_Z(0, n s^2)."""
    k = np.arange(1, shares, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * share_variance * k / (k + 1))))


def ddg_rdp(
    orders: np.ndarray, *, l2: float, l1: float, share_variance: float, shares: int, dim: int
) -> np.ndarray:
    """RDP at ``orders`` of the sum of ``shares`` independent N_Z(0, s^2)^dim added to a
    query with integer sensitivities ``l2`` and ``l1`` (Kairouz et al. Prop. 14): the
    three-term minimum of the module docstring, sigma^2 = shares * s^2."""
    a = np.asarray(orders, dtype=np.float64)
    sigma = math.sqrt(shares * share_variance)
    tau = ddg_tau(share_variance, shares)
    l2s, l1s = l2 / sigma, l1 / sigma
    t1 = a * l2s * l2s / 2.0 + tau * dim
    t2 = a / 2.0 * (l2s * l2s + 2.0 * l1s * tau + tau * tau * dim)
    t3 = a / 2.0 * (l2s + math.sqrt(dim) * tau) ** 2
    return np.minimum(np.minimum(t1, t2), t3)


def _log_moment(q: float, eps: np.ndarray, alpha: int, coefficient: float) -> float:
    """log of the bracket of Zhu & Wang's bound at integer ``alpha``; ``eps[l]`` = eps(l).
    ``coefficient`` multiplies the terms l >= 3 (3 in their general upper bound)."""
    ell = np.arange(2, alpha + 1, dtype=np.float64)
    log_c = gammaln(alpha + 1.0) - gammaln(ell + 1.0) - gammaln(alpha - ell + 1.0)
    terms = (
        log_c
        + ell * math.log(q)
        + (alpha - ell) * math.log1p(-q)
        + (ell - 1.0) * eps[2 : alpha + 1]
    )
    terms[1:] += math.log(coefficient)
    head = (alpha - 1) * math.log1p(-q) + math.log(alpha * q - q + 1.0)
    return float(logsumexp(np.concatenate(([head], terms))))


def poisson_subsampled_rdp(
    q: float,
    rdp_of: Callable[[np.ndarray], np.ndarray],
    orders: np.ndarray = INTEGER_ORDERS,
    *,
    _coefficient: float = 3.0,
) -> np.ndarray:
    """RDP at integer ``orders`` of a mechanism with RDP curve ``rdp_of`` run on a Poisson
    sample of rate ``q`` (Zhu & Wang 2019's general bound; the module docstring), never above
    the unsampled curve. (``_coefficient`` = 1 is their tighter bound, which needs a
    condition on the mechanism; tests use it to check against the subsampled Gaussian.)"""
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sample rate q must be in (0, 1], got {q!r}")
    orders = np.asarray(orders, dtype=np.float64)
    if not np.all((orders >= 2) & (orders == np.round(orders))):
        raise ValueError("the subsampled DDG bound needs integer orders >= 2")
    plain = np.asarray(rdp_of(orders), dtype=np.float64)
    if q == 1.0:
        return plain
    top = int(orders.max())
    eps = np.zeros(top + 1)
    eps[2:] = rdp_of(np.arange(2, top + 1, dtype=np.float64))
    sub = np.array([_log_moment(q, eps, int(a), _coefficient) / (a - 1.0) for a in orders])
    return np.minimum(sub, plain)


def ddg_rdp_epsilon(
    steps: Iterable[tuple[float, RoundRdp, int]],
    delta: float,
    orders: np.ndarray = INTEGER_ORDERS,
    *,
    gaussian: Iterable[tuple[float, float, int]] = (),
) -> tuple[float, float]:
    """(epsilon, order) at ``delta`` of rounds given as (q, parameters, count), composed
    with the Poisson-subsampled Gaussian releases ``gaussian`` as (q, sigma, count), by the
    RDP route of the module docstring: RDP adds over all of them, at integer orders, then
    the conversion of :func:`fedsgld.privacy.rdp.rdp_epsilon`."""
    total = np.zeros(len(orders))
    for q, params, count in steps:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"step count must be an integer >= 0, got {count!r}")
        if count:
            total += count * params.subsampled_rdp(q, orders)
    for q, sigma, count in gaussian:
        total += count * subsampled_gaussian_rdp(q, sigma, orders)[0]
    if not np.any(total):
        return 0.0, float(orders[0])
    return rdp_epsilon(total, delta, orders)
