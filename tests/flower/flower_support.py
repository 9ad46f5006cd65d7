"""Helpers for the Flower tests: small configs, process isolation and clean-up.

Every Flower process gets its own FLWR_HOME under the test's tmp directory, telemetry,
update checks and runtime dependency installation are off, only loopback addresses are
used, and every process a test starts (including the detached local SuperLink that
``flwr run`` leaves behind, and the SuperExec children) is stopped by a finalizer: the
processes are found by the test's unique tmp path in their command line or environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# A small, fast federation (synthetic data, an MLP): the engine's test settings.
SMALL: dict = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 3,
    "rounds": 12,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 0.5,
    "decay_gamma": 0.5,
    "decay_t0": 5.0,
    "prenoise": 0.01,
    "epsilon": 50.0,
    "eval_every": 4,
    "burn_in": 4,
    "thin": 2,
    "max_samples": 3,
    "checkpoint_every": 5,
    "seed": 3,
}


def run_config_arg(cfg: dict) -> str:
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


def _pids_tagged(tag: str) -> list[int]:
    """PIDs (ours) whose command line or environment mentions ``tag``."""
    me = os.getpid()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            blob = (d / "cmdline").read_bytes() + b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        if tag.encode() in blob:
            found.append(int(d.name))
    return found


def stop_tagged(tag: str, timeout: float = 15.0) -> None:
    """Stop every process started under ``tag`` (SIGTERM, then SIGKILL)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_tagged(tag)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < end and _pids_tagged(tag):
            time.sleep(0.2)


class Processes:
    """Long-running Flower processes of one test; all stopped at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            start_new_session=True,
        )
        self.procs[name] = p
        return p

    def wait_listening(self, name: str, port: int, timeout: float = 120.0) -> None:
        wait_port(port, timeout, proc=self.procs[name], log=self.root / f"{name}.log")

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        stop_tagged(str(self.root))


@pytest.fixture
def flower_tmp(tmp_path_factory):  # imported by the test modules that need it
    """A short, unique directory for one test's Flower processes (stopped at teardown)."""
    root = tmp_path_factory.mktemp("flwr")
    procs = Processes(root)
    yield root, procs
    procs.stop()


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
