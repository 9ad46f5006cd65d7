"""The site's guard in a real Flower deployment on loopback (issue 25).

One SuperLink, two SuperNodes each reading its own ``.npz``, ``flwr run``: the guard mod
runs in Flower's own ClientApp processes. Site 0's policy has only a budget (and trusts
the server's noise) otherwise its defaults: noised evaluation, its ledger beside its policy; site 1's policy
answers no evaluation at all (``max_evaluations = 0``), and the server's log names why.
The attacks themselves, message by message: tests/privacy/test_site_guard.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_support import BIN, DEPLOYED, SMALL, flower_env, flwr, free_port, run_config_arg

from fedsgld.config import load_config
from fedsgld.deploy.export_sites import export_sites

pytestmark = [pytest.mark.deploy, pytest.mark.slow]  # ~80 s; LocalGrid tests cover the guard

RUN = {
    **SMALL,
    "sites": 2,
    "rounds": 2,
    "eval_every": 0,
    "checkpoint_every": 0,
    **DEPLOYED,
    "threads": 1,
}


def test_a_deployed_sites_guard_noises_charges_and_refuses(flower_tmp):
    root, procs = flower_tmp
    files = export_sites(
        load_config(None, {k: v for k, v in RUN.items() if "-" not in k}), root / "data"
    )
    (root / "state0").mkdir()
    (root / "state0" / "policy.toml").write_text(
        "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n"
    )
    (root / "policy1.toml").write_text(
        "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\nmax_evaluations = 0\n"
    )
    nodes = [
        f"site-id=0 site-data='{files[0]}' privacy-policy='{root / 'state0' / 'policy.toml'}'",
        f"site-id=1 site-data='{files[1]}' privacy-policy='{root / 'policy1.toml'}'",
    ]
    port = free_port()
    link = ["--insecure", "--host", "127.0.0.1", "--port", str(port)]
    link += ["--disable-runtime-dependency-installation"]
    procs.start("superlink", [str(BIN / "flower-superlink"), *link], flower_env(root / "hl"))
    procs.wait_listening("superlink", port)
    for k, nc in enumerate(nodes):
        args = ["--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port())]
        procs.start(
            f"supernode-{k}",
            [str(BIN / "flower-supernode"), *args, "--node-config", nc],
            flower_env(root / f"hn{k}"),
        )
    cli = root / "hc"
    cli.mkdir()
    (cli / "config.toml").write_text(
        f'[superlink]\ndefault = "loop"\n\n[superlink.loop]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    out = root / "out"
    res = flwr(
        ["run", ".", "loop", "--stream", "--run-config", run_config_arg({**RUN, "out": str(out)})],
        flower_env(cli),
        timeout=600,
    )
    log = res.stdout + res.stderr
    assert (out / "results.json").is_file(), log[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["privacy"]["steps"] == 2  # both sites trained
    # site 0 released noised metrics of each model (last iterate, posterior average) ...
    assert r["metrics"]["sites"]["0"]["release"] == "dp"
    assert r["metrics"]["posterior"]["sites"]["0"]["release"] == "dp"
    state = json.loads((Path(root / "state0") / "fedsgld-site-0.json").read_text())
    led = state["ledger"]["ledger"]
    assert [1.0, 5.0, 2] in led  # ... each charged to its ledger, with the two rounds it
    assert sum(c for q, _, c in led if q == RUN["sample_rate"]) == 2  # trained (promised noise)
    assert list(state["evaluations"].values()) == [2]
    assert list(state["answered"].values()) == [[0, 1]]  # rounds 0 and 1, numbered, persisted
    # site 1 refused every evaluation, and said why
    dropped = [d for d in r["flower"]["dropped_replies"] if d["kind"] == "evaluate"]
    assert {d["site"] for d in dropped} == {1}
    assert all("policy max_evaluations is 0" in d["reason"] for d in dropped), dropped
    assert "1" not in r["metrics"]["sites"]
