"""The budget check's tools: certificates by domination, a quick refusal, the step search,
and :class:`BudgetExhausted`, the refusal of a step that would overspend.

Certification (why per-step checks are cheap)
----------------------------------------------
A ledger whose rigorous epsilon was computed and found <= budget is "certified". A
candidate ledger A is *dominated* by a certified ledger B when, for every q, the steps of
A can be matched one-to-one to steps of B with the same q and a sigma_B <= sigma_A. By
Hall's theorem (the admissible partners of a step are nested in sigma) this holds iff for
every threshold s:  #{A steps with sigma <= s}  <=  #{B steps with sigma <= s}, per q.
Composition is commutative, adding steps never lowers epsilon and epsilon is
non-increasing in each sigma, so eps(A) <= eps(B) <= budget: A is within budget without
computing anything (:func:`dominates`). The accountant's ``max_steps`` certifies the
ledger at the end of a planned schedule, after which every step along it costs a
domination check, O(#entries log #entries).

A quick refusal
---------------
:func:`single_step_delta_lower_bound` is the exact delta of the ledger's worst single
step: when it already exceeds the target delta the ledger overspends, which the
accountant says without building a privacy loss distribution (whose grid would be
enormous for a noise multiplier near 0).

The step search
---------------
:func:`max_steps_by_search` and :func:`max_steps_by_runs` find the largest number of
steps of a :class:`~fedsgld.privacy.ledger.Plan` that a budget check ``within(key) ->
(ok, epsilon or None)`` accepts; epsilon is non-decreasing in the number of steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from fedsgld.privacy.ledger import LedgerKey, Plan, append

__all__ = [
    "BudgetExhausted",
    "dominates",
    "max_steps_by_runs",
    "max_steps_by_search",
    "single_step_delta_lower_bound",
]

#: a budget check: (within budget, the epsilon or None when certified without computing)
Within = Callable[[LedgerKey], tuple[bool, "float | None"]]


class BudgetExhausted(RuntimeError):
    """A step would take the rigorous epsilon past the budget; the step was NOT recorded.

    Attributes: ``epsilon`` (the rigorous epsilon the ledger would have with the step) and
    ``budget``.
    """

    def __init__(self, message: str, *, epsilon: float, budget: float) -> None:
        super().__init__(message)
        self.epsilon = epsilon
        self.budget = budget


def _is_prefix(certified: LedgerKey, candidate: LedgerKey) -> bool:
    """Whether ``candidate`` is the first steps of ``certified`` (the per-step pattern)."""
    n = len(candidate)
    if n == 0:
        return True
    if n > len(certified) or candidate[: n - 1] != certified[: n - 1]:
        return False
    (q, s, c), (q2, s2, c2) = candidate[-1], certified[n - 1]
    return q == q2 and s == s2 and c <= c2


def dominates(certified: LedgerKey, candidate: LedgerKey) -> bool:
    """Whether every step of ``candidate`` maps injectively to a ``certified`` step with the
    same q and a sigma <= its own (Hall's condition, checked per q at every threshold)."""
    if _is_prefix(certified, candidate):
        return True
    if not certified:
        return False
    a = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(certified, dtype=np.float64)
    for q in np.unique(a[:, 0]):
        sa, sb = a[a[:, 0] == q], b[b[:, 0] == q]
        if sb.size == 0:
            return False
        oa, ob = np.argsort(sa[:, 1], kind="stable"), np.argsort(sb[:, 1], kind="stable")
        sig_a, cum_a = sa[oa, 1], np.cumsum(sa[oa, 2])
        sig_b, cum_b = sb[ob, 1], np.cumsum(sb[ob, 2])
        # at every candidate sigma s: #{candidate <= s} <= #{certified <= s}
        n_a = cum_a[np.searchsorted(sig_a, sig_a, side="right") - 1]
        i_b = np.searchsorted(sig_b, sig_a, side="right") - 1
        n_b = np.where(i_b >= 0, cum_b[np.maximum(i_b, 0)], 0.0)
        if np.any(n_a > n_b):
            return False
    return True


def single_step_delta_lower_bound(key: Iterable[tuple[float, float, int]], eps: float) -> float:
    """max over the ledger's entries of ONE step's delta(eps): a lower bound on the ledger's.

    One Poisson-subsampled Gaussian step (rate q, noise multiplier sigma), remove direction
    (Balle, Barthe & Gaboardi 2018, exact for the Gaussian): delta(eps) = q delta_G(eps'),
    eps' = log(1 + (e^eps - 1) / q), with the Gaussian mechanism's exact profile
    delta_G(e) = Phi(1/(2 sigma) - e sigma) - e^e Phi(-1/(2 sigma) - e sigma)
    (Balle & Wang 2018). Composing more steps never lowers delta(eps), so a value above
    the target delta proves the ledger overspends.
    """
    from scipy.special import log_ndtr, ndtr

    arr = np.asarray([(q, s) for q, s, _ in key if q > 0.0], dtype=np.float64)
    if eps == math.inf or arr.size == 0:  # delta(inf) = 0, and a step at rate 0 releases nothing
        return 0.0
    q, sigma = arr[:, 0], arr[:, 1]
    with np.errstate(divide="ignore"):
        log1mq = np.where(q < 1.0, np.log1p(-np.minimum(q, 1.0 - 1e-300)), -np.inf)
    e = np.logaddexp(eps, log1mq) - np.log(q)
    a = 1.0 / (2.0 * sigma) - e * sigma
    b = -1.0 / (2.0 * sigma) - e * sigma
    delta_g = ndtr(a) - np.exp(e + log_ndtr(b))
    return float(np.max(q * np.clip(delta_g, 0.0, 1.0)))


def max_steps_by_search(within: Within, plan: Plan, limit: int, budget: float) -> int:
    """Bracket T by doubling the step count, then narrow the bracket by interpolating
    epsilon between its ends (bisection when that stalls): a few whole-ledger checks."""

    def ok(t: int) -> tuple[bool, float | None]:
        return within(plan.ledger(t))

    if limit == 0:
        return 0
    lo, eps_lo = 0, 0.0  # lo steps fit (eps_lo None: certified without a value)
    t = 1
    while True:  # doubling: lo fits, hi does not
        fits, eps = ok(t)
        if fits:
            lo, eps_lo = t, eps
            if t == limit:
                return limit
            t = min(2 * t, limit)
            continue
        hi, eps_hi = t, eps
        break
    stall = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if stall < 2 and eps_lo is not None and eps_hi is not None and eps_hi > eps_lo:
            frac = (budget - eps_lo) / (eps_hi - eps_lo)
            guess = lo + int(round(frac * (hi - lo)))
            mid = min(max(guess, lo + 1), hi - 1)
        fits, eps = ok(mid)
        if fits:
            stall = stall + 1 if mid - lo < (hi - lo) // 8 else 0
            lo, eps_lo = mid, eps
        else:
            stall = stall + 1 if hi - mid < (hi - lo) // 8 else 0
            hi, eps_hi = mid, eps
    return lo


def max_steps_by_runs(within: Within, key: LedgerKey, plan: Plan, limit: int) -> int:
    """Walk the schedule run by run (a run = consecutive steps with the same bucketed
    (q, sigma), cut so that each run at most doubles the steps walked so far), check the
    ledger at the end of each run, bisect inside the first run that overspends. (Suits the
    prefix cache of the dp_accounting reference.)"""
    t = 0
    pending: tuple[float, float] | None = None  # step t's point, if already evaluated
    while t < limit:
        q, s = pending if pending is not None else plan.point(t)
        pending = None
        n, cap = 1, min(limit - t, max(1, t))
        while n < cap:
            nxt = plan.point(t + n)
            if nxt != (q, s):
                pending = nxt
                break
            n += 1
        if within(append(key, q, s, n))[0]:
            key, t = append(key, q, s, n), t + n
            continue
        lo, hi = 0, n  # lo steps of this run fit, hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if within(append(key, q, s, mid))[0]:
                lo = mid
            else:
                hi = mid
        return t + lo
    return t
