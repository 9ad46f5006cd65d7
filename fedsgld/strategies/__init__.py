"""The server side: the update rule a round applies to the sites' sums (DP-SGLD, DP-SGD,
SGD and DPVI in :class:`LangevinServer`), the round's public plan (:class:`RoundPlan`) and
the iterates it keeps (:class:`PosteriorSamples`). Transports drive it; it knows none."""

from fedsgld.strategies.server import LangevinServer, PosteriorSamples, RoundPlan

__all__ = ["LangevinServer", "PosteriorSamples", "RoundPlan"]
