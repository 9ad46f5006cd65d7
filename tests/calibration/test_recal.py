"""Private temperature scaling: per-record gradients, and that it fixes miscalibration."""

from __future__ import annotations

import math

import pytest
import torch

from fedsgld.calibration import calibration_report
from fedsgld.calibration.recal import (
    RECAL_STREAM,
    carve_calibration,
    confidence_gaps,
    site_temperature_sum,
    temperature_gradients,
    temperature_nll,
)
from fedsgld.config import load_config
from fedsgld.run.lifecycle import RunLifecycle
from fedsgld.strategies import LangevinServer


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """True logits z* (3 classes) and labels drawn from softmax(z*): a calibrated model."""
    g = torch.Generator().manual_seed(seed)
    z = 2.0 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(1)
    return z, y


def test_per_record_gradient_is_the_derivative_of_the_nll():
    z, y = _data(50, 0)
    for log_t in (-0.7, 0.0, 0.9):
        s = torch.tensor(log_t, dtype=torch.float64, requires_grad=True)
        losses = -torch.log_softmax(z / s.exp(), -1)[torch.arange(50), y]
        auto = torch.stack([torch.autograd.grad(li, s, retain_graph=True)[0] for li in losses])
        torch.testing.assert_close(temperature_gradients(z, y, log_t), auto)
    with pytest.raises(ValueError, match="logits must be"):
        temperature_gradients(z, y[:3], 0.0)


