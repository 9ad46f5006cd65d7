"""The ``flwr-clientapp`` shim of the warm sites (see :mod:`fedsgld.deploy.warm`).

Flower's SuperExec runs ``flwr-clientapp --runtime-api-address ... --token ...`` (found on
``PATH``) once per message. The shim, placed first on the SuperNode's ``PATH``, hands that
task to the SuperNode's fork server: its arguments, environment, working directory and
stdin/stdout/stderr, over a Unix socket in a directory private to the user. The server
forks a process that becomes Flower's ``flwr-clientapp`` with exactly these; the shim
forwards signals to it and exits with its status. When no fork server is serving yet, the
shim starts one in the background and runs Flower's own ``flwr-clientapp`` in a new
interpreter: a task is never slower than stock, and it never waits for a server to warm
up (Flower hands a task out again if it has not reported within 30 s).

Standard library only: the shim script runs this module with ``python -IS`` (no site
packages) so that it starts in milliseconds. ``FEDSGLD_WARM=off`` in the SuperNode's
environment makes it run Flower's own ``flwr-clientapp`` every time.

Either way the task's app bundle is checked against the site's policy before Flower installs
it (:mod:`fedsgld.clients.approval`): in the forked child, or in the cold process, which runs
Flower's ``flwr-clientapp`` entry point through :func:`checked_clientapp`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys

ENV_SOCKET = "FEDSGLD_WARM_SOCKET"  # the fork server's socket (set by `fedsgld supernode`)
ENV_MODE = "FEDSGLD_WARM"  # "off": the shim always runs Flower's own flwr-clientapp
SHIM_NAME = "flwr-clientapp"
SHIM_MARK = "fedsgld warm-site shim"
SERVER_MODULE = "fedsgld.deploy.warm"

HEADER = struct.Struct("!I")  # length of a JSON message
STATUS = struct.Struct("!i")  # the task process's exit status


def private_dir(path: str) -> str:
    """``path`` as a directory only this user can enter (created with mode 0700)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if (
        stat.S_ISLNK(st.st_mode)
        or not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.getuid()
        or st.st_mode & 0o077
    ):
        raise PermissionError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            "(it holds the socket that carries Flower's task tokens)"
        )
    return path


