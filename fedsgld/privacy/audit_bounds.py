"""Statistical lower bounds on epsilon from one run with m canaries (no torch).

The game (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"):
each of m canaries is included independently with probability 1/2 by randomness the
auditor does not control; the mechanism runs once; the auditor scores every canary from
what was released and makes r guesses (IN for the highest scores, OUT for the lowest,
abstaining on the rest), v of them correct. If the mechanism were (epsilon, delta)-DP
with respect to each canary, v could not be large; a v too large for an epsilon at the
chosen confidence rejects that epsilon. The largest rejected epsilon is a lower bound on
the mechanism's true epsilon, valid with that confidence.

Two tests of the same counts (m, r, v):

* :func:`one_run_p_value` / :func:`one_run_epsilon`: Steinke et al.'s theorem for
  (epsilon, delta)-DP: P[v correct or more] <= P[Bin(r, p) >= v] + 2 m delta
  max_{1<=i<=v} P[v - i <= Bin(r, p) < v] / i, with p = e^eps / (1 + e^eps).
* :func:`fdp_rejects` / :func:`fdp_epsilon`: Mahloujifar, Melis & Chaudhuri 2024
  (arXiv 2410.22235), for a mechanism that is f-DP with a given trade-off curve, here
  mu-Gaussian DP. It compares the whole curve with the guessing game rather than one
  (epsilon, delta) point, which is why it is tighter: the result is the largest mu
  rejected, reported as the epsilon of mu-GDP at the given delta. It is a lower bound on
  epsilon for mechanisms whose trade-off curve is Gaussian (the idealised game, and by
  the central limit theorem many-step DP-SGD approximately); Steinke et al.'s bound needs
  no such assumption.

Choosing how many guesses to make after looking at the scores is itself a test; trying
several and keeping the best invalidates the bound unless corrected. :func:`audit_scores`
tries a fixed grid of guess counts and divides the significance by the number of tries
(Bonferroni), or picks the count on one half of the canaries and evaluates it on the
other half (``selection="split"``). The grid has two shapes of guesses: k IN on the
highest scores and k OUT on the lowest (``"both"``), and k IN on the highest alone,
abstaining on the rest (``"in"``). Against a Poisson-subsampled mechanism the second is
often the better: a canary that is IN but was rarely sampled looks OUT, so the lowest
scores are a poor guess of OUT, while the highest are a sure guess of IN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
from scipy import optimize, special, stats

__all__ = [
    "AuditBound",
    "audit_scores",
    "count_correct",
    "fdp_epsilon",
    "fdp_rejects",
    "gdp_epsilon_at",
    "gdp_mu_at",
    "guess_grid",
    "guess_pairs",
    "one_run_epsilon",
    "one_run_p_value",
]

#: the largest epsilon searched (an audit with m canaries cannot certify much above log m)
EPS_MAX = 50.0


def _check(m: int, r: int, v: int) -> None:
    if not (isinstance(m, (int, np.integer)) and m >= 1):
        raise ValueError(f"canaries m must be an integer >= 1, got {m!r}")
    if not (0 <= r <= m):
        raise ValueError(f"guesses r must be in [0, m={m}], got {r!r}")
    if not (0 <= v <= r):
        raise ValueError(f"correct guesses v must be in [0, r={r}], got {v!r}")


def _check_level(confidence: float, delta: float) -> None:
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not (0.0 <= delta < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")


# -- Steinke, Nasr & Jagielski 2023 ----------------------------------------------------------


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """An upper bound on P[at least v of r guesses correct] for an (epsilon, delta)-DP
    mechanism audited with m canaries (Steinke et al. 2023, their main theorem)."""
    _check(m, r, v)
    if v == 0:
        return 1.0
    p = float(special.expit(epsilon))
    # tail[i] = P[Bin(r, p) >= v - i] for i = 0..v-1; tail[0] is the bound for delta = 0
    tail = stats.binom.sf(np.arange(v - 1, -1, -1), r, p)
    beta = float(tail[0])
    if delta == 0.0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    below = np.append(tail[1:], 1.0) - beta  # P[v - i <= Bin < v], i = 1..v
    return min(beta + 2.0 * m * delta * float(np.max(below / i)), 1.0)


def _largest_rejected(rejects: Callable[[float], bool], lo: float = 0.0) -> float:
    """sup{eps >= lo : rejects(eps)} for a test that rejects small epsilons and stops
    rejecting at some point (monotone); ``lo`` when it rejects none."""
    if not rejects(lo):
        return lo
    hi = max(1.0, 2.0 * lo)
    while rejects(hi):
        lo, hi = hi, 2.0 * hi
        if hi > EPS_MAX:
            return EPS_MAX
    for _ in range(60):  # bisection to ~1e-6 relative
        mid = 0.5 * (lo + hi)
        if rejects(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6:
            break
    return lo


def one_run_epsilon(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95) -> float:
    """The lower bound on epsilon of Steinke et al. 2023: the largest epsilon for which
    v correct out of r guesses (m canaries) has probability at most 1 - confidence under
    (epsilon, delta)-DP. 0 when no epsilon >= 0 is rejected."""
    _check(m, r, v)
    _check_level(confidence, delta)
    alpha = 1.0 - confidence
    if v == 0 or one_run_p_value(m, r, v, 0.0, 0.0) > alpha:
        return 0.0  # not even epsilon = 0 with delta = 0 is rejected
    return _largest_rejected(lambda e: one_run_p_value(m, r, v, e, delta) <= alpha)


# -- Mahloujifar, Melis & Chaudhuri 2024: f-DP in one run --------------------------------------


def gdp_delta_at(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-Gaussian DP (Dong, Roth & Su 2019, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    a = stats.norm.cdf(-epsilon / mu + mu / 2)
    b = math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2) if epsilon < 700 else 0.0
    return float(max(a - b, 0.0))


def gdp_epsilon_at(mu: float, delta: float) -> float:
    """The epsilon of mu-Gaussian DP at ``delta`` (0 when delta alone covers it)."""
    if mu <= 0 or gdp_delta_at(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta_at(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta_at(mu, e) - delta, 0.0, hi, xtol=1e-10))


def gdp_mu_at(epsilon: float, delta: float) -> float:
    """The mu whose mu-Gaussian DP has exactly (epsilon, delta)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    hi = 1.0
    while gdp_delta_at(hi, epsilon) < delta:
        hi *= 2.0
    return float(optimize.brentq(lambda u: gdp_delta_at(u, epsilon) - delta, 1e-12, hi, xtol=1e-12))


