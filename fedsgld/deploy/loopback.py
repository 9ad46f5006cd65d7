"""A whole Flower deployment on loopback: one SuperLink, one SuperNode per site, ``flwr run``.

What the deployment tests and ``benchmarks/secagg_cost.py --loopback`` start: Flower's own
``flower-superlink`` and ``flower-supernode`` (insecure, 127.0.0.1 only), every process
with its own FLWR_HOME under one directory, telemetry, update checks and runtime
dependency installation off. Every process this module starts leads its own process
group (its SuperExec children join it) and :meth:`Processes.stop` stops exactly those
groups, by the PIDs it started: never by a name.

    with Loopback(root) as lo:
        lo.start(["site-id=0 site-data='/data/site-0.npz'", ...])
        results = lo.run({"sites": 1, "rounds": 3, "out": "/tmp/out"})
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedsgld.clients.approve import approve
from fedsgld.config import load_config
from fedsgld.deploy.shim import install_shim
from fedsgld.deploy.staging import stage_app

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]  # the app's directory (its pyproject.toml)


def run_config_arg(cfg: dict[str, Any]) -> str:
    """A ``--run-config`` string (TOML values)."""
    parts = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
        elif isinstance(v, str):
            parts.append(f"{k}='{v}'")
        else:
            parts.append(f"{k}={v!r}")
    return " ".join(parts)


def flower_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of one Flower process: its own FLWR_HOME, nothing phoned home."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PYTHONUNBUFFERED="1",
        RAY_USAGE_STATS_ENABLED="0",
        # SuperLink and SuperNode start `flower-superexec` by name: the venv's bin must be on PATH
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
    )
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int,
    timeout: float = 120.0,
    *,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    """Wait until something listens on ``port``; fail with the process's log if it exits or hangs."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-4000:] if log is not None and log.is_file() else ""
    state = (
        f"exited with {proc.returncode}"
        if proc is not None and proc.poll() is not None
        else "still running"
    )
    raise TimeoutError(
        f"nothing listens on 127.0.0.1:{port} after {timeout:g} s (process {state}); its log:\n{tail}"
    )


def write_connection(home: Path, name: str, port: int, *, ca: Path | None = None) -> None:
    """The ``flwr`` CLI's config in ``home``: connection ``name`` to 127.0.0.1:``port``."""
    home.mkdir(parents=True, exist_ok=True)
    tls = f'root-certificates = "{ca}"' if ca is not None else "insecure = true"
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\n{tls}\n'
    )


def link_address_args(port: int) -> list[str]:
    """Fleet and Control APIs on one port; the SuperLink never installs dependencies."""
    return ["--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation"]


def supernode_args(
    link_port: int, node_port: int, node_config: str, security: list[str]
) -> list[str]:
    return [
        str(BIN / "flower-supernode"),
        *security,
        "--superlink",
        f"127.0.0.1:{link_port}",
        "--port",  # the node's local runtime API: co-located nodes need distinct ports
        str(node_port),
        "--node-config",
        node_config,
    ]


