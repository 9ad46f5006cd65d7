"""Gaussian differential privacy (Dong, Roth & Su 2019): the paper's accountant.

A mechanism is mu-GDP when distinguishing neighbouring datasets from its output is no
easier than distinguishing N(0, 1) from N(mu, 1). The Poisson-subsampled Gaussian
mechanism (sampling rate q, noise multiplier sigma) composed over steps t is, by the
central limit theorem of Dong, Roth & Su (Bu et al. 2020 for DP-SGD), approximately
mu-GDP with

    mu = sqrt( sum_t q_t^2 * (exp(1 / sigma_t^2) - 1) )

(= q * sqrt(sum_t (exp(1 / sigma_t^2) - 1)) for a single q), and mu-GDP implies
(epsilon, delta(epsilon))-DP for every epsilon >= 0 with

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - exp(epsilon) * Phi(-epsilon / mu - mu / 2).

Privacy caveat: the CLT is asymptotic (T -> infinity with q * sqrt(T) fixed), it is an
approximation and NOT an upper bound. In practice it UNDER-estimates epsilon: by about
2-12 % for a constant sigma, and by about a fifth for a decaying DP-SGLD schedule whose
sigma_t ends below 1. fedsgld reports it (it is what the paper reports) but never uses it
for the budget check; that is the rigorous accountant's job (see ``accountant.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from scipy.special import log_ndtr

__all__ = ["gdp_delta", "gdp_epsilon", "gdp_max_steps", "gdp_mu"]

# exp(x) overflows a double beyond x ~ 709.78
_MAX_EXP = 709.0


def _check_entry(q: float, sigma: float, count: int) -> None:
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sampling rate q must be in (0, 1], got {q!r}")
    if not (sigma > 0.0 and not math.isnan(sigma)):
        raise ValueError(f"noise multiplier sigma must be > 0, got {sigma!r}")
    if int(count) != count or count < 0:
        raise ValueError(f"step count must be an integer >= 0, got {count!r}")


def gdp_mu(ledger: Iterable[tuple[float, float, int]]) -> float:
    """mu = sqrt(sum over steps of q^2 * (exp(1 / sigma^2) - 1)) for a ledger of (q, sigma, count).

    Returns ``inf`` when some sigma is so small that exp(1 / sigma^2) overflows, and 0.0 for
    an empty ledger. Approximate (CLT): see the module docstring for the caveat.
    """
    total = 0.0
    for q, sigma, count in ledger:
        q, sigma = float(q), float(sigma)
        _check_entry(q, sigma, count)
        if count == 0:
            continue
        if math.isinf(sigma):
            continue
        x = 1.0 / (sigma * sigma)
        if x > _MAX_EXP:
            return math.inf
        total += count * q * q * math.expm1(x)
    return math.sqrt(total) if math.isfinite(total) else math.inf


def _log_delta(epsilon: float, mu: float) -> float:
    """log delta(epsilon) for mu-GDP, finite mu > 0 and finite epsilon >= 0 (-inf if delta == 0)."""
    a = float(log_ndtr(-epsilon / mu + mu / 2.0))
    b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2.0))
    if b >= a:  # only by rounding: the true delta is positive but below double precision
        return -math.inf
    return a + math.log1p(-math.exp(b - a))


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2) for mu-GDP.

    Computed in log space (``scipy.special.log_ndtr``) so that large epsilon neither
    overflows e^epsilon nor cancels to a negative number. ``mu = 0`` gives 0 (no leakage),
    ``mu = inf`` gives 1. This is the exact trade-off of the Gaussian mechanism with noise
    multiplier 1/mu; whether the *mechanism* is mu-GDP is the CLT's approximation.
    """
    epsilon, mu = float(epsilon), float(mu)
    if math.isnan(epsilon) or math.isnan(mu):
        raise ValueError(f"epsilon and mu must be numbers, got epsilon={epsilon!r}, mu={mu!r}")
    if mu < 0.0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if mu == 0.0 or math.isinf(epsilon):
        return 0.0
    if math.isinf(mu):
        return 1.0
    return min(1.0, math.exp(_log_delta(epsilon, mu)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with gdp_delta(epsilon, mu) <= delta (mu-GDP -> (epsilon, delta)-DP).

    Root finding (bisection to 1e-12 relative, returning the upper end) on
    log delta(epsilon) - log delta. The bracket starts at [0, 1] and
    doubles its upper end until delta(upper) <= delta, so large epsilon (large mu) is found
    too. Returns 0.0 when delta(0) <= delta (including mu = 0) and ``inf`` for mu = inf.
    Approximate as an accountant (CLT): see the module docstring.
    """
    mu, delta = float(mu), float(delta)
    if math.isnan(mu) or mu < 0.0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    log_target = math.log(delta)

    def f(eps: float) -> float:
        # clamp -inf (delta below double precision) to a finite value of the right sign
        return max(_log_delta(eps, mu), -1e4) - log_target

    if f(0.0) <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while f(hi) > 0.0:
        lo, hi = hi, 2.0 * hi
        if hi > 1e300:  # pragma: no cover - mu is finite, so delta(eps) -> 0
            return math.inf
    # bisection (delta(eps) is decreasing): f(lo) > 0 >= f(hi)
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if f(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return float(hi)


def gdp_max_steps(
    point: Callable[[int], tuple[float, float]],
    *,
    budget: float,
    delta: float,
    limit: int,
    constant: bool,
) -> int:
    """Largest T <= limit whose GDP-CLT epsilon (exact sigmas) is <= budget, along
    ``point(t) -> (q, sigma)``, t = 0, 1, ... (``constant``: the same point every step).

    Approximate like every GDP-CLT figure: reported beside the rigorous count, never used
    for a budget."""
    # epsilon is increasing in mu: find the largest admissible mu^2, then walk the steps
    lo, hi = 0.0, 1.0
    while gdp_delta(budget, hi) <= delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(budget, mid) <= delta:
            lo = mid
        else:
            hi = mid
    mu2_max = lo * lo

    def per_step(t: int) -> float:
        q, sigma = point(t)
        return gdp_mu([(q, sigma, 1)]) ** 2

    if constant:
        inc = per_step(0)
        if inc == 0.0:
            return limit
        t = min(limit, int(mu2_max / inc) if math.isfinite(inc) else 0)
    else:
        t, total = 0, 0.0
        while t < limit:
            total += per_step(t)
            if total > mu2_max:
                break
            t += 1
    return t