def _gdp_inverse_blow_up(mu: float) -> Callable[[float], float]:
    """x -> Phi(Phi^-1(x) - mu): the smallest probability an event can have under one
    neighbour when it has probability x under the other, for a mu-GDP mechanism."""
    normal = NormalDist()  # pure Python: the f-DP recursion calls this once per step
    return lambda x: normal.cdf(normal.inv_cdf(x) - mu) if 0.0 < x < 1.0 else float(x >= 1.0)


def fdp_rejects(
    m: int, r: int, v: int, inverse_blow_up: Callable[[float], float], alpha: float
) -> bool:
    """Whether v correct out of r guesses (m canaries) has probability below ``alpha``
    for every mechanism that is f-DP with the trade-off curve behind ``inverse_blow_up``.

    The idea (Mahloujifar et al. 2024): write rho_i = E[(correct) 1{C >= i}] / m and
    eta_i = E[(wrong) 1{C >= i}] / m for C the number of correct guesses. Suppose
    P[C >= v] >= alpha; then rho_v >= alpha v / m and eta_v >= alpha (r - v) / m. Going
    down from i = v, f-DP forces eta_i >= f^-1(rho_{i+1}) (the wrong guesses cannot be
    much rarer than the right ones), and mass added at C = i adds i / (r - i) as much
    to rho as to eta. The smallest total rho_0 + eta_0 reachable this way must not exceed
    r / m (every guess is right or wrong); if it does, the supposition was false.
    """
    _check(m, r, v)
    if v == 0:
        return False
    rho = alpha * v / m
    eta = alpha * (r - v) / m
    for i in range(v - 1, -1, -1):
        need = max(eta, inverse_blow_up(rho))
        if need == eta:  # nothing moves from here down
            break
        rho = min(rho + i / (r - i) * (need - eta), 1.0)
        eta = need
    return rho + eta > r / m


