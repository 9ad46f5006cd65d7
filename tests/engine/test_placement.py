"""Noise placement "sites": local noisy steps at every site, the server averages."""

from __future__ import annotations

import json

import pytest
import torch
from dp_reference import dpsgld_sigma, pld_epsilon

from fedsgld import engine
from fedsgld.config import load_config

SMALL = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 3,
    "rounds": 8,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 2.0,
    "decay_gamma": 0.5,
    "decay_t0": 5.0,
    "prenoise": 0.01,
    "epsilon": 30.0,
    "eval_every": 4,
    "burn_in": 2,
    "thin": 2,
    "max_samples": 3,
    "checkpoint_every": 4,
    "seed": 5,
}


def _run(tmp_path, name, **over):
    cfg = load_config(None, {**SMALL, **over})
    return engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)


def _schedule(steps):
    """SMALL's documented DP-SGLD schedule (q, sigma_t) for local steps 0 .. steps - 1."""
    return [(0.2, dpsgld_sigma(t, lr=0.2, gamma=0.5, t0=5.0, tau=2.0)) for t in range(steps)]


def _theta(res):
    return torch.load(res.out_dir / "checkpoint.pt", weights_only=False)["server"]["theta"]


def test_one_local_sgd_step_per_round_is_the_server_step(tmp_path):
    # With no noise, the N_k-weighted average of one local step per site,
    # sum_k N_k/N (theta - alpha S_k / (q N_k)), is the server's step theta - alpha sum_k S_k / (q N).
    server = _run(tmp_path, "server", method="sgd")
    sites = _run(tmp_path, "sites", method="sgd", noise_placement="sites", local_steps=1)
    torch.testing.assert_close(_theta(sites), _theta(server), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 7-16 s
def test_local_steps_are_each_accounted(tmp_path):
    res = _run(tmp_path, "local", noise_placement="sites", local_steps=3)
    p = res["privacy"]
    assert p["steps"] == 8 and p["local_steps"] == 3 and p["noise_placement"] == "sites"
    assert p["ledger_steps"] == 24
    # the ledger is exactly the schedule's 24 local steps: epsilon from dp_accounting
    ref = pld_epsilon(_schedule(24), delta=1e-5, grid=0.0)
    assert ref * (1 - 2e-3) <= p["epsilon"]["pld"] <= ref * 1.01
    assert p["epsilon"]["pld"] <= 30.0
    ledger = json.loads((tmp_path / "local" / "ledger.json").read_text())
    assert sum(e[2] for e in ledger["ledger"]) == 24
    assert res["metrics"]["posterior"]["samples"] == 3


@pytest.mark.slow  # 7-16 s
def test_the_budget_stops_whole_rounds_of_local_steps(tmp_path):
    # a budget of a few rounds of 4 local steps (one that affords none is refused)
    res = _run(tmp_path, "tight", noise_placement="sites", local_steps=4, epsilon=10.0, rounds=50)
    p = res["privacy"]
    assert p["halted"] and "4 local steps" in p["halt_reason"]
    assert 1 <= p["steps"] < 50 and p["ledger_steps"] == 4 * p["steps"]
    assert p["epsilon"]["pld"] <= 10.0
    # dp_accounting: the rounds taken fit the budget, one more round would have overspent
    assert pld_epsilon(_schedule(4 * p["steps"]), delta=1e-5) <= 10.0
    assert pld_epsilon(_schedule(4 * (p["steps"] + 1)), delta=1e-5) > 10.0


def test_a_budget_that_affords_no_round_of_local_steps_is_refused(tmp_path):
    with pytest.raises(ValueError, match="affords 0 of the 50 rounds"):
        _run(tmp_path, "none", noise_placement="sites", local_steps=4, epsilon=2.0, rounds=50)
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"noise_placement": "client"}, "noise_placement must be one of server, sites"),
        ({"local_steps": 3}, "local_steps must be 1 with noise_placement = 'server'"),
        ({"noise_placement": "sites", "local_steps": 0}, r"local_steps must be an integer in \[1"),
        ({"noise_placement": "sites", "method": "dpvi"}, "supports methods sgd, dpsgd and dpsgld"),
    ],
)
def test_bad_placement_settings_are_named(over, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, {**SMALL, **over})
