"""Private recalibration in a run: the split, one ledger, the one budget, the result file."""

from __future__ import annotations

import json
import math

import pytest
from dp_reference import pld_epsilon

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.privacy import PrivacyAccountant

RUN = {
    "dataset": "synthetic",
    "model": "logreg",
    "method": "dpsgd",
    "sites": 3,
    "sample_rate": 0.2,
    "lr": 0.5,
    "noise_multiplier": 1.0,
    "eval_every": 0,
    "burn_in": 2,
    "thin": 2,
    "max_samples": 2,
    "checkpoint_every": 0,
    "seed": 4,
    "recal_fraction": 0.25,
    "recal_steps": 6,
    "recal_noise_multiplier": 10.0,
}


def _run(tmp_path, name, **over):
    cfg = load_config(None, {**RUN, **over})
    return engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)


def _expand(ledger):
    return [(q, s) for q, s, c in ledger for _ in range(c)]


def test_result_file_shows_the_split_the_epsilons_and_ece_before_and_after(tmp_path):
    res = _run(tmp_path, "r", rounds=8, epsilon=20.0)
    on_disk = json.loads((tmp_path / "r" / "results.json").read_text())
    pr = on_disk["privacy"]
    rc = pr["recalibration"]
    # the calibration split came out of the training split
    plain = _run(tmp_path, "plain", rounds=1, epsilon=20.0, recal_fraction=0.0)
    for with_cal, without in zip(on_disk["sites"], plain["sites"], strict=True):
        assert with_cal["n_calibration"] == round(0.25 * without["n_train"])
        assert with_cal["n_train"] + with_cal["n_calibration"] == without["n_train"]
        assert with_cal["n_test"] == without["n_test"]
    assert rc["calibration_sizes"] == [s["n_calibration"] for s in on_disk["sites"]]
    # one ledger: 8 training steps, then 6 recalibration steps at their own (q, sigma)
    steps = _expand(pr["ledger"])
    assert steps == [(0.2, 1.0)] * 8 + [(1.0, 10.0)] * 6
    assert pr["steps"] == 8 and rc["steps_taken"] == 6 and pr["ledger_steps"] == 14
    # training and recalibration epsilon, composed (dp_accounting, not the accountant)
    eps_train = pld_epsilon(steps[:8], delta=1e-5, grid=0.0)
    eps_recal = pld_epsilon(steps[8:], delta=1e-5, grid=0.0)
    eps_total = pld_epsilon(steps, delta=1e-5, grid=0.0)
    assert rc["epsilon_training"]["pld"] == pytest.approx(eps_train, rel=0.01)
    assert rc["epsilon_recalibration"]["pld"] == pytest.approx(eps_recal, rel=0.01)
    assert rc["epsilon_total"]["pld"] == pytest.approx(eps_total, rel=0.01)
    assert rc["epsilon_total"] == pr["epsilon"]  # the run's epsilon is the composed one
    assert max(eps_train, eps_recal) < eps_total < eps_train + eps_recal
    assert rc["epsilon_total"]["pld"] <= rc["budget"] == 20.0
    # per-site ECE before and after, the temperature, the report and the benchmark row
    m = on_disk["metrics"]["recal"]
    assert m["suffix"] == "+recal" and m["temperature"] > 0 and m["steps"] == 6
    assert set(m["before_after"]["sites"]) == {"0", "1", "2"}
    for k, ba in m["before_after"]["sites"].items():
        assert ba["ece"]["before"] == on_disk["metrics"]["sites"][k]["ece"]
        assert ba["ece"]["after"] == m["sites"][k]["ece"]
    assert m["temperature"] != 1.0 and m["pooled"]["nll"] != on_disk["metrics"]["pooled"]["nll"]
    # temperature scaling keeps every prediction's arg max
    assert m["pooled"]["accuracy"] == on_disk["metrics"]["pooled"]["accuracy"]
    report = (tmp_path / "r" / "report.md").read_text()
    assert "(`dpsgd+recal`)" in report and "ECE before -> after" in report
    assert "recalibration" in report and "composed" in report
    assert res.evaluations["recal"].probs.shape == res.evaluations["last"].probs.shape


