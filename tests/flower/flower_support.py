"""Helpers for the Flower tests: small configs, process isolation and clean-up.

Every Flower process gets its own FLWR_HOME under the test's tmp directory, telemetry,
update checks and runtime dependency installation are off, only loopback addresses are
used, and every process a test starts (including the detached local SuperLink that
``flwr run`` leaves behind, and the SuperExec children) is stopped by a finalizer: the
processes are found by the test's unique tmp path in their command line or environment.
The helpers that start a deployment live in :mod:`fedsgld.deploy.loopback` (the benchmarks
use them too); this module re-exports them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from fedsgld.deploy import loopback
from fedsgld.deploy.loopback import (  # noqa: F401 - the tests import them from here
    BIN,
    ROOT,
    flower_env,
    flwr,
    free_port,
    run_config_arg,
    wait_port,
)
from fedsgld.secagg.crypto import mask, modulus_mask
from fedsgld.secagg.shamir import combine

# A small, fast federation (synthetic data, an MLP): the engine's test settings.
# a short deployed run's posterior sampling and waits (the loopback deployment tests)
DEPLOYED = {
    "burn_in": 1,
    "thin": 1,
    "max_samples": 2,
    "poll-interval": 0.1,
    "wait-for-sites": 120.0,
    "round-timeout": 120.0,
}

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


class Processes(loopback.Processes):
    """Long-running Flower processes of one test; all stopped at teardown, with whatever
    else mentions the test's directory (the detached SuperLink of ``flwr run``)."""

    def stop(self) -> None:
        super().stop()
        stop_tagged(str(self.root))


@pytest.fixture
def flower_tmp(tmp_path_factory):  # imported by the test modules that need it
    """A short, unique directory for one test's Flower processes (stopped at teardown)."""
    root = tmp_path_factory.mktemp("flwr")
    procs = Processes(root)
    yield root, procs
    procs.stop()


def unmasked_input(sp, masked: dict, unmask: dict, v: int):
    """Site ``v``'s masked input minus its self mask, as a server rebuilds that mask from
    the unmasking shares it received (``masked``, ``unmask``: every site's replies by
    site id): uniform modulo 2^bits for one site, the small noisy sum for all of them."""
    y = np.frombuffer(masked[v]["y"], dtype="<u4").astype(np.uint64)
    seed = combine({sp.point(u): m["self_mask_shares"][v] for u, m in unmask.items()},
                   sp.threshold)  # fmt: skip
    return (y - mask(seed, sp.length, sp.bits)) & modulus_mask(sp.bits)
