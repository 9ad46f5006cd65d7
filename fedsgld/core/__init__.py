"""The torch maths of a private step: per-record gradients, pre-noise, clipping, noise, the
Langevin update, and the one release step (charge the ledger, then draw the noise:
:mod:`fedsgld.core.release`). The torch-free schedules live in :mod:`fedsgld.privacy.schedules`."""

from fedsgld.core.device import DEVICES, resolve_device
from fedsgld.core.mechanism import (
    GRAD_PATHS,
    FlatModel,
    clipped_gradient_sum,
    langevin_update,
    poisson_sample,
    site_step,
)

__all__ = [
    "DEVICES",
    "GRAD_PATHS",
    "FlatModel",
    "clipped_gradient_sum",
    "langevin_update",
    "poisson_sample",
    "resolve_device",
    "site_step",
]