def test_halting_reserves_the_recalibration_in_the_one_budget(tmp_path):
    budget = 3.0
    res = _run(tmp_path, "h", rounds=400, epsilon=budget)
    pr = res["privacy"]
    steps = _expand(pr["ledger"])
    t = pr["steps"]
    # training stopped where "t training steps + the 6 reserved steps" still fit ...
    acc = PrivacyAccountant(delta=1e-5, epsilon_budget=budget)
    allowed = acc.max_steps(lambda i: (1.0, 10.0) if i < 6 else (0.2, 1.0), limit=406) - 6
    assert 0 < t == allowed < 400
    assert pr["halted"] and "reserved recalibration steps" in pr["halt_reason"]
    # ... every recalibration step ran, and the composition stays within the budget
    assert pr["recalibration"]["steps_taken"] == 6 and steps[t:] == [(1.0, 10.0)] * 6
    assert pld_epsilon(steps, delta=1e-5, grid=0.0) <= budget * 1.01
    assert pr["epsilon"]["pld"] <= budget
    # one more training step would not have fitted with the recalibration
    assert pld_epsilon([(0.2, 1.0)] * (t + 1) + [(1.0, 10.0)] * 6, delta=1e-5, grid=0.0) > (
        budget * 0.99
    )
    # without recalibration the same budget trains longer
    plain = _run(tmp_path, "p", rounds=400, epsilon=budget, recal_fraction=0.0)
    assert plain["privacy"]["steps"] > t


def test_recalibration_alone_over_budget_is_refused_before_training(tmp_path):
    # training alone fits this budget (one that affords no round is refused before this)
    with pytest.raises(ValueError, match="recal_noise_multiplier"):
        _run(tmp_path, "x", rounds=5, epsilon=5.0, recal_noise_multiplier=0.5, recal_steps=50)
    assert not (tmp_path / "x").exists()  # refused before anything was released


def test_non_private_recalibration_fits_without_noise_or_ledger(tmp_path):
    # two small steps on breast cancer: an under-confident model, which recalibration
    # sharpens (synthetic data are separated so well that any model is certain and right)
    res = _run(tmp_path, "s", method="sgd", dataset="breast_cancer", rounds=2, lr=0.05)
    pr = res["privacy"]
    assert pr["ledger"] == [] and pr["recalibration"]["steps_taken"] == 6
    assert "epsilon_total" not in pr["recalibration"]
    m = res["metrics"]
    assert m["recal"]["temperature"] < 1.0
    assert m["recal"]["pooled"]["nll"] < m["pooled"]["nll"] - 0.05
    assert m["recal"]["pooled"]["ece"] < m["pooled"]["ece"]


@pytest.mark.parametrize(
    "over, match",
    [
        ({"method": "dpvi"}, "recal_fraction > 0 .* needs method sgd, dpsgd or dpsgld"),
        (
            {"noise_placement": "sites", "local_steps": 2},
            "recal_fraction > 0 .* needs noise_placement = 'server'",
        ),
        ({"recal_fraction": 1.0}, r"recal_fraction must be a number in \[0.0, 1.0\)"),
        ({"recal_sample_rate": 0.0}, r"recal_sample_rate must be a number in \[1e-09, 1.0\]"),
        ({"recal_steps": 0}, r"recal_steps must be an integer in \[1, 100000\]"),
        ({"recal_noise_multiplier": -1.0}, "recal_noise_multiplier must be a number in"),
        ({"recal_clip": 0.0}, "recal_clip must be a number in"),
        ({"recal_lr": math.inf}, "recal_lr must be a number in"),
    ],
)
def test_bad_recalibration_settings_are_named(over, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, {**RUN, **over})


