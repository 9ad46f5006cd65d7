"""Which Ray a Flower simulation of fedsgld runs on: one of its own, or a running cluster.

Flower's simulation runtime (``flower-superlink --simulation`` -> ``flwr-simulation``)
starts its Ray backend with ``ray.init(**init_args)``; the federation config only carries
``num_cpus``, ``num_gpus``, ``logging_level`` and ``log_to_driver`` there (identical in
flwr 1.41 and 1.42), never an address. ``ray.init`` without one reads the ``RAY_ADDRESS``
environment variable, which the SuperLink passes on to the simulation process it starts.
So ``fedsgld deploy local --ray-address ADDRESS`` sets ``RAY_ADDRESS`` for the SuperLink
it starts, and nothing else:

``local``      a Ray instance of the simulation's own, started with the run and stopped
               with it (the default). Without it, ``ray.init()`` would join the cluster a
               ``ray start`` on this machine last recorded (``/tmp/ray/ray_current_cluster``),
               someone else's included.
``HOST:PORT``  the head node's GCS address of a running cluster (``ray start --head
               --port PORT``), checked to answer before any Flower process starts.

Ray's ``auto`` is refused (without a recorded cluster it joins any Ray running on the
machine), and so is a Ray Client address (``ray://``).

On an existing cluster the simulation is one more Ray driver: when the run ends Flower
ends its actors and calls ``ray.shutdown()``, which disconnects that driver and leaves
every node of the cluster running (``tests/flower/test_ray_cluster.py`` checks it). The
cluster's own settings apply: its nodes' ``--num-cpus`` decide how many Flower actors run
(``client-resources-num-cpus`` each), and ``init-args-num-cpus``/``init-args-num-gpus``
cannot be given (Ray refuses them when joining a cluster), so they are refused here first.
"""

from __future__ import annotations

import os
import socket

#: The address value that names no host: a Ray of the run's own.
LOCAL = "local"
#: ``--federation-config`` keys that only a Ray of the run's own accepts.
OWN_RAY_ONLY = ("init-args-num-cpus", "init-args-num-gpus")


def check_ray_address(address: str, name: str = "--ray-address") -> str:
    """``address`` if it is ``local`` or ``HOST:PORT`` with PORT in [1, 65535]; ValueError
    naming the setting (``name``) and the valid forms otherwise."""
    forms = "local or HOST:PORT (the head's `ray start --head --port PORT`)"
    value = address.strip()
    if value == LOCAL:
        return value
    if value.startswith("ray://") or value == "auto":
        why = "a Ray Client address" if value != "auto" else "Ray's auto (it may join any Ray here)"
        raise ValueError(
            f"{name}: {address!r} is {why}, which the simulation does not use; run it on a "
            f"node of the cluster and give {forms}"
        )
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name} must be {forms}, PORT in [1, 65535]; got {address!r}")
    return value


def default_ray_address() -> str:
    """``RAY_ADDRESS`` from the environment when set (Ray's own convention), else ``local``."""
    return os.environ.get("RAY_ADDRESS", "").strip() or "local"


def check_reachable(address: str, timeout: float = 5.0, name: str = "--ray-address") -> None:
    """ValueError unless something accepts a TCP connection at ``HOST:PORT`` (``local`` passes)."""
    if address == LOCAL:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise ValueError(
            f"{name} {address}: nothing answers there ({err.strerror or err}); start "
            f"the head with `ray start --head --port {port}` or give the address it printed"
        ) from err


def check_flwr_args(address: str, flwr_args: list[str]) -> None:
    """ValueError when ``flwr run``'s options set what only a Ray of the run's own accepts."""
    if address == LOCAL:
        return
    given = [key for key in OWN_RAY_ONLY if any(key in arg for arg in flwr_args)]
    if given:
        raise ValueError(
            f"--ray-address {address}: {', '.join(given)} cannot be given for an existing "
            "cluster (its nodes' --num-cpus/--num-gpus decide); leave them out"
        )


def checked_address(address: str | None, name: str = "--ray-address") -> str:
    """``address`` (None: ``RAY_ADDRESS`` if set, else ``local``) checked: its form, and that
    the head answers; errors name the setting (``name``)."""
    if address is None:
        name = f"RAY_ADDRESS (or {name})"
        value = check_ray_address(default_ray_address(), name)
    else:
        value = check_ray_address(address, name)
    check_reachable(value, name=name)
    return value


def ray_environment(address: str | None, flwr_args: list[str]) -> dict[str, str]:
    """The checked ``RAY_ADDRESS`` for the SuperLink's environment (None: the default)."""
    value = checked_address(address)
    check_flwr_args(value, flwr_args)
    return {"RAY_ADDRESS": value}


__all__ = [
    "LOCAL",
    "OWN_RAY_ONLY",
    "check_flwr_args",
    "check_ray_address",
    "check_reachable",
    "checked_address",
    "default_ray_address",
    "ray_environment",
]
