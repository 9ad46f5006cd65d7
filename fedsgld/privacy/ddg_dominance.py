"""A Gaussian dominating pair for the distributed discrete Gaussian, up to a tiny slack.

The sum Z of n honest shares N_Z(0, s^2) per coordinate (sigma^2 = n s^2) is compared,
pointwise and UNIFORMLY on Z, with the law k of K(X): X ~ N(0, sigma^2 - r^2) continuous
and K(x) ~ N_Z(x, r^2) (a discrete Gaussian centred at x; r^2 = :func:`kernel_variance`).
K commutes with integer shifts, so "integer vector + K(X)" is a post-processing of the
continuous Gaussian mechanism "integer vector + X": its privacy is dominated by the
Poisson-subsampled Gaussian with noise multiplier sqrt(sigma^2 - r^2) / Delta_2.

With theta(v) = 2 sum_{j >= 1} exp(-2 pi^2 v j^2) (v a variance; Poisson summation gives
sum_{x in Z} exp(-(x - c)^2 / (2 v)) = sqrt(2 pi v) (1 + 2 sum_j e^{-2 pi^2 v j^2}
cos(2 pi j c)), within sqrt(2 pi v) [1 - theta(v), 1 + theta(v)] for every centre c, equal
to sqrt(2 pi v) (1 + theta(v)) at c = 0) and phi_v the N(0, v) density:

* one share: p(z) = phi_{s^2}(z) / (1 + theta(s^2)) exactly;
* adding a share to a law within [L, U] phi_A(z): completing the square,
  sum_x phi_A(x) phi_B(z - x) = phi_{A+B}(z) sum_x phi_{AB/(A+B)}(x - cz), so the sum is
  within [L (1 - theta(h)), U (1 + theta(h))] phi_{A+B}(z) / (1 + theta(B)),
  h = AB/(A+B) = s^2 k/(k+1) when A = k s^2, B = s^2;
* k(z) = int phi_{sigma^2 - r^2}(x) e^{-(z-x)^2/(2 r^2)} / N_r(x) dx with
  N_r(x) in sqrt(2 pi r^2) [1 - theta(r^2), 1 + theta(r^2)]: within
  [1 / (1 + theta(r^2)), 1 / (1 - theta(r^2))] phi_{sigma^2}(z).

So, per coordinate and for every z in Z, e^{-down} <= p_sum(z) / k(z) <= e^{up} with

    up   = sum_{k=1}^{n-1} log(1 + theta(s^2 k/(k+1))) + log(1 + theta(r^2))
    down = n log(1 + theta(s^2)) - sum_{k=1}^{n-1} log(1 - theta(s^2 k/(k+1)))
           - log(1 - theta(r^2))

and over d coordinates the bounds are d up and d down (the coordinates are independent).
theta(v) is bounded above by 2 e^{-c} / (1 - e^{-3c}), c = 2 pi^2 v (j^2 - 1 >= 3 (j - 1)).
At fedsgld's grid s is in the tens of thousands and both bounds underflow to 0.

Whole run (docs/accounting.md, "The distributed discrete Gaussian", gives the proof): the
output law of the real run is, for every output sequence, within e^{-A_down} and e^{A_up}
of the run with k in place of the shares (A = sum over rounds of d up, d down), so
delta(eps) <= e^{A_up} delta_k(eps - A_up - A_down), and delta_k is bounded by the PLD
of the dominating Gaussian ledger (:mod:`fedsgld.privacy.pld_fft`). Hence

    epsilon(delta) <= epsilon_PLD(delta e^{-A_up}) + A_up + A_down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from fedsgld.privacy import pld_fft

__all__ = [
    "KERNEL_VARIANCE",
    "NoiseComparison",
    "compare_shares",
    "dominated_delta",
    "dominated_epsilon",
    "kernel_variance",
    "log_theta",
]

#: r^2 of the comparison kernel (capped at half the noise variance): theta(4) ~ 1e-34
KERNEL_VARIANCE = 4.0
MERGE = pld_fft.DEFAULT_SIGMA_MERGE


def log_theta(variance: float) -> float:
    """An upper bound on log theta(v), theta(v) = 2 sum_{j >= 1} exp(-2 pi^2 v j^2)."""
    if not (variance > 0 and math.isfinite(variance)):
        raise ValueError(f"variance must be finite and > 0, got {variance!r}")
    c = 2.0 * math.pi**2 * variance
    return math.log(2.0) - c - math.log1p(-math.exp(-3.0 * c))


def _log1p_theta(variance: float) -> float:
    """An upper bound on log(1 + theta(v))."""
    return math.log1p(math.exp(log_theta(variance)))


def _minus_log1m_theta(variance: float) -> float:
    """An upper bound on -log(1 - theta(v)) (inf when the bound on theta reaches 1)."""
    t = math.exp(log_theta(variance))
    return math.inf if t >= 1.0 else -math.log1p(-t)


def kernel_variance(total_variance: float) -> float:
    """r^2 = min(:data:`KERNEL_VARIANCE`, sigma^2 / 2): the comparison kernel's variance."""
    return min(KERNEL_VARIANCE, total_variance / 2.0)


