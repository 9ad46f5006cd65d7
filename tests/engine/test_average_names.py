"""Averaged models carry honest names: a posterior average only for Langevin chains."""

from __future__ import annotations

import json

import pytest

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.posteriors import SWAG, iterate_average
from fedsgld.run import results
from fedsgld.studies.benchmark import benchmark_markdown, derived_rows

TINY = {
    "dataset": "synthetic",
    "model": "logreg",
    "sites": 2,
    "rounds": 6,
    "sample_rate": 0.3,
    "lr": 0.2,
    "epsilon": 50.0,
    "noise_multiplier": 1.0,
    "eval_every": 0,
    "burn_in": 2,
    "thin": 1,
    "max_samples": 3,
    "checkpoint_every": 0,
    "seed": 1,
}


@pytest.mark.parametrize(
    "method, kind, suffix, label",
    [
        ("dpsgld", "posterior_average", "+bma", "posterior average (Bayesian model averaging)"),
        ("dpsgd", "iterate_average", "+avg", "iterate average"),
        ("sgd", "iterate_average", "+avg", "iterate average"),
        ("dpvi", "iterate_average", "+avg", "iterate average of variational posteriors"),
    ],
)
def test_result_file_report_and_plot_name_the_average(
    tmp_path, monkeypatch, method, kind, suffix, label
):
    seen: list[list[str]] = []
    real = results.plot_reliability_overlay

    def spy(curves, path, **kw):
        seen.append(list(curves))
        return real(curves, path, **kw)

    monkeypatch.setattr(results, "plot_reliability_overlay", spy)
    cfg = load_config(None, {**TINY, "method": method})
    engine.run(cfg, out_dir=tmp_path / method, progress=False, log=lambda s: None)
    on_disk = json.loads((tmp_path / method / "results.json").read_text())
    post = on_disk["metrics"]["posterior"]
    assert (post["kind"], post["suffix"], post["label"]) == (kind, suffix, label)
    assert post["samples"] == 3
    report = (tmp_path / method / "report.md").read_text()
    assert f"`{method}{suffix}`" in report
    assert label[:1].upper() + label[1:] in report
    if kind == "iterate_average":
        assert "osterior average" not in report and "Bayesian model averaging" not in report
    swag = [] if method == "dpvi" else [SWAG["label"]]  # SWAG: not for variational methods
    assert seen == [["last iterate", label, *swag]]
    # the benchmark's row for the average takes the same suffix
    names = [name for name, _, _ in derived_rows(method, on_disk["metrics"])]
    assert names == [method + suffix] + [method + "+swag" for _ in swag]


def test_only_langevin_methods_have_a_posterior_average():
    for m in ("sgd", "dpsgd", "dpvi", "vi"):
        assert iterate_average(m)["suffix"] == "+avg"
        assert "posterior average" not in iterate_average(m)["label"]
    assert iterate_average("dpsgld")["suffix"] == "+bma"


def test_benchmark_markdown_explains_the_suffixes():
    row = {"mean": 0.5, "std": 0.0, "n": 1}
    block = {k: row for k in ("accuracy", "nll", "brier", "ece", "auc")}
    table = {
        m: {"pooled": block, "sites": {"0": block}, "steps": row, "epsilon": {"pld": row}}
        for m in ("dpsgd", "dpsgd+avg")
    }
    md = benchmark_markdown(
        {
            "config": {
                "dataset": "synthetic",
                "sites": 1,
                "partition": "iid",
                "model": "mlp",
                "epsilon": 1.0,
                "delta": 1e-5,
                "rounds": 3,
            },
            "benchmark": {"seeds": [0]},
            "dpsgd_noise_multiplier": None,
            "table": table,
            "finding": {},
        }
    )
    assert "| dpsgd+avg |" in md and "`+avg`: iterate average" in md
