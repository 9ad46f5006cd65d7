"""A server that runs its own ServerApp, against real deployed sites on loopback.

One SuperLink and four stock SuperNodes, each with its own node config (its own records
file and policy file, or deliberately neither); fedsgld's ClientApp with its guard on every
node. The ServerApp is the attacker's own (written below into its own app directory, next
to fedsgld's ClientApp): it chooses every placement, run key, sample rate and file path.

- site 0 (a budget and bounds, placements left to the default): asked for the ``server``
  placement with one record in 160 and no pre-noise, under fresh run keys. Refused.
- site 1 (no policy file): asked for evaluations under one run key, then invented ones.
  Refused: a deployed site without a lifetime budget answers nothing computed on its records.
- site 2 (no ``site-data``): asked to train on a dataset at a path the server names.
  Refused by key; no error names a path.
- site 3 (``placements = ["server"]``): trusts the server; every round it answers is in its
  lifetime ledger as the event the server promised.

The same attacks message by message: tests/privacy/test_site_sovereignty.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from flower_support import flower_env, flwr

from fedsgld.config import load_config
from fedsgld.deploy.export_sites import export_sites
from fedsgld.deploy.loopback import Loopback

pytestmark = [pytest.mark.deploy, pytest.mark.slow]  # ~1-2 min

ATTACK = {
    "dataset": "synthetic",
    "model": "logreg",
    "sites": 4,
    "sample_rate": 0.2,
    "epsilon": 50.0,
    "randomness": "os",
    "seed": 1,
}

ATTACKER_APP = '''
"""The attacker's ServerApp: crafted messages, every reply recorded."""
import json, time
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from fedsgld.config import Config
from fedsgld.federation import initial_theta
from fedsgld.flower.protocol import pack_vector, plan_record, run_record

app = ServerApp()
BASE = json.loads({base!r})


def ask(grid, pairs):
    msgs = [Message(RecordDict(rec), node, kind, group_id=f"attack-{{i}}")
            for i, (node, kind, rec) in enumerate(pairs)]
    out = {{}}
    for r in grid.send_and_receive(msgs, timeout=300):
        out[r.metadata.group_id] = (
            "refused: " + str(r.error.reason)[-700:] if r.has_error() else "answered"
        )
    return [out.get(f"attack-{{i}}", "no reply") for i in range(len(msgs))]


def train(node, cfg, theta, **fields):
    rec = {{"round": 0, "epoch": 0, "run-key": "k", "sample-rate": cfg.privacy.sample_rate,
           "sigma": 1.0, "prenoise": 0.01, "clip": 1.0, "theta": pack_vector(theta), **fields}}
    return (node, "train", {{"plan": plan_record(rec, run_record(cfg))}})


@app.main()
def main(grid: Grid, context) -> None:
    out = context.run_config["out"]
    end = time.monotonic() + 300
    while len(grid.get_node_ids()) < 4 and time.monotonic() < end:
        time.sleep(0.5)
    cfg = Config.from_flat(BASE)
    nodes = sorted(grid.get_node_ids())
    msgs = [Message(RecordDict({{"run": run_record(cfg)}}), n, "query") for n in nodes]
    site_of, shape, broken = {{}}, None, None
    for r in grid.send_and_receive(msgs, timeout=300):
        if r.has_error():
            broken = r.metadata.src_node_id
            query_error = str(r.error.reason)[-700:]
            continue
        (e,) = json.loads(str(r.content["sites"]["json"]))
        site_of[e["site"]] = r.metadata.src_node_id
        shape = (tuple(e["input_shape"]), e["num_classes"])
    theta = initial_theta(cfg, *shape).numpy().astype(np.float32)
    server = Config.from_flat({{**BASE, "noise_placement": "server"}})
    seen = {{"query-error-2": query_error}}
    # 1: the server placement, one record in 160, no pre-noise, a fresh run key each
    seen["site0"] = ask(grid, [
        train(site_of[0], server, theta, **{{"sample-rate": 1 / 160, "prenoise": 0.0,
              "run-key": f"fresh-{{i}}"}}) for i in range(4)])
    # 2: evaluations under one run key, then invented ones
    def evaluate(key):
        ev = ConfigRecord({{"site-id": 1, "run-key": key, "groups": json.dumps({{"m": [0]}})}})
        rec = {{"thetas": ArrayRecord({{"0": Array(theta)}}), "eval": ev, "run": run_record(cfg)}}
        return (site_of[1], "evaluate", rec)
    seen["site1"] = ask(grid, [evaluate("E") for _ in range(3)] + [evaluate(f"E{{i}}") for i in range(5)])
    # 4: a dataset at a path the server names
    named = Config.from_flat({{**BASE, "noise_placement": "server", "data_path": "/etc/passwd"}})
    seen["site2"] = ask(grid, [train(broken, named, theta)])
    # the site that trusts the server: three rounds of one run
    seen["site3"] = ask(grid, [train(site_of[3], server, theta, round=t) for t in range(3)])
    with open(out, "w") as fh:
        json.dump(seen, fh)
