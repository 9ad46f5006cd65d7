"""A Flower simulation and a sweep on a Ray cluster that was already running.

The slow test starts a real two-node cluster on this machine with ``ray start`` (a head
and a second worker node, each with its own temp dir, its own ports and one CPU), runs
``fedsgld deploy local --ray-address`` and ``fedsgld sweep --address`` against it, checks
that a Flower actor ran on the second node and that both nodes outlive the runs, then
stops exactly the two ``ray start`` process groups it started, by their PIDs (never
``ray stop``: it ends every Ray process of the user on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedsgld.cli.commands import main as fedsgld_main
from fedsgld.deploy.loopback import BIN, Processes, free_port
from fedsgld.deploy.ray_cluster import (
    check_flwr_args,
    check_ray_address,
    check_reachable,
    default_ray_address,
    ray_environment,
)

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG = (
    "dataset='synthetic' model='mlp' sites=2 rounds=2 eval_every=0 epsilon=30.0 lr=0.2 "
    "temperature=2.0 burn_in=0 thin=1 max_samples=2"
)
SWEEP_CONFIG = ROOT / "simulations" / "calibration_breast_cancer.toml"
SWEEP_SETS = ["recal_fraction=0", "rounds=4", "burn_in=1", "thin=1", "eval_every=0"]
#: fedsgld.simulate over Flower's Ray simulation on the cluster, and the engine, same seed
API_RUN = """
import sys, torch, fedsgld
from torch import nn

def net():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

def blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.randn(n, 5, generator=g) + y[:, None], y

sites = [blobs(40, k) for k in range(2)]
small = dict(rounds=2, sample_rate=0.2, lr=0.2, temperature=2.0, epsilon=30.0, eval_every=0,
             burn_in=0, thin=1, max_samples=2, seed=3, progress=False)
ref = fedsgld.simulate(net, sites, **small)
got = fedsgld.simulate(net, sites, transport="ray", ray_address=sys.argv[1], **small)
print("same theta:", torch.equal(ref.theta, got.theta), "steps:", got.results["privacy"]["steps"])
"""
STORE = str(100 * 1024 * 1024)  # bytes of object store per node: /dev/shm is shared


@pytest.mark.parametrize("value", ["local", "127.0.0.1:6379", " head.example:1 "])
def test_valid_ray_addresses_pass(value):
    assert check_ray_address(value) == value.strip()


@pytest.mark.parametrize(
    "value, words",
    [
        ("", "must be local or HOST:PORT"),
        ("headnode", "must be local or HOST:PORT"),
        (":6379", "must be local or HOST:PORT"),
        ("h:0", r"PORT in \[1, 65535\]"),
        ("h:65536", r"PORT in \[1, 65535\]"),
        ("h:port", "must be local or HOST:PORT"),
        ("ray://h:10001", "Ray Client address"),
        ("auto", "may join any Ray here"),
    ],
)
def test_invalid_ray_addresses_name_the_flag(value, words):
    with pytest.raises(ValueError, match=f"--ray-address.*{words}"):
        check_ray_address(value)


def test_default_is_ray_address_or_a_ray_of_its_own(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert default_ray_address() == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert default_ray_address() == "10.0.0.5:6379"
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # checked as well, named as it came
    with pytest.raises(ValueError, match=r"^RAY_ADDRESS \(or --ray-address\): 'auto'"):
        ray_environment(None, [])


def test_the_python_api_checks_ray_address_before_any_work():
    import fedsgld

    with pytest.raises(ValueError, match="ray_address: only with transport='ray'"):
        fedsgld.simulate(sites=2, rounds=1, ray_address="127.0.0.1:6379", progress=False)
    with pytest.raises(ValueError, match="ray_address must be local or HOST:PORT"):
        fedsgld.simulate(sites=2, rounds=1, transport="ray", ray_address="head", progress=False)


def test_init_args_cpus_are_refused_for_an_existing_cluster_only():
    args = ["--federation-config", "num-supernodes=2 init-args-num-cpus=4"]
    check_flwr_args("local", args)  # a Ray of the run's own takes them
    with pytest.raises(ValueError, match="init-args-num-cpus cannot be given"):
        check_flwr_args("127.0.0.1:6379", args)


def test_an_address_where_nothing_listens_is_refused_before_anything_starts(capsys):
    port = free_port()  # bound and released: nothing listens there now
    with pytest.raises(ValueError, match=f"127.0.0.1:{port}: nothing answers there"):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="nothing answers"):
        ray_environment(f"127.0.0.1:{port}", [])
    status = fedsgld_main(["deploy", "local", "--ray-address", "head", "--run-config", "rounds=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--ray-address must be" in err[0]


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_args(role: str, temp: Path, ports: list[int]) -> list[str]:
    """``ray start --block`` of one node on loopback: its own temp dir, ports, one CPU."""
    head = role == "head"
    args = [str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1"]
    args += ["--head", "--port", str(ports[0])] if head else ["--address", f"127.0.0.1:{ports[0]}"]
    args += ["--num-cpus", "1", "--object-store-memory", STORE, "--temp-dir", str(temp / role)]
    args += ["--disable-usage-stats"]
    own = ports[1:7] if head else ports[7:13]
    names = ["node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc"]
    names += ["metrics-export", "runtime-env-agent"]
    for name, port in zip(names, own, strict=True):
        args += [f"--{name}-port", str(port)]
    if head:
        args += ["--ray-client-server-port", str(ports[13]), "--dashboard-port", str(ports[14])]
        args += ["--include-dashboard", "false"]
    return args


def _wait_started(procs: Processes, name: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while "Ray runtime started" not in procs.log(name):
        if procs.procs[name].poll() is not None or time.monotonic() > end:
            pytest.fail(f"ray start ({name}) did not start:\n{procs.log(name)[-3000:]}")
        time.sleep(0.5)


def _group(pgid: int) -> dict[int, str]:
    """The live processes of process group ``pgid`` (from /proc): PID -> program name."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members[int(stat.parent.name)] = Path(cmd).name
    return members


