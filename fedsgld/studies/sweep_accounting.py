"""The privacy of choosing among trials: Papernot & Steinke (ICLR 2022, arXiv 2110.03620).

A private selection runs a RANDOM number K of independent trials of one randomised
algorithm Q and releases only the best trial's output. Q here is: draw a grid point and a
seed uniformly, train (a DP run), release a noisy validation score of each of its models.
K is drawn, before any trial runs, from

* the truncated negative binomial D_{eta,gamma} (``shape`` eta >= 0):
  P(K = k) proportional to (1 - gamma)^k C(k + eta - 1, k) for k >= 1 (eta = 0: the
  logarithmic distribution (1 - gamma)^k / (k log(1/gamma)); eta = 1: the geometric),
  with mean eta (1 - gamma) / (gamma (1 - gamma^eta)) (eta = 0: (1 - gamma) /
  (gamma log(1/gamma))); gamma is chosen so that the mean is ``mean``;
* the Poisson distribution (``shape`` = inf) with mean ``mean`` (K = 0 releases nothing).

If one trial is (lambda, eps_lambda)-RDP at every order lambda, the selection is
(lambda, eps'_lambda)-RDP with (their Theorems 2 and 6)

    TNB:     eps'_lambda = eps_lambda + (1 + eta) min_mu [(1 - 1/mu) eps_mu + log(1/gamma)/mu]
                           + log(mean) / (lambda - 1)
    Poisson: eps'_lambda = eps_lambda + mean * delta_hat + log(mean) / (lambda - 1),
             delta_hat = delta of one trial at epsilon log(1 + 1/(lambda - 1)),

then made non-decreasing in lambda (RDP is monotone in its order), and converted to
(epsilon, delta) as one run's curve is (:func:`fedsgld.privacy.rdp.rdp_epsilon`). These are
the bounds dp_accounting's ``RepeatAndSelectDpEvent`` gives with its RDP accountant; the
tests compare the two.

One trial's RDP curve is that of its ledger (its training and recalibration steps, planned
before it runs as the run's own accountant will allow them, sigmas rounded down as the run
rounds them) plus its score releases (Gaussian, alpha / (2 sigma_v^2) each). A trial draws
its grid point at random, so Q is a mixture over points; Renyi divergence is jointly
quasi-convex, so the pointwise maximum over the points' curves bounds Q's curve.

Privacy caveat: sizes of the validation splits are public (as the training splits' are),
and a selection's number of trials and their draws must stay secret until the result is
released: only the best trial's output may leave, never the others' or K.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from fedsgld.calibration.metrics import NLL_FLOOR
from fedsgld.calibration.recal import RecalPlan
from fedsgld.config import Config
from fedsgld.privacy.accountant import PrivacyAccountant
from fedsgld.privacy.rdp import DEFAULT_ORDERS, rdp_epsilon, subsampled_gaussian_rdp

#: per-record range of each selectable validation score: the sensitivity of its sum
SCORE_SENSITIVITY = {"accuracy": 1.0, "nll": -math.log(NLL_FLOOR), "brier": 2.0}
#: whether a larger score is better
SCORE_HIGHER = {"accuracy": True, "nll": False, "brier": False}
#: methods whose trials are DP and whose ledger can be planned before they run
PRIVATE_METHODS = ("dpsgd", "dpsgld")


@dataclass(frozen=True)
class SelectionSettings:
    """A private selection's public settings.

    ``total_epsilon``: what the whole procedure may spend at ``delta``; ``mean`` the
    expected number of trials (>= 1); ``shape`` the distribution of the number of trials
    (0 logarithmic, 1 geometric, (0, inf) truncated negative binomial, inf Poisson);
    ``score_noise`` the noise multiplier sigma_v of each released validation score;
    ``select`` the score (accuracy, nll or brier)."""

    total_epsilon: float
    delta: float
    mean: float = 10.0
    shape: float = math.inf
    score_noise: float = 20.0
    select: str = "accuracy"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.total_epsilon) and self.total_epsilon > 0):
            raise ValueError(f"--total-epsilon must be > 0, got {self.total_epsilon!r}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if not (math.isfinite(self.mean) and self.mean >= 1.0):
            raise ValueError(f"--selection-mean must be a number >= 1, got {self.mean!r}")
        if math.isnan(self.shape) or self.shape < 0:
            raise ValueError(f"--selection-shape must be in [0, inf], got {self.shape!r}")
        if not (math.isfinite(self.score_noise) and self.score_noise > 0):
            raise ValueError(f"--score-noise must be > 0, got {self.score_noise!r}")
        if self.select not in SCORE_SENSITIVITY:
            raise ValueError(
                f"--select must be one of {', '.join(SCORE_SENSITIVITY)} with "
                f"--private-selection (a bounded per-record score), got {self.select!r}"
            )

    def distribution(self) -> dict[str, Any]:
        """The distribution of K, named, with its parameters."""
        if self.shape == math.inf:
            return {"name": "poisson", "mean": self.mean}
        name = {0.0: "logarithmic", 1.0: "geometric"}.get(
            float(self.shape), "truncated negative binomial"
        )
        return {"name": name, "mean": self.mean, "shape": self.shape,
                "gamma": tnb_gamma(self.shape, self.mean)}  # fmt: skip


# ----------------------------------------------------------------- the number of trials
def tnb_mean(gamma: float, shape: float) -> float:
    """Mean of the truncated negative binomial D_{shape, gamma} (shape 0: logarithmic)."""
    if shape == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return shape * (1 - gamma) / (gamma * (1 - gamma**shape))


def tnb_gamma(shape: float, mean: float) -> float:
    """gamma with mean(D_{shape, gamma}) >= ``mean``, within 1e-12 of equality (bisection;
    the smaller gamma is kept: it is the conservative one for the bound)."""
    if mean <= 1:
        return 1.0 - 1e-12
    lo, hi = 1e-12, 1.0 - 1e-12  # the mean falls as gamma grows
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if tnb_mean(mid, shape) >= mean:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return lo


def trial_count_pmf(settings: SelectionSettings, k: np.ndarray) -> np.ndarray:
    """P(K = k) under the selection's distribution (for the tests and the report)."""
    k = np.asarray(k)
    if settings.shape == math.inf:
        return stats.poisson.pmf(k, settings.mean)
    gamma = tnb_gamma(settings.shape, settings.mean)
    if settings.shape == 0:
        return np.where(k >= 1, stats.logser.pmf(k, 1 - gamma), 0.0)
    base = stats.nbinom.pmf(k, settings.shape, gamma)
    return np.where(k >= 1, base / (1 - gamma**settings.shape), 0.0)


