"""The ServerApp: ``flwr run .`` starts here (``[tool.flwr.app.components] serverapp``).

The run config (``[tool.flwr.app.config]`` in pyproject.toml, ``--run-config`` overrides)
has the keys of ``fedsgld simulate``'s config plus ``out``, ``resume``,
``round-timeout`` and ``wait-for-sites`` (see :mod:`fedsgld.flower.protocol`).
``task = "pate"`` runs PATE instead (:mod:`fedsgld.pate.flower`, keys ``pate.*``).
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsgld.flower.runner import PlacementRefused, serve
from fedsgld.pate.server import serve_pate

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    flwr_log = logging.getLogger("flwr")

    def log(msg: str) -> None:
        flwr_log.info("[fedsgld] %s", msg)

    run_config = dict(context.run_config)
    if run_config.get("task", "train") == "pate":
        res = serve_pate(grid, run_config, log=log)
        for mech, e in res["mechanisms"].items():
            eps = e["epsilon"]
            log(
                f"PATE {mech}: {e['answered']} labels, epsilon data-independent "
                f"{eps['data_independent']:.3f} (data-dependent {eps['data_dependent']:.3f}, "
                f"not private to release); results in {res['out_dir']}"
            )
        return
    try:
        results = serve(grid, run_config, log=log)
    except PlacementRefused as err:  # a site will not answer this run: no round is run
        flwr_log.error("[fedsgld] stopped before round 1: %s", err)
        raise  # the run is marked failed, with this reason (`fedsgld deploy run` exits 1)
    pr = results["privacy"]
    eps = ", ".join(f"{k}={v:.4f}" for k, v in pr["epsilon"].items())
    log(
        f"{pr['method']}: {pr['steps']} steps, epsilon {eps} (budget {pr['budget']}); results in {results.out_dir}"
    )
