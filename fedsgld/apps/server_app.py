"""The ServerApp: ``flwr run .`` starts here (``[tool.flwr.app.components] serverapp``).

The run config (``[tool.flwr.app.config]`` in pyproject.toml, ``--run-config`` overrides)
has the keys of ``fedsgld simulate``'s config plus ``out``, ``resume``,
``round-timeout`` and ``wait-for-sites`` (see :mod:`fedsgld.apps.protocol`).
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .runner import serve

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    flwr_log = logging.getLogger("flwr")

    def log(msg: str) -> None:
        flwr_log.info("[fedsgld] %s", msg)

    results = serve(grid, dict(context.run_config), log=log)
    pr = results["privacy"]
    eps = ", ".join(f"{k}={v:.4f}" for k, v in pr["epsilon"].items())
    log(f"{pr['method']}: {pr['steps']} steps, epsilon {eps} (budget {pr['budget']}); results in {results['out_dir']}")
