"""The one choice of where a run's noise is added: its placement -> its round mode.

``server`` (:class:`~fedsgld.strategies.modes.ServerNoise`), ``secure``
(:class:`~fedsgld.strategies.secure_sum.SecureSum`) and ``sites``
(:class:`~fedsgld.strategies.modes.SiteNoise`), in the order of their accuracy. The
placement is read here only, once per server; everything else asks the mode.
"""

from __future__ import annotations

from fedsgld.strategies.modes import RoundMode, ServerNoise, ServerState, SiteNoise
from fedsgld.strategies.secure_sum import SecureSum

MODES: tuple[type[RoundMode], ...] = (ServerNoise, SecureSum, SiteNoise)
# a placement, and the run-config settings that choose it, in the order of their accuracy
PLACEMENT_SETTINGS = {m.placement: m.settings for m in MODES}


def round_mode(server: ServerState) -> RoundMode:
    """The round mode of ``server``'s placement (``server.privacy.placement``)."""
    by_name = {m.placement: m for m in MODES}
    placement = server.privacy.placement
    if placement not in by_name:
        raise ValueError(f"placement must be one of {sorted(by_name)}, got {placement!r}")
    return by_name[placement](server)
