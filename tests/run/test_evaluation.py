"""The typed evaluation and run result: pooled reports as each constructor promises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedsgld.calibration import calibration_report
from fedsgld.calibration.pooling import pooling_stats, report_from_stats
from fedsgld.run.evaluation import Evaluation, RunResult


def _site(seed: int, n: int, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, classes, generator=g), -1).float()
    return probs, torch.randint(0, classes, (n,), generator=g)


def _reports(site_probs):
    return {str(k): calibration_report(p.numpy(), y.numpy()) for k, (p, y) in site_probs.items()}


def test_pooled_from_predictions_is_the_report_of_the_concatenation_in_site_order():
    site_probs = {0: _site(0, 40), 2: _site(1, 25), 5: _site(2, 31)}
    ev = Evaluation.from_predictions(_reports(site_probs), site_probs, missing_sites=[1])
    p = np.concatenate([site_probs[k][0].numpy() for k in (0, 2, 5)])
    y = np.concatenate([site_probs[k][1].numpy() for k in (0, 2, 5)])
    assert ev.pooled == calibration_report(p, y)
    assert ev.shared and ev.pooled_from == "predictions" and ev.missing_sites == [1]
    assert np.array_equal(ev.curve()[0], p) and np.array_equal(ev.curve()[1], y)
    assert sorted(ev.site_curves()) == [0, 2, 5]
    assert ev.report == {"pooled": ev.pooled, "sites": ev.sites}


def test_pooled_from_statistics_keeps_no_predictions():
    site_probs = {0: _site(3, 50), 1: _site(4, 20)}
    stats = [pooling_stats(p.numpy(), y.numpy()) for p, y in site_probs.values()]
    ev = Evaluation.from_statistics(_reports(site_probs), stats)
    np.testing.assert_equal(ev.pooled, report_from_stats(stats))  # NaN where not pooled
    assert not ev.shared and ev.pooled_from == "site statistics"
    assert ev.reliability is not None and int(ev.reliability["counts"].sum()) == 70
    with pytest.raises(ValueError, match="holds no predictions"):
        ev.curve()


def test_run_result_reads_as_results_json():
    doc = {"privacy": {"steps": 3}, "metrics": {"pooled": {"accuracy": 0.5}}}
    site_probs = {0: _site(5, 10)}
    last = Evaluation.from_predictions(_reports(site_probs), site_probs)
    res = RunResult(doc, Path("run"), {"last": last})
    assert res["privacy"]["steps"] == 3 and dict(res) == doc and len(res) == 2
    assert res.last is last and res.out_dir == Path("run")
    assert not any(k.startswith("_") for k in res)
