"""The audit on a Flower simulation: the same canaries and the same auditor as the engine.

:func:`run_audit_flower` runs ``config`` with Flower's simulation runtime (Ray, through
``flwr.simulation.run_simulation``) and audits it exactly as
:func:`fedsgld.studies.audit.run_audit` audits the in-process engine:

* **The canaries are inserted at their site, inside the ClientApp.** The app is the
  project's ClientApp (:func:`fedsgld.apps.client_app.build_app`) with one more mod,
  :func:`canary_mod`, inside the site's guard: for every training message the guard has
  passed, it gives the canaries' site, when this node hosts it, the canaries as extra
  records (``Site.extra_records``, the hook the engine uses): the site's Poisson sample
  draws them with its records and its clipping clips them. With secure aggregation the
  mod does the same on the secure round's messages (``train.secagg``), and the canaries
  are in the site's masked input. The mod knows the canaries' parameters and the
  inclusion randomness; nothing of it travels in a message.
* **The auditor reads what the server sees.** The ServerApp is the project's round loop
  (:func:`fedsgld.apps.runner.serve`) with the audit watching its
  :class:`~fedsgld.strategies.LangevinServer` (``on_release``): with noise at the server
  the parameters after every round, with noise at the sites the parameters the canaries'
  site returned, with secure aggregation the parameters after the decoded secure sum. The readings, scores and bounds are :class:`fedsgld.studies.audit.CanaryAudit`'s.

A seeded simulation (``randomness = "seeded"``) draws every sample and every noise as the
engine does, so the two transports give the same readings up to float32 transport
(``tests/flower/test_audit_flower.py``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedsgld.apps.client_app import build_app
from fedsgld.clients.guard import Training
from fedsgld.config import Config
from fedsgld.flower.handoff import admitted
from fedsgld.flower.protocol import SECAGG, TRAIN
from fedsgld.flower.runner import serve
from fedsgld.flower.site_runtime import hosted_sites
from fedsgld.studies.audit import CanaryAudit, audit_result, make_audit

_log = logging.getLogger("fedsgld.studies.audit")


def canary_mod(settings: dict[str, Any]) -> Callable[[Message, Context, Callable], Message]:
    """A ClientApp mod that inserts the canaries of ``settings``
    (:meth:`CanaryAudit.settings`) at their site when this node hosts it."""
    placed: dict[str, Any] = {}

    def mod(msg: Message, context: Context, call_next: Callable) -> Message:
        if msg.metadata.message_type in (TRAIN, SECAGG):
            request = admitted(msg).request  # the guard's decoded plan: a Training or a step
            plan = request.plan if isinstance(request, Training) else request.secure.plan
            site = hosted_sites(context, plan.config).sites.get(settings["site"])
            if site is not None and placed.get("site") is not site:  # once per built site
                CanaryAudit.from_settings(settings).insert_at(site)
                placed["site"] = site
        return call_next(msg, context)

    return mod


def run_config_of(config: Config, out: Path) -> dict[str, Any]:
    """The Flower run config of ``config``, writing its result directory to ``out``."""
    return {**config.flat(), "out": str(out)}


def run_audit_flower(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    nodes: int | None = None,
    log: Callable[[str], None] = _log.info,
    **audit_options: Any,
) -> dict[str, Any]:
    """:func:`fedsgld.studies.audit.run_audit` on a Flower simulation of ``nodes`` SuperNodes
    (default: one per site), one CPU each. ``audit_options``: those of
    :func:`fedsgld.studies.audit.make_audit` (canaries, confidence, site, raw_norm, audit_seed,
    inclusion_seed)."""
    audit = make_audit(config, **audit_options)
    nodes = config.run.sites if nodes is None else nodes
    holder: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        holder["results"] = serve(grid, holder["run_config"], log=log, on_server=audit.watch)

    client_app = build_app([canary_mod(audit.settings())])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedsgld-audit-") as tmp:
        out = Path(out_dir) if out_dir is not None else Path(tmp) / "run"
        holder["run_config"] = run_config_of(config, out.expanduser().resolve())
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=nodes,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    if "results" not in holder:
        raise RuntimeError("the Flower simulation ended without results (see its log)")
    return audit_result(audit, holder["results"], config, start)
