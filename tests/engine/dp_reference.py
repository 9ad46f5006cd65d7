"""Epsilon of a DP-SGD / DP-SGLD ledger computed straight from dp_accounting, with no
fedsgld code: the expected values of the engine tests come from here, not from the
accountant under test.

The run's accountant rounds every sigma DOWN onto the geometric grid (1 + r)^k before
accounting (README, "Privacy accounting"); :func:`bucket` writes that rule out, and
:func:`pld_epsilon` composes Poisson-subsampled Gaussian steps (add/remove adjacency) with
dp_accounting's PLD accountant at the run's discretisation (1e-3).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import groupby


def bucket(sigma: float, grid: float) -> float:
    """The largest (1 + grid)^k <= sigma (sigma itself when grid = 0)."""
    if grid == 0.0:
        return sigma
    base = 1.0 + grid
    k = math.floor(math.log(sigma) / math.log(base))
    while base**k > sigma:
        k -= 1
    while base ** (k + 1) <= sigma:
        k += 1
    return base**k


def dpsgld_sigma(t: int, *, lr: float, gamma: float, t0: float, tau: float) -> float:
    """sigma_t = sqrt(2 alpha_t tau), alpha_t = lr (1 + t / t0)^(-gamma)."""
    return math.sqrt(2.0 * lr * (1.0 + t / t0) ** (-gamma) * tau)


def pld_epsilon(steps: Iterable[tuple[float, float]], *, delta: float, grid: float = 0.01) -> float:
    """Epsilon at ``delta`` of the steps [(q, sigma), ...] after bucketing sigma."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    bucketed = [(q, bucket(s, grid)) for q, s in steps]
    events = [
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), len(list(run))
        )
        for (q, s), run in groupby(bucketed)
    ]
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_event.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))
