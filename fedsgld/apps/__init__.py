"""Flower entry points: ``server_app:app`` and ``client_app:app`` (named in pyproject.toml).

The apps are thin: the ServerApp runs :func:`fedsgld.flower.runner.serve` (the round loop
around :class:`fedsgld.strategies.LangevinServer`), the ClientApp calls the handlers of
:mod:`fedsgld.flower.sites` (around :class:`fedsgld.clients.Site`). Nothing is imported
here, so importing the package does not import Flower.
"""

# The apps as ``[tool.flwr.app.components]`` names them ("module:attribute"), for
# fedsgld.flower.local_grid.run_local(run_config, **APPS): strings, so that importing
# this package still imports neither app.
SERVER_APP = "fedsgld.apps.server_app:app"
CLIENT_APP = "fedsgld.apps.client_app:app"
APPS = {"server_app": SERVER_APP, "client_app": CLIENT_APP}