def test_site_sum_is_clipped_and_poisson_sampled():
    z, y = _data(400, 1)
    g = confidence_gaps(z, y, 0.0)
    hits = (z.argmax(1) == y).double()
    torch.testing.assert_close(g, hits - torch.softmax(z, -1).max(1).values)
    assert g.abs().max() <= 1.0 and g.min() < 0 < g.max()
    full = site_temperature_sum(
        z, y, log_t=0.0, sample_rate=1.0, clip=0.5, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(full, g.clamp(-0.5, 0.5).sum().reshape(1))
    half = site_temperature_sum(
        z, y, log_t=0.0, sample_rate=0.5, clip=0.5, generator=torch.Generator().manual_seed(0)
    )
    idx = (torch.rand(400, generator=torch.Generator().manual_seed(0)) < 0.5).nonzero()[:, 0]
    torch.testing.assert_close(half, g[idx].clamp(-0.5, 0.5).sum().reshape(1))
    none = site_temperature_sum(
        z, y, log_t=0.0, sample_rate=1.0, clip=None, generator=torch.Generator()
    )
    torch.testing.assert_close(none, g.sum().reshape(1))
    with pytest.raises(ValueError, match="logits must be"):
        confidence_gaps(z, y[:3], 0.0)


def test_the_gap_needs_no_clipping_where_the_gradient_is_biased_by_it():
    # over-confident logits (true T = 4): the clipped NLL gradient's root stays far below
    # log 4, the confidence gap's root (bounded, unclipped) lands on it
    z, y = _data(20_000, 4)
    z = 4.0 * z

    def root(stat):
        lo, hi = -2.0, 3.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if float(stat(mid).mean()) > 0 else (mid, hi)
        return 0.5 * (lo + hi)

    gap_root = root(lambda s: confidence_gaps(z, y, s))
    grad_root = root(lambda s: temperature_gradients(z, y, s).clamp(-1.0, 1.0))
    assert abs(gap_root - math.log(4.0)) < 0.1
    assert grad_root < math.log(4.0) - 0.2


def test_carved_split_is_disjoint_deterministic_and_named_when_too_large():
    keep, cal = carve_calibration(100, 0.2, seed=3, site_id=1)
    assert len(cal) == 20 and len(keep) == 80
    assert sorted(torch.cat([keep, cal]).tolist()) == list(range(100))
    again = carve_calibration(100, 0.2, seed=3, site_id=1)
    assert torch.equal(again[1], cal)
    assert not torch.equal(carve_calibration(100, 0.2, seed=3, site_id=2)[1], cal)
    assert len(carve_calibration(3, 0.01, seed=0, site_id=0)[1]) == 1  # at least one
    with pytest.raises(ValueError, match="recal_fraction"):
        carve_calibration(1, 0.5, seed=0, site_id=0)


def _fit(tmp_path, name, logits, labels, **over):
    """Recalibrate ``logits`` split over 3 sites through the run lifecycle: the ledger,
    the server's noise and the budget are the real ones."""
    cfg = load_config(
        None,
        {
            "method": "dpsgd",
            "dataset": "synthetic",
            "epsilon": 3.0,
            "recal_fraction": 0.1,
            "recal_steps": 20,
            "recal_noise_multiplier": 20.0,
            "recal_clip": 1.0,
            **over,
        },
    )
    lc = RunLifecycle(cfg, out=tmp_path / name, resume=False, transport="test", log=lambda s: None)
    server = LangevinServer(
        cfg.privacy,
        theta=torch.zeros(2),
        site_sizes=[100, 100, 100],
        rounds=1,
        randomness=lc.server_randomness(),
    )
    lc.attach(server)
    parts = list(zip(logits.chunk(3), labels.chunk(3), strict=True))
    rng = lc.site_randomness()

    def site_sums(log_t, j):
        return [
            site_temperature_sum(
                z,
                y,
                log_t=log_t,
                sample_rate=cfg.privacy.recal_sample_rate,
                clip=cfg.privacy.recal_clip,
                generator=rng.generator(1 + k, RECAL_STREAM, j, 0),
            )
            for k, (z, y) in enumerate(parts)
        ]

    state = lc.recalibrate(site_sums, calibration_sizes=[int(y.shape[0]) for _, y in parts])
    return state, server


@pytest.mark.parametrize("scale, direction", [(4.0, "over"), (0.25, "under")])
def test_recalibration_lowers_the_nll_of_a_miscalibrated_model(tmp_path, scale, direction):
    z_cal, y_cal = _data(3000, 10)
    z_test, y_test = _data(3000, 11)
    state, server = _fit(tmp_path, direction, scale * z_cal, y_cal)
    t = state["temperature"]
    assert state["steps"] == 20
    # over-confident logits need T > 1, under-confident T < 1; the ideal T is `scale`
    assert (t > 1.5) if direction == "over" else (t < 0.6)
    assert abs(math.log(t) - math.log(scale)) < 0.2  # the noise
    before = temperature_nll(scale * z_test, y_test, 0.0)
    after = temperature_nll(scale * z_test, y_test, math.log(t))
    ideal = temperature_nll(z_test, y_test, 0.0)
    assert after < before - 0.05
    assert after - ideal < 0.1 * (before - ideal)
    p_before = torch.softmax(scale * z_test, -1).numpy()
    p_after = torch.softmax(scale * z_test / t, -1).numpy()
    assert (
        calibration_report(p_after, y_test.numpy())["ece"]
        < 0.5 * calibration_report(p_before, y_test.numpy())["ece"]
    )
    # every step is in the one ledger, at the recalibration's (q, sigma)
    assert server.accountant.ledger == [(1.0, 20.0, 20)]


def test_noise_is_drawn_by_the_server_after_the_ledger_holds_the_step(tmp_path, monkeypatch):
    from fedsgld.core.noise import Randomness

    z, y = _data(300, 2)
    real = Randomness.gaussian
    seen = []

    def spy(self, shape, *, std, key, dtype=torch.float32):
        if key[1:2] == (RECAL_STREAM,):
            import json

            on_disk = json.loads((tmp_path / "spy" / "ledger.json").read_text())
            seen.append((key, std, sum(c for _, _, c in on_disk["ledger"])))
        return real(self, shape, std=std, key=key, dtype=dtype)

    monkeypatch.setattr(Randomness, "gaussian", spy)
    _fit(tmp_path, "spy", z, y, recal_steps=3, recal_clip=0.5)
    assert seen == [((0, RECAL_STREAM, j, 0), 20.0 * 0.5, j + 1) for j in range(3)]


def test_the_budget_refuses_recalibration_steps_that_overspend(tmp_path):
    z, y = _data(300, 3)
    # 20 full-batch steps at sigma 2 cost far more than epsilon 3: only the first few fit
    state, server = _fit(tmp_path, "b", z, y, recal_noise_multiplier=2.0)
    assert 0 < state["steps"] < 20
    assert state["halt_reason"].startswith("privacy budget: recalibration step")
    assert server.accountant.rigorous_epsilon() <= 3.0


@pytest.mark.parametrize("scale", [3.0, 0.4])
def test_ece_improves_at_a_realistic_budget(tmp_path, scale):
    # MNIST-5k's calibration splits: 640 records; the default 20 steps at sigma 70 inside
    # epsilon 1 (the recalibration alone spends about 0.21)
    z_cal, y_cal = _data(640, 20)
    z_test, y_test = _data(4000, 21)
    for seed in range(3):
        # (noise_multiplier: the run's planned training must fit epsilon 1 for it to start)
        state, server = _fit(tmp_path, f"r{seed}", scale * z_cal, y_cal, epsilon=1.0,
                             recal_noise_multiplier=70.0, seed=seed,
                             noise_multiplier=10.0)  # fmt: skip
        assert state["steps"] == 20 and server.accountant.rigorous_epsilon() < 0.25
        t = state["temperature"]
        before = calibration_report(torch.softmax(scale * z_test, -1).numpy(), y_test.numpy())
        after = calibration_report(torch.softmax(scale * z_test / t, -1).numpy(), y_test.numpy())
        assert after["ece"] < 0.5 * before["ece"], (seed, t, before["ece"], after["ece"])


@pytest.mark.slow  # 250 charged steps, each written and fsynced: 2 s to 2 min, with the disk
def test_the_noise_added_has_the_charged_scale(tmp_path, monkeypatch):
    # every step's noisy sum minus the sites' exact sum, over the charged std sigma * C,
    # is N(0, 1): a KS test that accepts it and rejects 2/3 and 3/2 of the scale
    import numpy as np
    from scipy import stats

    from fedsgld.run import recalibration

    z, y = _data(300, 5)
    exact, noisy = [], []
    real_step = recalibration.temperature_step

    def spy(log_t, noisy_sum, *, lr, expected_batch):
        parts = [confidence_gaps(zz, yy, log_t).clamp(-0.5, 0.5).sum() for zz, yy in
                 zip(z.chunk(3), y.chunk(3), strict=True)]  # fmt: skip
        exact.append(float(sum(parts)))
        noisy.append(float(noisy_sum.reshape(-1)[0]))
        return real_step(log_t, noisy_sum, lr=lr, expected_batch=expected_batch)

    monkeypatch.setattr(recalibration, "temperature_step", spy)
    state, server = _fit(tmp_path, "ks", z, y, recal_steps=250, recal_noise_multiplier=400.0,
                         recal_clip=0.5, epsilon=10.0, accountant="rdp")  # fmt: skip
    assert state["steps"] == 250
    assert server.accountant.ledger == [(1.0, 400.0, 250)]
    r = (np.array(noisy) - np.array(exact)) / (400.0 * 0.5)
    assert stats.kstest(r, "norm").pvalue > 1e-3
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(r / wrong, "norm").pvalue < 1e-3
