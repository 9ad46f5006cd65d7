"""Secure aggregation in a real Flower deployment on loopback: one SuperLink, one SuperNode
per site, ``flwr run`` (docs/secure_aggregation.md).

Every SuperNode reads only its own ``.npz`` and its own privacy-policy file (its own
``epsilon``, ``max_dropouts = 1``, its long-term signing key and the consortium's key
list, so every roster is authenticated); its ledger file (``fedsgld-site-K.json``) lives next
to that file. The first run (3 sites, warm sites on the stock SuperNodes: a fresh ClientApp
interpreter per message is tested by test_flower_deploy.py and test_site_guard_deploy.py)
checks the result file's blocks, that every site's
ledger holds exactly one distributed discrete Gaussian charge per round, and that the
run's epsilon is ``ddg_epsilon`` of its rounds. The second (4 sites, warm sites on the
stock SuperNodes) gives one site a policy that assumes more dropouts than the plan: it
refuses every round, which is a dropout within the plan, so the run completes without it
and names the refusal. The
third (3 sites, ``max_dropouts = 0``, on the fast path) runs the default one-shot rounds:
every round after the first is one exchange, and every ledger holds its rounds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_flower_deploy import RUN as DEPLOY_RUN

from fedsgld.config import load_config
from fedsgld.deploy.export_sites import export_sites
from fedsgld.deploy.loopback import Loopback, approved_policy
from fedsgld.federation import Federation
from fedsgld.privacy.distributed import ddg_epsilon
from fedsgld.secagg import identity

pytestmark = [pytest.mark.deploy, pytest.mark.slow]  # 4 to 5 min each on 2 loaded cores

RUN = {
    **DEPLOY_RUN,  # test_flower_deploy's short run: 3 rounds, no evaluation rounds
    "method": "dpsgld",
    "noise_placement": "sites",
    "local_steps": 1,
    "secure_aggregation": True,
    "max_dropouts": 1,
}
ROUNDS = RUN["rounds"]


def _engine_config(sites: int, **over):
    run = {**RUN, "sites": sites, **over}
    return load_config(None, {k: v for k, v in run.items() if "-" not in k})


def _reference(sites: int, **over) -> tuple[float, list]:
    """The run's epsilon (``ddg_epsilon`` of its rounds) and each round's [q, params, 1]
    as a site's ledger file writes it."""
    cfg = _engine_config(sites, **over)
    server = Federation(cfg, log=lambda s: None).make_server()
    rounds = [(cfg.privacy.sample_rate, server.mode.parameters(t), 1) for t in range(ROUNDS)]
    entries = [[q, dataclasses.asdict(p), c] for q, p, c in rounds]
    return ddg_epsilon(rounds, cfg.privacy.delta)[0], json.loads(json.dumps(entries))


def _deploy(
    root: Path, policies: list[str], *, fast: bool = False, warm: bool = False, **over
) -> dict:
    """``policies[k]``: site k's policy file text, to which its long-term key (written by
    ``identity.generate`` in its own directory, mode 0600) and the consortium's key list
    are added. ``fast``: on the fast path; ``warm``: stock SuperNodes with warm sites;
    ``over``: run settings. The run's results.json."""
    files = export_sites(_engine_config(len(policies), **over), root / "data")
    public = {k: identity.generate(root / f"site{k}" / "site.key") for k in range(len(policies))}
    peers = "".join(f'{k} = "{h}"\n' for k, h in public.items())
    nodes = []
    for k, (text, data) in enumerate(zip(policies, files)):
        (root / f"site{k}" / "peers.toml").write_text(peers)
        keys = 'signing_key = "site.key"\npeers = "peers.toml"\n'  # next to the policy
        keys += 'public_records = "exact"\npublic_test_records = "exact"\n'  # one machine
        if fast or warm:  # a warm site runs only a bundle the site's policy approves
            approved_policy(root / f"site{k}" / "policy.toml", text + keys)
        else:
            (root / f"site{k}" / "policy.toml").write_text(text + keys)
        nodes.append(
            f"site-id={k} site-data='{data}' privacy-policy='{root / f'site{k}' / 'policy.toml'}'"
        )
    with Loopback(root / "flwr") as lo:
        lo.start(nodes, fast=fast, warm=warm)
        run = {**RUN, "sites": len(policies), "out": str(root / "out"), **over}
        return lo.run(run, timeout=1200.0)


def _ledger(root: Path, k: int) -> dict:
    return json.loads((root / f"site{k}" / f"fedsgld-site-{k}.json").read_text())


def _check_ledgers(root: Path, epsilons: list[float], entries: list) -> None:
    """Site k's ledger file: one DDG charge per round at that round's parameters, its own
    budget, the rounds numbered; its only Gaussian releases are its noised evaluations."""
    for k, eps in enumerate(epsilons):
        state = _ledger(root, k)
        assert state["ledger"]["ddg"] == entries
        assert state["ledger"]["budget"] == eps  # the site's own budget, not the run's 50
        assert list(state["answered"].values()) == [[0, ROUNDS - 1]]
        # the final evaluations (policy evaluation = "dp", noise multiplier 5): q = 1 each
        evaluations = sum(state["evaluations"].values())
        assert evaluations > 0
        assert state["ledger"]["ledger"] == [[1.0, 5.0, evaluations]]


