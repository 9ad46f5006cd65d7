"""A run that cannot train on the sites it was set up with fails loudly, and so does the
documented deploy command.

* ``min_sites`` (default: every site): a round answered by fewer sites fails the run,
  naming the round, the sites that answered and the others' reasons; results.json lists
  the sites behind every round.
* Two resumed copies of one run (same run key, same epoch): the sites with a policy refuse
  the second copy's rounds as replays; it must not "succeed" on the site without one.
* ``python -m fedsgld.deploy run``: exits non-zero with the reason where ``flwr run
  --stream`` exits 0 for a failed run (a real loopback deployment, ``-k deploy``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flower_support import BIN, ROOT, SMALL, flower_env, flwr, free_port, run_config_arg
from flwr.app import Error, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedsgld.apps import APPS
from fedsgld.config import load_config
from fedsgld.deploy.loopback import site_node_configs
from fedsgld.flower.directory import REJOIN_TRIES
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.strategy import AllSitesFailed, TooFewSites


def _round(msg: Message) -> int:
    return int(msg.content["plan"]["round"])


def _refuse(site: int, rnd: int):
    """Site ``site`` answers round ``rnd`` with an error (as a refusing site does)."""

    def hook(ins: Message, reply: Message):
        if ins.metadata.message_type != "train" or reply.has_error():
            return reply
        if int(reply.content["sum"]["site-id"]) == site and _round(ins) == rnd:
            return Message(Error(2, "PolicyRefused: the site's budget is spent"), reply_to=ins)
        return reply

    return hook


def test_a_round_below_min_sites_fails_the_run_naming_the_sites(tmp_path):
    out = tmp_path / "few"
    with pytest.raises(TooFewSites) as err:
        run_local({**SMALL, "out": str(out)}, **APPS, fault=_refuse(1, 5), shuffle_seed=7)
    msg = str(err.value)
    assert not isinstance(err.value, AllSitesFailed)
    assert "round 5: 2 of 3 sites answered (sites [0, 2]), fewer than min_sites = 3" in msg
    assert "site 1: error reply (code 2): PolicyRefused: the site's budget is spent" in msg
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["steps"] == 5  # rounds 0..4; round 5 was not taken
    assert not (out / "results.json").exists()


def test_min_sites_lets_a_run_go_on_and_results_name_each_rounds_sites(tmp_path):
    out = tmp_path / "two"
    run_local(
        {**SMALL, "out": str(out), "min_sites": 2}, **APPS, fault=_refuse(1, 5), shuffle_seed=7
    )
    r = json.loads((out / "results.json").read_text())
    assert r["round_contributors"] == [
        {"rounds": [0, 4], "sites": [0, 1, 2]},
        {"rounds": [5, 5], "sites": [0, 2]},
        {"rounds": [6, 11], "sites": [0, 1, 2]},
    ]
    assert r["privacy"]["steps"] == 12


def test_min_sites_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"min_sites must be an integer in \[0, sites = 3\]"):
        load_config(None, {**SMALL, "min_sites": 4})
    with pytest.raises(ValueError, match="min_sites"):
        run_local({**SMALL, "min_sites": -1, "out": str(tmp_path / "x")}, **APPS)


def _policy(tmp_path, k):
    d = tmp_path / f"site{k}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "policy.toml").write_text(
        "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\ndelta = 1e-5\nplacements = ['server']\n"
    )
    return str(d / "policy.toml")


@pytest.mark.slow  # 7-16 s
def test_two_resumed_copies_of_a_run_fail_instead_of_training_on_one_site(tmp_path):
    """Every deployed site keeps a policy and a replay record on disk. A run crashes; its
    directory is copied; both copies resume (same run key, epoch 1). The second copy's
    rounds are refused by every site as replays: it must fail, naming them."""
    ncs = site_node_configs(SMALL, tmp_path, policy=None)
    for k, nc in enumerate(ncs):
        nc["privacy-policy"] = _policy(tmp_path, k)
    cfg = {**SMALL, "randomness": "os"}

    def crash(ins, reply):
        if ins.metadata.message_type == "train" and _round(ins) == 7:
            raise RuntimeError("server crashed")
        return reply

    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(RuntimeError, match="server crashed"):
        run_local({**cfg, "out": str(a)}, **APPS, node_configs=ncs, fault=crash)
    shutil.copytree(a, b)
    run_local({**cfg, "out": str(a), "resume": True}, **APPS, node_configs=ncs)
    assert (a / "results.json").is_file()
    with pytest.raises(TooFewSites) as err:
        run_local({**cfg, "out": str(b), "resume": True}, **APPS, node_configs=ncs)
    msg = str(err.value)
    assert msg.startswith("round 5: ")
    assert "site 0: " in msg and "site 1: " in msg and "site 2: " in msg
    assert "already answered" in msg
    assert not (b / "results.json").exists()


# -- the deploy command ----------------------------------------------------------------------


def _deploy_run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedsgld.deploy", "run", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _fake_flwr(tmp_path, status: str, details: str, run_exit: int = 0):
    """A stand-in ``flwr``: ``run`` starts run 7 and exits ``run_exit``, ``ls`` reports
    ``status``; every call is logged."""
    row = {"run-id": "7", "status": status, "status-details": details}
    script = tmp_path / "flwr"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(tmp_path / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1] == 'run':\n"
        "    app = sorted(os.listdir(sys.argv[2]))\n"
        f"    open({str(tmp_path / 'app')!r}, 'w').write(' '.join(app))\n"
        "    print('Successfully started run 7')\n"
        f"    sys.exit({run_exit})\n"
        f"print(json.dumps({{'success': True, 'runs': [{row!r}]}}))\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("status", "run_exit", "code"),
    [("finished:completed", 0, 0), ("finished:failed", 0, 1), ("finished:stopped", 0, 1)]
    + [("finished:completed", 3, 3)],
)
def test_the_deploy_command_exits_with_the_runs_outcome(
    tmp_path, monkeypatch, capsys, status, run_exit, code
):
    from fedsgld.deploy import run as deploy_run

    why = "ServerApp failed with exception: round 5: 1 of 3 sites answered"
    fake = _fake_flwr(tmp_path, status, why, run_exit)
    monkeypatch.setattr(deploy_run, "_flwr", lambda: str(fake))
    monkeypatch.chdir(ROOT)
    assert deploy_run.main([".", "hospitals", "--run-config", "rounds=2"]) == code
    calls = (tmp_path / "calls").read_text().splitlines()
    # the app directory is staged: only what the bundle holds, removed afterwards
    app, rest = calls[0].removeprefix("run ").split(" ", 1)
    assert rest == "hospitals --run-config rounds=2 --stream"
    assert Path(app).name == "app" and Path(app).parent.name.startswith("fedsgld-app-")
    assert not Path(app).exists()
    assert (tmp_path / "app").read_text().split() == [".gitignore", "fedsgld", "pyproject.toml"]
    if run_exit == 0:
        assert calls[1] == "ls hospitals --run-id 7 --format json"
    err = capsys.readouterr().err
    if status == "finished:failed":
        assert f"did not complete (finished:failed): {why}" in err


@pytest.mark.deploy
@pytest.mark.slow  # ~100 s; the stand-in tests above cover every exit status
def test_the_deploy_command_exits_non_zero_for_a_failed_run(flower_tmp):
    """A resume of a directory that holds no run fails in the ServerApp: ``flwr run
    --stream`` exits 0 anyway; ``python -m fedsgld.deploy run`` exits 1 with the reason,
    and 0 for a run that completes."""
    from fedsgld.deploy.export_sites import export_sites

    root, procs = flower_tmp
    run = {**SMALL, "rounds": 2, "eval_every": 0, "checkpoint_every": 0, "threads": 1}
    files = export_sites(load_config(None, run), root / "data")
    run |= {"poll-interval": 0.1, "wait-for-sites": 120.0, "round-timeout": 120.0}
    port = free_port()
    link = [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1"]
    link += ["--port", str(port), "--disable-runtime-dependency-installation"]
    procs.start("superlink", link, flower_env(root / "home-link"))
    procs.wait_listening("superlink", port)
    for k, f in enumerate(files):  # every deployed site needs its policy file
        nc = f"site-id={k} site-data='{f}' privacy-policy='{_policy(root, k)}'"
        node = [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}"]
        node += ["--port", str(free_port()), "--node-config", nc]
        procs.start(f"supernode-{k}", node, flower_env(root / f"home-node{k}"))
    home = root / "home-cli"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loop"\n\n[superlink.loop]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    env = flower_env(home)
    bad = run_config_arg({**run, "out": str(root / "none"), "resume": True})
    plain = flwr(["run", ".", "loop", "--stream", "--run-config", bad], env, timeout=600)
    assert plain.returncode == 0  # the gap this command closes
    res = _deploy_run([".", "loop", "--run-config", bad], env)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "did not complete (finished:failed)" in res.stderr
    assert "holds no checkpoint.pt and no ledger.json" in res.stderr
    good = run_config_arg({**run, "out": str(root / "ok")})
    res = _deploy_run([".", "loop", "--run-config", good], env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "completed" in res.stderr and (root / "ok" / "results.json").is_file()


# -- a site's node restarted: the site rejoins ------------------------------------------------


def _restarting_grid(tmp_path, *, other_sizes: bool = False, silent: int = 0, queries=None):
    """A LocalGrid whose node of site 1 "crashes" while it answers round 3 (its reply is lost)
    and comes back as a new node (a new id, its node config, fresh state), as a SuperNode
    started again registers anew. ``other_sizes``: the new node's query reply publishes
    other sizes for site 1; ``silent``: its first so many query replies are lost (a
    restarted node's first task runs cold and may miss the round timeout). ``queries``: a
    list that gets the round of every query the new node is sent."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from fedsgld.flower.local_grid import SUPERLINK_NODE_ID, LocalGrid, _app

    run = {**SMALL, "out": str(tmp_path / "out"), "min_sites": 2, "round-timeout": 0.5}
    ncs = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    grid: LocalGrid
    grid_round = [0]  # the round of the last train message
    asks = [] if queries is None else queries  # the round of each query to the new node

    def fault(ins: Message, reply: Message):
        if ins.metadata.message_type == "query" and ins.metadata.dst_node_id == 7:
            asks.append(grid_round[0])
            if len(asks) <= silent:
                return None
        if ins.metadata.message_type == "train":
            grid_round[0] = _round(ins)
        if ins.metadata.message_type == "query" and other_sizes and ins.metadata.dst_node_id == 7:
            entries = json.loads(str(reply.content["sites"]["json"]))
            entries[0]["n_train"] += 1
            reply.content["sites"] = ConfigRecord({"json": json.dumps(entries)})
        if ins.metadata.message_type != "train" or _round(ins) != 3:
            return reply
        old = grid.contexts.get(ins.metadata.dst_node_id)
        if old is None or old.node_config["partition-id"] != 1:
            return reply
        del grid.contexts[ins.metadata.dst_node_id]  # the crash: its reply never leaves
        grid.contexts[7] = Context(
            run_id=old.run_id, node_id=7, node_config=dict(old.node_config),
            state=RecordDict(), run_config=dict(old.run_config),
        )  # fmt: skip
        return None

    grid = LocalGrid(_app(APPS["client_app"], ClientApp), ncs, run_config=run, fault=fault)
    ctx = Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={},
                  state=RecordDict(), run_config=dict(run))  # fmt: skip
    _app(APPS["server_app"], ServerApp)(grid, ctx)
    return json.loads((tmp_path / "out" / "results.json").read_text())


