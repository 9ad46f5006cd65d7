"""The pooled standardisation in a run: one charged release composed in the one budget,
close to the exact pooled statistics when the noise is small; and a seeded short run on
the real centres."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_reference import pld_epsilon

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.data.centres import heart_disease_records

RUN = {
    "dataset": "heart_disease",
    "partition": "centres",
    "sites": 4,
    "model": "logreg",
    "method": "dpsgd",
    "sample_rate": 0.2,
    "clip": 1.0,
    "lr": 0.5,
    "noise_multiplier": 2.0,
    "epsilon": 50.0,
    "delta": 1e-4,
    "eval_every": 0,
    "burn_in": 1,
    "thin": 1,
    "max_samples": 2,
    "swag_samples": 0,
    "checkpoint_every": 0,
    "threads": 1,
    "seed": 3,
    "standardize": "pooled",
}


def _run(tmp_path, name, built=None, **over):
    cfg = load_config(None, {**RUN, **over})
    out = tmp_path / name
    res = engine.run(cfg, out_dir=out, progress=False, log=lambda s: None, built=built)
    return res, json.loads((out / "results.json").read_text())


def _exact():
    x = np.concatenate([r[0] for r in heart_disease_records()])
    return x.mean(0), x.std(0, ddof=1)


def _expand(ledger):
    return [(q, s) for q, s, c in ledger for _ in range(c)]


def test_pooled_release_is_charged_first_and_composed_with_training(tmp_path):
    _, doc = _run(tmp_path, "r", rounds=4, standardize_noise_multiplier=3.0)
    pr = doc["privacy"]
    st = pr["standardization"]
    assert st["placement"] == "server" and st["noise_multiplier"] == 3.0
    assert st["sensitivity"] == pytest.approx(np.sqrt(26))
    steps = _expand(pr["ledger"])
    assert steps == [(1.0, 3.0)] + [(0.2, 2.0)] * 4  # the release, then the training steps
    assert pr["epsilon"]["pld"] == pytest.approx(pld_epsilon(steps, delta=1e-4, grid=0.0), rel=0.01)
    _, plain = _run(tmp_path, "plain", rounds=4, standardize="site")
    assert _expand(plain["privacy"]["ledger"]) == [(0.2, 2.0)] * 4
    assert "standardization" not in plain["privacy"]
    assert plain["privacy"]["epsilon"]["pld"] < pr["epsilon"]["pld"]


def test_the_release_counts_against_the_budget(tmp_path):
    """At epsilon 1 the release leaves less room: training stops sooner than without it."""
    tight = {"epsilon": 1.0, "rounds": 400, "noise_multiplier": 3.0}
    res, doc = _run(tmp_path, "with", **tight, standardize_noise_multiplier=5.0)
    _, without = _run(tmp_path, "without", **tight, standardize="site")
    assert doc["privacy"]["steps"] < without["privacy"]["steps"]
    assert doc["privacy"]["epsilon"]["pld"] <= 1.0
    with pytest.raises(ValueError, match="standardize_noise_multiplier"):
        _run(tmp_path, "refused", **tight, standardize_noise_multiplier=0.3)
    assert not (tmp_path / "refused").exists()  # refused before anything was released


def test_pooled_statistics_are_close_to_the_exact_ones_at_a_generous_epsilon(tmp_path):
    mean, std = _exact()
    _, doc = _run(
        tmp_path, "r", rounds=1, epsilon=1e4, standardize_noise_multiplier=0.05,
        standardize_clip=10.0,
    )  # fmt: skip
    st = doc["privacy"]["standardization"]
    scale = np.array(st["public_scale"])
    assert np.all(np.abs(np.array(st["mean"]) - mean) < 0.05 * scale)
    floor = std > 0.6 * scale  # elsewhere the floor (half the public scale) applies
    assert np.all(np.abs(np.array(st["std"]) - std)[floor] < 0.15 * scale[floor])
    # the non-private run uses the exact pooled statistics (nothing released)
    _, sgd = _run(tmp_path, "sgd", rounds=1, method="sgd")
    st = sgd["privacy"]["standardization"]
    assert st["placement"] == "exact" and sgd["privacy"]["ledger"] in ([], None)
    np.testing.assert_allclose(st["mean"], mean, rtol=1e-6)  # float32 records
    np.testing.assert_allclose(st["std"], std, rtol=1e-6)


@pytest.mark.parametrize("placement", ["sites", "secure"])
def test_pooled_release_at_the_sites_and_through_the_secure_sum(tmp_path, placement):
    over = {"noise_placement": "sites", "secure_aggregation": placement == "secure"}
    built: dict = {}
    _, doc = _run(tmp_path, placement, built=built, rounds=2, **over)
    st = doc["privacy"]["standardization"]
    assert st["placement"] == placement
    if placement == "secure":  # every site's own ledger holds the release and the rounds
        assert st["event"] == "DistributedDiscreteGaussianStep"
        for guard in built["federation"]._secure_sites:
            assert guard.ledger.accountant.steps == 3
    else:
        assert _expand(doc["privacy"]["ledger"])[0] == (1.0, 10.0)
    mean, _ = _exact()
    assert np.all(np.isfinite(st["mean"])) and np.all(np.array(st["std"]) > 0)
    assert doc["privacy"]["epsilon"]["pld"] <= RUN["epsilon"]
    assert abs(st["mean"][0] - mean[0]) < 30  # age: a noisy, clipped, but sane estimate


def test_a_seeded_short_run_on_the_four_centres(tmp_path):
    """DP-SGLD on the real centres with the private pooled standardisation: reproducible
    from the seed, and it learns something (FLamby's pooled logistic regression: 0.795)."""
    over = {"method": "dpsgld", "rounds": 60, "lr": 0.05, "temperature": 20.0, "epsilon": 5.0}
    res, doc = _run(tmp_path, "a", **over)
    _, again = _run(tmp_path, "b", **over)
    assert doc["metrics"]["pooled"] == again["metrics"]["pooled"]
    assert set(doc["metrics"]["sites"]) == {"0", "1", "2", "3"}
    assert [s["n_test"] for s in doc["sites"]] == [104, 89, 16, 45]
    assert doc["metrics"]["pooled"]["accuracy"] > 0.6
