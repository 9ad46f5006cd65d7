"""The audit through a Flower simulation (Ray, ``run_simulation``) gives the engine's audit.

Same config, same seeds (``randomness = "seeded"``, the canaries' parameters and their
inclusion): the canaries are inserted inside the ClientApp at their site, the auditor
reads the server's releases, and the readings agree with the in-process engine's up to
float32 transport. Compared: every score's separation (to 1e-3), the counts of correct
guesses and both lower bounds (to 1e-6), and the accountant's epsilon.
"""

from __future__ import annotations

import pytest

from fedsgld.config import load_config
from fedsgld.studies.audit import run_audit
from fedsgld.studies.audit_flower import run_audit_flower

pytestmark = [pytest.mark.simulation, pytest.mark.slow]

#: 12 steps of DP-SGD (q 0.5, sigma 1) on two small sites, 1,000 canaries: the canaries
#: show (bound well above 0), so agreeing bounds mean agreeing readings. The sampled
#: canaries stay well inside the server's check ||S_k|| <= N_k C (their sum has norm
#: sqrt(taken) C, about 16, against N_k C with N_k over 100)
SMALL_AUDIT = {
    "dataset": "synthetic",
    "model": "mlp",
    "hidden": 16,
    "sites": 2,
    "max_records": 400,
    "method": "dpsgd",
    "epsilon": 100.0,
    "sample_rate": 0.5,
    "noise_multiplier": 1.0,
    "lr": 0.1,
    "rounds": 12,
    "eval_every": 0,
    "checkpoint_every": 0,
    "burn_in": 0,
    "max_samples": 0,
    "swag_samples": 0,
    "randomness": "seeded",
    "threads": 1,
    "seed": 3,
}


@pytest.mark.parametrize("placement", ["server", "sites"])
def test_flower_simulation_audit_equals_the_engines(placement, tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    cfg = load_config(None, {**SMALL_AUDIT, "noise_placement": placement})
    kw = {"canaries": 1000, "inclusion_seed": 7, "audit_seed": 11}
    ref = run_audit(cfg, progress=False, log=lambda s: None, **kw)
    got = run_audit_flower(cfg, out_dir=tmp_path / "flower", log=lambda s: None, **kw)
    assert got["transport"] == "flower" and ref["transport"] == "in-process"
    assert got["rounds_seen"] == ref["rounds_seen"] == 12
    assert got["epsilon_accountant"] == ref["epsilon_accountant"]
    assert ref["epsilon_lower_bound"] > 0.5, ref  # the canaries show
    for name, sep in ref["separation"].items():
        assert got["separation"][name] == pytest.approx(sep, abs=1e-3), name
    for method, b in ref["bounds"].items():
        g = got["bounds"][method]
        assert (g["guesses"], g["correct"], g["score"]) == (b["guesses"], b["correct"], b["score"])
        assert g["epsilon"] == pytest.approx(b["epsilon"], abs=1e-6)


def test_flower_simulation_audit_with_secure_aggregation(tmp_path, monkeypatch):
    """Secure aggregation over Flower: the canaries ride in the canaries' site's masked
    input (the mod inserts them on the secure round's messages), the auditor reads the
    parameters after each decoded sum. The shares come from the operating system, so the
    readings differ from the engine's: the canaries must show as strongly as on the engine
    (likelihood-ratio separation within 0.3 of it) and the bound stay below the accountant's."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    over = {"secure_aggregation": True, "noise_placement": "sites", "local_steps": 1}
    cfg = load_config(None, {**SMALL_AUDIT, **over})
    kw = {"canaries": 1000, "inclusion_seed": 7, "audit_seed": 11}
    ref = run_audit(cfg, progress=False, log=lambda s: None, **kw)
    got = run_audit_flower(cfg, out_dir=tmp_path / "flower", log=lambda s: None, **kw)
    assert got["transport"] == "flower" and got["rounds_seen"] == ref["rounds_seen"] == 12
    assert got["curve"] == ref["curve"] == "accountant"  # the dominating ledger's PLD
    assert got["epsilon_accountant"] == pytest.approx(ref["epsilon_accountant"])
    lr = "likelihood_ratio"
    assert ref["separation"][lr] > 0.5, ref
    assert got["separation"][lr] == pytest.approx(ref["separation"][lr], abs=0.3), got
    assert got["epsilon_lower_bound"] < got["epsilon_accountant"], got
