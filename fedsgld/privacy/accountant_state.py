"""The accountant's checkpoint format: its ledger and settings as a JSON-serialisable dict.

A run persists the accountant's state before it draws the noise of every step (the
ledger first), and a site persists its own ledger the same way; this module writes and
reads that dict, version :data:`STATE_VERSION`::

    {"version": 1, "ledger": [[q, sigma, count], ...], "steps": T, "gdp_mu2": mu^2 | None,
     "delta": ..., "budget": ..., "accountant": ..., "sigma_rel_grid": ...,
     "pld_discretization": ...}

``gdp_mu2`` is the GDP mu^2 of the recorded steps at their exact (unrounded) sigmas.
Restoring into an accountant whose settings differ is refused naming the setting, so a
resumed run never silently changes its budget or guarantee.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from fedsgld.privacy.gdp import gdp_mu
from fedsgld.privacy.ledger import LedgerKey, normalise

__all__ = ["STATE_VERSION", "check_same_settings", "read_state", "saved_mu2", "write_state"]

STATE_VERSION = 1
_STATE_KEYS = ("ledger", "delta", "budget", "accountant", "sigma_rel_grid", "pld_discretization")


def write_state(ledger: LedgerKey, mu2: float, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict of a ledger, its exact GDP mu^2 and the accountant's ``settings``
    (keys delta, budget, accountant, sigma_rel_grid, pld_discretization)."""
    return {
        "version": STATE_VERSION,
        "ledger": [[q, s, c] for q, s, c in ledger],
        "steps": sum(c for _, _, c in ledger),
        "gdp_mu2": mu2 if math.isfinite(mu2) else None,
        **settings,
    }


def read_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], LedgerKey]:
    """(the accountant's constructor arguments, the validated ledger) of a state dict."""
    if not isinstance(state, Mapping):
        raise ValueError(f"privacy accountant state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(
            f"privacy accountant state version must be {STATE_VERSION}, got {version!r}"
        )
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"privacy accountant state lacks {missing}")
    settings = {
        "delta": state["delta"],
        "epsilon_budget": state["budget"],
        "accountant": state["accountant"],
        "sigma_rel_grid": state["sigma_rel_grid"],
        "pld_discretization": state["pld_discretization"],
    }
    return settings, normalise(state["ledger"])


def check_same_settings(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """ValueError naming the first setting of ``saved`` that differs from ``ours``."""
    for name, value in saved.items():
        if value != ours[name]:
            raise ValueError(
                f"load_state_dict: the saved {name}={value!r} differs from this accountant's "
                f"{name}={ours[name]!r}; use PrivacyAccountant.from_state_dict to restore the "
                "saved settings"
            )


def saved_mu2(state: Mapping[str, Any], key: LedgerKey) -> float:
    """GDP mu^2 at the exact sigmas, when the state has it (older states: the ledger's)."""
    mu2 = state.get("gdp_mu2")
    if mu2 is None or isinstance(mu2, bool) or not isinstance(mu2, numbers.Real) or mu2 < 0:
        mu2 = gdp_mu(key) ** 2 if key else 0.0
    return float(mu2)
