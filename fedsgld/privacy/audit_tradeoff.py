"""The accountant's own trade-off curve, and the one-run f-DP test against it (no torch).

A mechanism is f-DP when no test tells one neighbour from the other better than the
trade-off curve f allows. Mahloujifar, Melis & Chaudhuri 2024 (arXiv 2410.22235) test a
curve from one run with canaries (:func:`fedsgld.privacy.audit_bounds.fdp_rejects`); the
curve enters only through its "inverse blow-up"

    h(x) = the least probability an event can have under one neighbour when it has
           probability x under the other.

The accountant (:mod:`fedsgld.privacy.pld_fft`) holds the curve of the run it accounts for:
its privacy loss distribution (PLD), for each direction of add/remove adjacency, of a pair
(P, Q) that dominates the run's mechanism. With L = log dP/dQ the privacy loss (its
distribution under P is the PLD; Q puts mass p e^-x where P puts p at loss x, and none
at +infinity), the event of P-mass x with the least Q-mass takes the outcomes of largest
loss first (Neyman-Pearson), so h is the piecewise-linear curve through the points

    (P[L >= x_k], Q[L >= x_k]),  x_k the losses from +infinity down,

convex and increasing. The audit uses the greatest convex curve below both directions'
curves (a canary may be the record that is added or the one that is removed, and the test
averages over canaries, which needs a convex h).

Why a rejection is rigorous: the pair dominates the mechanism (every hockey-stick
divergence of the pair is at least the mechanism's, at every epsilon, by the accountant's
construction), so the mechanism's curve lies above the pair's, and if the run's guesses
reject the pair's curve at significance alpha they reject the mechanism's claim. No
Gaussian (mu-GDP) shape is assumed. The window of the FFT can fold a mass of at most
``window_mass * delta`` (about 1e-11) onto the wrong losses; h is lowered by ``slack``
(1e-9 by default) to cover it.

:func:`scaled_ledger_epsilon` turns the test into a number: the claimed ledger with every
noise multiplier divided by s >= 0 is a family of mechanisms (s = 1 is what the accountant
claims; s = 2 is the same run with half the noise); the largest s whose curve is rejected,
reported as that ledger's epsilon at delta, is a lower bound on epsilon for a mechanism of
the claimed kind (Poisson-subsampled Gaussian steps) with any noise scale. A rejection of
s = 1 (that epsilon above the accountant's) needs no such qualification: the run is not
what the accountant claims.

A secure sum's rounds (the distributed discrete Gaussian) are accounted by a dominating
Gaussian ledger up to a slack (:mod:`fedsgld.privacy.ddg_dominance`): for every output the
real run's probability lies within e^{-A_down} and e^{A_up} of the dominating run's, under
either neighbour. An event of probability x in the real run then has probability at least
e^{-A_up} x in the dominating run, so its other-neighbour probability there is at least
h(e^{-A_up} x), and in the real run at least e^{-A_down} h(e^{-A_up} x). ``LedgerCurves``
with ``slack_up``/``slack_down`` tests that lower, still convex curve, and reports each
scale's epsilon as the accountant does: the PLD's at delta e^{-A_up}, plus A_up + A_down.
At fedsgld's grids both slacks underflow to 0 and the curve is the dominating ledger's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from fedsgld.privacy import audit_bounds, pld_fft

__all__ = [
    "LedgerCurves",
    "audit_run",
    "pld_inverse_blow_up",
    "scaled_ledger_epsilon",
]

#: h is lowered by this much (the FFT window's folded mass is below 1e-11 at delta <= 1e-5)
DEFAULT_SLACK = 1e-9
#: the noise scales s tried: 2^(k / STEPS_PER_OCTAVE), up to S_MAX
STEPS_PER_OCTAVE = 32
S_MAX = 16.0


def _lower_convex_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The vertices of the greatest convex function below the points (x, y), x ascending."""
    keep: list[int] = []
    for i in range(x.size):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            # b lies on or above the chord from a to i: not a vertex of the lower hull
            if (y[b] - y[a]) * (x[i] - x[a]) >= (y[i] - y[a]) * (x[b] - x[a]):
                keep.pop()
            else:
                break
        keep.append(i)
    return x[keep], y[keep]