@dataclass(frozen=True)
class NoiseComparison:
    """Per-coordinate comparison of the sum of shares with the kernel law k.

    ``gaussian_variance``: sigma^2 - r^2, the variance of the continuous Gaussian that k
    post-processes; ``up``, ``down``: log p_sum(z) / k(z) lies in [-down, up] for every z.
    """

    kernel_variance: float
    gaussian_variance: float
    up: float
    down: float


def compare_shares(
    share_variance: float, shares: int, *, kernel: float | None = None
) -> NoiseComparison:
    """:class:`NoiseComparison` of the sum of ``shares`` N_Z(0, ``share_variance``) (the
    module docstring's ``up`` and ``down``); ``kernel``: r^2 in (0, n s^2), default
    :func:`kernel_variance`."""
    if not (share_variance > 0 and math.isfinite(share_variance)):
        raise ValueError(f"share_variance must be finite and > 0, got {share_variance!r}")
    if isinstance(shares, bool) or not isinstance(shares, int) or shares < 1:
        raise ValueError(f"shares must be an integer >= 1, got {shares!r}")
    total = shares * share_variance
    r2 = kernel_variance(total) if kernel is None else float(kernel)
    if not (0.0 < r2 < total):
        raise ValueError(f"kernel must be in (0, {total:g}), got {kernel!r}")
    h = [share_variance * k / (k + 1.0) for k in range(1, shares)]
    up = sum(_log1p_theta(v) for v in h) + _log1p_theta(r2)
    down = (
        shares * _log1p_theta(share_variance)
        + sum(_minus_log1m_theta(v) for v in h)
        + _minus_log1m_theta(r2)
    )
    return NoiseComparison(r2, total - r2, up, down)


def _check_slack(slack_up: float, slack_down: float) -> tuple[float, float]:
    if not (slack_up >= 0.0 and slack_down >= 0.0):
        raise ValueError(f"slacks must be >= 0, got {slack_up!r}, {slack_down!r}")
    return float(slack_up), float(slack_down)


def dominated_epsilon(
    ledger: Iterable[tuple[float, float, int]],
    delta: float,
    *,
    slack_up: float = 0.0,
    slack_down: float = 0.0,
) -> float:
    """epsilon_PLD(delta e^{-A_up}) + A_up + A_down of the dominating Gaussian ``ledger``
    [(q, sigma, count), ...] (:mod:`fedsgld.privacy.pld_fft`, an upper bound)."""
    up, down = _check_slack(slack_up, slack_down)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    key = [e for e in ledger if e[2]]
    if not key:
        return 0.0
    d = delta * math.exp(-up)
    if not d > 0.0:  # a slack this large leaves no guarantee
        return math.inf
    eps = pld_fft.compose(key, delta=d, sigma_merge=MERGE).epsilon(d)
    return eps + up + down


def dominated_delta(
    ledger: Iterable[tuple[float, float, int]],
    epsilon: float,
    *,
    slack_up: float = 0.0,
    slack_down: float = 0.0,
    delta_floor: float = 1e-12,
) -> float:
    """e^{A_up} delta_PLD(epsilon - A_up - A_down) of the dominating Gaussian ``ledger``
    (resolved down to ``delta_floor``). Below zero, delta(e) <= delta(0) + 1 - e^e."""
    up, down = _check_slack(slack_up, slack_down)
    if not (epsilon >= 0.0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    key = [e for e in ledger if e[2]]
    if not key:
        return 0.0
    pld = pld_fft.compose(key, delta=delta_floor, sigma_merge=MERGE)
    e = epsilon - up - down
    base = pld.delta(e) if e >= 0.0 else pld.delta(0.0) - math.expm1(e)
    return min(1.0, math.exp(up) * base)
