"""Pooled metrics from per-site statistics, so that test labels and predictions stay at the sites.

A site that does not share its predictions sends, per evaluation group, the sufficient
statistics of the pooled top-label metrics over its test split:

    n, correct, sum of -log p_{i,y_i} (floored as in ``nll``), sum of Brier terms, and the
    top-label reliability table (per confidence bin: count, sum of confidence, correct).

Summed over sites these give the pooled accuracy, NLL, Brier score, ECE and MCE exactly
(up to floating-point summation order), and the pooled reliability diagram. They reveal
the site's test-set size, accuracy and confidence histogram, but not its labels: SCE, ACE
and AUC need per-class or per-record information, so their pooled values are NaN (null
in results.json) unless the sites share predictions; every site's own report still has
them, computed at the site.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fedsgld.calibration.metrics import NLL_FLOOR, _binned_gaps, _check_bins, bin_edges, validate

STATS_KEYS = ("n", "correct", "nll_sum", "brier_sum", "bin_count", "bin_conf", "bin_correct")


def pooling_stats(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, Any]:
    """The statistics of one site's predictions that :func:`report_from_stats` pools."""
    _check_bins(n_bins)
    p, y = validate(probs, labels)
    conf = p.max(axis=1)
    correct = p.argmax(axis=1) == y
    counts, mean_conf, mean_hit = _binned_gaps(conf, correct, n_bins)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    with np.errstate(invalid="ignore"):
        bin_conf = np.where(counts > 0, mean_conf * counts, 0.0)
        bin_hit = np.where(counts > 0, mean_hit * counts, 0.0)
    return {
        "n": int(len(y)),
        "correct": int(correct.sum()),
        "nll_sum": float(-np.sum(np.log(np.maximum(p[np.arange(len(y)), y], NLL_FLOOR)))),
        "brier_sum": float(np.sum((p - onehot) ** 2)),
        "bin_count": [int(c) for c in counts],
        "bin_conf": [float(v) for v in bin_conf],
        "bin_correct": [int(round(v)) for v in bin_hit],
    }


def check_stats(stats: Any, n_bins: int = 15) -> dict[str, Any]:
    """Validate one site's statistics (from the network); ValueError names the problem."""
    if not isinstance(stats, dict) or sorted(stats) != sorted(STATS_KEYS):
        raise ValueError(f"statistics must have exactly the keys {list(STATS_KEYS)}")
    n, correct = stats["n"], stats["correct"]
    if not (isinstance(n, int) and isinstance(correct, int) and 0 <= correct <= n):
        raise ValueError("statistics: n and correct must be integers with 0 <= correct <= n")
    for k in ("bin_count", "bin_conf", "bin_correct"):
        v = stats[k]
        if not isinstance(v, list) or len(v) != n_bins:
            raise ValueError(f"statistics: {k} must be a list of {n_bins} numbers")
    counts = np.asarray(stats["bin_count"], dtype=np.float64)
    conf = np.asarray(stats["bin_conf"], dtype=np.float64)
    hits = np.asarray(stats["bin_correct"], dtype=np.float64)
    if not (np.all(np.isfinite(conf)) and np.isfinite(stats["nll_sum"])):
        raise ValueError("statistics: non-finite values")
    if (
        counts.sum() != n
        or hits.sum() != correct
        or np.any(counts < 0)
        or np.any(hits < 0)
        or np.any(hits > counts)
        or np.any(conf < -1e-9)
        or np.any(conf > counts + 1e-9)
        or not (0.0 <= stats["nll_sum"])
        or not (0.0 <= stats["brier_sum"] <= 2.0 * n + 1e-9)
    ):
        raise ValueError("statistics are inconsistent (counts, correct or sums out of range)")
    return stats


def report_from_stats(stats: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Pooled accuracy, nll, brier, ece, mce from sites' statistics; sce, ace, auc NaN."""
    stats = list(stats)
    if not stats:
        raise ValueError("report_from_stats needs at least one site's statistics")
    n = sum(s["n"] for s in stats)
    if n == 0:
        raise ValueError("the sites' test splits are empty")
    counts = np.sum([s["bin_count"] for s in stats], axis=0).astype(np.float64)
    conf = np.sum([s["bin_conf"] for s in stats], axis=0)
    hits = np.sum([s["bin_correct"] for s in stats], axis=0).astype(np.float64)
    ne = counts > 0
    gaps = np.abs(hits[ne] / counts[ne] - conf[ne] / counts[ne])
    nan = float("nan")
    return {
        "accuracy": sum(s["correct"] for s in stats) / n,
        "nll": sum(s["nll_sum"] for s in stats) / n,
        "brier": sum(s["brier_sum"] for s in stats) / n,
        "ece": float(np.sum(counts[ne] / n * gaps)),
        "mce": float(gaps.max()),
        "sce": nan,
        "ace": nan,
        "auc": nan,
    }


def reliability_from_stats(stats: Iterable[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The pooled top-label reliability table (as :func:`~.metrics.reliability_bins`)."""
    stats = list(stats)
    counts = np.sum([s["bin_count"] for s in stats], axis=0).astype(np.float64)
    conf = np.sum([s["bin_conf"] for s in stats], axis=0)
    hits = np.sum([s["bin_correct"] for s in stats], axis=0).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "edges": bin_edges(len(counts)),
            "counts": counts.astype(np.int64),
            "confidence": conf / counts,
            "accuracy": hits / counts,
        }