def _group_gone(pgid: int, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while _group(pgid) and time.monotonic() < end:
        time.sleep(0.5)
    return not _group(pgid)


@pytest.fixture
def ray_cluster():
    """A head and a second worker node, one CPU each; yields (address, temp dir, PIDs of the
    two ``ray start`` processes, each its process group's leader); stops exactly those two
    process groups afterwards."""
    temp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # Ray's socket paths must be short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0"
    )  # the sweep's tasks import fedsgld
    ports = _ports(15)
    nodes = {role: Processes(temp) for role in ("head", "worker")}
    try:
        nodes["head"].start("head", _node_args("head", temp, ports), env)
        _wait_started(nodes["head"], "head")
        nodes["worker"].start("worker", _node_args("worker", temp, ports), env)
        _wait_started(nodes["worker"], "worker")
        yield f"127.0.0.1:{ports[0]}", temp, {r: p.procs[r].pid for r, p in nodes.items()}
    finally:
        for role in ("worker", "head"):
            nodes[role].stop()  # SIGTERM to the group this test started, then SIGKILL
        pgids = {r: p.procs[r].pid for r, p in nodes.items() if r in p.procs}
        left = {r: _group(g) for r, g in pgids.items() if not _group_gone(g)}
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


def _cluster_core(pids: dict[str, int]) -> set[int]:
    """The running PIDs of each node's ``ray start`` and its ``gcs_server`` and ``raylet``
    (the worker processes a raylet starts and reaps come and go)."""
    core = set()
    for pid in pids.values():
        core |= {
            p for p, name in _group(pid).items() if p == pid or name in ("gcs_server", "raylet")
        }
    return core


def _actor_logs(logs: Path) -> list[Path]:
    """The worker logs of a node that record one of Flower's actors."""
    return [f for f in logs.glob("worker-*.out") if ":actor_name:ClientAppActor" in f.read_text()]


@pytest.mark.slow
def test_flower_simulation_and_sweep_on_an_existing_two_node_cluster(ray_cluster, flower_tmp):
    address, temp, pids = ray_cluster
    # flower_tmp's teardown stops whatever names its directory (deploy local's SuperLink
    # and simulation, should the command be killed by the timeout before it stops them)
    tmp_path, _ = flower_tmp
    before = _cluster_core(pids)
    assert len(before) == 2 + 1 + 2  # two ray start, one GCS, two raylets
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    out, home = tmp_path / "flower", tmp_path / "home"
    cmd = [sys.executable, "-m", "fedsgld", "deploy", "local", "--home", str(home)]
    cmd += ["--ray-address", address, "--run-config", f"{RUN_CONFIG} out='{out}'"]
    cmd += ["--federation-config", "num-supernodes=2 client-resources-num-cpus=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert f"the running cluster at {address} (joined, not stopped)" in res.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["engine"] == "flower" and results["privacy"]["steps"] == 2
    # one of Flower's two actors ran on the second node (it has one CPU, the head one)
    worker_logs = temp / "worker" / "session_latest" / "logs"
    actors = _actor_logs(worker_logs)
    assert actors, f"no Flower actor ran on the second node ({worker_logs})"
    # the run disconnected from the cluster and stopped nothing of it
    assert _cluster_core(pids) == before

    # the Python API's Ray transport on the same cluster: the engine's numbers
    cmd = [sys.executable, "-c", API_RUN, address]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert "same theta: True steps: 2" in res.stdout, (res.stdout + res.stderr)[-3000:]
    assert len(_actor_logs(worker_logs)) > len(actors)  # it too ran an actor on the second node
    assert _cluster_core(pids) == before

    sweep_out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fedsgld", "sweep", str(SWEEP_CONFIG), "--grid", "lr=0.02,0.2"]
    cmd += ["--methods", "sgd", "--seeds", "0", "--address", address, "--out", str(sweep_out)]
    cmd += ["--no-progress", *[x for s in SWEEP_SETS for x in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert re.search(f"Ray tasks on {re.escape(address)}", res.stdout + res.stderr)
    sweep = json.loads((sweep_out / "sweep.json").read_text())
    assert len(list((sweep_out / "trials").iterdir())) == 2 and "sgd" in sweep["table"]
    assert _cluster_core(pids) == before


@pytest.mark.slow  # two Ray starts: about 13 s on two shared cores
def test_a_sweeps_pool_leaves_a_callers_own_ray_connected():
    import ray

    from fedsgld.studies.sweep_trials import _Pool

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        pool = _Pool(ray=True, address=None, workers=1, log=lambda _line: None)
        pool.close()
        assert ray.is_initialized()  # the caller's Ray: not the pool's to disconnect
    finally:
        ray.shutdown()
    try:
        pool = _Pool(ray=True, address=None, workers=1, log=lambda _line: None)
        pool.close()
        assert not ray.is_initialized()  # the Ray it started itself: disconnected
    finally:
        if ray.is_initialized():  # the pool left its Ray running: stop it all the same
            ray.shutdown()