def test_a_site_whose_node_restarts_rejoins_at_the_next_round(tmp_path):
    r = _restarting_grid(tmp_path)
    assert r["flower"]["rejoined"] == [{"round": 4, "site": 1, "node": 7}]
    assert r["round_contributors"] == [
        {"rounds": [0, 2], "sites": [0, 1, 2]},
        {"rounds": [3, 3], "sites": [0, 2]},
        {"rounds": [4, 11], "sites": [0, 1, 2]},
    ]
    assert r["flower"]["nodes"]["1"] == 7


def test_a_restarted_node_that_misses_its_first_query_is_asked_again(tmp_path):
    """The new node's answer to the first query is lost (its first task ran cold past the
    round timeout): it is asked again at the next round, and its site rejoins then."""
    queries: list[int] = []
    r = _restarting_grid(tmp_path, silent=1, queries=queries)
    assert queries == [3, 4]  # before rounds 4 and 5 (the last train message: rounds 3, 4)
    assert r["flower"]["rejoined"] == [{"round": 5, "site": 1, "node": 7}]
    assert r["round_contributors"] == [
        {"rounds": [0, 2], "sites": [0, 1, 2]},
        {"rounds": [3, 4], "sites": [0, 2]},
        {"rounds": [5, 11], "sites": [0, 1, 2]},
    ]


def test_a_new_node_that_never_answers_is_asked_a_bounded_number_of_times(tmp_path):
    queries: list[int] = []
    r = _restarting_grid(tmp_path, silent=REJOIN_TRIES, queries=queries)
    assert len(queries) == REJOIN_TRIES and r["flower"]["rejoined"] == []
    assert r["round_contributors"][-1] == {"rounds": [3, 11], "sites": [0, 2]}


def test_a_new_node_that_publishes_other_sizes_does_not_take_the_site(tmp_path):
    r = _restarting_grid(tmp_path, other_sizes=True)
    assert r["flower"]["rejoined"] == []
    assert r["round_contributors"][-1] == {"rounds": [3, 11], "sites": [0, 2]}
