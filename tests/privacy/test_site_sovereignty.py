"""The site's policy decides how it is trained: placement, lifetime budget, files.

Attacks as a server that runs its own ServerApp would make them: real Flower messages to
the real ClientApp and its guard (:class:`~fedsgld.flower.local_grid.LocalGrid`), each
crafted message one the server alone chooses (placement, sample rate, run key, file
path). The same attacks over a real loopback deployment:
tests/flower/test_site_sovereignty_deploy.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_site_guard import (
    CONFIG,
    LOCAL,
    SMALL,
    Node,
    answered,
    evaluation,
    ledger_file,
    plan,
    policy_file,
    refused,
    site0,
    site_file,
)

from fedsgld.apps.client_app import app as CLIENT_APP
from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.policy_init import init_policy
from fedsgld.config import Config
from fedsgld.flower.local_grid import LocalGrid
from fedsgld.flower.protocol import run_record
from fedsgld.flower.runner import PlacementRefused, serve
from fedsgld.privacy import PrivacyAccountant
from fedsgld.secagg import identity

# what the deployed site of the attack trusts: a budget, bounds; placements left to default
HOSPITAL = dict(epsilon=4.0, max_sample_rate=0.1, min_noise_multiplier=0.6, max_clip=10.0)


def hospital_policy(tmp_path, name="hospital", **keys) -> str:
    """A policy file with only the keys given (no placements unless named), and the exact
    record counts published unless ``public_records`` is given (None: none published)."""
    keys = {"public_records": "exact", "public_test_records": "exact", **keys}
    keys = {k: v for k, v in keys.items() if v is not None}
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "policy.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return str(d / "policy.toml")


# -- 1: the placement is the site's choice ---------------------------------------------------


def test_the_server_cannot_choose_a_placement_the_sites_policy_does_not_list(tmp_path):
    """The attack: ``noise_placement = "server"``, a sample rate of one record in 160 and
    no pre-noise; a reply that holds one record's clipped gradient gives the record away.
    A policy that does not list "server" refuses every such round, charged nothing."""
    pol = hospital_policy(tmp_path, **HOSPITAL)
    node = Node({"site-id": 0, "privacy-policy": pol})
    for k in range(3):
        attack = plan(CONFIG, **{"sample-rate": 1 / 160, "prenoise": 0.0, "run-key": f"r{k}"})
        refused(node.send("train", plan=attack), "refuses placement 'server'", "secure, sites")
    assert not (tmp_path / "hospital" / "fedsgld-site-0.json").exists()  # nothing charged
    # the placements it lists are answered, and charged
    own = Config.from_flat({**LOCAL.flat(), "sample_rate": 0.1, "temperature": 2.0})
    answered(node.send("train", plan=plan(own)))
    assert ledger_file(tmp_path / "hospital")["ledger"]["steps"] == 2  # two local steps


def test_a_site_that_trusts_the_server_is_charged_the_noise_the_server_promises(tmp_path):
    """``placements = ["server"]``: every answered round is in the site's lifetime ledger
    as the event the server promised (q, sigma), across run keys, until the budget ends."""
    pol = hospital_policy(tmp_path, placements=["server"], epsilon=2.0, max_sample_rate=0.5)
    node = Node({"site-id": 0, "privacy-policy": pol})
    refused(node.send("train", plan=plan(LOCAL)), "refuses placement 'sites'")
    n = 0
    promise = {"sigma": 2.0}
    while not (
        reply := node.send("train", plan=plan(**promise, **{"run-key": f"r{n}"}))
    ).has_error():
        n += 1
        assert n < 200
    refused(reply, "budget epsilon=2")
    led = ledger_file(tmp_path / "hospital")["ledger"]
    assert led["ledger"] == [[0.2, 2.0, n]]  # the promised (q, sigma), once per answered round
    assert n >= 1
    eps = PrivacyAccountant.from_state_dict(led).rigorous_epsilon()
    assert eps <= 2.0
    acc = PrivacyAccountant(delta=1e-5, epsilon_budget=None, accountant="pld")
    from fedsgld.privacy.events import subsampled_steps

    acc.spend(subsampled_steps([(0.2, 2.0)] * (n + 1)))  # one more would have passed it
    assert acc.rigorous_epsilon() > 2.0


def test_a_request_expecting_fewer_records_than_the_floor_is_refused(tmp_path):
    pol = policy_file(tmp_path)  # min_expected_batch: the default 16
    node = Node({"site-id": 0, "privacy-policy": pol})
    n = site0(node).num_train
    q = 15.0 / n
    refused(node.send("train", plan=plan(**{"sample-rate": q})), "policy min_expected_batch is 16")
    answered(node.send("train", plan=plan(**{"sample-rate": 16.5 / n})))
    low = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, "low", min_expected_batch=1)})
    answered(low.send("train", plan=plan(**{"sample-rate": q})))


# -- 2: every deployed site has a lifetime budget --------------------------------------------


def test_a_deployed_site_without_a_budget_answers_nothing_computed_on_its_records(tmp_path):
    """The attack: 20 evaluations under one run key, then more under invented run keys;
    noised answers averaged without limit. Without a budget every one is refused; the
    query (public sizes) says why, so an honest server stops before round 1."""
    z = np.zeros(54595, np.float32)
    no_file = Node({"site-id": 0, "state-dir": str(tmp_path / "state")})
    no_epsilon = Node({"site-id": 0, "privacy-policy": hospital_policy(tmp_path, max_clip=5.0)})
    for node, where in ((no_file, "no privacy-policy file"), (no_epsilon, "has no epsilon")):
        for k in range(25):
            refused(
                node.send("evaluate", **evaluation([z], run_key=f"E{k}")),
                "without a lifetime privacy budget",
                where,
                "fedsgld site init",
            )
        refused(node.send("train", plan=plan(LOCAL)), "without a lifetime privacy budget")
        refused(node.send("train", plan=plan(LOCAL, **{"run-key": "x"})), "budget")
        info = answered(node.send("query", run=run_record(CONFIG)))
        (entry,) = json.loads(info.content["sites"]["json"])
        assert entry["placements"] == [] and "fedsgld site init" in entry["refuses"]
        assert entry.get("label_histogram") is None
        # a site without a policy publishes no record count; this policy publishes its own
        assert entry["n_train"] is None if node is no_file else entry["n_train"] > 0
    assert not list((tmp_path / "state").glob("*.json"))  # nothing was ever charged


# -- 4: the site's files are the site's ------------------------------------------------------


def _secret_npz(tmp_path) -> Path:
    p = tmp_path / "secret" / "other-site.npz"
    p.parent.mkdir()
    np.savez(p, patient_ids=np.arange(5), diagnoses=np.arange(5))
    return p


def test_a_deployed_site_reads_only_the_file_its_own_node_config_names(tmp_path):
    secret = _secret_npz(tmp_path)
    pol = policy_file(tmp_path)
    # the server names a file: refused by key, never read
    for path in ("/etc/passwd", str(secret), str(tmp_path / "nothing-here")):
        cfg = Config.from_flat({**SMALL, "data_path": path})
        node = Node({"site-id": 0, "privacy-policy": pol})
        for kind, records in (
            ("train", {"plan": plan(cfg)}),
            ("query", {"run": run_record(cfg)}),
        ):
            reason = refused(node.send(kind, **records), "names a file (data_path)")
            assert path not in reason and "passwd" not in reason
    # a node config without site-data: no dataset of the server's choosing is opened
    bare = Node({"site-id": 0, "privacy-policy": pol}, records=False)
    reason = refused(bare.send("query", run=run_record(CONFIG)), "has no records file")
    assert "site-data" in reason


@pytest.mark.parametrize("target", ["/etc/passwd", "secret", "missing"])
def test_no_error_the_server_receives_names_a_path_or_an_array(tmp_path, target):
    """The site's own bad file (or a path the operator mistyped) is an error in the site's
    log; what the server receives names the node-config key only."""
    secret = _secret_npz(tmp_path)
    path = {"/etc/passwd": "/etc/passwd", "secret": str(secret), "missing": "/no/such.npz"}[target]
    node = Node({"site-id": 0, "site-data": path, "privacy-policy": policy_file(tmp_path)})
    for kind, records in (("query", {"run": run_record(CONFIG)}), ("train", {"plan": plan()})):
        reason = refused(node.send(kind, **records), "cannot read the records file", "site-data")
        for leak in (path, "passwd", "pickled", "patient_ids", "diagnoses", "x_train", "lacks"):
            assert leak not in reason, (leak, reason[-400:])


# -- the server plans within what the sites accept ----------------------------------------------


def _grid(tmp_path, policies: list[str | None]) -> LocalGrid:
    ncs = []
    for k, pol in enumerate(policies):
        nc = {"site-id": k, "site-data": site_file(k), "state-dir": str(tmp_path / f"s{k}")}
        if pol is not None:
            nc["privacy-policy"] = pol
        ncs.append(nc)
    return LocalGrid(CLIENT_APP, ncs)


def test_the_server_stops_before_round_1_naming_the_site_and_what_it_accepts(tmp_path):
    trusting = policy_file(tmp_path, "trusting", placements=["server", "sites"])
    own = policy_file(tmp_path, "own", placements=["secure", "sites"])
    run = {**SMALL, "randomness": "os", "rounds": 2, "out": str(tmp_path / "out")}
    grid = _grid(tmp_path, [trusting, own, trusting])
    with pytest.raises(PlacementRefused) as err:
        serve(grid, run, log=lambda s: None)
    msg = str(err.value)
    assert "site 1 refuses placement 'server' (it accepts secure, sites)" in msg
    assert "every site accepts sites (set noise_placement = 'sites'" in msg
    assert "\n" not in msg
    no_budget = _grid(tmp_path, [trusting, None, trusting])
    with pytest.raises(PlacementRefused, match="site 1 answers nothing computed on its records"):
        serve(no_budget, {**run, "out": str(tmp_path / "out2")}, log=lambda s: None)
    # a plan every site accepts runs, and every site's ledger holds its rounds
    res = serve(grid, {**run, **_sites_placement(), "out": str(tmp_path / "ok")}, log=print)
    assert res["privacy"]["steps"] == 2  # two rounds, each of two local steps at every site
    for k, name in ((0, "trusting"), (1, "own")):
        led = ledger_file_of(tmp_path / name, k)["ledger"]["ledger"]
        assert sum(c for q, _, c in led if q == SMALL["sample_rate"]) == 2 * 2  # local steps


def _sites_placement() -> dict:
    return {"noise_placement": "sites", "local_steps": 2, "epsilon": 50.0}


def ledger_file_of(d: Path, site: int) -> dict:
    return json.loads((d / f"fedsgld-site-{site}.json").read_text())


# -- fedsgld site init -----------------------------------------------------------------------


def test_site_init_writes_a_commented_policy_with_safe_defaults(tmp_path):
    pol, public = init_policy(tmp_path / "p" / "policy.toml", epsilon=4, site_id=3)
    assert pol.epsilon == 4.0 and pol.placements == ("secure", "sites")
    # the site's long-term key, readable by its owner only; its public key starts the list
    key = tmp_path / "p" / "site.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert identity.public_hex(identity.load(key)) == public
    assert pol.peers.key(3) == bytes.fromhex(public) and pol.peers.sites == (3,)
    assert (tmp_path / "p" / "site.pub").read_text() == f'3 = "{public}"\n'
    assert pol.signing_key == str(key.resolve()) and pol.min_peers == 2
    assert pol.min_expected_batch == 16 and pol.evaluation == "dp"
    assert not pol.insecure_seeded_noise and not pol.share_predictions
    assert pol.state_dir == str((tmp_path / "p").resolve())
    text = (tmp_path / "p" / "policy.toml").read_text()
    assert "TRUSTS the server" in text and text.count("#") > 15
    # no record count is published unless the operator writes one (then no training)
    assert pol.public_records is None and "# public_records = 1000" in text
    assert "publishes no record count" in pol.sizes_refusal(3)
    counted, _ = init_policy(
        tmp_path / "r" / "policy.toml", epsilon=4, public_records=1200, public_test_records="exact"
    )
    assert (counted.public_records, counted.public_test_records) == (1200, "exact")
    assert counted.sizes_refusal(0) is None
    with pytest.raises(ValueError, match="exists.*--force"):
        init_policy(tmp_path / "p" / "policy.toml", epsilon=8)
    with pytest.raises(ValueError, match="signing key .* exists"):
        init_policy(tmp_path / "p" / "other.toml", epsilon=8)
    assert identity.public_hex(identity.load(key)) == public  # the key was not replaced
    assert SitePolicy.from_file(tmp_path / "p" / "policy.toml").epsilon == 4.0
    for bad, words in ((0, "--epsilon must be"), (math.inf, "--epsilon must be")):
        with pytest.raises(ValueError, match=words):
            init_policy(tmp_path / "q.toml", epsilon=bad)
    with pytest.raises(ValueError, match="policy placements must be"):
        init_policy(tmp_path / "q.toml", epsilon=1, placements=("trusted",))
    assert not (tmp_path / "q.toml").exists()


def test_policy_placements_are_checked_by_name():
    for bad in ("server", [], ["server", "server"], ["cloud"]):
        with pytest.raises(ValueError, match="policy placements must be a non-empty list"):
            SitePolicy(epsilon=1.0, placements=bad)
    with pytest.raises(ValueError, match="policy min_expected_batch"):
        SitePolicy(epsilon=1.0, min_expected_batch=-1)


def test_site_commands_write_a_policy_rotate_its_key_and_print_its_ledger(tmp_path, capsys):
    from fedsgld.cli import main

    pol = tmp_path / "site" / "policy.toml"
    assert main(["site", "init", "--epsilon", "3", "--site-id", "5", "--out", str(pol)]) == 0
    first = (tmp_path / "site" / "site.pub").read_text()
    assert main(["site", "ledger", str(pol)]) == 0
    assert "has answered nothing yet" in capsys.readouterr().out
    # a round charged to its ledger, then printed
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, "charged")})
    answered(node.send("train", plan=plan(LOCAL)))
    assert main(["site", "ledger", str(tmp_path / "charged" / "policy.toml")]) == 0
    out = capsys.readouterr().out
    assert "site 0" in out and "2 releases" in out and "spent of its budget 50" in out
    # a new key: the policy kept, its own line replaced in its key list
    assert main(["site", "new-key", str(pol)]) == 0
    second = (tmp_path / "site" / "site.pub").read_text()
    assert second != first and second.startswith("5 = ")
    assert (tmp_path / "site" / "peers.toml").read_text() == second
    assert SitePolicy.from_file(pol).epsilon == 3.0


def test_a_selection_charged_into_the_sites_ledger_counts_against_its_lifetime_budget(tmp_path):
    """``fedsgld sweep --private-selection --site-ledgers POLICY`` writes the selection's
    charge into the site's own ledger file (:func:`~fedsgld.studies.sweep_charge.charge_sites`).
    The same site, its ClientApp then asked to train under that policy, composes every
    round with the charge: it answers fewer rounds than a site that paid nothing, keeps the
    charge in its ledger, and stops within its lifetime budget."""
    from fedsgld.privacy.approx_dp import RdpCurveRelease
    from fedsgld.privacy.rdp import DEFAULT_ORDERS
    from fedsgld.studies.sweep_charge import charge_sites, site_targets

    def rounds_answered(name: str) -> int:
        node = Node({"site-id": 0, "privacy-policy": str(tmp_path / name / "policy.toml")})
        n = 0
        while not (
            reply := node.send("train", plan=plan(sigma=2.0, **{"run-key": f"r{n}"}))
        ).has_error():
            n += 1
            assert n < 400
        refused(reply, "budget epsilon=2")
        return n

    keys = dict(placements=["server"], epsilon=2.0, max_sample_rate=0.5)
    charged = hospital_policy(tmp_path, "charged", **keys)
    hospital_policy(tmp_path, "fresh", **keys)  # the same site, nothing charged before
    curve = tuple(float(a) / (2 * 8.0**2) for a in DEFAULT_ORDERS)  # a Gaussian at sigma 8
    release = RdpCurveRelease(tuple(map(float, DEFAULT_ORDERS)), curve, "selection")
    (rec,) = charge_sites(site_targets(charged, 1, 1e-5), release, "selection:abc")
    assert rec["status"] == "charged" and 0 < rec["site_epsilon"] < 2.0
    n_charged, n_fresh = rounds_answered("charged"), rounds_answered("fresh")
    assert 1 <= n_charged < n_fresh, (n_charged, n_fresh)
    led = ledger_file(tmp_path / "charged")
    assert led["answered"]["selection:abc"] == [0, 0]  # the charge is still there
    assert len(led["ledger"]["approx"]) == 1 and led["ledger"]["ledger"] == [[0.2, 2.0, n_charged]]
    eps = PrivacyAccountant.from_state_dict(led["ledger"]).rigorous_epsilon()
    assert rec["site_epsilon"] < eps <= 2.0
