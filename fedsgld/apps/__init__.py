"""Flower entry points: ``server_app:app`` and ``client_app:app`` (named in pyproject.toml).

The apps are thin: the ServerApp runs :func:`fedsgld.flower.runner.serve` (the round loop
around :class:`fedsgld.strategies.LangevinServer`), the ClientApp calls the handlers of
:mod:`fedsgld.flower.sites` (around :class:`fedsgld.clients.Site`). Nothing is imported
here, so importing the package does not import Flower.
"""
