"""Pure functions of DP-SGLD: per-record gradients, pre-noise, clipping, the Langevin step."""

from .mechanism import FlatModel, clipped_gradient_sum, langevin_update, poisson_sample, site_step
from .schedules import CyclicalSchedule, StepSchedule, sgld_noise_multiplier

__all__ = [
    "CyclicalSchedule",
    "FlatModel",
    "StepSchedule",
    "clipped_gradient_sum",
    "langevin_update",
    "poisson_sample",
    "sgld_noise_multiplier",
    "site_step",
]