def fdp_epsilon(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95) -> float:
    """The f-DP one-run lower bound for Gaussian DP: the epsilon (at ``delta``) of the
    largest mu such that mu-GDP is rejected by v correct out of r guesses; 0 if none."""
    _check(m, r, v)
    _check_level(confidence, delta)
    if not delta > 0.0:
        raise ValueError(f"the f-DP bound reports epsilon at a delta > 0, got {delta!r}")
    mu = fdp_mu(m, r, v, confidence=confidence)
    return gdp_epsilon_at(mu, delta) if mu > 0 else 0.0


def fdp_mu(m: int, r: int, v: int, *, confidence: float = 0.95) -> float:
    """The largest mu whose mu-GDP is rejected (0 if none)."""
    alpha = 1.0 - confidence
    return _largest_rejected(lambda mu: fdp_rejects(m, r, v, _gdp_inverse_blow_up(mu), alpha))


# -- guesses from scores, and the correction for choosing how many -----------------------------


def guess_grid(m: int, *, smallest: int = 10, ratio: float = 2.0) -> list[int]:
    """Guess counts per side tried by :func:`audit_scores`: a geometric grid from
    ``smallest`` to m // 2 (fixed before any score is seen)."""
    half = m // 2
    if half < 1:
        return [1] if m >= 1 else []
    ks, k = [], float(min(smallest, half))
    while int(round(k)) < half:
        if not ks or int(round(k)) > ks[-1]:
            ks.append(int(round(k)))
        k *= ratio
    ks.append(half)
    return ks


#: the shapes of guesses :func:`audit_scores` tries by default (see the module docstring)
SIDES = ("both", "in")


def guess_pairs(m: int, sides: Sequence[str] = SIDES, ks: Sequence[int] | None = None):
    """(k_in, k_out) of every guess tried: for each k of ``ks`` (default
    :func:`guess_grid`), (k, k) for ``"both"`` and (k, 0) for ``"in"``, where they fit."""
    bad = set(sides) - {"both", "in"}
    if bad or not sides:
        raise ValueError(f"sides must be a non-empty subset of ('both', 'in'), got {sides!r}")
    ks = list(ks) if ks is not None else guess_grid(m)
    pairs = [(k, k) for k in ks if "both" in sides and 1 <= k and 2 * k <= m]
    pairs += [(k, 0) for k in ks if "in" in sides and 1 <= k <= m]
    if not pairs:
        raise ValueError(f"no guess count fits {m} canaries")
    return pairs


def count_correct(
    scores: Sequence[float], included: Sequence[bool], k_in: int, k_out: int
) -> tuple[int, int]:
    """(guesses, correct) when the k_in highest scores are guessed IN and the k_out lowest
    OUT (ties broken by index: the scores are a function of the released run only)."""
    s = np.asarray(scores, dtype=float)
    inc = np.asarray(included, dtype=bool)
    if s.shape != inc.shape or s.ndim != 1:
        raise ValueError(
            f"scores and included must be 1-D of one length, got {s.shape}, {inc.shape}"
        )
    if k_in < 0 or k_out < 0 or k_in + k_out > s.size:
        raise ValueError(f"k_in + k_out must be in [0, {s.size}], got {k_in} + {k_out}")
    order = np.argsort(s, kind="stable")
    top = order[s.size - k_in :] if k_in else order[:0]
    bottom = order[:k_out]
    return k_in + k_out, int(inc[top].sum() + (~inc[bottom]).sum())


