"""Privacy analysis of PATE's noisy vote aggregation.

Privacy unit and sensitivity
----------------------------
Every teacher trains on a disjoint subset of one site's records, so adding or removing one
patient record changes at most one teacher, hence at most one vote per query: one count of
the vote histogram goes down by 1 and another goes up by 1 (L1 sensitivity 2, L2
sensitivity sqrt(2)); the maximum count changes by at most 1.

LNMax (Papernot et al. 2017, "Semi-supervised knowledge transfer ...")
---------------------------------------------------------------------
Each query releases ``argmax_j (n_j + Lap(1/gamma))``, which is (2 gamma, 0)-DP. The moments
accountant tracks the log moment alpha(lambda) of the privacy loss for lambda = 1..moments.
Per query:

* data-independent (the 2017 paper's bound for a (2 gamma)-DP mechanism, and the pure-DP
  bound: the privacy loss never exceeds 2 gamma, so its log moment never exceeds
  2 gamma lambda; the paper's reference code takes the smaller of the two)::

      alpha(lambda) <= min(2 gamma^2 lambda (lambda + 1), 2 gamma lambda)

* data-dependent (the paper's Theorem 2 with the bound of its Theorem 3). With n the vote
  histogram of the query, j* its plurality class and Delta_j = n_{j*} - n_j::

      q = min(1, sum_{j != j*} (2 + gamma Delta_j) / (4 exp(gamma Delta_j)))
          >= Pr[noisy argmax != j*]
      if q < (e^{2 gamma} - 1) / (e^{4 gamma} - 1):
          alpha(lambda) <= log((1 - q) ((1 - q) / (1 - e^{2 gamma} q))^lambda
                               + q exp(2 gamma lambda))

  and the per-query value is the minimum of this and the data-independent bound.

Log moments add over queries; epsilon at delta is
``min_{lambda=1..moments} (sum_queries alpha(lambda) + log(1/delta)) / lambda``.

GNMax and Confident-GNMax (Papernot et al. 2018, "Scalable private learning with PATE")
-----------------------------------------------------------------------------------------
GNMax releases ``argmax_j (n_j + N(0, sigma^2))``; it has Renyi DP (RDP) of order lambda
equal to ``lambda / sigma^2`` for all lambda > 1 (data-independent; L2 sensitivity
sqrt(2)). Confident-GNMax first checks ``max_j n_j + N(0, sigma_1^2) >= T`` (sensitivity 1:
RDP ``lambda / (2 sigma_1^2)``) and answers with GNMax(sigma_2) only if the check passes.

* data-dependent, per query (2018, Proposition 7 and Theorem 6): with q_tilde an upper
  bound on the probability that the mechanism's output differs from a likely outcome::

      GNMax:      q_tilde = min(1, sum_{j != j*} 1/2 erfc((n_{j*} - n_j) / (2 sigma)))
      threshold:  p = Pr[max_j n_j + N(0, sigma_1^2) >= T] = Phi((max_j n_j - T) / sigma_1),
                  q_tilde = min(p, 1 - p)   (the likely outcome is answer / no answer),
                  analysed as GNMax with sigma = sqrt(2) sigma_1 (same RDP curve).

  With mu_2 = sigma sqrt(log(1/q_tilde)), mu_1 = mu_2 + 1, eps_i = mu_i / sigma^2, if
  mu_2 > 1, lambda < mu_1, q_tilde e^{eps_2} < 1 and
  ``q_tilde <= e^{(mu_2 - 1) eps_2} / (mu_1/(mu_1 - 1) * mu_2/(mu_2 - 1))^{mu_2}``, then::

      RDP(lambda) <= 1/(lambda - 1) log((1 - q_tilde) A^{lambda-1} + q_tilde B^{lambda-1}),
      A = (1 - q_tilde) / (1 - (q_tilde e^{eps_2})^{(mu_2 - 1)/mu_2}),
      B = e^{eps_1} / q_tilde^{1/(mu_1 - 1)},

  and the per-query value is the minimum of this and the data-independent RDP. For
  Confident-GNMax the threshold cost is paid by every posed query and the GNMax cost by
  the answered ones (the 2018 paper's composition).
* data-independent: ``n * lambda / sigma^2`` for GNMax; for Confident-GNMax every posed
  query is charged ``lambda / (2 sigma_1^2) + lambda / sigma_2^2`` (a bound that does not
  look at which queries were answered, because that too depends on the data).

RDP adds over queries and converts to (epsilon, delta)-DP by
``epsilon = min_lambda RDP(lambda) + log(1/delta) / (lambda - 1)`` (Mironov 2017).

Why the two numbers differ by orders of magnitude, and the caveat
-----------------------------------------------------------------
The data-independent bound charges every query as if the teachers' votes were split so
that one record could flip the answer. When teachers agree (say 95 of 100 vote for one
class), the noisy argmax is the plurality class with probability 1 - q where q is
astronomically small (exp(-gamma * gap) or exp(-gap^2 / (4 sigma^2))); changing one
teacher's vote barely moves that probability, so the query's log moment / RDP is close
to zero instead of ~min(2 gamma^2 lambda (lambda + 1), 2 gamma lambda). Summed over
thousands of mostly unanimous queries, this gives e.g. a single-digit data-dependent
epsilon next to a data-independent epsilon in the hundreds or thousands (100 teachers,
gamma = 0.2, 9000 queries, delta = 1e-5: about 1451.5 data-independent).

The data-dependent epsilon is a function of the private votes: it is itself
data-dependent, and releasing it (or choosing parameters by it) is NOT differentially
private. Publishing it needs a private release, e.g. its smooth sensitivity plus noise
(Papernot et al. 2018, Section B), which this module does not do. Only the
data-independent epsilon is a guarantee that can be published as is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import log_ndtr, logsumexp

#: Default Renyi orders for the GNMax analysis (all > 1).
DEFAULT_ORDERS: np.ndarray = np.concatenate(
    [np.arange(1.25, 10.0, 0.25), np.arange(10.0, 100.0, 0.5), np.geomspace(100.0, 2000.0, 80)]
)


# --------------------------------------------------------------------------- validation


def _positive(name: str, v: Any) -> float:
    ok = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    if not ok or not (math.isfinite(float(v)) and float(v) > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def _check_delta(delta: Any) -> float:
    ok = isinstance(delta, (int, float, np.floating)) and not isinstance(delta, bool)
    if not ok or not (0.0 < float(delta) < 1.0):
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    return float(delta)


def _check_num_classes(num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return int(num_classes)


def vote_counts(teacher_preds: Any, *, num_classes: int) -> np.ndarray:
    """(n_queries, num_classes) histogram: column q of ``teacher_preds`` counted per class.

    ``teacher_preds`` is an (n_teachers, n_queries) integer array of predicted labels;
    every entry must lie in [0, num_classes). Raises ``ValueError`` naming the setting.
    """
    num_classes = _check_num_classes(num_classes)
    a = np.asarray(teacher_preds)
    if a.ndim != 2:
        raise ValueError(
            f"teacher_preds must be a 2-D (n_teachers, n_queries) array, got shape {a.shape}"
        )
    if a.shape[0] < 1:
        raise ValueError("teacher_preds must hold at least one teacher (row)")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if not (np.issubdtype(a.dtype, np.floating) and np.all(a == np.round(a))):
            raise ValueError(f"teacher_preds must hold integer labels, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= num_classes):
        raise ValueError(
            f"teacher_preds must lie in [0, num_classes) = [0, {num_classes}), got values in "
            f"[{a.min()}, {a.max()}]"
        )
    counts = np.zeros((a.shape[1], num_classes), dtype=np.int64)
    for q in range(a.shape[1]):  # one query (column) at a time
        counts[q] = np.bincount(a[:, q], minlength=num_classes)
    return counts


def _check_orders(orders: Sequence[float] | np.ndarray | None) -> np.ndarray:
    o = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=np.float64).ravel()
    if o.size == 0 or not np.all(np.isfinite(o)) or np.any(o <= 1.0):
        raise ValueError("orders must be a non-empty list of finite Renyi orders > 1")
    return o


# --------------------------------------------------------------------------- LNMax


def lnmax_q(counts: np.ndarray, *, gamma: float) -> float:
    """Theorem 3 of the 2017 paper: an upper bound on Pr[LNMax(counts) != plurality].

    ``q = min(1, sum_{j != j*} (2 + gamma Delta_j) / (4 exp(gamma Delta_j)))`` with
    ``Delta_j = n_{j*} - n_j`` (j* the first plurality class).
    """
    counts = np.asarray(counts, dtype=np.float64)
    top = int(np.argmax(counts))
    gaps = gamma * (counts[top] - np.delete(counts, top))
    q = float(np.sum((2.0 + gaps) * np.exp(-gaps) / 4.0))
    return min(q, 1.0)


def _lnmax_independent(lam: np.ndarray, gamma: float) -> np.ndarray:
    """Data-independent per-query log moment of LNMax: min(2 g^2 l (l + 1), 2 g l)."""
    return np.minimum(2.0 * gamma**2 * lam * (lam + 1.0), 2.0 * gamma * lam)


def lnmax_log_moments(
    counts: np.ndarray, *, gamma: float, moments: int, data_dependent: bool = True
) -> np.ndarray:
    """Per-query log moments alpha(lambda), lambda = 1..moments (see module docstring)."""
    lam = np.arange(1, moments + 1, dtype=np.float64)
    independent = _lnmax_independent(lam, gamma)
    if not data_dependent:
        return independent
    q = lnmax_q(counts, gamma=gamma)
    e2g = math.exp(2.0 * gamma)
    if q >= (e2g - 1.0) / (e2g * e2g - 1.0):
        return independent
    if q == 0.0:
        return np.zeros_like(lam)
    # log((1-q) * ((1-q)/(1-e^{2g} q))^l + q * e^{2 g l}), in log space.
    log_ratio = math.log1p(-q) - math.log1p(-e2g * q)
    dep = np.logaddexp(math.log1p(-q) + lam * log_ratio, math.log(q) + 2.0 * gamma * lam)
    return np.minimum(independent, dep)


def _moments_epsilon(total_log_moments: np.ndarray, delta: float) -> float:
    lam = np.arange(1, total_log_moments.size + 1, dtype=np.float64)
    return float(np.min((total_log_moments + math.log(1.0 / delta)) / lam))


def lnmax_epsilon(
    teacher_preds: Any,
    *,
    num_classes: int,
    gamma: float,
    delta: float,
    moments: int = 8,
) -> dict[str, float]:
    """Epsilon at ``delta`` of LNMax (Laplace scale 1/gamma) over the answered queries.

    ``teacher_preds``: (n_teachers, n_queries) integer array, column q holding every
    teacher's predicted label for answered query q. The analysis iterates over these
    columns (queries), never over label values.

    Returns ``{"data_dependent": eps_dd, "data_independent": eps_di}`` from the 2017
    moments accountant with lambda = 1..moments::

        eps = min_lambda (sum_queries alpha_q(lambda) + log(1/delta)) / lambda

    where the data-independent alpha_q(lambda) = min(2 gamma^2 lambda (lambda + 1),
    2 gamma lambda) and the data-dependent one is the smaller of that and Theorem 2's
    bound at the query's q (module docstring). Caveat: ``data_dependent`` depends on the
    private votes, so releasing it is not differentially private without smooth
    sensitivity; it is always <= ``data_independent`` and is far smaller when teachers
    mostly agree.
    """
    counts = vote_counts(teacher_preds, num_classes=num_classes)
    return lnmax_epsilon_from_counts(counts, gamma=gamma, delta=delta, moments=moments)


def check_counts(counts: Any) -> np.ndarray:
    """A vote histogram: (n_queries, num_classes) non-negative integers, one row per query."""
    c = np.asarray(counts)
    if c.ndim != 2 or c.shape[1] < 2:
        raise ValueError(
            f"counts must be a 2-D array (n_queries, num_classes >= 2), got shape {c.shape}"
        )
    if not np.issubdtype(c.dtype, np.integer):
        if not (np.all(np.isfinite(c)) and np.all(c == np.round(c))):
            raise ValueError("counts must be integer vote counts")
        c = c.astype(np.int64)
    if c.size and c.min() < 0:
        raise ValueError(f"counts must be >= 0, got a minimum of {c.min()}")
    return c.astype(np.int64, copy=False)


def lnmax_epsilon_from_counts(
    counts: Any, *, gamma: float, delta: float, moments: int = 8
) -> dict[str, float]:
    """:func:`lnmax_epsilon` from the answered queries' vote histogram (n_queries, num_classes).

    The analysis needs only the per-query counts, so a server that receives per-site
    histograms (and never single teachers' votes) can run it on their sum.
    """
    gamma = _positive("gamma", gamma)
    delta = _check_delta(delta)
    if isinstance(moments, bool) or not isinstance(moments, (int, np.integer)) or moments < 1:
        raise ValueError(f"moments must be an integer >= 1, got {moments!r}")
    counts = check_counts(counts)
    n = counts.shape[0]
    lam = np.arange(1, int(moments) + 1, dtype=np.float64)
    independent = n * _lnmax_independent(lam, gamma)
    dependent = np.zeros(int(moments))
    for q in range(n):
        dependent += lnmax_log_moments(counts[q], gamma=gamma, moments=int(moments))
    dependent = np.minimum(dependent, independent)  # both bound the same log moments
    return {
        "data_dependent": _moments_epsilon(dependent, delta),
        "data_independent": _moments_epsilon(independent, delta),
    }


# --------------------------------------------------------------------------- GNMax (RDP)


def gnmax_log_q(counts: np.ndarray, *, sigma: float) -> float:
    """log of Proposition 7's bound (2018) on Pr[GNMax(counts) != plurality]:
    ``q = min(1, sum_{j != j*} 1/2 erfc((n_{j*} - n_j) / (2 sigma)))``.

    ``1/2 erfc(x / (2 sigma))`` is the upper tail at x of N(0, 2 sigma^2)."""
    counts = np.asarray(counts, dtype=np.float64)
    top = int(np.argmax(counts))
    gaps = counts[top] - np.delete(counts, top)
    log_terms = log_ndtr(-gaps / (math.sqrt(2.0) * sigma))  # log P(N(0, 2 sigma^2) > gap)
    return min(float(logsumexp(log_terms)), 0.0)


def threshold_log_q(counts: np.ndarray, *, threshold: float, sigma1: float) -> float:
    """log q_tilde for the threshold check: q_tilde = min(p, 1 - p),
    p = Pr[max_j n_j + N(0, sigma1^2) >= threshold]."""
    top = float(np.max(np.asarray(counts, dtype=np.float64)))
    log_p = float(log_ndtr((top - threshold) / sigma1))
    log_1mp = float(log_ndtr((threshold - top) / sigma1))
    return min(log_p, log_1mp)


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x < 0, accurate near 0 and for very negative x."""
    if x > -0.6931471805599453:
        return math.log(-math.expm1(x))
    return math.log1p(-math.exp(x))


def smooth_gaussian_rdp(log_q: float, *, sigma: float, orders: np.ndarray) -> np.ndarray:
    """Per-query data-dependent RDP of a GNMax-type mechanism (2018, Theorem 6 with
    mu_2 = sigma sqrt(log 1/q), mu_1 = mu_2 + 1, eps_i = mu_i / sigma^2), capped by the
    data-independent ``orders / sigma^2``. ``log_q`` is the log of q_tilde."""
    orders = np.asarray(orders, dtype=np.float64)
    independent = orders / sigma**2
    if log_q == -math.inf:
        return np.zeros_like(orders)  # the output is fixed: no privacy loss
    if log_q >= 0.0:
        return independent
    mu2 = sigma * math.sqrt(-log_q)
    mu1 = mu2 + 1.0
    eps1, eps2 = mu1 / sigma**2, mu2 / sigma**2
    if mu2 <= 1.0 or -log_q <= eps2:
        return independent
    # q <= e^{(mu2-1) eps2} / (mu1/(mu1-1) * mu2/(mu2-1))^{mu2}
    log_cap = (mu2 - 1.0) * eps2 - mu2 * (math.log(mu1 / (mu1 - 1.0)) + math.log(mu2 / (mu2 - 1.0)))
    if log_q > log_cap:
        return independent
    log_1mq = _log1mexp(log_q)
    log_a = log_1mq - _log1mexp((log_q + eps2) * (mu2 - 1.0) / mu2)
    log_b = eps1 - log_q / (mu1 - 1.0)
    applies = orders < mu1
    out = independent.copy()
    lm1 = orders[applies] - 1.0
    dep = np.logaddexp(log_1mq + lm1 * log_a, log_q + lm1 * log_b) / lm1
    out[applies] = np.minimum(independent[applies], dep)
    return out


def rdp_to_epsilon(rdp: np.ndarray, orders: np.ndarray, delta: float) -> tuple[float, float]:
    """(epsilon, best order): ``min_lambda rdp(lambda) + log(1/delta) / (lambda - 1)``."""
    eps = np.asarray(rdp) + math.log(1.0 / delta) / (np.asarray(orders) - 1.0)
    i = int(np.argmin(eps))
    return float(eps[i]), float(orders[i])


def gnmax_epsilon(
    teacher_preds: Any,
    *,
    num_classes: int,
    sigma: float,
    delta: float,
    threshold: float | None = None,
    sigma1: float | None = None,
    answered: Any = None,
    orders: Sequence[float] | np.ndarray | None = None,
) -> dict[str, float]:
    """Epsilon at ``delta`` of GNMax (noise std ``sigma``) or Confident-GNMax by RDP.

    GNMax (``threshold=None``): ``teacher_preds`` is (n_teachers, n_queries) of the
    answered queries; per query the data-independent RDP is ``lambda / sigma^2`` and the
    data-dependent one is Theorem 6's smooth bound at Proposition 7's q (module docstring).

    Confident-GNMax (``threshold=T``, ``sigma1`` the threshold noise, ``sigma`` the answer
    noise sigma_2): ``teacher_preds`` covers every posed query and ``answered`` (bool,
    n_queries) marks those that passed the check. Data-dependent RDP = sum over all posed
    queries of the threshold check's smooth bound + sum over answered ones of GNMax's;
    data-independent = n_posed * (lambda / (2 sigma1^2) + lambda / sigma^2).

    Returns ``{"data_dependent": eps_dd, "data_independent": eps_di}`` with
    ``eps = min_lambda RDP(lambda) + log(1/delta)/(lambda - 1)``. The data-dependent
    value depends on the private votes and is not private to release without smooth
    sensitivity.
    """
    counts = vote_counts(teacher_preds, num_classes=num_classes)
    return gnmax_epsilon_from_counts(
        counts, sigma=sigma, delta=delta, threshold=threshold, sigma1=sigma1,
        answered=answered, orders=orders,
    )  # fmt: skip


def gnmax_epsilon_from_counts(
    counts: Any,
    *,
    sigma: float,
    delta: float,
    threshold: float | None = None,
    sigma1: float | None = None,
    answered: Any = None,
    orders: Sequence[float] | np.ndarray | None = None,
) -> dict[str, float]:
    """:func:`gnmax_epsilon` from the vote histogram (n_queries, num_classes): of the
    answered queries for GNMax, of every posed query for Confident-GNMax."""
    sigma = _positive("sigma", sigma)
    delta = _check_delta(delta)
    o = _check_orders(orders)
    counts = check_counts(counts)
    n = counts.shape[0]
    if threshold is None:
        if sigma1 is not None or answered is not None:
            raise ValueError("sigma1 and answered are only used with threshold (Confident-GNMax)")
        mask = np.ones(n, dtype=bool)
        dependent = np.zeros_like(o)
        independent = n * o / sigma**2
    else:
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold)):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        if sigma1 is None:
            raise ValueError("sigma1 (the threshold-check noise std) is required with threshold")
        sigma1 = _positive("sigma1", sigma1)
        if answered is None:
            raise ValueError("answered (bool mask over the posed queries) is required")
        mask = np.asarray(answered)
        if mask.shape != (n,) or mask.dtype != bool:
            raise ValueError(
                f"answered must be a bool array of shape ({n},) (one per posed query), got "
                f"{mask.dtype} {mask.shape}"
            )
        dependent = np.zeros_like(o)
        for q in range(n):
            lq = threshold_log_q(counts[q], threshold=float(threshold), sigma1=sigma1)
            dependent += smooth_gaussian_rdp(lq, sigma=math.sqrt(2.0) * sigma1, orders=o)
        independent = n * (o / (2.0 * sigma1**2) + o / sigma**2)
    for q in np.flatnonzero(mask):
        dependent += smooth_gaussian_rdp(gnmax_log_q(counts[q], sigma=sigma), sigma=sigma, orders=o)
    dependent = np.minimum(dependent, independent)  # both bound the same RDP curve
    return {
        "data_dependent": rdp_to_epsilon(dependent, o, delta)[0],
        "data_independent": rdp_to_epsilon(independent, o, delta)[0],
    }


__all__ = [
    "DEFAULT_ORDERS",
    "check_counts",
    "gnmax_epsilon",
    "gnmax_epsilon_from_counts",
    "gnmax_log_q",
    "lnmax_epsilon",
    "lnmax_epsilon_from_counts",
    "lnmax_log_moments",
    "lnmax_q",
    "rdp_to_epsilon",
    "smooth_gaussian_rdp",
    "threshold_log_q",
    "vote_counts",
]
