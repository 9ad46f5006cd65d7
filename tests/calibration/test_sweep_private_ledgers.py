"""fedsgld sweep --private-selection --site-ledgers: the selection charged into every site's
own ledger file before any trial, once (a rerun charges nothing), all sites or none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.approx_dp import RdpCurveRelease
from fedsgld.privacy.events import Repeated, SubsampledGaussianStep
from fedsgld.privacy.rdp import DEFAULT_ORDERS, rdp_epsilon
from fedsgld.studies.sweep import run_sweep
from fedsgld.studies.sweep_accounting import SelectionSettings
from fedsgld.studies.sweep_charge import charge_sites, site_targets

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "simulations" / "sweep_breast_cancer.toml"
SMALL = ["rounds=12", "burn_in=4", "thin=2", "epsilon=0.5"]
SETTINGS = SelectionSettings(total_epsilon=2.0, delta=1e-5, mean=2, shape=1.0)


def _sites(d: Path, budget: float, spent_by_site0: int = 0) -> None:
    """Four simulated sites' ledger files with a lifetime budget; site 0 has spent some."""
    pol = SitePolicy.simulation(epsilon=budget, delta=1e-5, state_dir=str(d))
    for k in range(4):
        with SiteLedger.open(k, pol, d / f"fedsgld-site-{k}.json") as led:
            steps = Repeated(SubsampledGaussianStep(0.01, 1.0), spent_by_site0 if k == 0 else 1)
            led.admit(event=steps, round_of=("earlier-run", 0, 1))


def _kw(out: Path, ledgers: Path | None) -> dict:
    return dict(sets=SMALL, methods=["dpsgd"], grid_items=["lr=0.05,0.1"], use_ray=False,
                progress=False, out=out, log=lambda s: None, private=SETTINGS, selection_seed=3,
                site_ledgers=ledgers)  # fmt: skip


def test_every_site_is_charged_before_the_trials_and_only_once(tmp_path):
    sites = tmp_path / "sites"
    sites.mkdir()
    _sites(sites, budget=6.0, spent_by_site0=200)
    before = {k: PrivacyAccountant.from_state_dict(json.loads(
        (sites / f"fedsgld-site-{k}.json").read_text())["ledger"]).rigorous_epsilon()
        for k in range(4)}  # fmt: skip
    out = tmp_path / "out"
    run_sweep(CONFIG, **_kw(out, sites))
    sel = json.loads((out / "selection.json").read_text())
    plan = json.loads((out / "selection_plan.json").read_text())
    assert plan["site_ledgers"] == str(sites.resolve())
    files = {k: sites / f"fedsgld-site-{k}.json" for k in range(4)}
    for c in sel["site_charges"]:
        k = c["site"]
        assert c["status"] == "charged" and c["ledger"] == str(files[k])
        state = json.loads(files[k].read_text())
        assert state["answered"][f"selection:{plan['selection_id']}"] == [0, 0]
        (entry,) = state["ledger"]["approx"]
        assert entry[0] == "rdp_curve" and entry[2].startswith("RepeatAndSelect") and entry[3] == 1
        # the site's own epsilon grew by at least the selection's own curve at its delta
        assert c["site_epsilon"] > before[k]
        assert (
            c["site_epsilon"]
            >= rdp_epsilon(np.array([np.inf if v is None else v for v in entry[1][1]]), 1e-5)[0]
            * 0.999
        )
    # charged first: every ledger file was written before the first trial's results
    first_result = min(p.stat().st_mtime_ns for p in (out / "trials").glob("*/results.json"))
    assert all(f.stat().st_mtime_ns <= first_result for f in files.values())
    # a rerun (same --out, --site-ledgers left out) charges nothing more
    saved = {k: f.read_bytes() for k, f in files.items()}
    again = run_sweep(CONFIG, **_kw(out, None))
    assert {k: f.read_bytes() for k, f in files.items()} == saved
    assert {c["status"] for c in again["site_charges"]} == {
        "charged by an earlier run of this selection"
    }
    with pytest.raises(ValueError, match="charged once"):
        run_sweep(CONFIG, **_kw(out, tmp_path))


def test_a_site_that_cannot_pay_stops_the_selection_before_any_charge(tmp_path):
    sites = tmp_path / "sites"
    sites.mkdir()
    _sites(sites, budget=2.5, spent_by_site0=900)  # site 0 is near its lifetime budget
    saved = {f.name: f.read_bytes() for f in sites.glob("*.json")}
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"nothing was charged.*site 0 .* budget 2\.5") as err:
        run_sweep(CONFIG, **_kw(out, sites))
    assert "site 1" not in str(err.value)  # the others could pay; none was charged
    assert {f.name: f.read_bytes() for f in sites.glob("*.json")} == saved
    assert not list((out / "trials").glob("*"))


def test_a_policy_file_names_the_ledgers_and_their_budget(tmp_path):
    (tmp_path / "policy.toml").write_text('epsilon = 3.0\ndelta = 1e-6\nstate_dir = "ledgers"\n')
    targets = site_targets(tmp_path / "policy.toml", 2, 1e-5)
    assert [t[2] for t in targets] == [tmp_path / "ledgers" / f"fedsgld-site-{k}.json"
                                       for k in range(2)]  # fmt: skip
    curve = tuple(DEFAULT_ORDERS / (2 * 4.0**2))
    release = RdpCurveRelease(tuple(DEFAULT_ORDERS), curve, "test")
    rec = charge_sites(targets, release, "selection:abc")
    assert [r["status"] for r in rec] == ["charged", "charged"]
    assert all(r["site_delta"] == 1e-6 and r["site_budget"] == 3.0 for r in rec)
    # at the site's delta 1e-6 the curve costs more than at the run's 1e-5
    assert rec[0]["site_epsilon"] > rdp_epsilon(np.asarray(curve), 1e-5)[0]
    again = charge_sites(targets, release, "selection:abc")
    assert [r["status"] for r in again] == ["already charged"] * 2
    assert [r["site_epsilon"] for r in again] == [r["site_epsilon"] for r in rec]
