"""fedsgld: differentially private Langevin dynamics (DP-SGLD) across hospital sites.

The Python API (docs/python-api.md), imported on first use so that ``import fedsgld``
stays light (no torch)::

    import fedsgld
    result = fedsgld.simulate(lambda: MyNet(), [(x0, y0), (x1, y1)], epsilon=4.0, ...)
"""

from __future__ import annotations

import importlib
from typing import Any

from fedsgld.version import __version__

#: The public names, each imported from :mod:`fedsgld.api` on first use.
_API = (
    "BudgetPlan",
    "BudgetWarning",
    "NothingToSpend",
    "Result",
    "RoundInfo",
    "RunInterrupted",
    "Stopped",
    "check_model",
    "make_config",
    "plan",
    "simulate",
)


def __getattr__(name: str) -> Any:
    if name in _API:
        # on first use: torch loads only when the API is used; no module of the package
        # imports the package root (they read fedsgld.version), so none depends on the API
        return getattr(importlib.import_module("fedsgld.api"), name)
    raise AttributeError(f"module 'fedsgld' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["__version__", *_API]
