"""The server side of fedsgld."""

from .server import LangevinServer, PosteriorSamples, RoundPlan

__all__ = ["LangevinServer", "PosteriorSamples", "RoundPlan"]