def pld_inverse_blow_up(
    pld: pld_fft.ComposedPLD, *, slack: float = DEFAULT_SLACK
) -> Callable[[float], float]:
    """x -> h(x) of the composed PLD ``pld`` (module docstring): the greatest convex curve
    below both directions' curves (each is convex; the test averages over canaries, which
    needs a convex h), lowered by ``slack`` (never below 0)."""
    if not (0.0 <= slack < 1e-3):
        raise ValueError(f"slack must be in [0, 1e-3), got {slack!r}")
    curves = []
    for x, p, extra in pld.distributions():
        xs, ps = x[::-1], np.maximum(p[::-1], 0.0)  # losses from the top down
        qs = ps * np.exp(-np.minimum(xs, 700.0))
        cum_p = np.concatenate(([0.0, extra], extra + np.cumsum(ps)))
        cum_q = np.minimum(np.concatenate(([0.0, 0.0], np.cumsum(qs))), 1.0)
        cum_p, first = np.unique(cum_p, return_index=True)  # massless outcomes add no point
        curves.append((cum_p, cum_q[first]))
    grid = np.unique(np.clip(np.concatenate([cp for cp, _ in curves] + [[0.0, 1.0]]), 0.0, 1.0))
    low = np.minimum.reduce([np.interp(grid, cp, cq) for cp, cq in curves])
    hx, hy = _lower_convex_hull(grid, np.append(low[:-1], 1.0))

    def h(t: float) -> float:
        if t <= 0.0:
            return 0.0
        if t >= 1.0:
            return 1.0
        return max(float(np.interp(t, hx, hy)) - slack, 0.0)

    return h


def _scaled(ledger: Sequence[tuple[float, float, int]], s: float) -> list[tuple[float, float, int]]:
    return [(float(q), float(sigma) / s, int(c)) for q, sigma, c in ledger]


class LedgerCurves:
    """The curves and epsilons of a ledger with its noise scaled by 1/s, computed once per s.

    ``ledger``: [(q, sigma, count), ...] as the accountant recorded it; ``delta``: the
    run's. The scales tried lie on the grid 2^(k / 32) so that tests of several guess
    counts share their PLDs."""

    def __init__(
        self,
        ledger: Sequence[tuple[float, float, int]],
        delta: float,
        *,
        slack_up: float = 0.0,
        slack_down: float = 0.0,
    ) -> None:
        if not ledger:
            raise ValueError("the ledger must hold at least one step (q, sigma, count)")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if not (0.0 <= slack_up < 1.0 and 0.0 <= slack_down < 1.0):
            raise ValueError(
                f"slack_up and slack_down must be in [0, 1), got {slack_up!r}, {slack_down!r}"
            )
        self.ledger = [(float(q), float(s), int(c)) for q, s, c in ledger]
        self.delta = delta
        self.slack_up, self.slack_down = float(slack_up), float(slack_down)
        #: the dominating run's delta: the real run's delta e^{-A_up}
        self._delta = delta * math.exp(-self.slack_up)
        self._pld: dict[int, pld_fft.ComposedPLD] = {}
        self._h: dict[int, Callable[[float], float]] = {}

    @staticmethod
    def scale(k: int) -> float:
        """s of grid point k."""
        return 2.0 ** (k / STEPS_PER_OCTAVE)

    def pld(self, k: int) -> pld_fft.ComposedPLD:
        if k not in self._pld:
            self._pld[k] = pld_fft.compose(
                _scaled(self.ledger, self.scale(k)),
                delta=self._delta,
                sigma_merge=pld_fft.DEFAULT_SIGMA_MERGE,
            )
        return self._pld[k]

    def inverse_blow_up(self, k: int) -> Callable[[float], float]:
        if k not in self._h:
            h = pld_inverse_blow_up(self.pld(k))
            if self.slack_up or self.slack_down:
                h = _slackened(h, self.slack_up, self.slack_down)
            self._h[k] = h
        return self._h[k]

    def epsilon(self, k: int) -> float:
        """The epsilon at delta of the ledger scaled by grid point k (k = 0: the accountant's),
        with the slack added as the accountant adds it."""
        return self.pld(k).epsilon(self._delta) + self.slack_up + self.slack_down


def _slackened(h: Callable[[float], float], up: float, down: float) -> Callable[[float], float]:
    """x -> e^{-down} h(e^{-up} x): the curve of a mechanism within e^{-down}..e^{up} of
    the one whose curve is h (module docstring); convex when h is."""
    a, b = math.exp(-up), math.exp(-down)
    return lambda x: b * h(a * x)


