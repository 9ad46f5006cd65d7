"""Bootstrap intervals and paired differences (fedsgld.calibration.intervals)."""

from __future__ import annotations

import numpy as np
import pytest

from fedsgld.calibration import intervals as iv
from fedsgld.calibration.metrics import calibration_report


def _calibrated(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A perfectly calibrated binary model: y ~ Bernoulli(p), p ~ U(0.05, 0.95)."""
    p1 = rng.uniform(0.05, 0.95, size=n)
    y = (rng.uniform(size=n) < p1).astype(np.int64)
    return np.stack([1 - p1, p1], 1), y


def _overconfident(p: np.ndarray) -> np.ndarray:
    """The same ranking, logits times 4: a clearly over-confident model."""
    z = np.log(p[:, 1] / p[:, 0]) * 4.0
    q1 = 1 / (1 + np.exp(-z))
    return np.stack([1 - q1, q1], 1)


def test_coverage_on_a_calibrated_model() -> None:
    """The 95 % intervals hold the true accuracy, NLL and Brier in about 95 % of 200
    simulated test sets, and dce's (true value 0) in at least 91 %."""
    g = np.linspace(0.05, 0.95, 200_001)
    truth = {
        "accuracy": float(np.mean(np.maximum(g, 1 - g))),
        "brier": float(np.mean(2 * g * (1 - g))),
        "nll": float(np.mean(-(g * np.log(g) + (1 - g) * np.log(1 - g)))),
    }
    rng = np.random.default_rng(11)
    hits = {k: 0 for k in (*truth, "dce")}
    reps = 200
    for r in range(reps):
        res = iv.metric_intervals([_calibrated(300, rng)], n_boot=500, seed=r)
        for k, v in truth.items():
            hits[k] += res[k]["lo"] <= v <= res[k]["hi"]
        hits["dce"] += res["dce"]["lo"] <= 0.0
    for k in truth:
        assert 0.91 <= hits[k] / reps <= 0.98, (k, hits[k] / reps)
    assert hits["dce"] / reps >= 0.91, hits["dce"] / reps


def test_a_model_against_itself_is_never_resolved() -> None:
    rng = np.random.default_rng(3)
    runs = [_calibrated(200, rng) for _ in range(3)]
    d = iv.paired_difference(runs, runs, n_boot=300)
    for k in iv.METRICS:
        assert d[k]["diff"] == 0.0 and d[k]["lo"] == 0.0 and d[k]["hi"] == 0.0
        assert d[k]["verdict"] == "not resolved"


def test_a_clearly_worse_model_is_resolved_worse() -> None:
    rng = np.random.default_rng(4)
    good = [_calibrated(400, rng) for _ in range(2)]
    bad = [(_overconfident(p), y) for p, y in good]
    d = iv.paired_difference(bad, good, n_boot=500)
    for k in ("nll", "brier", "ece", "dce"):
        assert d[k]["verdict"] == "worse", (k, d[k])
        assert d[k]["lo"] > 0
    # same ranking, same predicted class: accuracy does not move
    assert d["accuracy"]["verdict"] == "not resolved"
    back = iv.paired_difference(good, bad, n_boot=500)
    assert back["nll"]["verdict"] == "better"


def test_point_estimates_match_calibration_report() -> None:
    rng = np.random.default_rng(5)
    runs = [_calibrated(150, rng) for _ in range(2)]
    res = iv.metric_intervals(runs, n_boot=100)
    for k in ("accuracy", "nll", "brier", "ece"):
        per_seed = [calibration_report(p, y)[k] for p, y in runs]
        assert res[k]["seeds"] == pytest.approx(per_seed, abs=1e-12)
        assert res[k]["mean"] == pytest.approx(np.mean(per_seed), abs=1e-12)
        assert res[k]["lo"] <= res[k]["mean"] <= res[k]["hi"]


def test_debiased_ce_by_hand() -> None:
    """Two equal-mass bins written out (Kumar et al.: plug-in minus a(1-a)/(n_b - 1))."""
    conf = np.array([0.6, 0.6, 0.6, 0.6, 0.9, 0.9, 0.9, 0.9] * 3)
    hit = np.array([1, 0, 1, 1, 1, 1, 1, 0] * 3)
    probs = np.stack([1 - conf, conf], 1)
    labels = np.where(hit == 1, 1, 0)
    a1, a2 = 9 / 12, 9 / 12  # bins of 12: (0.6 x12: 9 hits), (0.9 x12: 9 hits)
    expect = 0.5 * ((a1 - 0.6) ** 2 - a1 * (1 - a1) / 11) + 0.5 * (
        (a2 - 0.9) ** 2 - a2 * (1 - a2) / 11
    )
    assert iv.dce_bins(24) == 2
    assert iv.debiased_l2_ce_squared(probs, labels) == pytest.approx(expect, abs=1e-12)
    assert iv.debiased_l2_ce(probs, labels) == pytest.approx(np.sqrt(max(expect, 0)), abs=1e-12)


def test_debiased_ce_is_centred_on_a_calibrated_model_where_ece_has_a_floor() -> None:
    rng = np.random.default_rng(6)
    sq, ece = [], []
    for _ in range(100):
        p, y = _calibrated(500, rng)
        sq.append(iv.debiased_l2_ce_squared(p, y))
        ece.append(calibration_report(p, y)["ece"])
    # the plug-in (a - c)^2 sits near a(1 - a) / n_b, about 6e-3 here
    assert abs(np.mean(sq)) < 1e-3
    assert np.mean(ece) > 0.03


def test_strata_and_errors() -> None:
    rng = np.random.default_rng(7)
    p, y = _calibrated(60, rng)
    strata = np.repeat([0, 1, 2], 20)
    res = iv.metric_intervals([(p, y)], strata=strata, n_boot=200)
    assert res["accuracy"]["lo"] <= res["accuracy"]["hi"]
    with pytest.raises(ValueError, match="strata"):
        iv.metric_intervals([(p, y)], strata=strata[:10], n_boot=10)
    with pytest.raises(ValueError, match="different records"):
        iv.paired_difference([(p, y)], [(p, 1 - y)], n_boot=10)
    with pytest.raises(ValueError, match="runs of A"):
        iv.paired_difference([(p, y)], [(p, y), (p, y)], n_boot=10)
    with pytest.raises(ValueError, match="at least one run"):
        iv.metric_intervals([], n_boot=10)
