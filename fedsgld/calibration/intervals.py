"""Metrics with bootstrap intervals, and paired comparisons that say when they are resolved.

A test set of a few hundred records cannot resolve every difference; a table that reports
only means says more than its data can show. Here every metric comes with a 95 %
percentile-bootstrap interval, and a comparison of two methods is a paired difference:

* **Per method.** The runs of one method (one per seed) give predictions on the same
  test records (or, where the test split depends on the seed, on each seed's own). One
  bootstrap replicate draws the seeds with replacement and the test records with
  replacement (within each stratum, e.g. each site, the same draw for every seed where
  the records are shared) and computes the mean over the drawn seeds of the metric on
  the drawn records. The 2.5 % and 97.5 % quantiles of ``n_boot`` replicates are the
  interval; the point estimate is the mean over seeds on all records.
* **Paired difference.** The same replicate (same seeds, same records) for both methods;
  the statistic is the mean over drawn seeds of metric(A) - metric(B). The difference is
  **resolved** only where its interval excludes zero: "better" or "worse" by the metric's
  direction (accuracy up, the rest down), else "not resolved".

Metrics (top-label, as :mod:`fedsgld.calibration.metrics`): accuracy, NLL (floored at
1e-12), Brier, binned ECE (15 equal-width bins) and the debiased L2 calibration error of
Kumar, Liang & Ma (2019), ``dce`` (:func:`debiased_l2_ce`): equal-mass bins b,

    CE^2 = sum_b (n_b / N) [ (a_b - c_b)^2 - a_b (1 - a_b) / (n_b - 1) ],  dce = sqrt(max(CE^2, 0))

(a_b accuracy, c_b mean confidence in the bin). The subtracted term is the plug-in's bias
from the labels' sampling noise, so a perfectly calibrated model's CE^2 is centred at
zero, where the binned ECE has a floor (about 0.03 on 1,000 records). Binned ECE's
interval describes the estimator's spread around that floor, not the true calibration
error; read calibration from ``dce``, NLL and Brier. In a bootstrap replicate the
records' own hits are the truth (and duplicated records make bins purer), so the
replicates of ``dce`` and ``ece`` sit above their estimates; their intervals (and their
differences') are shifted back by the replicates' mean minus the estimate, and floored
at 0 (binned ECE's plain percentile interval could lie wholly above its estimate) (without the shift, it held zero in
only 78 % of simulated test sets of a calibrated model; with it, about 94 %).
Accuracy's, NLL's and Brier's plain percentile intervals hold the true value in about
95 % (tests/calibration/test_intervals.py checks [0.91, 0.98] over 200 test sets).

Privacy caveat: these are statistics of test predictions, computed where the predictions
are (the in-process engine, or sites that share them); they are not released privately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsgld.calibration.metrics import NLL_FLOOR, bin_index, validate

METRICS = ("accuracy", "nll", "brier", "ece", "dce")
HIGHER_IS_BETTER = {"accuracy": True, "nll": False, "brier": False, "ece": False, "dce": False}
ECE_BINS = 15
DCE_BINS = 15
DCE_MIN_PER_BIN = 10
LEVEL = 0.95
#: binned estimators whose bootstrap replicates are biased upwards: intervals shifted back
BINNED = ("ece", "dce")

#: one run's test predictions: (probs (N, K), labels (N,))
Predictions = tuple[np.ndarray, np.ndarray]


def dce_bins(n: int, n_bins: int = DCE_BINS) -> int:
    """Equal-mass bins for ``n`` records: at most ``n_bins``, at least ``DCE_MIN_PER_BIN``
    records each (one bin below 20 records), so that every bin's variance term is defined."""
    return int(max(1, min(n_bins, n // DCE_MIN_PER_BIN)))


def _dce_sq_sorted(conf: np.ndarray, hit: np.ndarray, n_bins: int) -> np.ndarray:
    """Debiased CE^2 along the last axis of confidences sorted ascending (and their hits)."""
    n = conf.shape[-1]
    starts = np.round(np.linspace(0, n, n_bins + 1)).astype(np.int64)[:-1]
    counts = np.diff(np.append(starts, n)).astype(np.float64)
    c = np.add.reduceat(conf, starts, axis=-1) / counts
    a = np.add.reduceat(hit, starts, axis=-1) / counts
    var = np.where(counts > 1, a * (1 - a) / np.maximum(counts - 1, 1), 0.0)
    return np.sum(counts / n * ((a - c) ** 2 - var), axis=-1)


def debiased_l2_ce_squared(probs: Any, labels: Any, n_bins: int = DCE_BINS) -> float:
    """Kumar et al.'s debiased squared top-label calibration error (may be below zero)."""
    p, y = validate(probs, labels)
    conf, hit = p.max(axis=1), (p.argmax(axis=1) == y).astype(np.float64)
    order = np.argsort(conf, kind="stable")
    return float(_dce_sq_sorted(conf[order], hit[order], dce_bins(len(y), n_bins)))


def debiased_l2_ce(probs: Any, labels: Any, n_bins: int = DCE_BINS) -> float:
    """sqrt(max(CE^2, 0)) of :func:`debiased_l2_ce_squared` (Kumar, Liang & Ma 2019)."""
    return float(np.sqrt(max(debiased_l2_ce_squared(probs, labels, n_bins), 0.0)))


def _record_terms(p: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Per-record confidence, hit, NLL and Brier terms."""
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return {
        "conf": p.max(axis=1),
        "hit": (p.argmax(axis=1) == y).astype(np.float64),
        "nll": -np.log(np.maximum(p[np.arange(len(y)), y], NLL_FLOOR)),
        "brier": np.sum((p - onehot) ** 2, axis=1),
    }


def _metrics_rows(t: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    """Every metric on each row of record indices ``idx`` (R, N): arrays of shape (R,)."""
    conf, hit = t["conf"][idx], t["hit"][idx]
    n_rows, n = idx.shape
    b = bin_index(conf, ECE_BINS) + ECE_BINS * np.arange(n_rows)[:, None]
    size = n_rows * ECE_BINS
    sc = np.bincount(b.ravel(), weights=conf.ravel(), minlength=size).reshape(n_rows, -1)
    sh = np.bincount(b.ravel(), weights=hit.ravel(), minlength=size).reshape(n_rows, -1)
    order = np.argsort(conf, axis=1, kind="stable")
    dsq = _dce_sq_sorted(
        np.take_along_axis(conf, order, 1), np.take_along_axis(hit, order, 1), dce_bins(n)
    )
    return {
        "accuracy": hit.mean(axis=1),
        "nll": t["nll"][idx].mean(axis=1),
        "brier": t["brier"][idx].mean(axis=1),
        "ece": np.abs(sh - sc).sum(axis=1) / n,
        "dce": np.sqrt(np.maximum(dsq, 0.0)),
    }


def _check_runs(runs: Sequence[Predictions], what: str) -> list[tuple[np.ndarray, np.ndarray]]:
    if not runs:
        raise ValueError(f"{what}: needs at least one run's predictions")
    return [validate(p, y) for p, y in runs]


def _shared(runs: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    """Whether every run scored the same records (same labels, same order)."""
    y0 = runs[0][1]
    return all(y.shape == y0.shape and np.array_equal(y, y0) for _, y in runs)


def _draws(n: int, strata: np.ndarray | None, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n) record indices drawn with replacement, within each stratum."""
    if strata is None:
        return rng.integers(0, n, size=(n_boot, n))
    out = np.empty((n_boot, n), dtype=np.int64)
    for s in np.unique(strata):
        members = np.flatnonzero(strata == s)
        out[:, members] = members[rng.integers(0, members.size, size=(n_boot, members.size))]
    return out


def _replicates(
    runs: list[list[tuple[np.ndarray, np.ndarray]]],
    strata: np.ndarray | None,
    n_boot: int,
    seed: int,
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Bootstrap replicates of each method's seed-averaged metrics (same draws for every
    method): [{metric: (n_boot,)}] per method, and the point estimates."""
    rng = np.random.default_rng(seed)
    n_seeds = len(runs[0])
    shared = all(_shared(m) for m in runs) and _shared([m[0] for m in runs])
    seed_draw = rng.integers(0, n_seeds, size=(n_boot, n_seeds))
    terms = [[_record_terms(p, y) for p, y in m] for m in runs]
    if shared:
        n = len(runs[0][0][1])
        if strata is not None and strata.shape != (n,):
            raise ValueError(f"strata must have one entry per test record ({n})")
        idx = [_draws(n, strata, n_boot, rng)] * n_seeds
    else:  # each seed's own test records, drawn independently (no strata)
        idx = [_draws(len(y), None, n_boot, rng) for _, y in runs[0]]
    reps = []
    for m in terms:
        per_seed = [_metrics_rows(m[s], idx[s]) for s in range(n_seeds)]
        reps.append(
            {
                k: np.mean(
                    np.stack([v[k] for v in per_seed], 1)[np.arange(n_boot)[:, None], seed_draw], 1
                )
                for k in METRICS
            }
        )
    points = []
    for m in terms:
        full = [_metrics_rows(t, np.arange(len(t["hit"]))[None, :]) for t in m]
        points.append({k: np.array([f[k][0] for f in full]) for k in METRICS})
    return reps, points  # type: ignore[return-value]


def _interval(
    values: np.ndarray, point: float, *, bias_corrected: bool, level: float = LEVEL
) -> tuple[float, float]:
    """Percentile interval of the replicates; ``bias_corrected``: shifted by the
    replicates' mean minus the point estimate (for ``dce``, see the module docs)."""
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    shift = float(np.mean(values)) - point if bias_corrected else 0.0
    return float(lo) - shift, float(hi) - shift


def metric_intervals(
    runs: Sequence[Predictions],
    *,
    strata: Any = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each metric: mean over the runs (seeds), its 95 % bootstrap interval over test
    records and seeds, and the per-seed values. ``strata``: a label per test record
    (e.g. the site) within which records are resampled."""
    checked = _check_runs(runs, "metric_intervals")
    st = None if strata is None else np.asarray(strata)
    reps, points = _replicates([checked], st, n_boot, seed)
    out = {}
    for k in METRICS:
        mean = float(points[0][k].mean())
        lo, hi = _interval(reps[0][k], mean, bias_corrected=k in BINNED)
        if k in BINNED:
            lo = max(lo, 0.0)
        out[k] = {
            "mean": mean,
            "lo": lo,
            "hi": hi,
            "seeds": [float(v) for v in points[0][k]],
        }
    return out


def verdict(lo: float, hi: float, higher_is_better: bool) -> str:
    """'better' / 'worse' for A against B when the interval of A - B excludes zero."""
    if lo > 0:
        return "better" if higher_is_better else "worse"
    if hi < 0:
        return "worse" if higher_is_better else "better"
    return "not resolved"


def paired_difference(
    runs_a: Sequence[Predictions],
    runs_b: Sequence[Predictions],
    *,
    strata: Any = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """A - B for each metric: the mean over seeds, its 95 % paired-bootstrap interval (the
    same seeds and records for both), and the verdict for A ("better", "worse", "not
    resolved"). Run i of A and run i of B must share a seed and test records."""
    a = _check_runs(runs_a, "paired_difference")
    b = _check_runs(runs_b, "paired_difference")
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} runs of A against {len(b)} of B")
    for i, ((_, ya), (_, yb)) in enumerate(zip(a, b, strict=True)):
        if not np.array_equal(ya, yb):
            raise ValueError(f"paired_difference: run {i} of A and of B scored different records")
    st = None if strata is None else np.asarray(strata)
    reps, points = _replicates([a, b], st, n_boot, seed)
    out = {}
    for k in METRICS:
        diff = float((points[0][k] - points[1][k]).mean())
        lo, hi = _interval(reps[0][k] - reps[1][k], diff, bias_corrected=k in BINNED)
        out[k] = {
            "diff": diff,
            "lo": lo,
            "hi": hi,
            "verdict": verdict(lo, hi, HIGHER_IS_BETTER[k]),
        }
    return out


def _reps_points(
    runs: Sequence[Sequence[Predictions]], strata: Any, n_boot: int, seed: int
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    checked = [_check_runs(r, "site_mean") for r in runs]
    st = None if strata is None else np.asarray(strata)
    return _replicates(checked, st, n_boot, seed)


def site_mean_intervals(
    per_site: Sequence[Sequence[Predictions]], *, n_boot: int = 2000, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """The unweighted mean over sites of each metric (FLamby's per-centre average), with
    its interval: each site's records resampled within the site, the same seeds drawn for
    every site (the same ``seed`` gives every site the same seed draws)."""
    if not per_site:
        raise ValueError("site_mean_intervals: needs at least one site")
    got = [_reps_points([runs], None, n_boot, seed) for runs in per_site]
    out = {}
    for k in METRICS:
        rep = np.mean([r[0][k] for r, _ in got], axis=0)
        mean = float(np.mean([p[0][k].mean() for _, p in got]))
        lo, hi = _interval(rep, mean, bias_corrected=k in BINNED)
        out[k] = {"mean": mean, "lo": max(lo, 0.0) if k in BINNED else lo, "hi": hi}
    return out


def site_mean_difference(
    per_site_a: Sequence[Sequence[Predictions]],
    per_site_b: Sequence[Sequence[Predictions]],
    *,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """A - B of the mean over sites (as :func:`site_mean_intervals`), paired as
    :func:`paired_difference`, with its verdict."""
    if len(per_site_a) != len(per_site_b) or not per_site_a:
        raise ValueError("site_mean_difference: A and B need the same, non-empty sites")
    got = [_reps_points([a, b], None, n_boot, seed) for a, b in zip(per_site_a, per_site_b)]
    out = {}
    for k in METRICS:
        rep = np.mean([r[0][k] - r[1][k] for r, _ in got], axis=0)
        diff = float(np.mean([(p[0][k] - p[1][k]).mean() for _, p in got]))
        lo, hi = _interval(rep, diff, bias_corrected=k in BINNED)
        out[k] = {"diff": diff, "lo": lo, "hi": hi, "verdict": verdict(lo, hi, HIGHER_IS_BETTER[k])}
    return out


__all__ = [
    "HIGHER_IS_BETTER",
    "METRICS",
    "debiased_l2_ce",
    "debiased_l2_ce_squared",
    "dce_bins",
    "metric_intervals",
    "paired_difference",
    "site_mean_difference",
    "site_mean_intervals",
    "verdict",
]
