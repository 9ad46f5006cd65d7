"""What a run reports besides its last iterate: honest names, and SWAG."""

from fedsgld.posteriors.naming import RECAL, SWAG, iterate_average

__all__ = ["RECAL", "SWAG", "iterate_average"]
