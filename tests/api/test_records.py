"""Bad records are refused before any budget is spent, each error naming the site and the
record's index: a non-finite feature or label, a site too small to evaluate, a label the
model has no class for. Nothing is written: no run directory, no ledger entry."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fedsgld
from fedsgld.data.user import MIN_SITE_RECORDS, read_user_sites


def _blobs(n: int, seed: int, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.randn(n, 4, generator=g) + y[:, None], y


def _model(classes: int = 3):
    return lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, classes))


RUN = dict(rounds=3, sample_rate=0.2, epsilon=30.0, eval_every=0, progress=False)


def _refused(tmp_path, sites, match: str, **kw) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        fedsgld.simulate(kw.pop("model", _model()), sites, out_dir=out, **RUN, **kw)
    assert not out.exists()  # refused before the directory, so before any ledger entry


def test_a_nan_feature_is_named_by_site_and_record(tmp_path):
    sites = [_blobs(30, k) for k in range(3)]
    sites[1][0][17, 2] = math.nan
    _refused(
        tmp_path,
        sites,
        r"sites\[1\]: record 17 has a non-finite feature \(nan at position \(2,\)\)",
    )
    x, y = _blobs(30, 7)
    x[4, 0] = math.inf
    _refused(tmp_path, sites[:1] + [_blobs(30, 1)], r"test_sites\[0\]: record 4", test_sites=[
        (x, y), _blobs(30, 8)])  # fmt: skip


def test_a_non_finite_or_fractional_label_is_named(tmp_path):
    x, y = _blobs(30, 0)
    labels = y.double()
    labels[9] = math.nan
    _refused(tmp_path, [(x, labels), _blobs(30, 1)], r"sites\[0\]: label 9 is nan")
    labels = y.double()
    labels[3] = 1.5
    _refused(tmp_path, [_blobs(30, 1), (x, labels)], r"sites\[1\]: label 3 is 1.5")
    _refused(tmp_path, [_blobs(30, 1), (x, y - 2)], r"sites\[1\]: label \d+ is -\d")


def test_a_site_too_small_to_evaluate_is_an_error_or_a_warning_when_asked(tmp_path):
    sites = [_blobs(30, 0), _blobs(5, 1), _blobs(30, 2)]
    _refused(
        tmp_path,
        sites,
        rf"sites\[1\]: 5 records \(1 for its test split\); a site needs at least {MIN_SITE_RECORDS}",
    )
    with pytest.warns(UserWarning, match=r"sites\[1\]: 5 records"):
        read_user_sites(sites, small="warn")
    with pytest.raises(ValueError, match="small_sites must be"):
        read_user_sites(sites, small="never")


def test_a_label_beyond_the_model_s_classes_names_the_label(tmp_path):
    sites = [_blobs(30, k, classes=3) for k in range(3)]
    sites[2][1][11] = 7  # a stray label
    _refused(tmp_path, sites, r"sites\[2\]: label 11 is 7, but the model returns 3 classes")
    # with num_classes given, the same label is named by num_classes
    _refused(tmp_path, sites, r"num_classes=3, but sites\[2\]: label 11 is 7", num_classes=3)


def test_good_records_pass_and_a_warned_small_site_runs(tmp_path):
    sites = [_blobs(30, 0), _blobs(8, 1)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = fedsgld.simulate(_model(), sites, small_sites="warn", **RUN)
    assert any("sites[1]: 8 records" in str(w.message) for w in seen)
    assert res.steps == 3
    np.testing.assert_array_equal(
        [r["n_train"] + r["n_test"] for r in res.results["python_api"]["site_records"]], [30, 8]
    )
