"""The fast path: Flower's own SuperNode and SuperLink with their fixed waits shortened.

    fedsgld supernode [--pull-interval S] [--predict F] [--reply-poll S] [--pull-backoff S]
        [--pull-backoff-cap S] [--task-poll S] [--active-for S] [--no-warm]
        -- FLOWER-SUPERNODE-ARGUMENTS
    fedsgld superlink [--pull-backoff S] [--pull-backoff-cap S] -- FLOWER-SUPERLINK-ARGUMENTS

Opt-in. Each runs Flower's own ``flower-supernode`` / ``flower-superlink`` (same flags,
TLS, SuperNode authentication, SuperExec, ClientApp and ServerApp processes) in this
process after adjusting, at run time, the waits that Flower 1.41/1.42 hard-codes:

``fedsgld supernode`` shortens the empty-pull sleep while a run is active (predicting the
next message from the last waits), polls for the ClientApp's reply every ``--reply-poll``,
wakes its SuperExec the moment a message is stored, shortens the object-pull backoff,
starts warm sites (:mod:`fedsgld.deploy.warm`) unless ``--no-warm``, and runs approved
bundles only (:mod:`fedsgld.clients.approval`; ``--no-policy`` to start without a
policy). ``fedsgld superlink`` shortens its ServerApp's object-pull backoff. Every option's
default is in ``--help``; why each wait, and what it costs: docs/architecture.md, "Design
notes". Nothing else changes (messages, retries, timeouts, authentication and the apps
are Flower's), and the command refuses to start unless the installed flwr is one of
:data:`SUPPORTED` with every adjusted file byte-identical to that release's
(:data:`ADJUSTED`).

This module holds the two commands (their options, and what they run in the SuperNode,
SuperExec, SuperLink and ServerApp processes). The parts they apply are modules of their
own: the checked releases :mod:`fedsgld.deploy.releases`, the waits
:mod:`fedsgld.deploy.waits`, the installed-bundle shortcut :mod:`fedsgld.deploy.bundles`
and the direct launch :mod:`fedsgld.deploy.launch`; their names stay importable from here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedsgld.clients import approval
from fedsgld.deploy import shim
from fedsgld.deploy.bundles import (
    INSTALLED_MARK,
    NO_BUNDLE_REUSE,
    bundle_installer,
    reuse_installed_bundle,
)
from fedsgld.deploy.fast_options import add_superlink_arguments, add_supernode_arguments
from fedsgld.deploy.launch import NO_DIRECT_LAUNCH, direct_launch, hand_to_fork_server
from fedsgld.deploy.releases import (
    ADJUSTED,
    BUNDLE_REUSE,
    DIRECT_LAUNCH,
    STOCK,
    SUPPORTED,
    UnsupportedFlower,
    check_flower,
    flower_version,
    release_mismatch,
)
from fedsgld.deploy.waits import (
    ENV_BACKOFF,
    ENV_WAKE,
    FLOWER_EMPTY_PULL_SLEEP,
    FLOWER_PULL_BACKOFF,
    FLOWER_PULL_TRIES,
    FLOWER_REPLY_SLEEP,
    POLL_BACKOFF,
    _Waits,
    _Wakeable,
    adjust_pull_backoff,
    adjust_supernode,
    backoff_from_env,
)

# what tests, the warm sites and the benchmarks import from here (the fast path's parts)
__all__ = [
    "ADJUSTED",
    "BUNDLE_REUSE",
    "DIRECT_LAUNCH",
    "FLOWER_EMPTY_PULL_SLEEP",
    "FLOWER_PULL_BACKOFF",
    "FLOWER_PULL_TRIES",
    "FLOWER_REPLY_SLEEP",
    "INSTALLED_MARK",
    "NO_BUNDLE_REUSE",
    "NO_DIRECT_LAUNCH",
    "POLL_BACKOFF",
    "SUPPORTED",
    "UnsupportedFlower",
    "_Waits",
    "add_superlink_arguments",
    "add_supernode_arguments",
    "adjust_pull_backoff",
    "adjust_supernode",
    "backoff_from_env",
    "bundle_installer",
    "check_flower",
    "direct_launch",
    "flower_version",
    "hand_to_fork_server",
    "main",
    "register",
    "release_mismatch",
    "reuse_installed_bundle",
    "run_superlink",
    "run_supernode",
    "serverapp_main",
    "superexec_main",
    "support",
]


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def support(version: str | None = None, root: str | Path | None = None) -> dict[str, str | None]:
    """For each part of the fast path, why it does not apply to flwr ``version`` (default:
    the installed one) under ``root``, or None where it applies: ``waits`` (the whole fast
    path: :data:`ADJUSTED`), ``bundle_reuse`` (:data:`BUNDLE_REUSE`) and ``direct_launch``
    (:data:`DIRECT_LAUNCH`)."""
    version = flower_version() if version is None else version
    tables = {"waits": ADJUSTED, "bundle_reuse": BUNDLE_REUSE, "direct_launch": DIRECT_LAUNCH}
    return {part: release_mismatch(table, version, root) for part, table in tables.items()}


def superexec_main(args: list[str] | None = None) -> int:
    """Flower's ``flower-superexec``, woken by its SuperNode (``fedsgld supernode``); its
    tasks go straight to the warm fork server where :func:`direct_launch` applies."""
    args = list(sys.argv[1:] if args is None else args)
    check_flower()
    from flwr.supercore.cli.flower_superexec import flower_superexec
    from flwr.supercore.superexec import run_superexec as rs

    if rs.time is not time:
        raise UnsupportedFlower(f"flwr's run_superexec is not as expected: {STOCK}")
    wake = os.environ.get(ENV_WAKE)
    if wake:  # started by `fedsgld supernode`
        direct_launch()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(wake)
        sock.bind(wake)
        sock.setblocking(False)
        rs.time = _Wakeable(sock)
    sys.argv = ["flower-superexec", *args]
    try:
        flower_superexec()
    except SystemExit as e:
        return _exit_code(e)
    return 0


def serverapp_main(args: list[str] | None = None) -> int:
    """Flower's ``flwr-serverapp`` with the object-pull backoff of ``fedsgld superlink``."""
    args = list(sys.argv[1:] if args is None else args)
    check_flower()
    backoff = backoff_from_env()
    if backoff is not None:
        adjust_pull_backoff(*backoff)
    from flwr.superlink.cli.flwr_serverapp import flwr_serverapp

    sys.argv = ["flwr-serverapp", *args]
    try:
        flwr_serverapp()
    except SystemExit as e:
        return _exit_code(e)
    return 0


