"""The ServerApp and ClientApp around a Python API user's own model factory and records.

:func:`run_user_apps` runs the project's apps (the ServerApp's round loop
:func:`fedsgld.flower.runner.serve`, and :func:`fedsgld.apps.client_app.build_app`'s
ClientApp with its site guard) over Flower, with the user's objects inside the apps
(:mod:`fedsgld.flower.user_sites`): the server draws theta_0 from the user's factory and
each node builds its sites from the user's records of those sites and the same factory,
under the run's seed. Two runtimes:

``"local"``  Flower's ``Grid`` interface in this process
    (:class:`fedsgld.flower.local_grid.LocalGrid`): the same messages, replies, guard and
    handlers, without Ray (milliseconds per round).
``"ray"``  Flower's simulation runtime, ``flwr.simulation.run_simulation``: the ClientApp,
    and so the user's factory and records, are pickled (cloudpickle) to Ray actors, one
    process per CPU. The factory must be picklable there: a module-level function of an
    importable module, or a function of the script itself (``__main__``, pickled by
    value); a lambda or closure works too. What cannot be pickled (an open file, a
    database connection in the factory's closure) is refused before Ray starts, naming
    the local runtime as the alternative.

A deployment (SuperNodes in other processes or machines) cannot receive in-memory
objects at all: see docs/python-api.md ("Deploying your own model").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsgld.apps.client_app import build_app
from fedsgld.data.partition import SiteData
from fedsgld.deploy.ray_cluster import checked_address
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.runner import serve
from fedsgld.flower.user_sites import UserObjects, user_objects_mod
from fedsgld.run.evaluation import RunResult
from fedsgld.run.progress import RoundInfo
from fedsgld.strategies import LangevinServer

RUNTIMES = ("local", "ray")


def _picklable(client_app: Any) -> None:
    """ValueError in one line when Ray could not carry the ClientApp (with the user's
    factory and records) to its actors."""
    import cloudpickle  # Ray's own serialiser of functions (a dependency of ray)

    try:
        cloudpickle.dumps(client_app)
    except Exception as err:  # noqa: BLE001 - reported in one line
        first = (str(err).splitlines() or [""])[0]
        raise ValueError(
            f"model: the factory cannot be sent to Flower's Ray actors ({type(err).__name__}: "
            f"{first}); define it at module level without unpicklable state, or use "
            'transport="flower" (the same apps in this process)'
        ) from err


def run_user_apps(
    run_config: dict[str, Any],
    *,
    model_fn: Callable[[], torch.nn.Module] | None,
    site_data: list[SiteData] | None,
    runtime: str = "local",
    nodes: int | None = None,
    log: Callable[[str], None] = lambda _line: None,
    on_round: Callable[[RoundInfo], Any] | None = None,
    ray_address: str | None = None,
) -> tuple[RunResult, LangevinServer]:
    """Run the apps over ``runtime`` (one of :data:`RUNTIMES`) with ``nodes`` nodes
    (default: one per site); the run's result and its server (theta, posterior).
    ``ray_address`` (``"ray"`` only): ``"local"`` or a running cluster's ``HOST:PORT``
    (None: ``RAY_ADDRESS`` if set, else ``"local"``; :mod:`fedsgld.deploy.ray_cluster`)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
    if ray_address is not None and runtime != "ray":
        raise ValueError(
            f"ray_address: only with Flower's Ray simulation; the runtime is {runtime!r}"
        )
    # every node starts with the run, and a node that fails to build its sites fails for
    # good: no reason to wait the deployment's 10 minutes for it
    run_config = {"wait-for-sites": 30.0 if runtime == "local" else 180.0, **run_config}
    objects = UserObjects.of(model_fn, site_data)
    holder: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        holder["result"] = serve(
            grid,
            run_config,
            log=log,
            on_server=lambda s: holder.__setitem__("server", s),
            model_fn=model_fn,
            on_round=on_round,
        )

    client_app = build_app(outer_mods=[user_objects_mod(objects)])
    n = nodes if nodes is not None else int(run_config.get("sites", 4))
    if runtime == "local":
        run_local(run_config, server_app=server_app, client_app=client_app, num_nodes=n)
    else:
        _picklable(client_app)
        _run_ray(server_app, client_app, n, checked_address(ray_address, "ray_address"))
    if "result" not in holder:
        raise RuntimeError("the Flower simulation ended without a result (see Flower's log)")
    return holder["result"], holder["server"]


def _run_ray(server_app: ServerApp, client_app: Any, nodes: int, address: str) -> None:
    """Flower's Ray simulation on a Ray of its own (``address`` ``"local"``) or joining the
    running cluster at ``address`` as one more driver: when the run ends Flower ends its
    actors and ``ray.shutdown()`` disconnects that driver, stopping nothing of the cluster."""
    import ray  # Flower's simulation extra
    from flwr.simulation import run_simulation

    if ray.is_initialized():
        # Flower would run on that Ray whatever the address, and shut it down at the end
        raise ValueError(
            "transport='ray': Ray is already initialised in this process (ray.init); call "
            "ray.shutdown() first and pass ray_address to join a cluster"
        )
    level = logging.getLogger("flwr").level
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=nodes,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"address": address},
            },
        )
    finally:
        logging.getLogger("flwr").setLevel(level)


__all__ = ["RUNTIMES", "run_user_apps"]
