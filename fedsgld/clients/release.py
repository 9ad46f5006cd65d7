"""What leaves a site, as numbers: the noised quantities of a site's releases.

The handlers compute exact answers; the site's guard (:mod:`fedsgld.clients.guard`, its
Flower mod :mod:`fedsgld.flower.guard`) lets out only what the site's policy allows, built
by the releases of :mod:`fedsgld.flower.release` (and :mod:`fedsgld.pate.guard` for vote
counts) from the functions here. This module holds the maths only: no Flower message.
Two releases add noise the site draws itself (Gaussian mechanism, charged to the site's
ledger before the draw as one step (q = 1, sigma)):

**Evaluation statistics** (policy ``evaluation = "dp"``). Of the mean softmax p_i of each
test record i (label y_i, confidence c_i = max_j p_ij in bin b_i of 15 equal bins), the
site sums the vector

    v = [count per bin, sum of c_i per bin, number correct per bin,
         sum_i min(-log p_{i,y_i}, B) / B,  sum_i ||p_i - e_{y_i}||^2 / 2]   (47 entries),

B = ``NLL_BOUND`` nats. Adding or removing one record changes one entry of each of the
three bin blocks by at most 1 each and the last two by at most 1 each: L2 sensitivity
sqrt(5). The site releases v + N(0, (sigma_e sqrt(5))^2 I), sigma_e = the policy's
``evaluation_noise_multiplier``, rounded into valid statistics (post-processing, free):
bin counts the non-negative integers closest to the noisy ones that sum to the public
n_test, correct counts in [0, count], confidence sums inside their bin, NLL and Brier sums
in their ranges. The site's report (accuracy, NLL of the clipped terms, Brier, ECE, MCE)
is computed from these; SCE, ACE and AUC need per-record data and are null.

**PATE vote counts** (unless ``allow_non_private``). One record trains one teacher (the
teachers' shares are disjoint), whose votes on all Q queries may change: L2 sensitivity
sqrt(2 Q) of the (Q, K) histogram. The site releases h + N(0, (sigma_v sqrt(2 Q))^2), sigma_v
= the policy's ``vote_noise_multiplier``, each row rounded to the closest non-negative
integer votes summing to the number of teachers (a valid histogram: post-processing).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsgld.calibration import metrics, pooling

STATS_BINS = 15
NLL_BOUND = 10.0  # nats: a record's NLL term in a noised release is min(-log p_y, NLL_BOUND)
STATS_SENSITIVITY = math.sqrt(5.0)
STATS_SIZE = 3 * STATS_BINS + 2


def vote_sensitivity(n_queries: int) -> float:
    """L2 sensitivity of one site's (n_queries, K) vote histogram to one record."""
    return math.sqrt(2.0 * n_queries)


# -- the noised quantities ----------------------------------------------------------------


def stats_vector(probs: Any, labels: Any) -> np.ndarray:
    """The summed vector v of the module docstring (each record adds at most 1 to five entries)."""
    s = pooling.pooling_stats(probs, labels, STATS_BINS)
    p, y = metrics.validate(probs, labels)
    nll = np.minimum(-np.log(np.maximum(p[np.arange(len(y)), y], metrics.NLL_FLOOR)), NLL_BOUND)
    tail = [float(nll.sum()) / NLL_BOUND, s["brier_sum"] / 2.0]
    return np.concatenate([s["bin_count"], s["bin_conf"], s["bin_correct"], tail]).astype(
        np.float64
    )


def round_to_total(v: np.ndarray, total: int) -> np.ndarray:
    """The non-negative integers closest to ``v`` (L2, then largest remainders) summing to
    ``total``: the Euclidean projection onto {x >= 0, sum x = total}, then rounded."""
    v = np.asarray(v, dtype=np.float64)
    if total <= 0:
        return np.zeros(v.shape, dtype=np.int64)
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - total
    j = np.arange(1, len(u) + 1)
    rho = int(np.nonzero(u - css / j > 0)[0][-1])
    x = np.maximum(v - css[rho] / (rho + 1), 0.0)
    out = np.floor(x).astype(np.int64)
    short = int(total - out.sum())
    if short > 0:
        out[np.argsort(-(x - out), kind="stable")[:short]] += 1
    return out


def noisy_stats(
    probs: Any, labels: Any, noise: np.ndarray, *, total: int | None = None
) -> dict[str, Any]:
    """The statistics of :func:`fedsgld.calibration.pooling.pooling_stats`, released from
    ``stats_vector + noise`` (noise of shape (STATS_SIZE,)) and rounded into valid ones
    with ``n = total``: the test-record count the site publishes; None: the noised bin
    counts' own sum, rounded, at least 1 (never the exact count: it differs between
    neighbours)."""
    v = stats_vector(probs, labels) + np.asarray(noise, dtype=np.float64)
    k = STATS_BINS
    n = int(total) if total is not None else max(1, int(np.rint(v[:k].sum())))
    counts = round_to_total(v[:k], n)
    edges = np.arange(k + 1, dtype=np.float64) / k
    conf = np.clip(v[k : 2 * k], edges[:-1] * counts, edges[1:] * counts)
    hits = np.clip(np.rint(v[2 * k : 3 * k]), 0, counts).astype(np.int64)
    return {
        "n": n,
        "correct": int(hits.sum()),
        "nll_sum": float(np.clip(v[3 * k] * NLL_BOUND, 0.0, n * NLL_BOUND)),
        "brier_sum": float(np.clip(v[3 * k + 1] * 2.0, 0.0, 2.0 * n)),
        "bin_count": [int(c) for c in counts],
        "bin_conf": [float(c) for c in conf],
        "bin_correct": [int(h) for h in hits],
    }


def noisy_votes(counts: np.ndarray, noise: np.ndarray, teachers: int) -> np.ndarray:
    """``counts + noise``, each row rounded to non-negative votes summing to ``teachers``."""
    v = np.asarray(counts, dtype=np.float64) + np.asarray(noise, dtype=np.float64)
    return np.stack([round_to_total(row, teachers) for row in v]).astype(np.int64)
