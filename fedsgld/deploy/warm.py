"""Warm sites: Flower's per-message ``flwr-clientapp`` process, forked from a warm one.

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode
receives (the executable of that name on ``PATH``); a fresh interpreter importing torch
and flwr costs seconds per message and per site. Here:

* a **fork server** (one per SuperNode) imports the heavy *libraries* once
  (:data:`DEFAULT_PRELOAD`: torch, numpy, scipy, httpx, flwr's ClientApp runtime) and
  waits on a Unix socket in a directory private to the user (mode 0700; the peer's uid is
  checked too, since every request carries a Flower task token);
* the **shim** (:mod:`fedsgld.deploy.shim`), installed as ``flwr-clientapp`` first on the
  SuperNode's ``PATH``, hands each task to it. The server forks; the child takes the
  task's arguments, environment, working directory and stdin/stdout/stderr and runs
  Flower's own ``flwr-clientapp`` entry point, which pulls the task, installs the app
  bundle, loads the ClientApp from it and runs it, exactly as a fresh process would. The
  shim exits with the child's status. Without a serving fork server the shim starts one
  in the background and runs Flower's own ``flwr-clientapp``.

What runs is the submitted app bundle's code. Flower's ``load_app`` reuses any module
already in ``sys.modules``, so a preloaded app package would silently run the site's
installed copy instead of the bundle: the server refuses to preload ``fedsgld`` (and
checks that no library imported it), and each child drops every ``fedsgld`` module (the
server's own code) before Flower loads the bundle. The site's shard and model are rebuilt
in each task from ``context.state``, which Flower keeps per run, as in a cold process.

Each child starts as a fresh interpreter would: CPython reseeds ``random`` at fork, numpy's
global generator is reseeded from the OS, torch's default generator is untouched (the
server draws nothing from it). The server never starts a Python thread and runs no torch
operation; it refuses to fork (the task then runs cold) if a Python thread appeared.
Variables read when libraries are imported (``PYTHON*``, ``OMP_*``, ``MKL_*``, ``TORCH*``,
``FLWR_TELEMETRY*``, ...) must be the same in the task's environment as in the server's,
otherwise the task runs cold. Each forked task has ``FEDSGLD_WARM_SITE`` set to the fork
server's pid and ``FEDSGLD_WARM_VIA`` to how it was handed over (``shim``, or
``superexec``: the fast path's SuperExec hands tasks over itself); with
``FEDSGLD_WARM_DEBUG=1`` it logs its run time and the library modules it imported that
were not preloaded (candidates for ``--preload``).

    python -m fedsgld.deploy.warm install-shim DIR     # writes DIR/flwr-clientapp
    PATH=DIR:$PATH FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.02 flower-supernode ...

A fork server stops when its owner exits: the SuperExec that ran the shim (its
``--parent-pid``), or ``fedsgld supernode``. Linux (Unix sockets, ``fork``,
``SO_PEERCRED``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from fedsgld.deploy.bundles import reuse_installed_bundle
from fedsgld.deploy.releases import check_flower
from fedsgld.deploy.shim import (
    ENV_MODE,
    ENV_SOCKET,
    SHIM_NAME,
    alive,
    install_shim,
    private_dir,
    send_json,
    socket_path,
    start_server,
)
from fedsgld.deploy.waits import adjust_pull_backoff, backoff_from_env
from fedsgld.deploy.warm_task import (
    ENV_CHILD,
    ENV_DEBUG,
    ENV_PROFILE,
    ENV_VIA,
    NEVER_PRELOAD,
    _app_modules,
    _child,
    _log,
    _recv_request,
    _Spare,
)

# What a fedsgld site task imports besides fedsgld itself (FEDSGLD_WARM_DEBUG lists the
# rest); libraries only, never an app package.
DEFAULT_PRELOAD = (
    "numpy",
    "torch",
    "torch.func",
    "torch._dynamo",  # torch.func.grad imports it on first use: seconds per task otherwise
    "scipy.special",
    "scipy.stats",
    "scipy.optimize",
    "httpx",
    "httpcore",  # httpx imports it when the task's client is made
    "h11",
    "encodings.cp437",  # zipfile, when Flower unpacks the app bundle
    "flwr.app",
    "flwr.clientapp",
    "flwr.supernode.cli.flwr_clientapp",
    "flwr.supernode.runtime.run_clientapp",
)
# environment variables that take effect when a library is imported, not per task
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "CUDA_", "FLWR_TELEMETRY")


__all__ = [
    "DEFAULT_PRELOAD",
    "ENV_CHILD",
    "ENV_DEBUG",
    "ENV_PROFILE",
    "ENV_VIA",
    "ENV_MODE",
    "ENV_SOCKET",
    "install_shim",
    "serve",
    "socket_path",
    "start_server",
]


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _peer_uid(conn: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None  # the private directory is the guard
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _refusal(req: dict, fds: list[int], base_env: dict[str, str]) -> str | None:
    if (
        len(fds) != 3
        or not isinstance(req.get("argv"), list)
        or not isinstance(req.get("env"), dict)
        or not isinstance(req.get("cwd"), str)
    ):
        return "malformed request"
    diff = set(base_env.items()) ^ set(_import_env(req["env"]).items())
    if diff:
        names = sorted({k for k, _ in diff})
        return f"import-time environment differs from the fork server's ({', '.join(names)})"
    if threading.active_count() != 1:
        return "the fork server has a thread; forking is unsafe"
    return None


def _preload(preload: list[str]) -> tuple[dict[str, str], float]:
    """Import ``preload`` (libraries only, never an app package); the import-time
    environment as it was before the imports, and when the imports started."""
    bad = [m for m in preload if m.split(".")[0] in NEVER_PRELOAD]
    if bad:
        raise ValueError(
            f"preload must not name app packages ({', '.join(bad)}): Flower would run "
            "the preloaded copy instead of the submitted app bundle"
        )
    base_env = _import_env(dict(os.environ))  # before the imports (torch sets some itself)
    server_modules = set(_app_modules())  # this module's own package
    t0 = time.monotonic()
    for m in preload:
        importlib.import_module(m)
    leaked = sorted(set(_app_modules()) - server_modules)
    if leaked:
        raise RuntimeError(f"preloading imported app modules {leaked}; refusing to serve")
    return base_env, t0


def _listen(path: str) -> tuple[socket.socket, int]:
    """A listening socket at ``path`` (private directory, mode 0600) and its inode."""
    private_dir(os.path.dirname(os.path.abspath(path)))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        lsock.bind(path)
    finally:
        os.umask(old)
    lsock.listen(64)
    return lsock, os.stat(path).st_ino


_REFUSED = "refused"  # a connection answered with a refusal: the loop waits for the next


def _task(conn, lsock, spare: _Spare | None, base_env: dict[str, str], me: int):
    """Take one task from ``conn``: hand it to ``spare``, or fork a child for it. Returns
    (pid, "spare" or "forked"); :data:`_REFUSED` for a connection refused; None for a bad
    request. ``conn`` and the task's descriptors are closed here in the server."""
    fds: list[int] = []
    try:
        conn.settimeout(10.0)
        if _peer_uid(conn) not in (None, os.getuid()):
            _log("refused a connection from another user")
            return _REFUSED
        req, fds = _recv_request(conn)
        why = _refusal(req, fds, base_env)
        if why:
            _log(f"task refused: {why}")
            send_json(conn, {"error": why})
            return _REFUSED
        conn.settimeout(None)
        if spare is not None and spare.take(conn, req, fds):
            return spare.pid, "spare"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            lsock.close()
            _child(conn, req, fds, me)
        return pid, "forked"
    except (OSError, ValueError, ConnectionError) as e:
        _log(f"bad request: {e!r}")
        return None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()


