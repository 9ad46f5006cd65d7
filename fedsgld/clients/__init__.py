"""The site (hospital) side of fedsgld."""

from .site import Site

__all__ = ["Site"]