WRAPPER = """#!{python}
# fedsgld fast path: Flower's {name}, its fixed waits shortened
# (written by `fedsgld {command}`; see fedsgld/deploy/fast.py)
import sys
from fedsgld.deploy.fast import {main}
sys.exit({main}())
"""


def _wrapper(d: Path, name: str, command: str, main: str) -> None:
    p = d / name
    p.write_text(WRAPPER.format(python=sys.executable, name=name, command=command, main=main))
    p.chmod(0o700)


def _flower_args(args: argparse.Namespace) -> list[str]:
    rest = list(args.flower_args)
    return rest[1:] if rest and rest[0] == "--" else rest


def _checked(command: str) -> bool:
    try:
        check_flower()
    except UnsupportedFlower as e:
        print(f"fedsgld {command}: error: {e}", file=sys.stderr)
        return False
    return True


def _cleanup_on_exit(bin_dir: Path, server: list[subprocess.Popen]):
    """Stop the fork server and remove ``bin_dir``: once, on Flower's graceful exit (its
    handlers run before it forces the exit) or when the command returns."""
    done = []

    def cleanup() -> None:
        if done:
            return
        done.append(True)
        for p in server:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(bin_dir, ignore_errors=True)

    from flwr.supercore.exit import add_exit_handler

    add_exit_handler(cleanup, run_before_force_exit=True)
    return cleanup