@dataclass(frozen=True)
class AuditBound:
    """One method's lower bound and the guesses that gave it."""

    method: str
    epsilon: float
    guesses: int
    correct: int
    tries: int  # the hypotheses the significance was divided among (Bonferroni)
    row: int = 0  # the score (row of the scores) that gave it
    k_in: int = 0  # guessed IN on the k_in highest scores
    k_out: int = 0  # and OUT on the k_out lowest
    significance: float = 0.0  # the share of 1 - confidence this guess was tested at
    scale: float | None = None  # noise scale s of the rejected ledger (accountant's curve)

    def to_dict(self) -> dict:
        return asdict(self)


METHODS = {"one_run": one_run_epsilon, "fdp": fdp_epsilon}


def audit_scores(
    scores: Sequence[float] | Sequence[Sequence[float]],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    ks: Sequence[int] | None = None,
    sides: Sequence[str] = SIDES,
    selection: str = "bonferroni",
    seed: int = 0,
) -> dict[str, AuditBound]:
    """Lower bounds by both methods from the canaries' scores and who was included.

    ``scores``: one score per canary (higher = more likely IN), or several score vectors
    (rows), every row counted as tries. For every row and every guess of
    :func:`guess_pairs` (``ks``, default :func:`guess_grid`; ``sides``), the k_in highest
    are guessed IN and the k_out lowest OUT. ``selection``: ``bonferroni`` (each try at
    significance (1 - confidence) / tries; the best bound is reported) or ``split`` (row
    and guess chosen on a random half of the canaries by the largest bound there, then
    evaluated once on the other half).
    """
    _check_level(confidence, delta)
    rows = np.atleast_2d(np.asarray(scores, dtype=float))
    inc = np.asarray(included, dtype=bool)
    m = inc.size
    if rows.shape[1] != m:
        raise ValueError(f"scores have {rows.shape[1]} columns for {m} canaries")
    if selection not in ("bonferroni", "split"):
        raise ValueError(f"selection must be bonferroni or split, got {selection!r}")
    if selection == "split":
        perm = np.random.default_rng(seed).permutation(m)
        a, b = np.sort(perm[: m // 2]), np.sort(perm[m // 2 :])
        out = {}
        for name in METHODS:
            pairs = guess_pairs(a.size, sides, ks)
            _, row, (k_in, k_out) = _best(rows[:, a], inc[a], name, delta, confidence, pairs, 1)
            # b holds m - m // 2 >= a's m // 2 canaries: a guess that fits a fits b
            r, v = count_correct(rows[row, b], inc[b], k_in, k_out)
            eps = METHODS[name](b.size, r, v, delta=delta, confidence=confidence)
            out[name] = AuditBound(name, eps, r, v, 1, row, k_in, k_out)
        return out
    pairs = guess_pairs(m, sides, ks)
    return {name: _best(rows, inc, name, delta, confidence, pairs, None)[0] for name in METHODS}


def _best(rows, inc, name, delta, confidence, pairs, tries):
    """(the best bound, its row, its (k_in, k_out)) over every row and guess."""
    m = inc.size
    n = tries if tries is not None else rows.shape[0] * len(pairs)
    conf = 1.0 - (1.0 - confidence) / n
    best = (AuditBound(name, 0.0, 0, 0, n), 0, pairs[0])
    for j, row in enumerate(rows):
        for k_in, k_out in pairs:
            r, v = count_correct(row, inc, k_in, k_out)
            eps = METHODS[name](m, r, v, delta=delta, confidence=conf)
            if eps > best[0].epsilon:
                best = (AuditBound(name, eps, r, v, n, j, k_in, k_out), j, (k_in, k_out))
    return best
