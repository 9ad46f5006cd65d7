"""The fast path: Flower's own SuperNode and SuperLink with their fixed waits shortened.

    fedsgld supernode [--pull-interval S] [--predict F] [--reply-poll S] [--pull-backoff S]
        [--pull-backoff-cap S] [--task-poll S] [--active-for S] [--no-warm]
        -- FLOWER-SUPERNODE-ARGUMENTS
    fedsgld superlink [--pull-backoff S] [--pull-backoff-cap S] -- FLOWER-SUPERLINK-ARGUMENTS

Opt-in. Each runs Flower's own ``flower-supernode`` / ``flower-superlink`` (same flags,
TLS, SuperNode authentication, SuperExec, ClientApp and ServerApp processes) in this
process after adjusting, at run time, the waits that Flower 1.41/1.42 hard-codes:

``fedsgld supernode``
  * **empty-pull sleep.** The SuperNode sleeps 3 s after every pull that brought no
    message, and in a federated round the pull right after a reply is always empty. While
    a run is active (a message arrived in the last ``--active-for`` s, default 60) it
    first waits ``--predict`` (0.7) times the shortest of the last three waits from a
    reply to the next message (see :class:`_Waits`), then pulls every
    ``--pull-interval`` (0.05 s), or a tenth of the time since its reply if that is
    longer; an idle node keeps Flower's 3 s.
  * **reply waits.** It checks every 0.5 s whether the ClientApp's reply (and each of its
    objects) is ready: every ``--reply-poll`` (0.01 s) instead (local checks).
  * **SuperExec task poll.** Its SuperExec asks for new tasks every
    ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (1 s). Here the SuperNode wakes its SuperExec
    (Flower's own, started through a ``flower-superexec`` wrapper first on its ``PATH``)
    the moment it has stored a message, over a datagram socket in a private directory; the
    SuperExec otherwise polls every ``--task-poll`` (2 s) unless the environment sets
    ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (a task taken before its message's objects are
    stored makes its ClientApp poll for them).
  * **object-pull backoff** in the SuperNode and in its ClientApp processes (below).
  * unless ``--no-warm``, **warm sites** (:mod:`fedsgld.deploy.warm`), started now; the
    SuperExec hands each task straight to the fork server (on the flwr releases in
    :data:`DIRECT_LAUNCH`; elsewhere through the ``flwr-clientapp`` shim).
  * **approved bundles only** (:mod:`fedsgld.clients.approval`): it refuses to start
    without a ``privacy-policy`` in the node config unless ``--no-policy``, and every
    ClientApp (forked warm, or cold through the shim) checks the app bundle's digest
    against the policy's ``approved_apps`` before Flower installs it.

``fedsgld superlink``
  * **object-pull backoff** in its ServerApp process (started through a
    ``flwr-serverapp`` wrapper first on the SuperLink's ``PATH``): a reply is visible to
    the ServerApp before its objects have all arrived, and Flower then retries after 1 s.

  **Object-pull backoff**: retries start after ``--pull-backoff`` (0.02 s) instead of 1 s
  and double up to ``--pull-backoff-cap`` (0.1 s) instead of 10 s; Flower's limit on the
  total time (7200 s) stays, its limit of 500 tries per object is lifted (with the short
  waits it would give up after a minute instead of over an hour).

Nothing else changes: messages, objects, retries, timeouts, authentication and the apps
are Flower's. The price is more requests to the SuperLink while a run is active: up to
one per ``--pull-interval`` per SuperNode instead of one per 3 s. ``python -m
fedsgld.deploy supernode|superlink`` is the same command (``fedsgld supernode`` re-runs
itself that way, so that the SuperNode process does not carry the whole CLI's imports).

Before anything starts, the code adjusted is checked: the installed flwr must be one of
:data:`SUPPORTED` and every adjusted file byte-identical to that release's (SHA-256, in
:data:`ADJUSTED`); otherwise the command refuses to start and says to use Flower's own
``flower-supernode`` / ``flower-superlink``, with which the warm sites work too.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# flwr releases this fast path was tested with: SHA-256 of each file whose waits it adjusts
_SUPERNODE = "d6342f743fdf768f63305b88414ae2654e9a21bda153739da19c608e8d375067"
_INFLATABLE = "077b26d921aa86389f0a9e16bab761bd10525ec66d6f175b56fdf4bac7872d40"
ADJUSTED = {
    "1.41.0": {
        "supernode/start_client_internal.py": _SUPERNODE,
        "supercore/inflatable/inflatable_utils.py": _INFLATABLE,
        "supercore/superexec/run_superexec.py": (
            "6b4855d76940ae0f257555b6e0e9894cc46b1ee9d5675092b0e16a5053e4b2fa"
        ),
    },
    "1.42.0": {
        "supernode/start_client_internal.py": _SUPERNODE,
        "supercore/inflatable/inflatable_utils.py": _INFLATABLE,
        "supercore/superexec/run_superexec.py": (
            "51cb82facb912f41320d002e1c862b3e5c712cbdf06736f527ede43cf4d207ea"
        ),
    },
}
SUPPORTED = tuple(ADJUSTED)
FLOWER_EMPTY_PULL_SLEEP = 3  # start_client_internal: time.sleep(3) after an empty pull
FLOWER_REPLY_SLEEP = 0.5  # _push_messages: time.sleep(0.5) while the reply is not ready
POLL_BACKOFF = 0.1  # a waiting node polls at most every tenth of the time since its reply
FLOWER_PULL_BACKOFF = (1, 10)  # supercore.constant: PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP
FLOWER_PULL_TRIES = 500  # supercore.constant.PULL_MAX_TRIES_PER_OBJECT
ENV_WAKE = "FEDSGLD_SUPEREXEC_WAKE"  # the datagram socket the SuperExec wrapper waits on
ENV_BACKOFF = "FEDSGLD_PULL_BACKOFF"  # "initial,cap" for the app processes
STOCK = "use Flower's own flower-supernode / flower-superlink (the warm sites work with them)"


class UnsupportedFlower(RuntimeError):
    """The installed flwr is not one this fast path was tested with."""


def flower_version() -> str:
    """The installed flwr's version, as Flower itself reads it (package metadata)."""
    import importlib.metadata as md

    try:
        return md.version("flwr")
    except md.PackageNotFoundError as e:
        raise UnsupportedFlower(f"flwr is not installed: {STOCK}") from e


