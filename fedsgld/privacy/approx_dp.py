"""Releases known only by an (epsilon, delta) guarantee or an RDP curve, composed with PLDs.

Some procedures have no privacy loss distribution of their own: a private selection among
trials (Papernot & Steinke 2022) is known only by its Renyi DP curve, an external
mechanism only by an (epsilon, delta) guarantee. Two events describe them:

* :class:`ApproxDpRelease` (epsilon_0, delta_0): a mechanism that is (epsilon_0,
  delta_0)-DP under add/remove adjacency.
* :class:`RdpCurveRelease` (orders, rdp): a mechanism that is (alpha, rdp_alpha)-RDP at
  every listed order alpha.

Worst-case PLD of an (epsilon_0, delta_0) guarantee
---------------------------------------------------
Kairouz, Oh & Viswanath (2015, Theorem 2.1): every (epsilon_0, delta_0)-DP mechanism is,
for each pair of neighbouring datasets, a post-processing of the pair (P, Q) on four
outcomes, with w = 1 - delta_0 and e = e^{epsilon_0}::

    P = (delta_0, w e/(1+e), w/(1+e), 0),   Q = (0, w/(1+e), w e/(1+e), delta_0).

Its privacy loss L = log P/Q (under P) is +infinity with probability delta_0, +epsilon_0
with w e/(1+e) and -epsilon_0 with w/(1+e); the pair is symmetric, so both directions of
add/remove adjacency have this PLD (``dp_accounting``'s
``PrivacyLossDistribution.from_privacy_parameters`` builds the same one). A pair that
dominates a mechanism dominates it under adaptive composition too (Zhu, Dong & Wang 2022),
so composing these pairs with the dominating pairs of the Gaussian steps bounds the whole
ledger.

Composition, exactly
--------------------
With delta_X(x) = E[(1 - e^{x - L_X})_+] + P(L_X = infinity) the privacy profile of a PLD
L_X, defined for every real x (negative x included), the profile of the composition
L_G + L_A of independent losses is

    delta(epsilon) = P(L_A = inf) + sum_j P(L_A = a_j) delta_G(epsilon - a_j),

where L_A is the composed loss of the approximate-DP releases (finitely many atoms a_j:
sums of +-epsilon_i; its mass at infinity 1 - prod_i (1 - delta_i)) and delta_G the
profile of the Gaussian ledger's discretised PLD (:mod:`fedsgld.privacy.pld_fft`, an upper
bound for every x). So delta adds: the composition's delta is never below
1 - prod (1 - delta_i) (<= sum delta_i), and a ledger asked for epsilon at a delta no
larger than that has none (epsilon = inf). epsilon(delta) is the smallest epsilon with
delta(epsilon) <= delta, found by bisection and returned at the upper end of the last
interval. When the atoms exceed :data:`MAX_ATOMS` they are rounded UP onto a grid
(delta_G is non-increasing, so this only raises delta).

Why it never under-reports: (1) each (epsilon_i, delta_i) release is dominated by its
pair above, (2) delta_G is an upper bound on the Gaussian ledger's profile, (3) the
composition formula is exact for dominating pairs and monotone in both, (4) rounding
atoms up and returning the upper end of the bisection only raise epsilon. It is never
below either part: delta_G(epsilon - L_A) averages to at least delta_G(epsilon) and to at
least the approximate-DP part's own profile (post-processing: dropping an output cannot
raise the hockey-stick divergence).

An RDP curve has no finite-atom PLD (a mechanism with infinite Renyi divergences at
orders below some alpha need not be approximately DP at a small delta). A
:class:`RdpCurveRelease` is therefore charged as the (epsilon', delta') pair its curve
gives at delta' = f delta / n (Canonne, Kamath & Steinke 2020, Prop. 12; n the number of
curve releases, delta the delta asked about), f taken from :data:`DELTA_SHARES`, the
smallest resulting epsilon kept: every choice is a valid bound, so the minimum is.

Torch-free, like the rest of :mod:`fedsgld.privacy`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fedsgld.privacy import pld_fft
from fedsgld.privacy.events import Composed, DpEvent, Repeated, UnsupportedEvent
from fedsgld.privacy.ledger import real
from fedsgld.privacy.rdp import rdp_epsilon

__all__ = [
    "DELTA_SHARES",
    "MAX_ATOMS",
    "ApproxDpRelease",
    "RdpCurveRelease",
    "approx_releases",
    "atoms",
    "composed_delta",
    "composed_epsilon",
]

#: shares f of the delta asked about given to the RDP-curve releases together (each gets
#: f delta / n); the smallest epsilon over them is kept
DELTA_SHARES = (0.5, 0.25, 0.1, 0.03, 0.01)
#: largest number of distinct finite losses of the approximate-DP part (then rounded up)
MAX_ATOMS = 512
_EPS_TOL = 1e-9


@dataclass(frozen=True)
class ApproxDpRelease(DpEvent):
    """A release that is (``epsilon``, ``delta``)-DP under add/remove adjacency, nothing
    more known: charged as its worst-case pair (the module docstring). ``label`` says what
    it was (kept in the ledger file; it does not change the charge)."""

    epsilon: float
    delta: float
    label: str = ""

    def __post_init__(self) -> None:
        eps = real("ApproxDpRelease epsilon", self.epsilon)
        if not (0.0 <= eps < math.inf):
            raise ValueError(f"ApproxDpRelease epsilon must be finite and >= 0, got {eps!r}")
        d = real("ApproxDpRelease delta", self.delta)
        if not (0.0 <= d < 1.0):
            raise ValueError(f"ApproxDpRelease delta must be in [0, 1), got {d!r}")
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", d)
        object.__setattr__(self, "label", str(self.label))


@dataclass(frozen=True)
class RdpCurveRelease(DpEvent):
    """A release that is (alpha, rdp[i])-RDP at every order alpha = ``orders[i]`` (> 1):
    charged as the (epsilon, delta) pair of its curve at a share of the delta asked about
    (the module docstring). ``label`` as :class:`ApproxDpRelease`'s."""

    orders: tuple[float, ...]
    rdp: tuple[float, ...]
    label: str = ""

    def __post_init__(self) -> None:
        orders = tuple(real("RdpCurveRelease orders", a) for a in self.orders)
        rdp = tuple(real("RdpCurveRelease rdp", r) for r in self.rdp)
        if not orders or len(orders) != len(rdp):
            raise ValueError(
                f"RdpCurveRelease needs as many rdp values as orders (>= 1), got "
                f"{len(orders)} orders and {len(rdp)} values"
            )
        if any(not (a > 1.0 and math.isfinite(a)) for a in orders):
            raise ValueError("RdpCurveRelease orders must be finite and > 1")
        if any(r < 0.0 for r in rdp):
            raise ValueError("RdpCurveRelease rdp values must be >= 0 (inf allowed)")
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "rdp", rdp)
        object.__setattr__(self, "label", str(self.label))

    def epsilon_at(self, delta: float) -> float:
        """The curve's epsilon at ``delta`` (Canonne, Kamath & Steinke 2020, Prop. 12)."""
        return float(rdp_epsilon(np.asarray(self.rdp), delta, np.asarray(self.orders))[0])


