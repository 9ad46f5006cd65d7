"""The fast path's direct launch: the SuperExec of ``fedsgld supernode`` hands each
``flwr-clientapp`` task straight to the warm fork server (:mod:`fedsgld.deploy.warm`), as
the shim would, without starting the shim's interpreter first."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

from fedsgld.deploy import shim
from fedsgld.deploy.releases import DIRECT_LAUNCH, release_mismatch

NO_DIRECT_LAUNCH = "tasks reach the warm fork server through the flwr-clientapp shim"


class _Handed:
    """What a task handed straight to the fork server returns in place of a ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


class _DirectLaunch:
    """Stands in for the ``subprocess`` module inside Flower's ``SubprocessExecutor``: a
    ``flwr-clientapp`` task goes straight to the SuperNode's warm fork server, exactly as
    the shim would hand it over (same arguments, environment, working directory and
    standard streams), without starting the shim's interpreter first (about 25 ms of CPU
    and more of latency per message). Anything else, or a task the fork server does not
    take, is started by ``subprocess.Popen`` as before (the shim then decides)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def Popen(self, args, *a, **kw):  # noqa: N802 - the name Flower calls
        handed = None
        if not a and isinstance(args, list) and args and args[0] == "flwr-clientapp":
            handed = hand_to_fork_server(args[1:], quiet=kw.get("stdout") == self._real.DEVNULL)
        return handed if handed is not None else self._real.Popen(args, *a, **kw)


def hand_to_fork_server(args: list[str], *, quiet: bool = False) -> _Handed | None:
    """Hand one ``flwr-clientapp ARGS`` task to the fork server of this SuperNode
    (``FEDSGLD_WARM_SOCKET``); None when it is not serving or refuses the task. A thread
    waits for the task's exit status, as the shim would."""
    if shim.why_cold(args) is not None or not os.environ.get(shim.ENV_SOCKET):
        return None
    try:
        path = shim.socket_path(args)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(10.0)
        conn.connect(path)
    except OSError:
        return None
    devnull = os.open(os.devnull, os.O_RDWR) if quiet else None
    try:
        fds = [0, devnull, devnull] if devnull is not None else [0, 1, 2]
        first = shim.hand_over(conn, args, fds, via="superexec")
    finally:
        if devnull is not None:
            os.close(devnull)
    if "pid" not in first:
        conn.close()
        return None

    def wait() -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(None)
            shim.recv_exact(conn, shim.STATUS.size)

    threading.Thread(target=wait, name="fedsgld-task-status", daemon=True).start()
    return _Handed(int(first["pid"]))


def direct_launch(version: str | None = None, root: str | Path | None = None) -> bool:
    """Tasks of the SuperExec in this process go straight to the warm fork server (flwr
    releases in :data:`DIRECT_LAUNCH`, file unchanged); returns whether it applies."""
    why = release_mismatch(DIRECT_LAUNCH, version, root)
    if why is not None:
        print(f"fedsgld: {NO_DIRECT_LAUNCH}: {why}", file=sys.stderr, flush=True)
        return False
    import subprocess as real

    from flwr.supercore.superexec.executor import subprocess_executor as se

    if se.subprocess is not real:
        why = "flwr's SubprocessExecutor does not use the subprocess module as expected"
        print(f"fedsgld: {NO_DIRECT_LAUNCH}: {why}", file=sys.stderr, flush=True)
        return False
    se.subprocess = _DirectLaunch(real)
    return True
