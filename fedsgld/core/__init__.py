"""Pure functions of DP-SGLD: per-record gradients, pre-noise, clipping, the Langevin step."""

from fedsgld.core.device import DEVICES, resolve_device
from fedsgld.core.mechanism import (
    GRAD_PATHS,
    FlatModel,
    clipped_gradient_sum,
    langevin_update,
    poisson_sample,
    site_step,
)
from fedsgld.privacy.schedules import CyclicalSchedule, StepSchedule, sgld_noise_multiplier

__all__ = [
    "CyclicalSchedule",
    "DEVICES",
    "GRAD_PATHS",
    "FlatModel",
    "StepSchedule",
    "clipped_gradient_sum",
    "langevin_update",
    "poisson_sample",
    "resolve_device",
    "sgld_noise_multiplier",
    "site_step",
]