Release = ApproxDpRelease | RdpCurveRelease


def approx_releases(event: DpEvent) -> list[Release] | None:
    """``event``'s approximate-DP releases in order; None when it holds none.

    Raises:
        UnsupportedEvent: an event that mixes them with other releases (charge each part
            on its own).
    """
    if isinstance(event, (ApproxDpRelease, RdpCurveRelease)):
        return [event]
    if isinstance(event, Repeated):
        inner = approx_releases(event.event)
        return None if inner is None else inner * int(event.count)
    if isinstance(event, Composed):
        parts = [approx_releases(e) for e in event.events]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise UnsupportedEvent(
                "an event mixing approximate-DP releases with other releases; charge "
                "them as separate events"
            )
        return [r for p in parts for r in p]  # type: ignore[union-attr]
    return None


# -- the approximate-DP part's loss distribution ----------------------------------------------
def atoms(pairs: Iterable[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray, float]:
    """(losses, probabilities, mass at +infinity) of the composed worst-case pairs of the
    (epsilon_i, delta_i) ``pairs``: equal losses merged; more than :data:`MAX_ATOMS`
    distinct losses rounded UP onto a grid (conservative)."""
    pairs = list(pairs)
    loss = np.zeros(1)
    prob = np.ones(1)
    for eps, d in pairs:
        e = math.exp(-eps)  # P(+eps) = w / (1 + e^{-eps}), P(-eps) = w e^{-eps} / (1 + e^{-eps})
        up, down = (1.0 - d) / (1.0 + e), (1.0 - d) * e / (1.0 + e)
        loss = np.concatenate([loss + eps, loss - eps])
        prob = np.concatenate([prob * up, prob * down])
        loss, prob = _merge(loss, prob)
    return loss, prob, -math.expm1(math.fsum([math.log1p(-d) for _, d in pairs]))


def _merge(loss: np.ndarray, prob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    loss = np.round(loss, 12)  # sums of the same epsilons in another order: one atom
    u, inv = np.unique(loss, return_inverse=True)
    p = np.bincount(inv, weights=prob, minlength=u.size)
    grid = 1e-6
    while u.size > MAX_ATOMS:  # round up onto a coarser grid until few enough
        up = np.ceil(u / grid) * grid
        u, inv = np.unique(up, return_inverse=True)
        p = np.bincount(inv, weights=p, minlength=u.size)
        grid *= 2.0
    return u, p


def _profile(pld: pld_fft.ComposedPLD) -> list[tuple[np.ndarray, np.ndarray, float]]:
    return [(x, p, e) for x, p, e in pld.distributions()]


def _delta_g(x: np.ndarray, p: np.ndarray, extra: float, at: float) -> float:
    """The discretised Gaussian profile delta_G(at), any real ``at``."""
    sel = x > at
    return extra + float(np.sum(p[sel] * -np.expm1(at - x[sel])))


def _delta(profiles, loss: np.ndarray, prob: np.ndarray, inf: float, epsilon: float) -> float:
    best = 0.0
    for x, p, extra in profiles:
        d = inf + sum(pj * _delta_g(x, p, extra, epsilon - aj) for aj, pj in zip(loss, prob))
        best = max(best, d)
    return min(1.0, best)


def _epsilon(profiles, loss, prob, inf: float, delta: float) -> float:
    if _delta(profiles, loss, prob, inf, 0.0) <= delta:
        return 0.0
    top = max(float(x[-1]) for x, _, _ in profiles) + float(np.max(loss)) + 1.0
    if _delta(profiles, loss, prob, inf, top) > delta:
        return math.inf
    lo, hi = 0.0, top
    while hi - lo > _EPS_TOL * (1.0 + hi):
        mid = 0.5 * (lo + hi)
        if _delta(profiles, loss, prob, inf, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _pairs(releases: Sequence[Release], delta: float, share: float) -> list[tuple[float, float]]:
    n = sum(isinstance(r, RdpCurveRelease) for r in releases)
    out = []
    for r in releases:
        if isinstance(r, ApproxDpRelease):
            out.append((r.epsilon, r.delta))
        else:
            d = share * delta / n
            eps = r.epsilon_at(d)
            out.append((eps, d) if math.isfinite(eps) else (0.0, 1.0 - 1e-300))
    return out


def _shares(releases: Sequence[Release]) -> tuple[float, ...]:
    return DELTA_SHARES if any(isinstance(r, RdpCurveRelease) for r in releases) else (0.0,)


def composed_epsilon(
    ledger: Iterable[tuple[float, float, int]], releases: Sequence[Release], delta: float
) -> float:
    """Upper bound on epsilon at ``delta`` of the Gaussian ``ledger`` [(q, sigma, count)]
    composed with the approximate-DP ``releases`` (the module docstring)."""
    delta = real("delta", delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    profiles = _profile(pld_fft.compose(list(ledger), delta=delta))
    best = math.inf
    for share in _shares(releases):
        loss, prob, inf = atoms(_pairs(releases, delta, share))
        if inf >= delta:
            continue
        best = min(best, _epsilon(profiles, loss, prob, inf, delta))
    return best


def composed_delta(
    ledger: Iterable[tuple[float, float, int]],
    releases: Sequence[Release],
    epsilon: float,
    *,
    delta: float,
) -> float:
    """Upper bound on delta at ``epsilon`` of the same composition (curve releases charged
    at shares of ``delta``, the accountant's target; the Gaussian PLD resolved to it)."""
    epsilon = real("epsilon", epsilon)
    if epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    profiles = _profile(pld_fft.compose(list(ledger), delta=delta))
    return min(
        _delta(profiles, *atoms(_pairs(releases, delta, share)), epsilon)
        for share in _shares(releases)
    )