'''


def _attacker_dir(root):
    d = root / "attacker"
    d.mkdir()
    base = json.dumps(ATTACK)
    (d / "attacker_app.py").write_text(textwrap.dedent(ATTACKER_APP.format(base=base)))
    (d / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "attacker"
            version = "1.0.0"
            dependencies = []

            [tool.flwr.app]
            publisher = "attacker"

            [tool.flwr.app.components]
            serverapp = "attacker_app:app"
            clientapp = "fedsgld.apps.client_app:app"

            [tool.flwr.app.config]
            out = ""
            """
        )
    )
    return d


def _policy(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_server_with_its_own_serverapp_cannot_take_what_the_sites_policy_keeps(flower_tmp):
    root, _ = flower_tmp
    files = export_sites(load_config(None, ATTACK), root / "data")
    hospital = _policy(
        root / "site0" / "policy.toml",
        "epsilon = 4.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nmax_sample_rate = 0.1\nmin_noise_multiplier = 0.6\nmax_clip = 10.0\n",
    )
    trusting = _policy(
        root / "site3" / "policy.toml",
        'epsilon = 4.0\npublic_records = "exact"\npublic_test_records = "exact"\nplacements = ["server"]\n',
    )
    nodes = [
        f"site-id=0 site-data='{files[0]}' privacy-policy='{hospital}'",
        f"site-id=1 site-data='{files[1]}' state-dir='{root / 'state1'}'",
        f"site-id=2 privacy-policy='{_policy(root / 'site2' / 'policy.toml', 'epsilon = 4.0')}'",
        f"site-id=3 site-data='{files[3]}' privacy-policy='{trusting}'",
    ]
    app = _attacker_dir(root)
    seen_file = root / "seen.json"
    with Loopback(root / "deploy") as lo:
        lo.start(nodes)
        res = flwr(
            ["run", ".", "loop", "--stream", "--run-config", f"out='{seen_file}'"],
            flower_env(lo.root / "home-cli"),
            timeout=600,
            cwd=app,
        )
        assert seen_file.is_file(), (res.stdout + res.stderr)[-3000:]
    seen = json.loads(seen_file.read_text())
    # 1: every server-placement round refused, nothing charged
    assert len(seen["site0"]) == 4
    assert all("refuses placement 'server'" in r for r in seen["site0"]), seen["site0"]
    assert not (root / "site0" / "fedsgld-site-0.json").exists()
    # 2: no budget, no answer, whatever the run key
    assert len(seen["site1"]) == 8
    assert all("without a lifetime privacy budget" in r for r in seen["site1"]), seen["site1"]
    assert not list((root / "state1").glob("*.json"))
    # 4: the site's files are its own; no error names the path
    assert seen["site2"][0].startswith("refused")
    for r in (seen["site2"][0], seen["query-error-2"]):
        assert "/etc/passwd" not in r and "passwd" not in r, r
    assert "data_path" in seen["site2"][0] or "has no records file" in seen["site2"][0]
    assert "has no records file" in seen["query-error-2"]
    # the trusting site: answered, each round charged as the server's promise
    assert seen["site3"] == ["answered"] * 3, seen["site3"]
    led = json.loads((root / "site3" / "fedsgld-site-3.json").read_text())["ledger"]
    assert led["ledger"] == [[0.2, 1.0, 3]]