def _entry(table: dict[str, dict[str, str]], version: str) -> str | None:
    """The release of ``table`` whose files stand for flwr ``version``: the release itself,
    or, for a patch release, its feature release (``1.42.1`` -> ``1.42.0``), which holds
    only if the patch left every listed file byte-identical."""
    if version in table:
        return version
    parts = version.split(".")
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        base = f"{parts[0]}.{parts[1]}.0"
        if base in table:
            return base
    return None


def release_mismatch(
    table: dict[str, dict[str, str]], version: str | None = None, root: str | Path | None = None
) -> str | None:
    """Why flwr ``version`` (default: the installed one) under ``root`` (default: the flwr
    package) is not one that ``table`` lists, in one line; None when it is: the release,
    or a patch release of it, with every listed file's SHA-256 as recorded."""
    version = flower_version() if version is None else version
    release = _entry(table, version)
    if release is None:
        return f"the installed flwr is {version}, checked releases are {', '.join(table)}"
    if root is None:
        import flwr

        root = Path(flwr.__file__).parent
    for rel, want in table[release].items():
        p = Path(root) / rel
        try:
            got = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError as e:
            return f"flwr file {p} cannot be read ({e})"
        if got != want:
            return (
                f"flwr file {p} is not flwr {release}'s, which was checked "
                f"(sha256 {got[:12]}..., expected {want[:12]}...)"
            )
    return None


def check_flower(version: str | None = None, root: str | Path | None = None) -> None:
    """Refuse (:class:`UnsupportedFlower`) unless flwr ``version`` is one of
    :data:`SUPPORTED` (or a patch release of one) and the files it adjusts under ``root``
    (the flwr package) are that release's."""
    version = flower_version() if version is None else version
    why = release_mismatch(ADJUSTED, version, root)
    if why is None:
        return
    if _entry(ADJUSTED, version) is None:
        raise UnsupportedFlower(
            f"the fast path supports flwr {' and '.join(SUPPORTED)} only (it adjusts "
            f"internal waits of those releases); the installed flwr is {version}: {STOCK}"
        )
    raise UnsupportedFlower(f"{why}: {STOCK}")


