"""``fedsgld deploy local [flwr run options]``: a Flower simulation on this machine that
starts its own SuperLink and stops exactly that one.

``flwr run .`` alone uses whatever healthy SuperLink answers on 127.0.0.1:39091 (another
user's, or one left from an earlier run), and a SuperLink it starts itself keeps running
after the run, with no PID reported. This command instead picks a free port, starts
``flower-superlink --simulation`` there with its own FLWR_HOME and database (under
``runs/flwr-local-<port>/`` unless ``--home`` names a directory), says so in one line,
runs ``flwr run . --stream`` against it (:mod:`fedsgld.deploy.run`: the exit status is the
run's outcome), and stops that SuperLink's process group by its PID when the run ends, on
Ctrl-C too (never by a process name).

Ray: the simulation starts a Ray instance of its own unless ``ray_address`` (``--ray-address``)
names a running cluster (:mod:`fedsgld.deploy.ray_cluster`); a cluster it did not start is
only joined and left, never stopped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fedsgld.deploy import run as deploy_run
from fedsgld.deploy.loopback import BIN, Processes, flower_env, free_port, link_address_args
from fedsgld.deploy.ray_cluster import ray_environment


def superlink_args(port: int, home: Path) -> list[str]:
    """Flower's SuperLink with the simulation runtime on 127.0.0.1:``port`` only."""
    return [
        str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
        *link_address_args(port), "--database", str(home / "superlink.db"),
    ]  # fmt: skip


def run_local(
    flwr_args: list[str],
    *,
    home: str | Path | None = None,
    app: str = ".",
    ray_address: str | None = None,
) -> int:
    """Start a SuperLink on a free port, ``flwr run APP --stream FLWR_ARGS`` on it, stop it.
    The simulation's Ray: ``ray_address`` (``local`` or a running cluster's
    ``HOST:PORT``; None: ``RAY_ADDRESS`` if set, else ``local``), checked before anything
    starts."""
    ray_env = ray_environment(ray_address, flwr_args)
    port = free_port()
    root = Path(home) if home is not None else Path("runs") / f"flwr-local-{port}"
    root.mkdir(parents=True, exist_ok=True)
    env = flower_env(root / "home", FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(port), **ray_env)
    procs = Processes(root)
    try:
        link = procs.start("superlink", superlink_args(port, root), env)
        print(
            f"fedsgld deploy local: SuperLink pid {link.pid} on 127.0.0.1:{port}, FLWR_HOME "
            f"{root / 'home'}, log {root / 'superlink.log'}; stopped when the run ends; Ray: "
            + _ray_words(ray_env["RAY_ADDRESS"]),
            file=sys.stderr,
            flush=True,
        )
        procs.wait_listening("superlink", port)
        # flwr run and flwr ls (children) find this SuperLink; Ray's address is the SuperLink's only
        os.environ.update({k: v for k, v in env.items() if k != "RAY_ADDRESS"})
        return deploy_run.main([app, *flwr_args])
    finally:
        procs.stop()


def _ray_words(address: str) -> str:
    if address == "local":
        return "its own, stopped with the run"
    return f"the running cluster at {address} (joined, not stopped)"


__all__ = ["run_local", "superlink_args"]