def test_resume_after_recalibration_reuses_its_temperature(tmp_path):
    first = _run(tmp_path, "res", rounds=4, epsilon=20.0)
    cfg = load_config(None, {**RUN, "rounds": 4, "epsilon": 20.0})
    again = engine.run(
        cfg, out_dir=tmp_path / "res", resume=True, progress=False, log=lambda s: None
    )
    assert again["metrics"]["recal"]["temperature"] == first["metrics"]["recal"]["temperature"]
    assert again["privacy"]["ledger_steps"] == first["privacy"]["ledger_steps"] == 4 + 6


BENCH_TOML = """
dataset = "synthetic"
model = "logreg"
sites = 2
rounds = 10
sample_rate = 0.2
lr = 0.2
temperature = 8.0
epsilon = 4.0
eval_every = 0
burn_in = 3
thin = 2
max_samples = 3
checkpoint_every = 0
recal_fraction = 0.2
recal_steps = 4
recal_noise_multiplier = 8.0

[benchmark]
methods = ["dpsgd", "dpsgld"]
seeds = [0]
"""


def test_benchmark_rows_and_dpsgd_calibrated_with_the_recalibration(tmp_path):
    from fedsgld.studies.benchmark import load_benchmark, run_benchmark

    (tmp_path / "b.toml").write_text(BENCH_TOML)
    config, bench = load_benchmark(tmp_path / "b.toml")
    res = run_benchmark(config, bench, out_dir=tmp_path / "out", progress=False, log=lambda s: None)
    assert set(res["table"]) == {
        f"{m}{s}"
        for m, avg in (("dpsgd", "+avg"), ("dpsgld", "+bma"))
        for s in ("", avg, "+swag", "+recal")
    }
    # DP-SGD's sigma was chosen for 10 training steps AND the 4 recalibration steps: it
    # trains every round, and the composition spends (almost exactly) the budget
    run = res["runs"]["dpsgd"][0]
    assert run["steps"] == 10 and 3.9 < run["epsilon"]["pld"] <= 4.0
    assert res["runs"]["dpsgld"][0]["epsilon"]["pld"] <= 4.0
    md = (tmp_path / "out" / "benchmark.md").read_text()
    assert "| dpsgd+recal |" in md and "| dpsgld+swag |" in md


def test_a_crash_inside_a_recalibration_noise_draw_keeps_the_step_spent(tmp_path, monkeypatch):
    import torch

    from fedsgld.calibration.recal import RECAL_STREAM
    from fedsgld.core.noise import Randomness

    out = tmp_path / "crash"
    real = Randomness.gaussian

    def crash_at_step_2(self, shape, *, std, key, dtype=torch.float32):
        if key == (0, RECAL_STREAM, 2, 0):
            on_disk = json.loads((out / "ledger.json").read_text())
            assert sum(c for _, _, c in on_disk["ledger"]) == 5 + 3  # step 2 is on disk
            raise RuntimeError("crash while drawing the recalibration noise")
        return real(self, shape, std=std, key=key, dtype=dtype)

    monkeypatch.setattr(Randomness, "gaussian", crash_at_step_2)
    with pytest.raises(RuntimeError, match="recalibration noise"):
        _run(tmp_path, "crash", rounds=5, epsilon=20.0)
    monkeypatch.setattr(Randomness, "gaussian", real)
    cfg = load_config(None, {**RUN, "rounds": 5, "epsilon": 20.0})
    res = engine.run(cfg, out_dir=out, resume=True, progress=False, log=lambda s: None)
    pr = res["privacy"]
    # the 3 released steps stay spent; the recalibration ran again with fresh noise
    assert pr["steps"] == 5 and pr["recalibration"]["steps_taken"] == 6
    assert _expand(pr["ledger"]) == [(0.2, 1.0)] * 5 + [(1.0, 10.0)] * (3 + 6)
    assert pr["epsilon"]["pld"] <= 20.0