def adjust_pull_backoff(initial: float, cap: float) -> None:
    """Object pulls in this process retry after ``initial`` s, doubling up to ``cap``.

    Flower also stops after 500 tries of one object; with its 1-10 s waits that is over
    an hour, with these a minute: the limit on tries is lifted, so that a pull still
    waits as long as Flower's would, up to Flower's limit on total time (7200 s)."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        kw = dict(fn.__kwdefaults__ or {})
        got = (kw.get("initial_backoff"), kw.get("backoff_cap"), kw.get("max_tries_per_object"))
        if got != (*FLOWER_PULL_BACKOFF, FLOWER_PULL_TRIES):
            raise UnsupportedFlower(f"flwr's {fn.__name__} is not as expected: {STOCK}")
        kw.update(initial_backoff=initial, backoff_cap=cap, max_tries_per_object=None)
        fn.__kwdefaults__ = kw


# flwr releases whose ClientApp install step was checked for the bundle reuse below
# (run_clientapp.py calls cli/install.py's install_from_fab, which unpacks and verifies the
# whole bundle and then returns the install directory if it already exists)
# (1.41.0 and 1.42.0 ship both files byte-identical: same SHA-256 in both releases' wheels)
_RUN_CLIENTAPP = "fa6612aaeda9cd398de69199b0cf264a38f72c1b9cfdc53644c8d6dab0b70eb6"
_INSTALL = "d09d889c176d3e661436b439618f67ac49bd9e72aa9db77dc25d6c4ed45ccc30"
BUNDLE_REUSE = {
    release: {"supernode/runtime/run_clientapp.py": _RUN_CLIENTAPP, "cli/install.py": _INSTALL}
    for release in ("1.41.0", "1.42.0")
}
NO_BUNDLE_REUSE = "each task unpacks and verifies the app bundle (Flower's own install)"
INSTALLED_MARK = (
    ".fedsgld-installed-"  # + the bundle's full SHA-256, written after Flower's install
)


def reuse_installed_bundle(version: str | None = None, root: str | Path | None = None) -> bool:
    """ClientApps forked from this process take an app bundle that Flower already installed
    (and that this process marked, with the bundle's full SHA-256) from its install
    directory, instead of unpacking and verifying all of it again for every message.

    Flower's own ``install_from_fab`` returns that same directory when it exists, but only
    after unpacking the bundle into a temporary directory and checking every file's hash:
    about a third of a warm task's CPU. The shortcut applies only to bundles whose first
    install through Flower completed here; any other bundle goes through Flower's install.
    Returns whether it was applied (flwr releases in :data:`BUNDLE_REUSE`, files unchanged)."""
    why = release_mismatch(BUNDLE_REUSE, version, root)
    if why is not None:
        print(f"fedsgld: {NO_BUNDLE_REUSE}: {why}", file=sys.stderr, flush=True)
        return False
    from flwr.cli import install as flwr_install
    from flwr.supernode.runtime import run_clientapp

    if run_clientapp.install_from_fab is not flwr_install.install_from_fab:
        why = "flwr's run_clientapp does not call cli.install.install_from_fab as expected"
        print(f"fedsgld: {NO_BUNDLE_REUSE}: {why}", file=sys.stderr, flush=True)
        return False
    run_clientapp.install_from_fab = bundle_installer(flwr_install.install_from_fab)
    return True


def bundle_installer(original):
    """``install_from_fab`` that returns a marked install directory for a bundle already
    installed (by ``original``, Flower's) and marks what ``original`` installs.

    The marked directory is found by name, without reading the bundle's metadata (a
    twentieth of a task's CPU): Flower names it ``<publisher>.<app>.<version>.<first
    hex digits of the digest>`` under ``$FLWR_HOME/apps``, and only the directory Flower
    installed from bundle bytes with exactly this SHA-256 carries the mark."""
    from flwr.common.config import get_flwr_home
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION

    def install_from_fab(fab_file, install_dir=None, skip_prompt=False):
        if not isinstance(fab_file, bytes) or install_dir is not None or not skip_prompt:
            return original(fab_file, install_dir, skip_prompt)
        digest = hashlib.sha256(fab_file).hexdigest()
        apps = get_flwr_home() / APP_DIR
        with contextlib.suppress(OSError):
            for path in apps.glob(f"*.{digest[:FAB_HASH_TRUNCATION]}"):
                if (path / (INSTALLED_MARK + digest)).is_file():
                    return path
        installed = original(fab_file, install_dir, skip_prompt)
        with contextlib.suppress(OSError):
            (Path(installed) / (INSTALLED_MARK + digest)).touch()
        return installed

    return install_from_fab


def backoff_from_env() -> tuple[float, float] | None:
    raw = os.environ.get(ENV_BACKOFF)
    if not raw:
        return None
    initial, cap = (float(x) for x in raw.split(","))
    return initial, cap


class _Waits:
    """Stands in for the ``time`` module inside Flower's ``start_client_internal``: its
    fixed sleeps shortened while a run is active, everything else ``time``'s.

    After a reply has been sent the next message cannot come before the other sites have
    replied and the server has taken its step; rounds are regular, so the first sleep
    after a reply lasts ``predict`` times the shortest of the last three waits from a
    reply to the next message (at most Flower's 3 s; once two are known, so that the
    slow first round of a run sets no wait on its own), and only then does the node poll
    every ``pull_interval``. A wait ends when the pull that found the message *started*
    (not when the message and its objects were stored). When the first pull after the
    predicted wait already finds the message, the wait was too long by an unknown amount
    (the server got faster, or the first rounds were slow): the node forgets its waits
    and polls from the reply in the next round, which measures the wait again. This cuts
    the requests a node makes per round several-fold at the cost of one late pull when
    rounds get shorter."""

    def __init__(
        self, pull_interval: float, reply_poll: float, active_for: float, predict: float
    ) -> None:
        self.pull_interval = pull_interval
        self.reply_poll = reply_poll
        self.active_for = active_for
        self.predict = predict
        self.last_message = -math.inf
        self.sent_at: float | None = None  # when the last reply went out
        self.gaps: list[float] = []  # reply -> next message, the last three rounds
        self.after_reply = False
        self.first_look = False  # the next pull is the first after a predicted wait
        self.debug = bool(os.environ.get("FEDSGLD_WARM_DEBUG"))  # warm.ENV_DEBUG

    def message(self, pulled_at: float) -> None:
        """A message was stored by the pull that started at ``pulled_at`` (monotonic)."""
        now = time.monotonic()
        self.last_message = now
        gap = None if self.sent_at is None else pulled_at - self.sent_at
        if gap is not None:
            # found at the first look after a predicted wait: the wait was too long by an
            # unknown amount, so measure again next round (poll from the reply)
            self.gaps = [] if self.first_look else [*self.gaps[-2:], gap]
            self.sent_at = None
        self.first_look = False
        if self.debug:
            _debug(
                f"message stored ({now - pulled_at:.3f} s to pull)"
                + ("" if gap is None else f", pulled {gap:.3f} s after the reply")
            )

    def replied(self) -> None:
        self.sent_at = time.monotonic()
        self.after_reply = True
        if self.debug:
            _debug("reply pushed")

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_EMPTY_PULL_SLEEP:
            now = time.monotonic()
            if now - self.last_message < self.active_for:
                # poll every pull_interval, or a tenth of the time since the reply if
                # longer: a node whose next message is seconds away (many sites, slow
                # rounds) makes tens of requests per round, not one per pull_interval
                since = 0.0 if self.sent_at is None else now - self.sent_at
                seconds = max(self.pull_interval, POLL_BACKOFF * since)
                if self.after_reply and len(self.gaps) >= 2:  # one slow round is no rule
                    seconds = min(3.0, max(seconds, self.predict * min(self.gaps)))
                    self.first_look = seconds > self.pull_interval
                    if self.debug:
                        _debug(f"first pull after the reply in {seconds:.3f} s")
                else:
                    self.first_look = False
            self.after_reply = False
        elif seconds == FLOWER_REPLY_SLEEP:
            seconds = self.reply_poll
        time.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)


def _debug(msg: str) -> None:
    t = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    print(f"{stamp} [fedsgld supernode {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def adjust_supernode(
    *,
    pull_interval: float,
    reply_poll: float,
    active_for: float,
    predict: float = 0.0,
    wake: str | None = None,
) -> _Waits:
    """Shorten the SuperNode's fixed sleeps in this process (after :func:`check_flower`);
    ``wake``: a datagram socket to signal whenever a message (a task) has been stored."""
    from flwr.supercore.inflatable import inflatable_utils as iu
    from flwr.supernode import start_client_internal as sci

    if (
        sci.time is not time
        or not callable(getattr(sci, "_pull_and_store_message", None))
        or not callable(getattr(sci, "_push_messages", None))
        or sci.pull_objects is not iu.pull_objects
    ):
        raise UnsupportedFlower(f"flwr.supernode.start_client_internal is not as expected: {STOCK}")
    waits = _Waits(pull_interval, reply_poll, active_for, predict)
    pull_and_store, push = sci._pull_and_store_message, sci._push_messages
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if wake else None
    if sender is not None:
        sender.setblocking(False)

    def pull_and_store_message(*args, **kwargs):
        started = time.monotonic()
        run_id = pull_and_store(*args, **kwargs)
        if run_id is not None:  # a message and its task are stored: wake the SuperExec
            waits.message(started)
            if sender is not None:
                with contextlib.suppress(OSError):  # not listening yet, or already woken
                    sender.sendto(b"t", wake)
        return run_id

    def push_messages(*args, **kwargs):
        try:
            return push(*args, **kwargs)
        finally:
            waits.replied()

    sci.time = waits
    sci._pull_and_store_message = pull_and_store_message
    sci._push_messages = push_messages
    return waits


class _Wakeable:
    """Stands in for ``time`` inside Flower's ``run_superexec``: its task-poll sleep ends
    as soon as the SuperNode signals a new task on ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sleep(self, seconds: float) -> None:
        ready, _, _ = select.select([self.sock], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.sock.recv(64)

    def __getattr__(self, name: str):
        return getattr(time, name)


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


# flwr releases whose SuperExec task launch was checked for the direct hand-off below
# (SubprocessExecutor.launch: ``subprocess.Popen([flwr-clientapp, ...])``, fire and forget)
# (1.41.0 and 1.42.0 ship the file byte-identical: same SHA-256 in both releases' wheels)
_SUBPROCESS_EXECUTOR = "8fca14d06c1531f0895952719e9194a3f62e9cd0de4148a6d2cdd5cdaf051f39"
DIRECT_LAUNCH = {
    release: {"supercore/superexec/executor/subprocess_executor.py": _SUBPROCESS_EXECUTOR}
    for release in ("1.41.0", "1.42.0")
}


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
    import threading

    from fedsgld.deploy import shim

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


def _seconds(name: str, lo: float, hi: float):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo:g}, {hi:g}] seconds, got {s}")
        return v

    return parse


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"--predict must be in [0, 1], got {s}")
    return v


