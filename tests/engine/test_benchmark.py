"""fedsgld benchmark end to end on small data, and the frozen-backbone (timm) path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_reference import pld_epsilon

from fedsgld.cli.commands import main
from fedsgld.studies.benchmark import calibrate_noise_multiplier, load_benchmark, run_benchmark

BENCH_TOML = """
dataset = "synthetic"
model = "mlp"
sites = 2
rounds = 15
sample_rate = 0.2
lr = 0.2
temperature = 2.0
decay_gamma = 0.5
decay_t0 = 5.0
prenoise = 0.01
epsilon = 20.0
eval_every = 0
burn_in = 5
thin = 2
max_samples = 3
checkpoint_every = 0

[benchmark]
methods = ["sgd", "dpsgd", "dpsgld"]
seeds = [0, 1]
"""


def test_calibrated_dpsgd_sigma_spends_at_most_the_budget():
    sigma = calibrate_noise_multiplier(sample_rate=0.05, steps=200, epsilon=2.0, delta=1e-5)
    # dp_accounting directly, not the accountant the calibration uses
    assert pld_epsilon([(0.05, sigma)] * 200, delta=1e-5, grid=0.0) <= 2.0
    assert pld_epsilon([(0.05, sigma * 0.99)] * 200, delta=1e-5, grid=0.0) > 2.0 * 0.98  # tight


@pytest.mark.slow  # 7-16 s
def test_benchmark_table_and_finding(tmp_path):
    cfg_path = tmp_path / "b.toml"
    cfg_path.write_text(BENCH_TOML)
    config, bench = load_benchmark(cfg_path)
    res = run_benchmark(config, bench, out_dir=tmp_path / "out", progress=False, log=lambda s: None)
    out = tmp_path / "out"
    data = json.loads((out / "benchmark.json").read_text())
    assert set(data["table"]) == {
        *("sgd", "sgd+avg", "sgd+swag"),
        *("dpsgd", "dpsgd+avg", "dpsgd+swag"),
        *("dpsgld", "dpsgld+bma", "dpsgld+swag"),
    }
    for method, t in data["table"].items():
        assert t["pooled"]["ece"]["n"] == 2, method
        assert set(t["sites"]) == {"0", "1"}
    for m in ("dpsgd", "dpsgld"):
        for run in data["runs"][m]:
            assert run["epsilon"]["pld"] <= 20.0
    assert "dpsgld" in data["finding"] and "statement" in data["finding"]["dpsgld"]
    md = (out / "benchmark.md").read_text()
    assert "Does the paper's finding hold?" in md and "| dpsgld+bma |" in md
    assert (out / "reliability_methods.png").stat().st_size > 5000
    assert res["dpsgd_noise_multiplier"] > 0


def test_benchmark_rejects_bad_method(tmp_path, capsys):
    cfg_path = tmp_path / "b.toml"
    cfg_path.write_text(BENCH_TOML.replace('"sgd", "dpsgd"', '"sgd", "adam"'))
    assert main(["benchmark", str(cfg_path), "--out", str(tmp_path / "o")]) == 2
    assert "benchmark.methods" in capsys.readouterr().err


def _write_pneumonia_npz(path, rng, n=(60, 12, 20), size=28):
    arrays = {}
    for split, k in zip(("train", "val", "test"), n):
        arrays[f"{split}_images"] = rng.integers(0, 256, (k, size, size), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, (k, 1), dtype=np.uint8)
    np.savez_compressed(path, **arrays)


def test_pneumonia_frozen_backbone_runs_with_random_weights(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    monkeypatch.setenv("FEDSGLD_CACHE", str(tmp_path / "cache"))
    npz = tmp_path / "pneumoniamnist.npz"
    _write_pneumonia_npz(npz, np.random.default_rng(0))
    args = [
        "simulate",
        "simulations/pneumonia_table2.toml",
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        f'data_path="{npz}"',
        "--set",
        "backbone=efficientnet_b0",
        "--set",
        "image_size=32",
        "--set",
        "rounds=4",
        "--set",
        "eval_every=2",
        "--set",
        "burn_in=1",
        "--set",
        "thin=1",
        "--set",
        "sample_rate=0.3",
    ]
    with pytest.warns(UserWarning, match="RANDOMLY INITIALISED"):
        assert main(args) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["privacy"]["steps"] == 4 and res["config"]["model"] == "timm_head"
    assert set(res["metrics"]["sites"]) == {"0", "1", "2"}
    assert 0.0 <= res["metrics"]["pooled"]["auc"] <= 1.0
    cached = list((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 6  # train and test features of 3 sites, computed once each


def test_calibrated_sigma_survives_the_runs_sigma_bucketing():
    sigma = calibrate_noise_multiplier(
        sample_rate=0.05, steps=150, epsilon=2.0, delta=1e-5, sigma_grid=0.01
    )
    assert pld_epsilon([(0.05, sigma)] * 150, delta=1e-5, grid=0.01) <= 2.0


def test_per_method_overrides_apply_to_that_method_only(tmp_path):
    cfg_path = tmp_path / "b.toml"
    cfg_path.write_text(
        BENCH_TOML.replace("seeds = [0, 1]", "seeds = [0]").replace(
            'methods = ["sgd", "dpsgd", "dpsgld"]', 'methods = ["sgd", "dpsgld"]'
        )
        + "\n[benchmark.overrides.sgd]\nlr = 0.05\n"
    )
    config, bench = load_benchmark(cfg_path)
    run_benchmark(config, bench, out_dir=tmp_path / "out", progress=False, log=lambda s: None)
    data = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    cfg = {
        m: json.loads((tmp_path / "out" / "runs" / f"{m}-seed0" / "results.json").read_text())[
            "config"
        ]
        for m in ("sgd", "dpsgld")
    }
    assert cfg["sgd"]["lr"] == 0.05 and cfg["dpsgld"]["lr"] == 0.2
    assert data["benchmark"]["overrides"] == {"sgd": {"lr": 0.05}}
    assert "Settings of `sgd` only: `lr = 0.05`" in (tmp_path / "out" / "benchmark.md").read_text()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("[benchmark.overrides.sgd]\nlr = -1.0\n", r"benchmark.overrides.sgd: lr must be"),
        ("[benchmark.overrides.dpvi]\nlr = 0.1\n", r"benchmark.overrides.dpvi: must name one of"),
        ("[benchmark.overrides.sgd]\nseed = 3\n", "cannot be overridden"),
    ],
)
def test_bad_overrides_are_named(tmp_path, extra, match):
    cfg_path = tmp_path / "b.toml"
    cfg_path.write_text(BENCH_TOML + "\n" + extra)
    with pytest.raises(ValueError, match=match):
        load_benchmark(cfg_path)


def test_the_finding_needs_similar_accuracy_too():
    from fedsgld.studies.benchmark import paper_finding

    def row(acc, ece):
        return {"pooled": {"accuracy": {"mean": acc}, "ece": {"mean": ece}}}

    better = paper_finding({"dpsgd": row(0.90, 0.04), "dpsgld": row(0.895, 0.01)})
    assert better["dpsgld"]["holds"]
    worse = paper_finding({"dpsgd": row(0.56, 0.41), "dpsgld": row(0.28, 0.15)})
    assert not worse["dpsgld"]["holds"] and "less accurate" in worse["dpsgld"]["statement"]
    assert not paper_finding({"dpsgd": row(0.9, 0.01), "dpsgld": row(0.9, 0.02)})["dpsgld"]["holds"]


HEART_TOML = """
dataset = "heart_disease"
partition = "centres"
sites = 4
model = "logreg"
standardize = "site"
epsilon = 1.0
delta = 1e-4
rounds = 8
sample_rate = 0.2
lr = 0.5
eval_every = 0
burn_in = 100
swag_samples = 0
checkpoint_every = 0