def draw_trial_count(settings: SelectionSettings, rng: np.random.Generator) -> int:
    """K from the selection's distribution, drawn with ``rng`` (which stays with whoever
    runs the selection: K is secret)."""
    if settings.shape == math.inf:
        return int(rng.poisson(settings.mean))
    gamma = tnb_gamma(settings.shape, settings.mean)
    if settings.shape == 0:
        return int(rng.logseries(1 - gamma))
    while True:  # the negative binomial conditioned on K >= 1
        k = int(rng.negative_binomial(settings.shape, gamma))
        if k >= 1:
            return k


# ------------------------------------------------------------------------ RDP curves
def ledger_rdp(
    ledger: Iterable[tuple[float, float, int]], orders: np.ndarray = DEFAULT_ORDERS
) -> np.ndarray:
    """The RDP curve of a ledger [(q, sigma, count)] of Poisson-subsampled Gaussian steps."""
    total = np.zeros(len(orders))
    groups: dict[float, list[tuple[float, int]]] = {}
    for q, sigma, count in ledger:
        groups.setdefault(float(q), []).append((float(sigma), int(count)))
    for q, entries in groups.items():
        sig = np.array([s for s, _ in entries])
        cnt = np.array([c for _, c in entries], dtype=np.float64)
        total += cnt @ subsampled_gaussian_rdp(q, sig, orders)
    return total


def trial_rdp(
    ledger: Iterable[tuple[float, float, int]],
    *,
    scores: int,
    score_noise: float,
    orders: np.ndarray = DEFAULT_ORDERS,
) -> np.ndarray:
    """One trial's curve: its ledger plus ``scores`` Gaussian score releases at noise
    multiplier ``score_noise`` (alpha / (2 sigma_v^2) each)."""
    return ledger_rdp(ledger, orders) + scores * np.asarray(orders) / (2 * score_noise**2)


def rdp_delta(rdp: np.ndarray, epsilon: float, orders: np.ndarray = DEFAULT_ORDERS) -> float:
    """delta at ``epsilon`` of an RDP curve (Canonne, Kamath & Steinke 2020, Prop. 12):
    min over orders of exp((a - 1)(rdp_a - eps + log(1 - 1/a)) - log a), capped at 1."""
    a = np.asarray(orders, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        log_d = (a - 1) * (np.asarray(rdp) - epsilon + np.log1p(-1 / a)) - np.log(a)
    log_d = np.where(np.isnan(log_d), np.inf, log_d)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_d))))))


