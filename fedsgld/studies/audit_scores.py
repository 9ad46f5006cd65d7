"""The auditor's scores: how likely each canary is IN, from its readings (no torch).

Every score is a function of the released iterates and the canaries' parameters alone,
never of who is IN. The readings (:class:`fedsgld.audit.CanaryAudit`): for canary j and
released round t, y_jt = <G_t, u_j> / C, the recovered noisy gradient sum read along the
canary's direction in units of the clip bound. A round of E local steps s with step
sizes alpha_s gives the step-size-weighted mean of its steps' sums, so

    y_jt = sum_s w_s b_js + e_jt,   w_s = alpha_s / sum alpha,   e_jt ~ N(0, v_t),
    v_t = sum_s w_s^2 sigma_s^2,

with b_js = 1 when canary j was in step s's Poisson sample (rate q, only if it is IN) and
0 otherwise (a canary's clipped gradient has norm exactly C along its own direction), plus
a little of the records' gradients and of the other canaries (none for Dirac canaries on
distinct parameters). q and sigma_s are public.

Four scores, all counted as tries in the Bonferroni correction of
:func:`fedsgld.privacy.audit_bounds.audit_scores`:

* :func:`likelihood_ratio`: log P[y_j. | IN] / P[y_j. | OUT] under that model. One step:
  P[y | IN] = (1 - q) phi_v(y) + q phi_v(y - 1), P[y | OUT] = phi_v(y), so the ratio is
  (1 - q) + q exp((y - 1/2) / v), and the rounds are independent given IN or OUT, so the
  log-ratios add. By Neyman-Pearson the most powerful test of one canary: it sees that a
  Poisson-sampled canary shows in few steps but strongly there, which a weighted sum
  dilutes over all the steps it missed.
* :func:`weighted_sum`: sum_t y_jt / var_t, var_t the spread of round t over the canaries
  (the optimal linear score; it does not assume the noise is what is claimed).
* :func:`whitened_score`: the same after whitening the rounds by their covariance.
* :func:`quiet_energy`: energy in directions across rounds where the noise is quieter
  than independent noise would be (noise reused across rounds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special, stats

from fedsgld.privacy import audit_bounds as ab

SCORE_NAMES = ("likelihood_ratio", "weighted_sum", "whitened", "quiet_energy")


def round_variance(weights: Sequence[float], sigmas: Sequence[float]) -> float:
    """v_t of a round: sum_s w_s^2 sigma_s^2 (module docstring)."""
    return float(sum(w * w * s * s for w, s in zip(weights, sigmas, strict=True)))


def likelihood_ratio(
    y: np.ndarray, q: float, variances: Sequence[float], steps=None, extra=None
) -> np.ndarray:
    """sum_t log P[y_jt | IN] / P[y_jt | OUT] for readings ``y`` (m, T).

    ``variances``: v_t per round (the public noise of its reading); ``steps``: E_t, the
    local steps per round (default 1); ``extra``: None or (m, T), a further variance
    s_jt of canary j's reading in round t, IN or OUT alike (the records' part left after
    the public estimate, :mod:`fedsgld.studies.audit_public`): v_t + s_jt replaces v_t. A round of E steps is modelled with equal weights
    1/E (its count of sampled steps k ~ Binomial(E, q) given IN): the ratio is
    sum_k Bin(k; E, q) exp((k/E) (y - k/(2E)) / v). One step: (1 - q) + q exp((y - 1/2)/v).
    """
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 2 or y.shape[1] != len(variances):
        raise ValueError(
            f"readings (m, T) and {len(variances)} round variances disagree: {y.shape}"
        )
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the sample rate q must be in (0, 1], got {q!r}")
    steps = [1] * y.shape[1] if steps is None else list(steps)
    if extra is not None and np.shape(extra) != y.shape:
        raise ValueError(f"extra variances {np.shape(extra)} must match the readings {y.shape}")
    out = np.zeros(y.shape[0])
    for t, (v, e) in enumerate(zip(variances, steps, strict=True)):
        if not v > 0.0:
            raise ValueError(f"round {t}: the reading's noise variance must be > 0, got {v!r}")
        k = np.arange(e + 1)
        log_prior = stats.binom.logpmf(k, e, q)  # log Bin(k; E, q)
        mean = k / e
        vt = v if extra is None else v + np.clip(extra[:, t : t + 1], 0.0, None)
        terms = log_prior[None, :] + mean[None, :] * (y[:, t : t + 1] - mean[None, :] / 2) / vt
        out += special.logsumexp(terms, axis=1)
    return out


def weighted_sum(y: np.ndarray) -> np.ndarray:
    """sum_t y_jt / var_t, var_t the spread of round t's readings over all canaries."""
    return (y / (y.var(axis=0) + 1e-12)).sum(axis=1)


