"""The four centres deployed: each SuperNode's site-data file is its own centre's records,
and a deployed site standardises them by its own file alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedsgld.config import load_config
from fedsgld.data.centres import heart_disease_records, heart_disease_sites
from fedsgld.data.standardize import site_standardize
from fedsgld.deploy.export_sites import export_sites, main
from fedsgld.deploy.loopback import site_node_configs
from fedsgld.flower.runner import _refuse_engine_only_settings
from fedsgld.flower.site_runtime import _load_own

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "simulations" / "heart_disease.toml"


def test_export_writes_each_centres_raw_records_to_its_own_file(tmp_path, capsys):
    assert main([str(CONFIG), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for name in ("Cleveland", "Hungary", "Switzerland", "Long Beach"):
        assert name in printed
    for k, (xtr, ytr, xte, yte) in enumerate(heart_disease_records()):
        with np.load(tmp_path / f"site-{k}.npz") as z:
            np.testing.assert_array_equal(z["x_train"], xtr.astype(np.float32))
            np.testing.assert_array_equal(z["y_train"], ytr)
            np.testing.assert_array_equal(z["x_test"], xte.astype(np.float32))
            np.testing.assert_array_equal(z["y_test"], yte)
            assert int(z["num_classes"]) == 2


def test_the_loopback_recipe_gives_each_supernode_its_centres_file(tmp_path):
    keys = dict(load_config(CONFIG).flat())
    configs = site_node_configs(keys, tmp_path)
    assert [c["site-id"] for c in configs] == [0, 1, 2, 3]
    for c, d in zip(configs, heart_disease_sites(), strict=True):
        with np.load(c["site-data"]) as z:
            assert z["x_train"].shape[0] == d.n_train and z["x_test"].shape[0] == d.n_test


def test_a_deployed_site_standardises_by_its_own_file(tmp_path):
    """Site 2 (Switzerland) reads only its file; its records are standardised by that file's
    training records, whatever the other centres' files hold (here: replaced by noise)."""
    config = load_config(CONFIG, {"standardize": "site"})
    files = export_sites(config, tmp_path)
    for k in (0, 1, 3):
        rng = np.random.default_rng(k)
        with np.load(files[k]) as z:
            arrays = {n: z[n] for n in z.files}
        arrays["x_train"] = rng.normal(size=arrays["x_train"].shape).astype(np.float32)
        np.savez(files[k], **arrays)
    shard, num_classes = _load_own(config, {"site-id": 2, "site-data": str(files[2])}, 2)
    expected = site_standardize(heart_disease_sites(only=[2])[0])
    assert num_classes == 2
    assert torch.equal(shard.x_train, expected.x_train)
    assert torch.equal(shard.x_test, expected.x_test)
    raw, _ = _load_own(
        load_config(CONFIG, {"standardize": "none"}), {"site-data": str(files[2])}, 2
    )
    assert not torch.equal(raw.x_train, shard.x_train)  # control: standardised, not raw


def test_the_pooled_standardisation_runs_over_flower_at_every_placement():
    """Over Flower at ``server``, ``sites`` and ``secure`` (a secure round:
    tests/flower/test_secagg_standardize.py); only the engine's held-out splits are refused."""
    for over in ({}, {"noise_placement": "sites"},
                 {"noise_placement": "sites", "secure_aggregation": True}, {"standardize": "site"}):  # fmt: skip
        _refuse_engine_only_settings(load_config(CONFIG, over))
    with pytest.raises(ValueError, match="recal_fraction > 0"):
        _refuse_engine_only_settings(load_config(CONFIG, {"recal_fraction": 0.2}))


def test_flower_and_the_engine_agree_on_the_centres_with_the_pooled_release():
    """A seeded Flower run with the private pooled standardisation (server placement) draws
    the release's noise from the server's seeded stream as the engine does: the same
    statistics, the same run (tests/privacy/test_site_standardize.py: the sites' side)."""
    import fedsgld

    kw = dict(config=str(CONFIG), method="dpsgd", rounds=3, progress=False)
    engine_run = fedsgld.simulate(**kw)
    flower_run = fedsgld.simulate(**kw, transport="flower")
    e = engine_run.results["privacy"]["standardization"]
    f = flower_run.results["privacy"]["standardization"]
    assert e["placement"] == f["placement"] == "server"
    assert f["mean"] == e["mean"] and f["std"] == e["std"]
    assert flower_run.metrics["accuracy"] == engine_run.metrics["accuracy"]
    assert flower_run.metrics == pytest.approx(engine_run.metrics, rel=1e-6)
    for k, m in engine_run.site_metrics.items():
        assert flower_run.site_metrics[k]["accuracy"] == m["accuracy"]


def test_flower_and_the_engine_agree_on_the_centres_with_site_standardisation():
    """A seeded Flower run over the four centres (each node its centre, standardised at the
    site) gives the engine's numbers."""
    import fedsgld

    kw = dict(config=str(CONFIG), standardize="site", method="dpsgd", rounds=3, progress=False)
    engine_run = fedsgld.simulate(**kw)
    flower_run = fedsgld.simulate(**kw, transport="flower")
    assert flower_run.metrics == engine_run.metrics
    for k, m in engine_run.site_metrics.items():
        assert flower_run.site_metrics[k]["accuracy"] == m["accuracy"]
        assert flower_run.site_metrics[k]["nll"] == pytest.approx(m["nll"], rel=1e-6)