def repeat_and_select_rdp(
    rdp: np.ndarray, *, mean: float, shape: float, orders: np.ndarray = DEFAULT_ORDERS
) -> np.ndarray:
    """The selection's RDP curve from one trial's (the module's formulas)."""
    a = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if shape == math.inf:
        out = np.array([
            rdp[i] + mean * rdp_delta(rdp, math.log1p(1 / (a[i] - 1)), a) + math.log(mean) / (a[i] - 1)
            for i in range(a.size)
        ])  # fmt: skip
    else:
        gamma = tnb_gamma(shape, mean)
        c = (1 + shape) * float(np.min((1 - 1 / a) * rdp - math.log(gamma) / a))
        out = rdp + math.log(mean) / (a - 1) + c
    # monotone in the order: the curve at a is at most its value at any larger order
    return np.minimum.accumulate(out[::-1])[::-1]


# --------------------------------------------------------------------- planned trials
def planned_ledger(flat: dict[str, Any]) -> list[tuple[float, float, int]]:
    """The most a trial with these settings can spend: its reserved recalibration steps
    and the training steps along its schedule that its accountant will allow (sigmas
    rounded down to the accountant's grid, as the run rounds them). A run halts at or
    before this ledger, so its own ledger is dominated by it."""
    cfg = Config.from_flat(flat)
    p = cfg.privacy
    if not p.private:
        raise ValueError(
            f"method {p.method!r} is not private: a private selection needs dpsgd or dpsgld"
        )
    acc = PrivacyAccountant(delta=p.delta, epsilon_budget=p.epsilon, accountant=p.accountant,
                            sigma_rel_grid=p.sigma_grid)  # fmt: skip
    recal = RecalPlan.from_config(cfg)
    reserved = recal.ledger() if recal is not None else []
    r = sum(c for _, _, c in reserved)
    e = p.local_steps  # steps per round: 1 but with noise at the sites (config checks it)
    first = [(q, s) for q, s, c in reserved for _ in range(c)]

    def schedule(i: int) -> tuple[float, float]:
        return first[i] if i < r else (p.sample_rate, p.sigma(i - r))

    n = acc.max_steps(schedule, limit=r + cfg.run.rounds * e)
    if n < r:
        raise ValueError(
            f"the reserved recalibration steps alone exceed epsilon={p.epsilon:g}; raise "
            "recal_noise_multiplier or lower recal_steps"
        )
    steps = ((n - r) // e) * e
    out: dict[tuple[float, float], int] = {}
    for q, s, c in reserved:
        key = (float(q), acc.bucket(s))
        out[key] = out.get(key, 0) + c
    for t in range(steps):
        key = (float(p.sample_rate), acc.bucket(p.sigma(t)))
        out[key] = out.get(key, 0) + 1
    return [(q, s, c) for (q, s), c in out.items()]


def selection_curve(
    curves: list[np.ndarray], settings: SelectionSettings, orders: np.ndarray = DEFAULT_ORDERS
) -> np.ndarray:
    """The whole selection's RDP curve at ``orders``: the worst grid point's one-trial
    curve, repeated and selected (what every site is charged)."""
    worst = np.max(np.stack(curves), axis=0)
    return repeat_and_select_rdp(worst, mean=settings.mean, shape=settings.shape, orders=orders)


def selection_epsilon(
    curves: list[np.ndarray], settings: SelectionSettings, orders: np.ndarray = DEFAULT_ORDERS
) -> dict[str, float]:
    """epsilon_trial (the worst point's one trial) and epsilon_total (the selection) at
    the settings' delta, from the grid points' one-trial curves."""
    worst = np.max(np.stack(curves), axis=0)
    total = selection_curve(curves, settings, orders)
    return {
        "epsilon_trial": rdp_epsilon(worst, settings.delta, orders)[0],
        "epsilon_total": rdp_epsilon(total, settings.delta, orders)[0],
    }


def noisy_score(
    value: float, n: int, *, select: str, score_noise: float, rng: np.random.Generator
) -> float:
    """A validation score released privately: the sum over the n records of the per-record
    score (in [0, sensitivity]) plus N(0, (score_noise * sensitivity)^2), divided by n."""
    if n < 1:
        raise ValueError(f"a validation score needs at least one record, got n = {n}")
    sens = SCORE_SENSITIVITY[select]
    return float((value * n + rng.normal(0.0, score_noise * sens)) / n)
