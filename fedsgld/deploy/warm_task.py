"""A warm site's task process: forked from the fork server (:mod:`fedsgld.deploy.warm`),
it becomes Flower's ``flwr-clientapp`` for one task, exactly as a fresh process would
(the task's arguments, environment, working directory and standard streams; the server's
own ``fedsgld`` modules dropped; global generators reseeded; the app bundle checked
against the site's policy before Flower installs it; one difference: the bundle's bytecode
is cached in its install directory even where ``PYTHONDONTWRITEBYTECODE`` is set). A spare
is such a process forked before its task arrives."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

from fedsgld.clients.approval import LOG as APPROVAL_LOG
from fedsgld.clients.approval import guard_clientapp
from fedsgld.deploy.shim import HEADER, STATUS, send_json

ENV_CHILD = "FEDSGLD_WARM_SITE"  # set in every forked task: the fork server's pid
ENV_VIA = "FEDSGLD_WARM_VIA"  # set in every forked task: "shim" or "superexec" (fast path)
ENV_DEBUG = "FEDSGLD_WARM_DEBUG"  # set: each task logs its run time and unpreloaded imports
ENV_PROFILE = "FEDSGLD_WARM_PROFILE"  # a directory: each task writes its cProfile there

NEVER_PRELOAD = ("fedsgld",)  # app packages: the bundle's copy must be the one that runs


def _log(msg: str) -> None:
    t = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    print(f"{stamp} [fedsgld warm {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _app_modules() -> list[str]:
    return [m for m in sys.modules if m.split(".")[0] in NEVER_PRELOAD]


def not_preloaded(before: set[str], after: set[str]) -> list[str]:
    """What a task imported beyond the server's preload: new top-level packages, and new
    subpackages of preloaded ones by their first two names (``scipy.fft`` where ``scipy``
    was preloaded, which the top-level name alone would hide); app packages and built-in
    modules left out."""
    tops = {m.split(".")[0] for m in before}
    out = set()
    for name in after - before:
        parts = name.split(".")
        if parts[0] in NEVER_PRELOAD or parts[0] in sys.builtin_module_names:
            continue
        out.add(".".join(parts[:2]) if parts[0] in tops else parts[0])
    return sorted(out)


def _recv_request(conn: socket.socket, maxfds: int = 3) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, maxfds)
    fds = list(fds)
    try:
        if len(data) < HEADER.size:
            raise ConnectionError("short request")
        (n,) = HEADER.unpack_from(data)
        body = bytearray(data[HEADER.size :])
        while len(body) < n:
            chunk = conn.recv(n - len(body))
            if not chunk:
                raise ConnectionError("request cut short")
            body += chunk
        return json.loads(bytes(body)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _reseed_after_fork() -> None:
    """The child's global generators as a fresh interpreter's (``random``: CPython)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # from the OS, as numpy does at import


def _child(conn: socket.socket, req: dict, fds: list[int], server: int) -> None:
    """In the forked process: become Flower's ``flwr-clientapp`` for this task."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ[ENV_CHILD] = str(server)
        os.environ[ENV_VIA] = "superexec" if req.get("via") == "superexec" else "shim"
        os.chdir(req["cwd"])
        sys.argv = list(req["argv"])
        for name in _app_modules():  # the server's own fedsgld: the bundle's must load
            del sys.modules[name]
        importlib.invalidate_caches()
        # the bundle's bytecode is cached beside it in Flower's install directory even where
        # PYTHONDONTWRITEBYTECODE is set (as in many container images): otherwise every
        # task compiles the whole app's source again (a quarter of a short task's CPU)
        sys.dont_write_bytecode = False
        _reseed_after_fork()
        send_json(conn, {"pid": os.getpid()})
        try:  # the site's check of the app bundle, before Flower installs or loads it
            guard_clientapp()
        except RuntimeError as e:
            print(f"{APPROVAL_LOG}: {e}", file=sys.stderr, flush=True)
            return  # exit status 1 (below)
        from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

        debug = bool(os.environ.get(ENV_DEBUG))
        before = set(sys.modules) if debug else set()
        t0, c0 = time.monotonic(), time.process_time()
        profile_dir = os.environ.get(ENV_PROFILE)
        prof = None
        if profile_dir:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        try:
            flwr_clientapp()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if prof is not None:
            prof.disable()
            with contextlib.suppress(OSError):
                prof.dump_stats(os.path.join(profile_dir, f"task-{os.getpid()}.prof"))
        if debug:
            libs = not_preloaded(before, set(sys.modules))
            _log(
                f"task done (exit {code}) in {time.monotonic() - t0:.3f} s "
                f"({time.process_time() - c0:.3f} s CPU); "
                f"imported packages not preloaded: {libs}"
            )
    except BaseException:  # noqa: BLE001 - the task's process must always report
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            conn.sendall(STATUS.pack(code))
        os._exit(code)


class _Spare:
    """A child forked before its task arrives, so that a task does not wait for the fork
    (about 15 ms of copying page tables for a server that has imported torch) nor for
    the child's first steps. It is forked from the same server state as a child forked on
    demand (the server runs no task code between tasks), and becomes a task exactly as
    one: :func:`_child` with the task's request, connection and standard streams, sent to
    it over a socket pair. It holds nothing of a task before then; it exits when the
    server closes its end (the server stopped, or another spare replaced it)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def fork(cls, lsock: socket.socket, server: int) -> _Spare | None:
        if threading.active_count() != 1:
            return None
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:  # tasks are forked when they come
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGHUP, signal.SIG_DFL)
                lsock.close()
                ours.close()
                try:
                    req, fds = _recv_request(theirs, maxfds=4)
                except (OSError, ValueError, ConnectionError):
                    os._exit(0)  # never used: the server closed its end
                if len(fds) != 4:
                    os._exit(0)
                theirs.close()
                conn = socket.socket(fileno=fds[0])
                _child(conn, req, fds[1:], server)  # exits
            except BaseException:  # noqa: BLE001 - never return into the server's loop
                code = 1
            os._exit(code)
        theirs.close()
        return cls(pid, ours)

    def take(self, conn: socket.socket, req: dict, fds: list[int]) -> bool:
        """Hand the task to this spare; False if it is gone (the task is then forked)."""
        try:
            send_json(self.sock, req, [conn.fileno(), *fds])
            return True
        except OSError:
            return False
        finally:
            self.sock.close()
