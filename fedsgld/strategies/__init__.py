"""The server side of fedsgld."""

from fedsgld.strategies.server import LangevinServer, PosteriorSamples, RoundPlan

__all__ = ["LangevinServer", "PosteriorSamples", "RoundPlan"]
