"""The benchmark's interval tables, verdicts and FLamby rows (fedsgld.studies.benchmark_intervals)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsgld.studies import benchmark_intervals as bi


def _site(n: int, rng: np.random.Generator, sharpen: float = 1.0):
    p1 = rng.uniform(0.05, 0.95, size=n)
    y = (rng.uniform(size=n) < p1).astype(np.int64)
    z = np.log(p1 / (1 - p1)) * sharpen
    q = 1 / (1 + np.exp(-z))
    return np.stack([1 - q, q], 1), y


def _rows(seeds: int = 2):
    """Two rows on the same records: 'good' calibrated, 'good+sharp' over-confident."""
    rng = np.random.default_rng(0)
    good, sharp = [], []
    for _ in range(seeds):
        per = {k: _site(n, rng) for k, n in enumerate((104, 89, 16, 45))}
        good.append(per)
        sharp.append({k: (_sharpen(p), y) for k, (p, y) in per.items()})
    return {"good": good, "good+sharp": sharp}


def _sharpen(p):
    z = np.log(p[:, 1] / p[:, 0]) * 5
    q = 1 / (1 + np.exp(-z))
    return np.stack([1 - q, q], 1)


def test_tables_scopes_and_verdicts(tmp_path):
    preds = _rows()
    table = bi.write_interval_report(
        tmp_path,
        preds,
        dataset="heart_disease",
        methods=["good"],
        compare=None,
        n_boot=300,
        header=["# t"],
    )
    row = table["rows"]["good"]
    assert list(row["scopes"]) == ["pooled", "mean of sites", *bi.HEART_CENTRES]
    assert row["records"] == dict(zip(bi.HEART_CENTRES, (104, 89, 16, 45), strict=True))
    (comp,) = table["comparisons"]  # the derived row against its base, by default
    assert (comp["a"], comp["b"]) == ("good+sharp", "good")
    assert comp["scopes"]["pooled"]["nll"]["verdict"] == "worse"
    assert comp["scopes"]["pooled"]["accuracy"]["verdict"] == "not resolved"
    md = (tmp_path / "calibration.md").read_text()
    assert "### Switzerland (16 test records)" in md
    assert "*FLamby (published)*: pooled training (non-private) | 0.795 | 0.735" in md
    assert "**worse**" in md and "not resolved" in md
    assert json.loads((tmp_path / "calibration.json").read_text())["dataset"] == "heart_disease"
    assert (tmp_path / "reliability_sites_good_sharp.png").stat().st_size > 5000


def test_other_datasets_name_sites_and_leave_out_flamby(tmp_path):
    preds = {"a": _rows(1)["good"]}
    table = bi.interval_tables(
        preds, names=bi.site_names("breast_cancer", [0, 1, 2, 3]), comparisons=[], n_boot=100
    )
    md = "\n".join(bi.intervals_markdown(table, dataset="breast_cancer"))
    assert "### site 2 (16 test records)" in md and "FLamby" not in md


@pytest.mark.parametrize(
    "bench, match",
    [
        ({"methods": ["sgd"], "n_boot": 10}, "n_boot"),
        ({"methods": ["sgd"], "compare": [["sgd"]]}, "compare"),
        ({"methods": ["sgd"], "compare": [["dpsgd", "sgd"]]}, "compare"),
    ],
)
def test_bad_settings_are_named(bench, match):
    with pytest.raises(ValueError, match=match):
        bi.check_interval_settings(bench)


def test_compare_names_rows_of_the_methods():
    bench = {"methods": ["sgd", "dpsgld"], "compare": [["dpsgld+bma", "sgd"]]}
    bi.check_interval_settings(bench)
    assert bench["compare"] == [("dpsgld+bma", "sgd")] and bench["n_boot"] == 2000
    with pytest.raises(ValueError, match="no row"):
        bi.interval_tables(
            {"sgd": _rows(1)["good"]},
            names=bi.site_names("x", [0, 1, 2, 3]),
            comparisons=[("dpsgld+bma", "sgd")],
            n_boot=100,
        )


def test_predictions_round_trip(tmp_path):
    preds = _rows(2)
    bi.save_predictions(tmp_path / "p.npz", preds)
    back = bi.load_predictions(tmp_path / "p.npz")
    assert list(back) == list(preds)
    for row in preds:
        for a, b in zip(preds[row], back[row], strict=True):
            assert list(a) == list(b)
            for s in a:
                assert np.array_equal(a[s][0], b[s][0]) and np.array_equal(a[s][1], b[s][1])
