"""Warm sites and the fast path (``fedsgld.deploy``) on loopback deployments.

``pytest -k deploy`` selects these. The deployments run a *modified* copy of the app
bundle (its ClientApp module writes a marker file when imported) while the SuperNodes'
installed fedsgld is this checkout's: a marker per task proves that every task ran the
submitted bundle's code, and the marker's content (``FEDSGLD_WARM_SITE``) that the task
was forked by a warm fork server. Every process has its own FLWR_HOME under the test's
tmp directory and is stopped by PID at teardown. Timings are measured by
``benchmarks/round_latency.py``, not here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flower_support import BIN, ROOT, flower_env, flwr, free_port, run_config_arg
from test_flower_deploy import RUN, SITES, _certificates, _node_key, _site_files

from fedsgld.clients.approve import approve
from fedsgld.deploy import fast, shim, warm
from fedsgld.deploy.loopback import write_connection

MARKER = """

# test_fast_deploy: this copy of the bundle marks every process that imports it
import os as _os

if _os.environ.get("FEDSGLD_TEST_MARKS"):
    _name = f"{_os.path.basename(_os.environ['FLWR_HOME'])}-{_os.getpid()}"
    with open(_os.path.join(_os.environ["FEDSGLD_TEST_MARKS"], _name), "w") as _f:
        _f.write(
            _os.environ.get("FEDSGLD_WARM_SITE", "cold")
            + " "
            + _os.environ.get("FEDSGLD_WARM_VIA", "-")
        )
"""


def _bundle(dst: Path) -> Path:
    """A copy of the app whose ClientApp module differs from the installed fedsgld's."""
    dst.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "fedsgld", dst / "fedsgld", ignore=shutil.ignore_patterns("__pycache__"))
    with open(dst / "fedsgld" / "apps" / "client_app.py", "a") as f:
        f.write(MARKER)
    return dst


def _policies(root: Path, bundles: list[Path]) -> list[Path]:
    """Each site's own policy: a lifetime budget, trust in this run's server placement,
    and the bundles it approved (a warm site runs only those)."""
    out = []
    for k in range(SITES):
        p = root / f"site{k}" / "policy.toml"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(
            "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n"
        )
        for b in bundles:
            approve(b, p)
        out.append(p)
    return out


def _wait_serving(sockets: list[Path], timeout: float = 300.0) -> None:
    """Wait until every fork server accepts connections (they import torch first)."""
    end = time.monotonic() + timeout
    pending = list(sockets)
    while pending and time.monotonic() < end:
        for p in list(pending):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(p))
                    pending.remove(p)
                except OSError:
                    pass
        time.sleep(0.5)
    assert not pending, f"fork servers not serving after {timeout:g} s: {pending}"


def _run(app: Path, cli_env: dict, connection: str, out: Path, rounds: int, log: Path) -> dict:
    res = flwr(
        ["run", str(app), connection, "--stream", "--run-config",
         run_config_arg({**RUN, "rounds": rounds, "out": str(out)})],
        cli_env, timeout=900,
    )  # fmt: skip
    text = res.stdout + res.stderr
    log.write_text(text)
    assert res.returncode == 0, text[-3000:]
    assert (out / "results.json").is_file(), text[-3000:]  # `flwr run --stream` can exit 0
    r = json.loads((out / "results.json").read_text())
    p = r["privacy"]
    assert r["engine"] == "flower"
    assert p["steps"] == rounds and p["ledger_steps"] == rounds
    assert sorted(r["metrics"]["sites"]) == [str(k) for k in range(SITES)]
    assert r["flower"]["dropped_replies"] == []
    assert len(set(r["flower"]["nodes"].values())) == SITES
    return r


def _marks(d: Path) -> dict[str, list[str]]:
    """Node (its FLWR_HOME's name) -> what each of its task processes wrote."""
    out: dict[str, list[str]] = {}
    for f in sorted(d.iterdir()):
        out.setdefault(f.name.rsplit("-", 1)[0], []).append(f.read_text())
    return out


def _tasks_per_node(rounds: int) -> int:
    return 1 + rounds  # the discovery query, then one training message per round


