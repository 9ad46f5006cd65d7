"""Calibration metrics against torchmetrics, sklearn and hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torchmetrics.functional.classification import multiclass_calibration_error

from fedsgld.calibration import calibration_report, ece_mce, reliability_bins
from fedsgld.calibration.metrics import ace, auc, brier, nll, sce


def _random_probs(n, k, seed, temp=1.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2 / temp
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True), rng.integers(0, k, n)


def _off_edges(p, n_bins=15, margin=1e-6):
    conf = p.max(1)
    dist = np.abs(conf * n_bins - np.round(conf * n_bins))
    return dist > margin * n_bins


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [2, 5, 10])
def test_ece_and_mce_match_torchmetrics_off_the_edges(seed, k):
    p, y = _random_probs(2000, k, seed)
    keep = _off_edges(p)
    p, y = p[keep], y[keep]
    e, m = ece_mce(p, y, 15)
    pt, yt = torch.tensor(p), torch.tensor(y)
    e_ref = multiclass_calibration_error(pt, yt, num_classes=k, n_bins=15, norm="l1").item()
    m_ref = multiclass_calibration_error(pt, yt, num_classes=k, n_bins=15, norm="max").item()
    assert e == pytest.approx(e_ref, abs=1e-6)
    assert m == pytest.approx(m_ref, abs=1e-6)


def test_bin_edges_by_hand():
    # 2 classes, 10 bins. Confidences exactly on edges: 0.6 goes to [0.6, 0.7), 1.0 to the last bin.
    p = np.array([[0.4, 0.6], [0.6, 0.4], [0.0, 1.0], [0.3, 0.7]])
    y = np.array([1, 1, 1, 1])
    b = reliability_bins(p, y, n_bins=10)
    assert b["counts"].tolist() == [0, 0, 0, 0, 0, 0, 2, 1, 0, 1]
    # bin [0.6,0.7): conf 0.6, 0.6; correct 1, 0 -> acc 0.5, gap 0.1
    # bin [0.7,0.8): conf 0.7, correct -> gap 0.3; bin [0.9,1.0]: conf 1.0, correct -> gap 0
    e, m = ece_mce(p, y, n_bins=10)
    assert e == pytest.approx((2 * 0.1 + 1 * 0.3 + 0) / 4)
    assert m == pytest.approx(0.3)


def test_hand_computed_metrics():
    p = np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    y = np.array([0, 1, 1])
    assert brier(p, y) == pytest.approx(((0.2**2 * 2) + (0.3**2 * 2) + (0.6**2 * 2)) / 3)
    assert nll(p, y) == pytest.approx(-(np.log(0.8) + np.log(0.7) + np.log(0.4)) / 3)
    # positives (y=1) have scores 0.7, 0.4; the negative 0.2: both ranked above -> AUC 1
    assert auc(p, y) == pytest.approx(1.0)
    r = calibration_report(p, y, n_bins=10)
    assert r["accuracy"] == pytest.approx(2 / 3)
    assert set(r) == {"accuracy", "nll", "brier", "ece", "mce", "sce", "ace", "auc"}
    assert all(isinstance(v, float) for v in r.values())


def test_sce_and_ace_by_hand():
    # 2 classes, 2 bins. class 0 scores 0.8, 0.3, 0.6; class 1 scores 0.2, 0.7, 0.4.
    p = np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    y = np.array([0, 1, 1])
    # SCE, class 0: bin[0,.5): {0.3 (y0=0)} gap .3 ; bin[.5,1]: {0.8 (1), 0.6 (0)} mean .7 freq .5 gap .2
    #   -> 1/3*.3 + 2/3*.2 = 0.2333; class 1: [0,.5): {.2 (0), .4 (1)} mean .3 freq .5 gap .2;
    #   [.5,1]: {.7 (1)} gap .3 -> 2/3*.2 + 1/3*.3 = .2333; SCE = .2333
    assert sce(p, y, n_bins=2) == pytest.approx(0.7 / 3)
    # ACE with 2 ranges (array_split of 3 sorted -> sizes 2, 1).
    # class 0 sorted: .3(0), .6(0) | .8(1): gaps |0-.45|=.45, |1-.8|=.2
    # class 1 sorted: .2(0), .4(1) | .7(1): gaps |.5-.3|=.2, |1-.7|=.3 -> (.45+.2+.2+.3)/4
    assert ace(p, y, n_bins=2) == pytest.approx(1.15 / 4)


def test_auc_matches_sklearn_multiclass_and_ties():
    p, y = _random_probs(500, 4, 7)
    assert auc(p, y) == pytest.approx(
        roc_auc_score(y, p, multi_class="ovr", average="macro"), abs=1e-10
    )
    pb, yb = _random_probs(300, 2, 8)
    pb = np.round(pb, 1)  # many ties
    pb = pb / pb.sum(1, keepdims=True)
    assert auc(pb, yb) == pytest.approx(roc_auc_score(yb, pb[:, 1]), abs=1e-10)


def test_calibrated_beats_overconfident():
    rng = np.random.default_rng(0)
    n, k = 20000, 3
    p, _ = _random_probs(n, k, 3)
    # labels drawn from p: p is calibrated by construction
    y = np.array([rng.choice(k, p=row) for row in p])
    cal = calibration_report(p, y)
    sharp = p**3
    sharp /= sharp.sum(1, keepdims=True)  # over-confident version of the same predictions
    over = calibration_report(sharp, y)
    assert cal["ece"] < 0.02
    assert over["ece"] > 3 * cal["ece"]
    assert over["nll"] > cal["nll"]


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        (np.array([[0.5, np.nan]]), np.array([0]), "finite"),
        (np.array([[1.2, -0.2]]), np.array([0]), ">= 0"),
        (np.array([[0.5, 0.6]]), np.array([0]), "sum to 1"),
        (np.array([[0.5, 0.5]]), np.array([2]), "labels must be in"),
        (np.array([[0.5, 0.5]]), np.array([-1]), "labels must be in"),
        (np.array([0.5, 0.5]), np.array([0]), "shape"),
        (np.array([[0.5, 0.5]]), np.array([0, 1]), "length"),
        (np.array([[0.5, 0.5]]), np.array([0.5]), "integers"),
    ],
)
def test_bad_inputs_are_rejected(probs, labels, match):
    with pytest.raises(ValueError, match=match):
        calibration_report(probs, labels)


def test_accepts_torch_tensors_and_rejects_bad_bins():
    p, y = _random_probs(50, 3, 1)
    a = calibration_report(torch.tensor(p), torch.tensor(y))
    b = calibration_report(p, y)
    assert a == pytest.approx(b)
    with pytest.raises(ValueError, match="n_bins"):
        calibration_report(p, y, n_bins=0)
