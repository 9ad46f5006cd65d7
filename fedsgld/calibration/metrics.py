"""Calibration and accuracy metrics for probabilistic classifiers (numpy, vectorised).

Conventions (fixed here, tested against torchmetrics off the bin edges and by hand on them):

* Bins: ``n_bins`` equal-width bins with edges ``k / n_bins`` (correctly rounded, so that
  0.6 is exactly the 6th of 10 edges; ``np.linspace`` would give 0.6000000000000001). A value
  on an inner edge belongs to the bin on its right, i.e. bins are [lo, hi), except the last,
  which is closed [lo, 1] so that confidence 1.0 falls in it (the netcal convention; Guo et
  al. 2017 use (lo, hi], torchmetrics [lo, hi) with 1.0 in a bin of its own).
* ECE (Guo et al. 2017): top-label confidence c_i = max_k p_ik, correctness a_i;
  ECE = sum_b (n_b / N) |mean_b(a) - mean_b(c)|; MCE = max over non-empty bins of the gap.
* SCE (Nixon et al. 2019, static calibration error): every class k, equal-width bins of
  p_ik over all records: SCE = (1/K) sum_k sum_b (n_kb / N) |mean_kb(1[y=k]) - mean_kb(p_k)|.
* ACE (Nixon et al. 2019, adaptive calibration error): every class k, records sorted by
  p_ik and split into R = n_bins equal-mass ranges (``np.array_split``):
  ACE = (1/(K R)) sum_k sum_r |mean_kr(1[y=k]) - mean_kr(p_k)|.
* Brier: mean over records of sum_k (p_ik - 1[y_i=k])^2 (ranges over [0, 2]).
* NLL: mean of -log max(p_{i,y_i}, 1e-12).
* AUC: binary: the AUC of p_i1 (rank statistic, ties count one half); multiclass: the
  macro average of one-vs-rest AUCs over classes present with both outcomes in the labels
  (NaN when no class qualifies).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NLL_FLOOR = 1e-12
SUM_TOL = 1e-4


def _as_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def validate(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check and convert: probs (N, K) finite, >= 0, rows summing to 1; labels in [0, K)."""
    p = _as_numpy(probs)
    y = _as_numpy(labels)
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] < 2:
        raise ValueError(
            f"probs must be an (N, K) array with N >= 1 and K >= 2, got shape {p.shape}"
        )
    if not np.issubdtype(p.dtype, np.number):
        raise ValueError(f"probs must be numeric, got dtype {p.dtype}")
    p = p.astype(np.float64)
    if not np.all(np.isfinite(p)):
        raise ValueError("probs must be finite (found NaN or inf)")
    if np.any(p < 0):
        raise ValueError(f"probs must be >= 0 (minimum {p.min():.3g})")
    dev = np.abs(p.sum(axis=1) - 1.0)
    if np.any(dev > SUM_TOL):
        i = int(dev.argmax())
        raise ValueError(
            f"each row of probs must sum to 1 within {SUM_TOL:g}; row {i} sums to {p[i].sum():.6g}"
        )
    y = y.reshape(-1) if y.ndim == 2 and 1 in y.shape else y
    if y.ndim != 1 or y.shape[0] != p.shape[0]:
        raise ValueError(f"labels must be a vector of length {p.shape[0]}, got shape {y.shape}")
    if y.dtype.kind not in "iub":
        if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError(
            f"labels must be in [0, {p.shape[1] - 1}], got values in [{y.min()}, {y.max()}]"
        )
    return p, y


def _check_bins(n_bins: int) -> None:
    if not isinstance(n_bins, (int, np.integer)) or isinstance(n_bins, bool) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")


def bin_edges(n_bins: int) -> np.ndarray:
    return np.arange(n_bins + 1, dtype=np.float64) / n_bins


def bin_index(values: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin of each value in [0, 1]: [lo, hi) bins, the last one closed."""
    edges = bin_edges(n_bins)
    return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, n_bins - 1)


def _binned_gaps(
    values: np.ndarray, hits: np.ndarray, n_bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bin: counts, mean value, mean hit (NaN where empty)."""
    idx = bin_index(values, n_bins)
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    sv = np.bincount(idx, weights=values, minlength=n_bins)
    sh = np.bincount(idx, weights=hits.astype(np.float64), minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return counts, sv / counts, sh / counts


def reliability_bins(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, np.ndarray]:
    """Top-label reliability table: edges, counts, mean confidence and accuracy per bin."""
    _check_bins(n_bins)
    p, y = validate(probs, labels)
    conf = p.max(axis=1)
    correct = p.argmax(axis=1) == y
    counts, mean_conf, acc = _binned_gaps(conf, correct, n_bins)
    return {
        "edges": bin_edges(n_bins),
        "counts": counts.astype(np.int64),
        "confidence": mean_conf,
        "accuracy": acc,
    }


def ece_mce(probs: Any, labels: Any, n_bins: int = 15) -> tuple[float, float]:
    b = reliability_bins(probs, labels, n_bins)
    nonempty = b["counts"] > 0
    gaps = np.abs(b["accuracy"][nonempty] - b["confidence"][nonempty])
    w = b["counts"][nonempty] / b["counts"].sum()
    return float(np.sum(w * gaps)), float(gaps.max())


def sce(probs: Any, labels: Any, n_bins: int = 15) -> float:
    _check_bins(n_bins)
    p, y = validate(probs, labels)
    n, k = p.shape
    total = 0.0
    for c in range(k):
        counts, mean_p, freq = _binned_gaps(p[:, c], y == c, n_bins)
        ne = counts > 0
        total += float(np.sum(counts[ne] / n * np.abs(freq[ne] - mean_p[ne])))
    return total / k


def ace(probs: Any, labels: Any, n_bins: int = 15) -> float:
    _check_bins(n_bins)
    p, y = validate(probs, labels)
    n, k = p.shape
    r = min(n_bins, n)
    total = 0.0
    for c in range(k):
        order = np.argsort(p[:, c], kind="stable")
        for part in np.array_split(order, r):
            total += abs(float(np.mean(y[part] == c)) - float(np.mean(p[part, c])))
    return total / (k * r)


def brier(probs: Any, labels: Any) -> float:
    p, y = validate(probs, labels)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def nll(probs: Any, labels: Any) -> float:
    p, y = validate(probs, labels)
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(y)), y], NLL_FLOOR))))


def _binary_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # scipy.stats takes about a second to import: only AUC needs it, so a site process
    # that never reports an AUC never loads it (tests/flower/test_site_startup.py)
    from scipy.stats import rankdata

    ranks = rankdata(scores)  # average ranks: ties count one half
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auc(probs: Any, labels: Any) -> float:
    p, y = validate(probs, labels)
    if p.shape[1] == 2:
        return _binary_auc(p[:, 1], y == 1)
    per_class = [_binary_auc(p[:, c], y == c) for c in range(p.shape[1])]
    defined = [a for a in per_class if not np.isnan(a)]
    return float(np.mean(defined)) if defined else float("nan")


def calibration_report(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, float]:
    """accuracy, nll, brier, ece, mce, sce, ace, auc of predicted probabilities (python floats)."""
    _check_bins(n_bins)
    p, y = validate(probs, labels)
    e, m = ece_mce(p, y, n_bins)
    return {
        "accuracy": float(np.mean(p.argmax(axis=1) == y)),
        "nll": nll(p, y),
        "brier": brier(p, y),
        "ece": e,
        "mce": m,
        "sce": sce(p, y, n_bins),
        "ace": ace(p, y, n_bins),
        "auc": auc(p, y),
    }
