"""The server side: the update rule a round applies to the sites' answers (DP-SGLD, DP-SGD,
SGD and DPVI in :class:`LangevinServer`), the round mode that decides where the noise is
added (:mod:`fedsgld.strategies.modes`, chosen once by
:func:`fedsgld.strategies.placement.round_mode`), the round's public plan
(:class:`RoundPlan`) and the iterates it keeps (:class:`PosteriorSamples`). Transports
drive it; it knows none."""

from fedsgld.strategies.modes import RoundMode, ServerNoise, SiteNoise, Transport
from fedsgld.strategies.secure_sum import SecureSum
from fedsgld.strategies.server import LangevinServer, PosteriorSamples, RoundPlan

__all__ = [
    "LangevinServer",
    "PosteriorSamples",
    "RoundMode",
    "RoundPlan",
    "SecureSum",
    "ServerNoise",
    "SiteNoise",
    "Transport",
]