[benchmark]
methods = ["dpsgd", "sgd"]
seeds = [0]
n_boot = 200
"""


def test_heart_disease_calibration_table_with_intervals_and_flamby_rows(tmp_path):  # about 6 s
    """A seeded short benchmark on the real four centres: the interval table per centre,
    the paired verdicts and FLamby's published rows beside ours."""
    cfg_path = tmp_path / "h.toml"
    cfg_path.write_text(HEART_TOML)
    config, bench = load_benchmark(cfg_path)
    res = run_benchmark(config, bench, out_dir=tmp_path / "out", progress=False, log=lambda s: None)
    table = res["intervals"]
    assert table["rows"]["dpsgd"]["records"] == {
        "Cleveland": 104,
        "Hungary": 89,
        "Switzerland": 16,
        "Long Beach": 45,
    }
    for row in table["rows"].values():
        for scope in row["scopes"].values():
            for m in scope.values():
                assert m["lo"] <= m["mean"] + 1e-12 and m["mean"] <= m["hi"] + 1e-12
    pairs = {(c["a"], c["b"]) for c in table["comparisons"]}
    assert pairs == {("sgd", "dpsgd")}
    md = (tmp_path / "out" / "calibration.md").read_text()
    assert "### Switzerland (16 test records)" in md
    assert "| *FLamby (published)*: FedAvg + DP-SGD, epsilon 1, delta 1e-4 | - | 0.685 |" in md
    assert "| fedsgld: dpsgd |" in md
    assert (tmp_path / "out" / "predictions.npz").stat().st_size > 0
    assert (tmp_path / "out" / "reliability_sites_dpsgd.png").stat().st_size > 5000
