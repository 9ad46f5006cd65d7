"""Four real hospitals deployed on loopback: one SuperNode per centre of Fed-Heart-Disease.

Each SuperNode reads only its own centre's records file (``export_sites``, raw) and its own
privacy policy (with its long-term key and the consortium's key list); the first run asks
for the private pooled standardisation with each site adding its own noise
(``noise_placement = "sites"``), the second, on the same SuperNodes, under secure
aggregation. The release goes through every site's guard before round 1 (a
``query.standardize`` message; a secure round of kind ``standardize``), every later
message carries the pooled statistics, and each site's ledger and audit log hold each
release beside its rounds (docs/hospitals.md). The sites' side message by message:
tests/privacy/test_site_standardize.py, tests/flower/test_secagg_standardize.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_support import DEPLOYED

from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy
from fedsgld.config import load_config
from fedsgld.deploy.loopback import LOOPBACK_POLICY, Loopback, approved_policy, site_node_configs
from fedsgld.secagg import identity

pytestmark = [pytest.mark.deploy, pytest.mark.slow]  # about a minute and a half

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4
RUN = {
    **load_config(ROOT / "simulations" / "heart_disease.toml").flat(),
    "noise_placement": "sites",
    "local_steps": 1,
    "rounds": ROUNDS,
    "randomness": "os",
    **DEPLOYED,
}


def test_four_deployed_centres_train_on_the_pooled_release_each_charged_and_logged(tmp_path):
    public = {k: identity.generate(tmp_path / f"site{k}" / "site.key") for k in range(4)}
    nodes = []
    for nc in site_node_configs(RUN, tmp_path, policy=None):
        k = nc["site-id"]
        (tmp_path / f"site{k}" / "peers.toml").write_text(
            "".join(f'{v} = "{h}"\n' for v, h in public.items())
        )
        # Switzerland's 30 records at q = 0.1 expect 3 per step: below the default floor
        # of 16 (docs/hospitals.md); these centres accept it
        text = (
            LOOPBACK_POLICY
            + 'min_expected_batch = 2\nsigning_key = "site.key"\npeers = "peers.toml"\n'
        )
        policy = approved_policy(tmp_path / f"site{k}" / "policy.toml", text)
        nodes.append(f"site-id={k} site-data='{nc['site-data']}' privacy-policy='{policy}'")
    with Loopback(tmp_path / "flwr") as lo:
        lo.start(nodes, fast=True)
        r = lo.run({**RUN, "out": str(tmp_path / "out")}, timeout=900.0)
        secure = {**RUN, "secure_aggregation": True, "out": str(tmp_path / "secure")}
        r2 = lo.run(secure, timeout=900.0)
    s = r["privacy"]["standardization"]
    assert s["placement"] == "sites" and s["transport"] == "flower"
    assert s["sites"] == [0, 1, 2, 3] and s["refused"] == []
    assert s["records"] == 199 + 172 + 30 + 85  # the counts the sites publish
    assert r["privacy"]["steps"] == ROUNDS and not r["privacy"]["halted"]
    # the run's ledger: the release, then the rounds
    run_ledger = json.loads((tmp_path / "out" / "ledger.json").read_text())["ledger"]
    assert run_ledger[0] == [1.0, 10.0, 1]
    # the second run: the release is one secure round, charged to the run and every site
    s = r2["privacy"]["standardization"]
    assert s["placement"] == "secure" and s["event"] == "DistributedDiscreteGaussianStep"
    assert s["sites"] == [0, 1, 2, 3] and s["records"] == 199 + 172 + 30 + 85
    assert r2["privacy"]["steps"] == ROUNDS and not r2["privacy"]["halted"]
    ddg = json.loads((tmp_path / "secure" / "ledger.json").read_text())["ddg"]
    assert ddg[0][0] == 1.0 and ddg[0][2] == 1  # the release (q = 1), then the rounds
    for k in range(4):  # each site's ledger and audit log: both releases, both runs' rounds
        state = json.loads((tmp_path / f"site{k}" / f"fedsgld-site-{k}.json").read_text())
        answered = state["answered"]
        keys = [key for key in answered if key.endswith("|standardize")]
        assert len(keys) == 2 and all(answered[x] == [0, 0] for x in keys), answered
        assert all(answered[x.removesuffix("|standardize")] == [0, ROUNDS - 1] for x in keys)
        assert [1.0, 10.0, 1] in state["ledger"]["ledger"]  # the first: its own noise, charged
        assert [e[0] for e in state["ledger"]["ddg"]].count(1.0) == 1  # the second: its share
        lines, problem = verify(SitePolicy.from_file(tmp_path / f"site{k}" / "policy.toml"))
        assert problem is None and lines > 0