def flwr(
    args: list[str], env: dict[str, str], *, timeout: float, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "flwr"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """The PIDs of every living process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        procs = list(Path("/proc").iterdir())
    except OSError:  # not Linux: none found
        procs = []
    for d in procs:
        if not d.name.isdigit():
            continue
        try:  # the field after the command's closing parenthesis: state, then ppid
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Processes:
    """Long-running Flower processes, each the leader of its own process group; logs in
    ``root``. :meth:`stop` ends exactly the groups it started (SIGTERM, then SIGKILL)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start ``args`` as ``name`` (its log ``root/name.log``, appended to on a restart)."""
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            start_new_session=True,
        )
        log.close()  # the child holds its own copy
        self.procs[name] = p
        self.commands[name] = (list(args), dict(env))
        return p

    def restart(self, name: str) -> subprocess.Popen:
        """Start ``name`` again with its command and environment (after it was killed).
        The old group is killed first: nothing of it outlives the restart."""
        old = self.procs[name]
        self._signal_group(old.pid, signal.SIGKILL)
        old.wait(timeout=15)
        return self.start(name, *self.commands[name])

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to ``name``'s process group: the process and every child it started."""
        self._signal_group(self.procs[name].pid, sig)

    def descendants(self, name: str, contains: str = "") -> list[int]:
        """PIDs of every process ``name`` started, directly or not, whose command line
        contains ``contains`` (Flower's SuperLink starts its SuperExec in a session of its
        own, so its ServerApps are not in the SuperLink's process group)."""
        return [pid for pid in descendants(self.procs[name].pid) if contains in _cmdline(pid)]

    def wait_listening(self, name: str, port: int, timeout: float = 120.0) -> None:
        wait_port(port, timeout, proc=self.procs[name], log=self.root / f"{name}.log")

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)  # the group this module's Popen made: its PID is the group id
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        # everything they started, also in sessions of its own (the SuperLink's SuperExec)
        started = [pid for p in self.procs.values() for pid in descendants(p.pid)]
        for p in self.procs.values():
            self._signal_group(p.pid, signal.SIGCONT)  # a stopped group cannot take SIGTERM
            self._signal_group(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
            self._signal_group(p.pid, signal.SIGKILL)  # children that outlived their leader
        for pid in started:  # by PID, the ones we saw: none outlives the deployment
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


class Loopback:
    """One SuperLink and its SuperNodes under ``root`` (a context manager: stopped at exit)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.procs = Processes(self.root)
        self.port = 0

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.stop()

    def start(
        self,
        node_configs: list[str],
        *,
        warm: bool = False,
        fast: bool = False,
        task_poll: float = 0.1,
        timeout: float = 120.0,
    ) -> None:
        """The SuperLink, then one SuperNode per entry of ``node_configs`` (``--node-config``).

        ``warm``: warm sites on the stock SuperNodes (docs/deployment.md): the
        ``flwr-clientapp`` shim first on each node's PATH, tasks polled every ``task_poll``
        seconds; each site's policy must then approve the bundle (:func:`approved_policy`).
        Otherwise every task starts a fresh ``flwr-clientapp`` interpreter, as Flower's own.
        ``fast``: the fast path instead (:mod:`fedsgld.deploy.fast`: ``python -m
        fedsgld.deploy superlink|supernode --`` around Flower's own commands, warm sites
        included; flwr 1.41/1.42 only, it refuses to start on another release).
        """
        extra: dict[str, str] = {}
        shims: Path | None = None
        wrap = [sys.executable, "-m", "fedsgld.deploy"]
        link = [*wrap, "superlink", "--"] if fast else [str(BIN / "flower-superlink")]
        if warm and not fast:
            shims = Path(install_shim(str(self.root / "warm-bin"))).parent
            extra["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = f"{task_poll:g}"
        self.port = free_port()
        self.procs.start(
            "superlink",
            [*link, "--insecure", *link_address_args(self.port)],
            flower_env(self.root / "home-link"),
        )
        self.procs.wait_listening("superlink", self.port, timeout)
        for k, nc in enumerate(node_configs):
            args = supernode_args(self.port, free_port(), nc, ["--insecure"])
            if fast:  # Flower's own arguments after the fast path's command
                args = [*wrap, "supernode", "--", *args[1:]]
            self.procs.start(f"supernode-{k}", args, self._node_env(k, extra, shims))
        write_connection(self.root / "home-cli", "loop", self.port)

    def _node_env(self, k: int, extra: dict[str, str], shims: Path | None) -> dict[str, str]:
        env = flower_env(self.root / f"home-node{k}", **extra)
        if shims is not None:
            env["PATH"] = os.pathsep.join([str(shims), env["PATH"]])
        return env

    def run(self, run_config: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
        """``flwr run . loop --stream`` with ``run_config`` (which names ``out``); its
        results.json. The stream's log is kept in ``root/flwr-run.log``."""
        return self.submit(run_config, name="flwr-run").result(timeout)

    def submit(self, run_config: dict[str, Any], *, name: str = "flwr-run") -> Submitted:
        """Start ``flwr run . loop --stream`` with ``run_config`` and return at once (its
        output in ``root/<name>.log``): several runs may use the deployment at one time."""
        app = self.root / "app"  # the bundle's files only: the same bytes as `flwr run .`
        if not (app / "pyproject.toml").is_file():
            shutil.rmtree(app, ignore_errors=True)
            stage_app(ROOT, app)
        args = ["run", str(app), "loop", "--stream", "--run-config", run_config_arg(run_config)]
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            [str(BIN / "flwr"), *args],
            env=flower_env(self.root / "home-cli"),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return Submitted(p, self.root / f"{name}.log", Path(run_config["out"]))


class Submitted:
    """One ``flwr run --stream`` started by :meth:`Loopback.submit`."""

    def __init__(self, proc: subprocess.Popen, log: Path, out: Path) -> None:
        self.proc, self.log, self.out = proc, log, out

    def wait(self, timeout: float = 600.0) -> int:
        """Its exit status (killed after ``timeout`` s: a TimeoutError)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
            raise TimeoutError(f"flwr run still running after {timeout:g} s") from None

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Its results.json; a RuntimeError with the stream's end where there is none."""
        code = self.wait(timeout)
        if code != 0 or not (self.out / "results.json").is_file():
            # `flwr run --stream` can exit 0 for a failed run: the result file is the proof
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"flwr run failed (exit {code}):\n{tail}")
        return json.loads((self.out / "results.json").read_text())


def approved_policy(path: Path, text: str) -> Path:
    """A site's privacy-policy file: ``text``, and ``approved_apps`` naming the bundle
    ``flwr run .`` submits from this checkout (what a warm site checks before it runs it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    approve(ROOT, path)
    return path


# a loopback deployment's sites (one machine, one owner): every placement, exact sizes
LOOPBACK_POLICY = (
    "epsilon = 1000.0\nplacements = ['secure', 'sites', 'server']\n"
    "public_records = 'exact'\npublic_test_records = 'exact'\n"
)


def site_node_configs(
    run_config: dict[str, Any],
    root: Path,
    *,
    policy: str | None = LOOPBACK_POLICY,
    sites: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Node configs of deployed sites for ``run_config``'s data: each site's own records
    file (the engine's split, ``export_sites``) under ``root/data`` and, unless ``policy``
    is None, its own policy file ``root/site<k>/policy.toml`` holding ``policy`` (its
    ledger beside it). ``sites``: which sites (default: all)."""
    # torch (through the federation): only the sites' files need it, not `fedsgld deploy local`
    from fedsgld.deploy.export_sites import export_sites

    keys = {k: v for k, v in run_config.items() if "-" not in k and k not in ("out", "resume")}
    files = export_sites(load_config(None, keys), Path(root) / "data")
    out = []
    for k in sites if sites is not None else range(len(files)):
        nc: dict[str, Any] = {"site-id": k, "site-data": str(files[k])}
        if policy is not None:
            p = Path(root) / f"site{k}" / "policy.toml"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(policy)
            nc["privacy-policy"] = str(p)
        out.append(nc)
    return out