def _loop(lsock: socket.socket, owner_pid: int | None, base_env: dict[str, str]) -> int:
    """Fork one child per task (through a spare forked ahead) until the owner exits."""
    served = 0
    debug = bool(os.environ.get(ENV_DEBUG))
    me = os.getpid()

    def new_spare() -> _Spare | None:
        sp = _Spare.fork(lsock, me)
        if debug and sp is not None:
            _log(f"spare {sp.pid} ready")
        return sp

    spare = new_spare()
    try:
        while True:
            ready, _, _ = select.select([lsock], [], [], 0.5)
            if owner_pid is not None and not alive(owner_pid):
                _log(f"owner {owner_pid} exited; stopping after {served} tasks")
                return 0
            if not ready:
                continue
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            taken = _task(conn, lsock, spare, base_env, me)
            if taken == _REFUSED:
                continue
            if taken is not None:
                served += 1
                spare = None  # taken, or gone
                if debug:
                    _log(f"task {served}: {taken[1]} {taken[0]}")
            if spare is None:  # the next task's, forked while this one runs; forked only
                # now, so that it holds none of this task's connection or streams
                spare = new_spare()
    finally:
        if spare is not None:
            spare.sock.close()  # the spare exits


def serve(path: str, owner_pid: int | None, preload: list[str]) -> int:
    """Import ``preload``, listen on ``path`` and fork one child per task until the owner
    process (the SuperNode's SuperExec, or ``fedsgld supernode``) exits."""
    base_env, t0 = _preload(preload)
    backoff = backoff_from_env()  # set by `fedsgld supernode`: its children pull the same way
    if backoff is not None:
        check_flower()
        adjust_pull_backoff(*backoff)
        reuse_installed_bundle()  # the fast path: installed bundles are not unpacked again
    gc.freeze()  # what is loaded now stays shared with the children (fewer copied pages)
    lsock, ino = _listen(path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel

    def _stop(signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    _log(f"serving {path} (preloaded {len(preload)} modules in {time.monotonic() - t0:.1f} s)")
    try:
        return _loop(lsock, owner_pid, base_env)
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        lsock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fedsgld.deploy.warm", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser(
        "install-shim", help=f"write DIR/{SHIM_NAME} (put DIR first on the SuperNode's PATH)"
    )
    ins.add_argument("dir")
    srv = sub.add_parser("serve", help="run a fork server (the shim starts one when needed)")
    srv.add_argument("--socket", required=True)
    srv.add_argument("--owner-pid", type=int, default=None, help="stop when this process exits")
    srv.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        help="comma-separated library modules to import once (never the app's own package)",
    )
    args = ap.parse_args(argv)
    if args.cmd == "install-shim":
        print(install_shim(args.dir))
        return 0
    preload = [m.strip() for m in args.preload.split(",") if m.strip()]
    try:
        return serve(args.socket, args.owner_pid, preload)
    except Exception as e:  # shims stop starting servers for this owner (shim.connect)
        _log(f"error: {e!r}")
        with contextlib.suppress(OSError), open(args.socket + ".failed", "w") as f:
            f.write(f"{args.owner_pid} {e!r}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
