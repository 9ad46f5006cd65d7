"""Where the mathematics runs: ``cpu``, ``cuda`` or ``auto`` (cuda when a GPU is visible).

The device is a performance setting: it changes speed, never the method or its privacy.
Every random draw that matters keeps its explicit generator, made on the same device
(``fedsgld.core.noise.seeded_generator(..., device=...)``); a CUDA generator is a
different algorithm from the CPU's, so a seed gives different (equally reproducible)
numbers on a GPU than on the CPU.
"""

from __future__ import annotations

import torch

from fedsgld.config.checks import DEVICES
from fedsgld.config.device import cuda_available, resolve_device

# The device setting's values and its resolution live with the setting (fedsgld.config,
# below core); core re-exports them beside the check its maths needs.
__all__ = ["DEVICES", "check_generator", "cuda_available", "resolve_device"]


def check_generator(generator: torch.Generator, device: torch.device, what: str) -> None:
    """Raise ValueError unless ``generator`` draws on ``device`` (type), naming ``what``."""
    if generator.device.type != device.type:
        raise ValueError(
            f"{what}: the generator draws on {generator.device.type} but the computation "
            f"runs on {device.type}; make the generator with "
            f"seeded_generator(..., device={device.type!r})"
        )
