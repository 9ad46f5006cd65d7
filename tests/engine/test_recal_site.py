"""Private per-site recalibration (recal_scope = "site") on the four heart-disease centres."""

from __future__ import annotations

import json

import pytest
import torch

from fedsgld import engine
from fedsgld.calibration.recal_site import (
    calibrated_probs,
    moment_statistics,
    moment_step,
    site_moment_sum,
)
from fedsgld.config import load_config

RUN = {
    "dataset": "heart_disease",
    "partition": "centres",
    "sites": 4,
    "model": "logreg",
    "standardize": "site",
    "method": "dpsgd",
    "sample_rate": 0.2,
    "lr": 0.2,
    "noise_multiplier": 1.5,
    "rounds": 12,
    "epsilon": 20.0,
    "delta": 1e-4,
    "eval_every": 0,
    "checkpoint_every": 0,
    "seed": 3,
    "recal_fraction": 0.25,
    "recal_scope": "site",
    "recal_steps": 4,
    "recal_noise_multiplier": 6.0,
}


def _run(tmp_path, name, **over):
    cfg = load_config(None, {**RUN, **over})
    return engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)


def test_statistics_are_bounded_and_the_noiseless_fit_matches_the_label_rate():
    """A site with 90 % positives, a model that says 50 %: the fit raises b until the mean
    predicted probability meets the label rate (the second moment's root)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(400, 2, generator=g) * 0.3
    y = (torch.rand(400, generator=g) < 0.9).long()
    u = moment_statistics(z * 50, y, 0.0, 0.0)
    assert u.shape == (400, 2) and float(u.norm(dim=1).max()) <= 1.0 + 1e-12
    s, b = 0.0, 0.0
    for _ in range(300):
        total = site_moment_sum(
            z, y, log_t=s, bias=b, sample_rate=1.0, clip=None, generator=torch.Generator()
        )
        s, b = moment_step(s, b, total, lr=0.5, expected_batch=400.0)
    p = calibrated_probs(z, s, b)
    assert b > 1.0
    assert abs(float(p[:, 1].mean()) - float(y.double().mean())) < 0.01
    # more than two classes: temperature only
    z3 = torch.randn(50, 3, generator=g)
    assert moment_statistics(z3, torch.zeros(50, dtype=torch.long), 0.0, 0.0).shape == (50, 1)


def test_iterates_stay_in_their_box():
    big = torch.tensor([1e6, -1e6], dtype=torch.float64)
    s, b = moment_step(0.0, 0.0, big, lr=1.0, expected_batch=1.0)
    assert s == pytest.approx(-2.302585, abs=1e-5) and b == 4.0


def test_run_fits_each_centre_charges_one_ledger_step_per_step(tmp_path):
    res = _run(tmp_path, "r")
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    fits = doc["metrics"]["recal"]["site_calibration"]
    assert sorted(fits) == ["0", "1", "2", "3"]
    assert len({round(f["bias"], 9) for f in fits.values()}) == 4  # each site its own
    rc = doc["privacy"]["recalibration"]
    # four sites, 4 steps: 4 recalibration entries in the one ledger (parallel composition)
    recal = [(q, s, c) for q, s, c in doc["privacy"]["ledger"] if s == 6.0]
    assert sum(c for _, _, c in recal) == 4 and rc["steps_taken"] == 4
    assert len(rc["noise_per_step"]) == 4
    assert rc["epsilon_total"]["pld"] <= 20.0
    # the per-site map is what the +recal evaluation applied, site by site
    assert set(res.evaluations["recal"].site_probs) == {0, 1, 2, 3}
    assert "Per-site recalibration (site 0 T" in (tmp_path / "r" / "report.md").read_text()


def test_a_site_fit_uses_its_own_noise_stream(tmp_path, monkeypatch):
    """Every site's noise of every step comes from that site's own stream, keyed by
    (site, step): no key is drawn twice, and the server's streams are not used."""
    from fedsgld.core import streams

    seen = []
    original = streams.recal_site_noise

    def spy(site_id, step):
        key = original(site_id, step)
        seen.append(key)
        return key

    monkeypatch.setattr(streams, "recal_site_noise", spy)
    _run(tmp_path, "r")
    assert len(seen) == 4 * 4 and len(set(seen)) == 16
    assert {k[0] for k in seen} == {streams.site_party(s) for s in range(4)}


def test_scope_is_checked():
    with pytest.raises(ValueError, match="recal_scope"):
        load_config(None, {**RUN, "recal_scope": "centre"})


def test_what_leaves_a_site_is_noised_at_the_site(tmp_path, monkeypatch):
    """The server's view of a per-site step is the site's noisy sum. Make every site's
    exact sum zero (the control: an unprotected path would hand the server exact zeros)
    and check that what the fit receives is N(0, (sigma_r C_r)^2) noise, drawn before it
    reaches the server's update."""
    import numpy as np

    import fedsgld.engine as eng
    import fedsgld.run.recalibration as rec

    monkeypatch.setattr(eng, "site_moment_sum", lambda *a, **k: torch.zeros(2, dtype=torch.float64))
    seen = []
    step = rec.moment_step

    def spy(s, b, noisy, **kw):
        seen.append(noisy.clone())
        return step(s, b, noisy, **kw)

    monkeypatch.setattr(rec, "moment_step", spy)
    _run(tmp_path, "r", recal_steps=10)
    values = torch.cat([v.reshape(-1) for v in seen]).numpy()
    assert values.size == 4 * 10 * 2 and np.all(values != 0.0)
    assert 6.0 * 0.7 < values.std() < 6.0 * 1.3  # recal_noise_multiplier 6, recal_clip 1