def run_supernode(args: argparse.Namespace) -> int:
    """``fedsgld supernode``."""
    if not _checked("supernode"):
        return 2
    try:  # a deployed site runs only the app bundles its policy approves
        print(
            f"fedsgld supernode: {approval.check_site_start(_flower_args(args), args.no_policy)}",
            file=sys.stderr,
            flush=True,
        )
    except ValueError as e:
        print(f"fedsgld supernode: error: {e}", file=sys.stderr)
        return 2

    bin_dir = Path(tempfile.mkdtemp(prefix="fedsgld-node-"))  # mode 0700: sockets, wrappers
    server: list[subprocess.Popen] = []
    cleanup = _cleanup_on_exit(bin_dir, server)
    try:
        wake = str(bin_dir / "superexec.wake")
        _wrapper(bin_dir, "flower-superexec", "supernode", "superexec_main")
        os.environ[ENV_WAKE] = wake
        os.environ[ENV_BACKOFF] = f"{args.pull_backoff:g},{args.pull_backoff_cap:g}"
        os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", f"{args.task_poll:g}")
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
        adjust_pull_backoff(args.pull_backoff, args.pull_backoff_cap)
        adjust_supernode(
            pull_interval=args.pull_interval,
            reply_poll=args.reply_poll,
            active_for=args.active_for,
            predict=args.predict,
            wake=wake,
        )
        # every ClientApp starts through the shim (warm, or cold with the bundle checked)
        shim.install_shim(str(bin_dir))
        if args.no_warm:
            os.environ[shim.ENV_MODE] = "off"
        else:
            sock = os.environ.get(shim.ENV_SOCKET) or str(bin_dir / "fork.sock")
            os.environ[shim.ENV_SOCKET] = shim.socket_path([], {shim.ENV_SOCKET: sock})
            server.append(shim.start_server(sock, os.getpid()))
        from flwr.supernode.cli.flower_supernode import flower_supernode

        sys.argv = ["flower-supernode", *_flower_args(args)]
        flower_supernode()
        return 0
    finally:
        cleanup()


def run_superlink(args: argparse.Namespace) -> int:
    """``fedsgld superlink``."""
    if not _checked("superlink"):
        return 2
    bin_dir = Path(tempfile.mkdtemp(prefix="fedsgld-link-"))  # mode 0700
    cleanup = _cleanup_on_exit(bin_dir, [])
    try:
        _wrapper(bin_dir, "flwr-serverapp", "superlink", "serverapp_main")
        os.environ[ENV_BACKOFF] = f"{args.pull_backoff:g},{args.pull_backoff_cap:g}"
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
        from flwr.superlink.cli.flower_superlink import flower_superlink

        def _exit(signum, _frame):  # uvicorn re-raises the signal after its shutdown
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _exit)
        signal.signal(signal.SIGINT, _exit)
        sys.argv = ["flower-superlink", *_flower_args(args)]
        flower_superlink()
        return 0
    finally:
        cleanup()


def _light(command: str):
    """``fedsgld supernode|superlink`` from the full ``fedsgld`` command: re-run the same
    command as ``python -m fedsgld.deploy`` in this process (same pid), which imports
    only this package and Flower (the full CLI imports torch: ~0.5 GB per site)."""

    def run(args: argparse.Namespace) -> int:
        argv = [sys.executable, "-m", "fedsgld.deploy", command]
        for action in _PARSERS[command]._actions:
            if action.dest in ("help", "flower_args"):
                continue
            value = getattr(args, action.dest)
            if isinstance(action, argparse._StoreTrueAction):
                argv += [action.option_strings[0]] if value else []
            else:
                argv += [action.option_strings[0], repr(value)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [*argv, "--", *_flower_args(args)])
        return 0  # not reached

    return run


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def register(sub, *, light: bool = True) -> None:
    """Add ``supernode`` and ``superlink`` to a command's subparsers (``light``: run
    them through ``python -m fedsgld.deploy``, see :func:`_light`)."""
    node = sub.add_parser(
        "supernode", help="Flower's SuperNode with its fixed waits shortened (fast path)"
    )
    add_supernode_arguments(node)
    node.set_defaults(func=_light("supernode") if light else run_supernode)
    link = sub.add_parser(
        "superlink", help="Flower's SuperLink with its object-pull backoff shortened (fast path)"
    )
    add_superlink_arguments(link)
    link.set_defaults(func=_light("superlink") if light else run_superlink)
    _PARSERS.update(supernode=node, superlink=link)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedsgld.deploy supernode|superlink ...``."""
    ap = argparse.ArgumentParser(
        prog="python -m fedsgld.deploy",
        description=__doc__.split("\n\n")[0],
        epilog="python -m fedsgld.deploy run APP CONNECTION [flwr run options]: flwr run "
        "whose exit status is the run's outcome (0 completed; 1 failed or stopped, with "
        "the reason).",
    )
    register(ap.add_subparsers(dest="command", required=True), light=False)
    args = ap.parse_args(argv)
    return int(args.func(args) or 0)