def arg_value(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def socket_path(args: list[str], env: dict[str, str] | None = None) -> str:
    """The fork server's socket for the SuperNode whose ``flwr-clientapp`` got ``args``.

    ``FEDSGLD_WARM_SOCKET`` if set; otherwise one socket per (FLWR_HOME, SuperNode runtime
    API address, interpreter), under ``fedsgld-warm-<uid>`` (mode 0700) in
    ``$XDG_RUNTIME_DIR`` or ``$TMPDIR`` (default /tmp).
    """
    env = os.environ if env is None else env
    if env.get(ENV_SOCKET):
        path = env[ENV_SOCKET]
        private_dir(os.path.dirname(os.path.abspath(path)))
        return path
    base = env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"
    key = "\0".join(
        [
            env.get("FLWR_HOME") or os.path.join(os.path.expanduser("~"), ".flwr"),
            arg_value(args, "--runtime-api-address") or "default",
            sys.executable,
        ]
    )
    name = hashlib.sha256(key.encode()).hexdigest()[:24] + ".sock"
    return os.path.join(private_dir(os.path.join(base, f"fedsgld-warm-{os.getuid()}")), name)


# -- messages ------------------------------------------------------------------------------


def send_json(conn: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = HEADER.pack(len(data)) + data
    sent = socket.send_fds(conn, [msg], fds) if fds else 0
    if sent < len(msg):
        conn.sendall(msg[sent:])


def recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_json(conn: socket.socket) -> dict | None:
    head = recv_exact(conn, HEADER.size)
    if head is None:
        return None
    body = recv_exact(conn, HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


# -- the fork server's process -------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_pid(path: str) -> int | None:
    """The pid of the fork server started for ``path``, if it still runs."""
    try:
        with open(path + ".pid") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if not alive(pid):
        return None
    try:  # a reused pid is not our server
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if SERVER_MODULE.encode() not in f.read():
                return None
    except OSError:
        pass
    return pid


def start_server(path: str, owner_pid: int | None, preload: list[str] | None = None):
    """Start a fork server for ``path`` in the background (output: ``<path>.log``).

    It runs with the normal interpreter flags and this process's environment (the
    SuperNode's), so it imports what Flower's own ``flwr-clientapp`` would import."""
    import subprocess

    cmd = [sys.executable, "-m", SERVER_MODULE, "serve", "--socket", path]
    if owner_pid is not None:
        cmd += ["--owner-pid", str(owner_pid)]
    if preload is not None:
        cmd += ["--preload", ",".join(preload)]
    with open(path + ".log", "ab") as log:
        p = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True
        )
    with open(path + ".pid", "w") as f:
        f.write(str(p.pid))
    return p


def failed_for(path: str, owner_pid: int | None) -> bool:
    """Whether a fork server for ``path`` and this owner already failed (``<path>.failed``)."""
    try:
        with open(path + ".failed") as f:
            return f.read().split()[0] == str(owner_pid)
    except (OSError, IndexError):
        return False


def connect(path: str, owner_pid: int | None) -> socket.socket | None:
    """A connection to the fork server at ``path``; None if none is serving yet, after
    starting one in the background (unless one already failed for this owner)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if server_pid(path) is None and not failed_for(path, owner_pid):
            start_server(path, owner_pid)
    return None


# -- the shim ------------------------------------------------------------------------------


def hand_over(conn: socket.socket, args: list[str], fds: list[int], via: str = "shim") -> dict:
    """Send the fork server one ``flwr-clientapp ARGS`` task (this process's environment
    and working directory, ``fds`` as its stdin/stdout/stderr); its first answer:
    ``{"pid": ...}`` when it forked the task, otherwise ``{"error": ...}``."""
    req = {"argv": [SHIM_NAME, *args], "env": dict(os.environ), "cwd": os.getcwd(), "via": via}
    try:
        send_json(conn, req, fds)
        return recv_json(conn) or {"error": "no answer"}
    except OSError as e:
        return {"error": repr(e)}


def checked_clientapp(args: list[str]) -> list[str]:
    """The command line of Flower's ``flwr-clientapp ARGS`` with the site's check of the app
    bundle first (:func:`fedsgld.clients.approval.checked_clientapp`): this interpreter runs
    ``approval.py``, loaded by its path so that no ``fedsgld`` module is imported (the
    bundle's must be the one that loads), and ``-P`` puts no directory before the bundle's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.join(package, "clients", "approval.py")
    code = (
        "import importlib.util as u, sys; "
        f"s = u.spec_from_file_location('_fedsgld_site_approval', {here!r}); "
        "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); "
        "sys.exit(m.checked_clientapp())"
    )
    return [sys.executable, "-P", "-c", code, *args]


def run_cold(args: list[str], shim: str | None, why: str | None = None) -> int:
    """Replace this process by Flower's own ``flwr-clientapp``, the app bundle checked
    first (:func:`checked_clientapp`)."""
    if why:
        print(f"fedsgld warm sites: {why}; this task runs cold", file=sys.stderr, flush=True)
    cmd = checked_clientapp(args)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 127  # not reached


def why_cold(args: list[str]) -> str | None:
    """Why a ``flwr-clientapp ARGS`` task must run cold whatever the fork server: ``""``
    when ``FEDSGLD_WARM`` is off, a reason when runtime dependency installation is on (the
    task installs the app's dependencies into a new environment: the libraries a fork
    server has already imported would shadow them); None when it may go warm."""
    if os.environ.get(ENV_MODE, "on").lower() in ("off", "0", "no", "false"):
        return ""
    if "--allow-runtime-dependency-installation" in args:
        return "runtime dependency installation is on"
    return None


def shim_main(shim: str | None = None, args: list[str] | None = None) -> int:
    """What the ``flwr-clientapp`` shim runs: hand the task to the warm fork server."""
    args = list(sys.argv[1:] if args is None else args)
    why = why_cold(args)
    if why is not None:
        return run_cold(args, shim, why or None)
    try:
        path = socket_path(args)
        owner = arg_value(args, "--parent-pid")
        conn = connect(path, int(owner) if owner else os.getppid())
    except (OSError, ValueError) as e:
        return run_cold(args, shim, f"unavailable ({e})")
    if conn is None:
        return run_cold(args, shim, "fork server starting")
    with conn:
        first = hand_over(conn, args, [0, 1, 2])
        if "pid" not in first:
            return run_cold(args, shim, str(first.get("error", "no answer")))
        child = int(first["pid"])

        def forward(signum, _frame):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        status = recv_exact(conn, STATUS.size)
        if status is None:
            return 1  # the task's process died without reporting
        return STATUS.unpack(status)[0]


SHIM_TEMPLATE = """#!{python} -IS
# {mark}: hands Flower's flwr-clientapp tasks to a warm fork server
# (written by `python -m fedsgld.deploy.warm install-shim`; see fedsgld/deploy/shim.py)
import os, sys
sys.path.insert(0, {deploy_dir!r})
try:
    from shim import shim_main
except ImportError:  # fedsgld moved: no task runs unchecked (install the shim again)
    sys.exit("fedsgld shim: " + {deploy_dir!r} + " is gone: the task is refused (no app "
             "bundle runs unchecked); run `python -m fedsgld.deploy.warm install-shim` again")
sys.exit(shim_main(__file__))
"""


def install_shim(directory: str) -> str:
    """Write the ``flwr-clientapp`` shim into ``directory`` (put it first on PATH)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SHIM_NAME)
    tmp = os.path.join(directory, f".{SHIM_NAME}.{os.getpid()}")
    text = SHIM_TEMPLATE.format(
        python=sys.executable,
        mark=SHIM_MARK,
        deploy_dir=os.path.dirname(os.path.abspath(__file__)),
    )
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path