def _check_run(r: dict, sites: int, ref: float, *, pipelined: int) -> None:
    p = r["privacy"]
    assert r["engine"] == "flower" and p["steps"] == ROUNDS and not p["halted"]
    block = p["secure_aggregation"]
    assert block["mechanism"] == "distributed discrete Gaussian"
    assert block["max_dropouts"] == 1 and block["last_round"]["sites"] == sites
    assert block["epsilon"] == pytest.approx(ref, rel=1e-9)
    assert p["rigorous_accountant"] == "pld"
    assert p["epsilon"]["pld"] == pytest.approx(ref, rel=1e-9)
    cost = r["flower"]["secure_aggregation"]
    assert cost["rounds"] == ROUNDS
    steps = {"advertise_keys", "share_keys", "masked_input", "consistency", "unmask", "round"}
    assert set(cost["median_seconds"]) == steps
    # a round that got its keys and shares with the consistency and unmask steps before
    # (secagg-pipeline) has no advertise_keys or share_keys exchange of its own
    assert cost["pipelined_rounds"] == pipelined
    early = ("advertise_keys", "share_keys")  # 0 s in a round that started at masked_input
    assert all(v > 0 for k, v in cost["median_seconds"].items() if k not in early)
    assert all((cost["median_seconds"][k] > 0) == (pipelined < ROUNDS / 2) for k in early)
    assert cost["median_server_sent_bytes"] > 0 and cost["median_server_received_bytes"] > 0
    assert len(set(r["flower"]["nodes"].values())) == sites  # one SuperNode per site


def test_secure_aggregation_deployed_each_site_charges_its_own_ledger(tmp_path):
    epsilons = [20.0, 25.0, 30.0]
    ref, entries = _reference(3)
    assert ref < min(epsilons)  # every site's budget holds the run
    policies = [f"epsilon = {e}\nmax_dropouts = 1\n" for e in epsilons]
    r = _deploy(tmp_path, policies, warm=True)  # Flower's cold ClientApps: test_flower_deploy
    print(f"round wall time: {r['round_wall_time_s']}; cost: {r['flower']['secure_aggregation']}")
    _check_run(r, 3, ref, pipelined=ROUNDS - 1)  # every site answers every step
    assert r["flower"]["dropped_replies"] == []
    _check_ledgers(tmp_path, epsilons, entries)


def test_a_site_whose_policy_assumes_more_dropouts_refuses_and_the_round_completes(tmp_path):
    ref, entries = _reference(4)
    policies = [f"epsilon = {20.0 + k}\nmax_dropouts = 1\n" for k in range(3)]
    policies.append("epsilon = 30.0\nmax_dropouts = 2\n")  # more than the plan's 1
    r = _deploy(tmp_path, policies, warm=True)  # warm sites: a third of the cold time
    _check_run(r, 4, ref, pipelined=0)  # site 3 never advertises: each round asks again
    dropped = r["flower"]["dropped_replies"]
    assert {d["site"] for d in dropped} == {3}
    assert {d["round"] for d in dropped} == set(range(ROUNDS))  # refused every round, ...
    assert all(d["kind"] == "secagg advertise_keys" for d in dropped), dropped  # ... at once
    assert all("policy max_dropouts is 2" in d["reason"] for d in dropped), dropped
    _check_ledgers(tmp_path, [20.0 + k for k in range(3)], entries)
    # the refusing site answered no round, charged no share (only its final evaluations)
    refused = _ledger(tmp_path, 3)
    assert refused["answered"] == {} and "ddg" not in refused["ledger"]


def test_one_shot_rounds_deployed_are_one_exchange_after_the_first(tmp_path):
    """No dropouts planned (the sites' policies too): the default one-shot rounds on the
    fast path. Round 0 asks for keys, then every round is its masked_input exchange alone,
    whose request carries the roster and whose reply the next round's keys; each site's
    ledger holds one charge per round and the epsilon is the reference's."""
    epsilons = [20.0, 25.0, 30.0]
    ref, entries = _reference(3, max_dropouts=0)
    r = _deploy(tmp_path, [f"epsilon = {e}\n" for e in epsilons], fast=True, max_dropouts=0)
    p = r["privacy"]
    assert p["steps"] == ROUNDS and not p["halted"]
    assert p["secure_aggregation"]["one_shot"] is True
    assert p["secure_aggregation"]["epsilon"] == pytest.approx(ref, rel=1e-9)
    cost = r["flower"]["secure_aggregation"]
    assert set(cost["median_seconds"]) == {"advertise_keys", "masked_input", "round"}
    assert cost["pipelined_rounds"] == ROUNDS - 1
    assert cost["median_seconds"]["advertise_keys"] == 0.0  # rounds 1.. ask for no keys
    assert r["flower"]["dropped_replies"] == []
    _check_ledgers(tmp_path, epsilons, entries)