def scaled_ledger_epsilon(
    m: int,
    r: int,
    v: int,
    curves: LedgerCurves,
    *,
    alpha: float,
    rejects: Callable[[int, int, int, Callable[[float], float], float], bool],
) -> tuple[float, float]:
    """(epsilon, s): the largest noise scale s on the grid whose curve v correct out of r
    guesses (m canaries) rejects at significance ``alpha``, and that scaled ledger's
    epsilon at delta; (0.0, 0.0) when not even the most private scale tried is rejected.
    ``rejects`` is :func:`fedsgld.privacy.audit_bounds.fdp_rejects`."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")

    def test(k: int) -> bool:
        return rejects(m, r, v, curves.inverse_blow_up(k), alpha)

    k_max = int(round(STEPS_PER_OCTAVE * math.log2(S_MAX)))
    lo = -k_max  # the most private scale tried: 16 times the claimed noise multipliers
    if not test(lo):
        return 0.0, 0.0
    hi = k_max
    if test(hi):
        return curves.epsilon(hi), curves.scale(hi)
    while hi - lo > 1:  # test(lo) and not test(hi)
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return curves.epsilon(lo), curves.scale(lo)


# -- every test of one run, and the correction for taking the best ------------------------------


def _gdp_epsilon(m: int, r: int, v: int, alpha: float, delta: float) -> float:
    return audit_bounds.fdp_epsilon(m, r, v, delta=delta, confidence=1.0 - alpha)


def audit_run(
    rows: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    ledger: Sequence[tuple[float, float, int]] | None = None,
    planned: Sequence[tuple[int, int, int]] = (),
    planned_share: float = 0.8,
    candidates: int = 4,
    slack: tuple[float, float] = (0.0, 0.0),
) -> dict[str, audit_bounds.AuditBound]:
    """The lower bounds of one audited run from its scores ``rows`` (one row per score, one
    column per canary) and the inclusion bits.

    Two bounds make the headline (the larger is reported, so each is tested at half of
    ``1 - confidence``, Bonferroni): ``one_run`` (Steinke et al., assumption-free) and
    ``fdp``, the f-DP test against the accountant's curve family of ``ledger``
    (:func:`scaled_ledger_epsilon`; without a ledger, the mu-GDP family, which assumes a
    Gaussian curve). ``gdp`` is the mu-GDP bound at the same significance (for comparison).

    Within each method the significance is divided among the guesses tried (weighted
    Bonferroni): ``planned`` guesses (row, k_in, k_out), fixed before the inclusion bits
    were read (:func:`fedsgld.studies.audit_scores.plan_guess`), share ``planned_share`` of
    it; every score row times :func:`audit_bounds.guess_pairs` shares the rest. The curve
    family is searched for the planned guesses and the ``candidates`` grid guesses with the
    largest mu-GDP bounds (a subset of the tests the correction counts). ``slack``:
    (A_up, A_down) of a ledger that dominates the run only up to them (a secure sum's,
    :class:`LedgerCurves`)."""
    rows = np.atleast_2d(np.asarray(rows, dtype=float))
    inc = np.asarray(included, dtype=bool)
    m = inc.size
    audit_bounds._check_level(confidence, delta)
    if rows.shape[1] != m:
        raise ValueError(f"scores have {rows.shape[1]} columns for {m} canaries")
    if not 0.0 <= planned_share < 1.0:
        raise ValueError(f"planned_share must be in [0, 1), got {planned_share!r}")
    share = planned_share if planned else 0.0
    alpha = (1.0 - confidence) / 2.0
    grid = [(j, a, b) for j in range(rows.shape[0]) for a, b in audit_bounds.guess_pairs(m)]
    tries = [(j, a, b, alpha * share / len(planned)) for j, a, b in planned]
    tries += [(j, a, b, alpha * (1.0 - share) / len(grid)) for j, a, b in grid]
    counts = [audit_bounds.count_correct(rows[j], inc, a, b) for j, a, b, _ in tries]
    out: dict[str, audit_bounds.AuditBound] = {}
    n = len(tries)

    def bound(name: str, i: int, eps: float, scale: float | None = None):
        j, a, b, sig = tries[i]
        r, v = counts[i]
        return audit_bounds.AuditBound(name, eps, r, v, n, j, a, b, sig, scale)

    one = [
        audit_bounds.one_run_epsilon(m, r, v, delta=delta, confidence=1.0 - t[3])
        for t, (r, v) in zip(tries, counts, strict=True)
    ]
    i = int(np.argmax(one))
    out["one_run"] = bound("one_run", i, one[i])
    gdp = [_gdp_epsilon(m, r, v, t[3], delta) for t, (r, v) in zip(tries, counts, strict=True)]
    i = int(np.argmax(gdp))
    out["gdp"] = bound("gdp", i, gdp[i])
    if not ledger:
        out["fdp"] = bound("fdp", i, gdp[i])
        return out
    curves = LedgerCurves(ledger, delta, slack_up=slack[0], slack_down=slack[1])
    order = len(planned) + np.argsort(-np.asarray(gdp[len(planned) :]), kind="stable")
    best = bound("fdp", 0, 0.0, 0.0)
    for i in [*range(len(planned)), *order[:candidates]]:
        r, v = counts[i]
        eps, s = scaled_ledger_epsilon(
            m, r, v, curves, alpha=tries[i][3], rejects=audit_bounds.fdp_rejects
        )
        if eps > best.epsilon:
            best = bound("fdp", int(i), eps, s)
    out["fdp"] = best
    return out