@pytest.mark.deploy
@pytest.mark.slow  # about 70 s
def test_fast_path_with_tls_and_supernode_auth_runs_the_submitted_bundle_warm(flower_tmp):
    root, procs = flower_tmp
    support = fast.support()  # what must apply on the installed flwr (its tables)
    if support["waits"] is not None:  # not a release the fast path knows: it refuses to start
        res = subprocess.run(
            [sys.executable, "-m", "fedsgld", "supernode", "--", "--insecure"],
            env=flower_env(root / "home-refused"), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2 and "flower-supernode" in res.stderr, res.stderr
        return
    via = "superexec" if support["direct_launch"] is None else "shim"
    files = _site_files(root)
    certs = _certificates(root / "certs")
    keys = root / "keys"
    keys.mkdir()
    port = free_port()
    procs.start(
        "superlink",
        [sys.executable, "-m", "fedsgld", "superlink", "--",
         "--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["cert"]),
         "--ssl-keyfile", str(certs["key"]), "--enable-supernode-auth",
         "--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation"],
        flower_env(root / "home-link"),
    )  # fmt: skip
    procs.wait_listening("superlink", port)
    cli_home = root / "home-cli"
    write_connection(cli_home, "tlslink", port, ca=certs["ca"])
    cli_env = flower_env(cli_home)
    for k in range(SITES):
        key = _node_key(keys, f"site{k}")
        reg = flwr(["supernode", "register", f"{key}.pub", "tlslink"], cli_env, timeout=60)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    marks = root / "marks"
    marks.mkdir()
    sockets = []
    app = _bundle(root / "bundle")
    policies = _policies(root, [app])
    for k, f in enumerate(files):
        sock = Path(shim.private_dir(str(root / f"warm{k}"))) / "fork.sock"
        sockets.append(sock)
        env = flower_env(
            root / f"home-node{k}", FEDSGLD_TEST_MARKS=str(marks), FEDSGLD_WARM_SOCKET=str(sock)
        )
        procs.start(
            f"supernode-{k}",
            [sys.executable, "-m", "fedsgld", "supernode", "--",
             "--root-certificates", str(certs["ca"]),
             "--auth-supernode-private-key", str(keys / f"site{k}"),
             "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
             "--node-config", f"site-id={k} site-data='{f}' privacy-policy='{policies[k]}'"],
            env,
        )  # fmt: skip
    _wait_serving(sockets)
    rounds = 3
    _run(app, cli_env, "tlslink", root / "out", rounds, root / "flwr-run.log")
    by_node = _marks(marks)
    assert sorted(by_node) == [f"home-node{k}" for k in range(SITES)], by_node
    for node, seen in by_node.items():
        # every task imported the bundle's ClientApp module, in a process forked warm
        assert len(seen) >= _tasks_per_node(rounds), (node, seen)
        # handed to the fork server by the SuperExec itself where DIRECT_LAUNCH lists the
        # installed flwr, else through the shim
        assert all(w.split()[0].isdigit() and w.split()[1] == via for w in seen), (node, seen)
    for k in range(SITES):
        log = procs.log(f"supernode-{k}")
        assert "runs cold" not in log, log[-3000:]
        why = f"fedsgld: {fast.NO_DIRECT_LAUNCH}: {support['direct_launch']}"
        assert (why in log) == (via == "shim"), log[-3000:]


@pytest.mark.deploy
@pytest.mark.slow  # two runs on stock SuperNodes (3 s sleeps per round): about 2 minutes
def test_stock_supernodes_with_warm_sites_run_each_submitted_bundle(flower_tmp):
    """Flower's own flower-supernode, the shim first on PATH: the fork server starts on the
    first task; a second run with a different bundle then runs that bundle, warm."""
    root, procs = flower_tmp
    files = _site_files(root)
    port = free_port()
    procs.start(
        "superlink",
        [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation"],
        flower_env(root / "home-link"),
    )  # fmt: skip
    procs.wait_listening("superlink", port)
    shim_dir = root / "warm-bin"
    assert Path(shim.install_shim(str(shim_dir))).name == "flwr-clientapp"
    marks = root / "marks"
    marks.mkdir()
    sockets = []
    bundle = _bundle(root / "bundle")
    policies = _policies(root, [ROOT, bundle])  # each site approves both bundles
    for k, f in enumerate(files):
        sock = Path(shim.private_dir(str(root / f"warm{k}"))) / "fork.sock"
        sockets.append(sock)
        env = flower_env(
            root / f"home-node{k}",
            FEDSGLD_TEST_MARKS=str(marks),
            FEDSGLD_WARM_SOCKET=str(sock),
            FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.1",
        )
        env["PATH"] = os.pathsep.join([str(shim_dir), env["PATH"]])
        node = f"site-id={k} site-data='{f}' privacy-policy='{policies[k]}'"
        procs.start(
            f"supernode-{k}",
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
             "--port", str(free_port()), "--node-config", node],
            env,
        )  # fmt: skip
    cli_home = root / "home-cli"
    write_connection(cli_home, "loop", port)
    cli_env = flower_env(cli_home)
    # first run: the repository's own app; the first task of each node starts its server
    _run(ROOT, cli_env, "loop", root / "out1", 1, root / "flwr-run-1.log")
    assert not any(marks.iterdir())  # the unmodified app writes no markers
    _wait_serving(sockets)
    rounds = 2
    _run(bundle, cli_env, "loop", root / "out2", rounds, root / "flwr-run-2.log")
    by_node = _marks(marks)
    assert sorted(by_node) == [f"home-node{k}" for k in range(SITES)], by_node
    for node, seen in by_node.items():
        assert len(seen) >= _tasks_per_node(rounds), (node, seen)
        assert all(w.split()[0].isdigit() and w.split()[1] == "shim" for w in seen), (node, seen)


def _fake_flwr_version(d: Path, version: str) -> Path:
    """A directory whose flwr package metadata claims ``version`` (first on PYTHONPATH,
    it is what importlib.metadata, and so Flower itself, reports)."""
    meta = d / f"flwr-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flwr\nVersion: {version}\n")
    return d


