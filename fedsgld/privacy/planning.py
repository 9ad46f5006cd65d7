"""Planning a budget before spending it: the noise that spends it, and what settings afford.

Every step t is a Poisson-subsampled Gaussian mechanism (q_t, sigma_t). Scaling every
sigma_t by one factor s > 0 is what changing a run's noise setting does: DP-SGLD's
sigma_t = sqrt(2 alpha_t tau) scales by s when tau (or alpha_0) is multiplied by s^2;
DP-SGD's constant sigma scales by s. The rigorous epsilon of T steps is non-increasing
in s, so :func:`fit_noise_scale` bisects s (on a log scale) for the SMALLEST noise whose
T steps stay within the budget: the returned factor is always on the affordable side,
and its epsilon is at least ``low`` times the budget unless the accountant's own grid
(``sigma_grid``) leaves no finer step. :func:`steps_afforded` is the accountant's own
search (:meth:`PrivacyAccountant.max_steps`), the one a run's budget check certifies.

Both use the rigorous accountant that enforces a run's budget (``accountant``:
"pld", "rdp" or "dp_accounting_pld", with the run's ``sigma_grid``), never the
Gaussian-DP CLT, which can under-estimate epsilon.

Privacy caveat: a plan is arithmetic on public settings; it releases nothing. Its promise
holds only for the schedule it was given (Poisson sampling at rate q, add/remove-one
adjacency, noise std sigma_t C on sums of records clipped to C).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fedsgld.privacy.accountant import PrivacyAccountant

Schedule = Callable[[int], tuple[float, float]]

#: the bisection stops once the plan's epsilon is at least this share of the budget
TARGET_SHARE = 0.99
_MAX_HALVINGS = 60
_MAX_BISECTIONS = 80


@dataclass(frozen=True)
class NoiseFit:
    """The factor ``scale`` on every sigma_t whose ``steps`` steps spend ``epsilon`` (rigorous,
    at most the budget) of the budget; ``epsilon_given``: the same steps at scale 1."""

    scale: float
    epsilon: float
    epsilon_given: float
    steps: int


def _accountant(delta: float, budget: float, accountant: str, sigma_grid: float):
    return PrivacyAccountant(
        delta=delta, epsilon_budget=budget, accountant=accountant, sigma_rel_grid=sigma_grid
    )


def plan_epsilon(
    schedule: Schedule, steps: int, *, delta: float, accountant: str = "pld",
    sigma_grid: float = 0.0, scale: float = 1.0,
) -> float:  # fmt: skip
    """The rigorous epsilon at ``delta`` of ``steps`` steps along ``schedule`` with every
    sigma_t multiplied by ``scale`` (sigma bucketed as a run's accountant buckets it);
    inf where the accountant cannot bound it (an enormous epsilon)."""
    acc = _accountant(delta, 1.0, accountant, sigma_grid)
    if steps <= 0:
        return 0.0

    def point(t: int) -> tuple[float, float]:
        q, sigma = schedule(t)
        return q, sigma * scale

    try:
        eps = acc.rigorous_epsilon(acc.ledger_after(point, steps))
    except (ValueError, OverflowError, ArithmeticError):
        return math.inf  # too little noise to bound: certainly past any sensible budget
    return eps if math.isfinite(eps) else math.inf


def fit_noise_scale(
    schedule: Schedule, steps: int, *, budget: float, delta: float, accountant: str = "pld",
    sigma_grid: float = 0.0, low: float = TARGET_SHARE,
) -> NoiseFit:  # fmt: skip
    """The smallest factor s on every sigma_t (to a bisection's tolerance) such that
    ``steps`` steps along ``schedule`` keep the rigorous epsilon <= ``budget``; its
    epsilon is in [``low`` budget, budget] unless the sigma grid's steps are coarser.

    Raises:
        ValueError: ``steps`` < 1, ``budget`` <= 0, or no factor in [2^-60, 2^60] fits.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"epsilon must be a number > 0, got {budget!r}")

    def eps(s: float) -> float:
        return plan_epsilon(
            schedule, steps, delta=delta, accountant=accountant, sigma_grid=sigma_grid, scale=s
        )

    given = eps(1.0)
    lo, hi, e_hi = _bracket(eps, given, budget)
    for _ in range(_MAX_BISECTIONS):
        if e_hi >= low * budget or hi / lo - 1.0 < 1e-9:
            break
        mid = math.sqrt(lo * hi)
        e_mid = eps(mid)
        if e_mid <= budget:
            hi, e_hi = mid, e_mid
        else:
            lo = mid
    return NoiseFit(scale=hi, epsilon=e_hi, epsilon_given=given, steps=steps)


def _bracket(eps: Callable[[float], float], given: float, budget: float):
    """(lo, hi, eps(hi)): eps(lo) > budget >= eps(hi), lo < hi, by halving or doubling."""
    if given <= budget:
        hi, e_hi = 1.0, given
        for _ in range(_MAX_HALVINGS):
            lo = hi / 2.0
            e_lo = eps(lo)
            if e_lo > budget:
                return lo, hi, e_hi
            hi, e_hi = lo, e_lo
        raise ValueError(f"the budget epsilon={budget:g} is spent by no noise level tried")
    lo = 1.0
    for _ in range(_MAX_HALVINGS):
        hi = lo * 2.0
        e_hi = eps(hi)
        if e_hi <= budget:
            return lo, hi, e_hi
        lo = hi
    raise ValueError(f"no noise level tried keeps epsilon within {budget:g}")


def steps_afforded(
    schedule: Schedule, *, budget: float, delta: float, limit: int, accountant: str = "pld",
    sigma_grid: float = 0.0,
) -> int:  # fmt: skip
    """How many steps (at most ``limit``) along ``schedule`` the budget affords: the
    search a run's accountant runs before its first round."""
    acc = _accountant(delta, budget, accountant, sigma_grid)
    return acc.max_steps(schedule, limit=limit)


__all__ = ["TARGET_SHARE", "NoiseFit", "fit_noise_scale", "plan_epsilon", "steps_afforded"]
