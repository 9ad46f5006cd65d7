"""Privacy: the accountant (GDP CLT and rigorous cross-checks), noise and clipping.

The noise and clipping helpers need torch; they are imported on first use, so that the
accountant (``fedsgld privacy``) starts without loading torch.
"""

from __future__ import annotations

from typing import Any

from .accountant import BudgetExhausted, PrivacyAccountant
from .gdp import gdp_delta, gdp_epsilon, gdp_mu

__all__ = [
    "BudgetExhausted",
    "PrivacyAccountant",
    "clip_and_sum",
    "gaussian_noise",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "os_seed",
    "seeded_generator",
]

_LAZY = {
    "clip_and_sum": "clipping",
    "gaussian_noise": "noise",
    "os_seed": "noise",
    "seeded_generator": "noise",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