def test_fast_path_refuses_an_unsupported_flwr_version(tmp_path):
    fake = _fake_flwr_version(tmp_path / "meta", "1.43.0")
    env = flower_env(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT), env.get("PYTHONPATH", "")])
    for command in ("supernode", "superlink"):
        t0 = time.monotonic()
        res = subprocess.run(
            [sys.executable, "-m", "fedsgld", command, "--", "--insecure"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2, res.stdout + res.stderr
        assert "supports flwr 1.41.0 and 1.42.0 only" in res.stderr, res.stderr
        assert "the installed flwr is 1.43.0" in res.stderr, res.stderr
        assert f"flower-{command}" in res.stderr  # says what to use instead
        assert time.monotonic() - t0 < 100  # refused before starting anything


def test_fast_path_refuses_flower_files_it_was_not_tested_with(tmp_path):
    version = fast.flower_version()
    if version not in fast.ADJUSTED:
        pytest.skip(f"flwr {version} is not one the fast path supports")
    import flwr

    for rel in fast.ADJUSTED[version]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(flwr.__file__).parent / rel, tmp_path / rel)
    fast.check_flower(version, tmp_path)  # the installed release's files pass
    f = tmp_path / "supernode" / "start_client_internal.py"
    f.write_text(f.read_text().replace("time.sleep(3)", "time.sleep(2)"))
    with pytest.raises(fast.UnsupportedFlower, match="start_client_internal.py"):
        fast.check_flower(version, tmp_path)
    with pytest.raises(fast.UnsupportedFlower, match="installed flwr is 1.40.2"):
        fast.check_flower("1.40.2", tmp_path)


def test_fork_server_refuses_to_preload_the_app_package(tmp_path):
    sock = Path(shim.private_dir(str(tmp_path / "w"))) / "fork.sock"
    with pytest.raises(ValueError, match="submitted app bundle"):
        warm.serve(str(sock), None, ["numpy", "fedsgld.config"])
    assert not sock.exists()


def test_debug_log_names_subpackages_a_task_imported_beyond_the_preload():
    """FEDSGLD_WARM_DEBUG's list: a new subpackage of a preloaded library by its first two
    names (the top-level name alone would hide it), a new library by its own; the app
    package and built-in modules never."""
    from fedsgld.deploy.warm_task import not_preloaded

    before = {"scipy", "scipy.stats", "numpy", "sys"}
    after = before | {"scipy.fft", "scipy.fft._basic", "cryptography.hazmat.primitives",
                      "cryptography", "fedsgld", "fedsgld.privacy", "_io"}  # fmt: skip
    assert not_preloaded(before, after) == ["cryptography", "scipy.fft"]
    assert not_preloaded(before, before) == []


def test_fork_server_socket_directory_must_be_private(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        shim.private_dir(str(d))
    with pytest.raises(PermissionError, match="mode 0700"):
        shim.socket_path([], {shim.ENV_SOCKET: str(d / "fork.sock")})


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow  # 7-16 s
def test_fork_server_hands_each_task_to_a_spare_forked_before_it(tmp_path):
    """Each task goes to a child the server forked before the task came (the fork is not on
    the task's path); every task is its own process with its own streams and exit status,
    and the waiting spare exits with the server."""
    d = shim.private_dir(str(tmp_path / "w"))
    sock = os.path.join(d, "fork.sock")
    log = tmp_path / "server.log"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    waiting = None
    with open(log, "wb") as f:
        server = subprocess.Popen(
            [sys.executable, "-m", "fedsgld.deploy.warm", "serve", "--socket", sock,
             "--owner-pid", str(owner.pid), "--preload", "json"],
            env={**os.environ, warm.ENV_DEBUG: "1"}, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_serving([Path(sock)], timeout=60)
        pids = []
        for _ in range(3):
            r, w = os.pipe()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(sock)
                first = shim.hand_over(c, ["--help"], [0, w, w])  # usage, exit status 0
                os.close(w)
                status = shim.recv_exact(c, shim.STATUS.size)
            with os.fdopen(r) as out:
                text = out.read()
            assert "pid" in first, first
            assert shim.STATUS.unpack(status)[0] == 0
            assert "usage" in text.lower(), text
            pids.append(first["pid"])
        assert len(set(pids)) == 3 and server.pid not in pids
        lines = log.read_text().splitlines()
        ready = [int(x.split("spare ")[1].split()[0]) for x in lines if x.endswith(" ready")]
        for n, pid in enumerate(pids, 1):
            assert any(x.endswith(f"task {n}: spare {pid}") for x in lines), lines
            assert pid in ready  # forked before its task came
        waiting = ready[-1]
        assert waiting not in pids and not _gone(waiting)
    finally:
        owner.kill()
        owner.wait()
        try:
            server.wait(timeout=30)  # it exits with its owner
        finally:
            if server.poll() is None:  # it did not: stopped by its PID all the same
                server.kill()
                server.wait()
    assert waiting is not None
    end = time.monotonic() + 10
    while not _gone(waiting) and time.monotonic() < end:
        time.sleep(0.1)
    assert _gone(waiting), "the waiting spare outlived its fork server"