def whitened_score(y: np.ndarray) -> np.ndarray:
    """sum over rounds after whitening: y (m, T) -> y S^-1 1, S the covariance of the rounds
    over the canaries, shrunk towards its diagonal (Schaefer & Strimmer 2005, target D)."""
    m, t = y.shape
    yc = y - y.mean(axis=0)
    sd = yc.std(axis=0) + 1e-12
    x = yc / sd
    r = x.T @ x / m
    w2 = (x * x).T @ (x * x) / m
    var_r = np.clip(w2 - r * r, 0.0, None) / max(m - 1, 1)
    off = ~np.eye(t, dtype=bool)
    denom = float((r[off] ** 2).sum())
    lam = 1.0 if denom == 0 else min(max(float(var_r[off].sum()) / denom, 0.0), 1.0)
    shrunk = (1 - lam) * r
    np.fill_diagonal(shrunk, 1.0)
    w = np.linalg.solve(shrunk, 1.0 / sd) / sd
    return y @ w


def quiet_energy(y: np.ndarray) -> np.ndarray:
    """A canary's energy in the directions across rounds where the released noise is
    quieter than it should be.

    With independent noise every direction across rounds carries about the same noise.
    A direction with much less (noise reused across rounds cancels in their difference)
    shows a canary's presence pattern almost noise-free: included canaries vary there,
    excluded ones do not. The score weighs each eigen-direction k of the rounds'
    covariance over all canaries by max(0, 1 / lambda_k - 1 / median lambda)."""
    yc = y - y.mean(axis=0)
    lam, vec = np.linalg.eigh(yc.T @ yc / y.shape[0])
    lam = np.clip(lam, 1e-12 * max(float(lam.max()), 1e-300), None)
    w = np.clip(1.0 / lam - 1.0 / float(np.median(lam)), 0.0, None)
    return ((yc @ vec) ** 2) @ w


def all_scores(
    y: np.ndarray, q: float, variances: Sequence[float], steps=None, extra=None
) -> dict[str, np.ndarray]:
    """Every score of :data:`SCORE_NAMES` for readings ``y`` (m, T) (``extra``: the
    likelihood ratio's per-canary variances); with fewer than 3 rounds (too few for a
    covariance) the likelihood ratio and the weighted sum only."""
    out = {
        "likelihood_ratio": likelihood_ratio(y, q, variances, steps, extra),
        "weighted_sum": weighted_sum(y),
    }
    if y.shape[1] >= 3:
        out["whitened"] = whitened_score(y)
        out["quiet_energy"] = quiet_energy(y)
    return out


def separation(score: np.ndarray, included: np.ndarray) -> float:
    """(mean IN - mean OUT) / pooled standard deviation: a score's per-canary signal (for
    reports only; it reads who is IN)."""
    s, inc = np.asarray(score, float), np.asarray(included, bool)
    a, b = s[inc], s[~inc]
    sd = math.sqrt(0.5 * (a.var() + b.var())) + 1e-300
    return float((a.mean() - b.mean()) / sd)


#: the seed of the simulated play :func:`plan_guess` chooses its guess on (public)
PLAN_SEED = 0x9A1


def simulated_readings(
    m: int, q: float, variances: Sequence[float], steps=None, *, seed: int = PLAN_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """(included, readings (m, T)) of a play of the claimed mechanism: each canary IN with
    probability 1/2, round t's reading k / E_t + N(0, v_t) with k ~ Binomial(E_t, q) for
    an IN canary and 0 for an OUT one (the model of the module docstring)."""
    rng = np.random.default_rng(seed)
    steps = [1] * len(variances) if steps is None else list(steps)
    inc = rng.random(m) < 0.5
    y = np.empty((m, len(variances)))
    for t, (v, e) in enumerate(zip(variances, steps, strict=True)):
        y[:, t] = rng.binomial(e, q, m) * inc / e + math.sqrt(v) * rng.standard_normal(m)
    return inc, y


def plan_guess(
    m: int,
    q: float,
    variances: Sequence[float],
    steps=None,
    *,
    delta: float,
    significance: float,
) -> tuple[int, int]:
    """The guess (k_in, k_out) to test the likelihood ratio with, chosen before any reading
    is seen: the one of :func:`fedsgld.privacy.audit_bounds.guess_pairs` with the largest
    mu-GDP f-DP bound at ``significance`` in :func:`simulated_readings` of the claimed
    mechanism (public: m, q, the rounds' variances). Testing one planned guess instead of a
    grid spends no significance on the choice."""
    inc, y = simulated_readings(m, q, variances, steps)
    score = likelihood_ratio(y, q, variances, steps)
    best, pick = -1.0, (m // 2, 0)
    for k_in, k_out in ab.guess_pairs(m):
        r, v = ab.count_correct(score, inc, k_in, k_out)
        eps = ab.fdp_epsilon(m, r, v, delta=delta, confidence=1.0 - significance)
        if eps > best:
            best, pick = eps, (k_in, k_out)
    return pick