def _backoff_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--pull-backoff",
        type=_seconds("--pull-backoff", 0.001, 1.0),
        default=0.02,
        help="first retry of an object pull (Flower: 1; default 0.02)",
    )
    ap.add_argument(
        "--pull-backoff-cap",
        type=_seconds("--pull-backoff-cap", 0.001, 10.0),
        default=0.1,
        help="longest retry wait of an object pull (Flower: 10; default 0.1)",
    )


def _flower_arguments(ap: argparse.ArgumentParser, exe: str) -> None:
    ap.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        metavar=f"-- {exe.upper()}-ARGUMENTS",
        help=f"passed to Flower's {exe} unchanged (after --)",
    )


def add_supernode_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--pull-interval",
        type=_seconds("--pull-interval", 0.005, 3.0),
        default=0.05,
        help="seconds between pulls from the SuperLink while a run is active "
        "(Flower: 3 after every empty pull; default 0.05)",
    )
    ap.add_argument(
        "--predict",
        type=_fraction,
        default=0.7,
        help="after a reply, first wait this fraction of the shortest of the last three "
        "reply-to-next-message waits before polling (0: poll at once; default 0.7)",
    )
    ap.add_argument(
        "--reply-poll",
        type=_seconds("--reply-poll", 0.001, 0.5),
        default=0.01,
        help="seconds between local checks for the ClientApp's reply (Flower: 0.5; default 0.01)",
    )
    _backoff_arguments(ap)
    ap.add_argument(
        "--task-poll",
        type=_seconds("--task-poll", 0.01, 60.0),
        default=2.0,
        help="the SuperExec's task poll besides the SuperNode's wake-up "
        "(FLWR_SUPEREXEC_TASK_POLL_INTERVAL, if not set; Flower: 1; default 2)",
    )
    ap.add_argument(
        "--active-for",
        type=_seconds("--active-for", 0.0, 86400.0),
        default=60.0,
        help="a node that got a message within this many seconds polls fast (default 60)",
    )
    ap.add_argument(
        "--no-warm", action="store_true", help="no warm sites: Flower's own flwr-clientapp"
    )
    ap.add_argument(
        "--no-policy",
        action="store_true",
        help="start without a privacy-policy in the node config: the site then runs any app "
        "bundle the server submits, unchecked (without this, it refuses to start)",
    )
    _flower_arguments(ap, "flower-supernode")


def add_superlink_arguments(ap: argparse.ArgumentParser) -> None:
    _backoff_arguments(ap)
    _flower_arguments(ap, "flower-superlink")


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
    from fedsgld.clients import approval
    from fedsgld.deploy import shim

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
