"""Step-size schedules and the DP-SGLD noise multiplier.

* constant:    alpha_t = alpha_0
* polynomial:  alpha_t = alpha_0 * (1 + t / t0) ** (-gamma)     (t = 0, 1, 2, ...)
* cyclical:    alpha_t = alpha_0 * (f + (1 - f) * (1 + cos(pi * (t mod L) / L)) / 2)
               (cSGLD, Zhang et al. 2020, with a floor f; f = 0 is their schedule): every
               cycle of L steps starts at alpha_0 and anneals towards f * alpha_0, so one
               chain explores with large steps and samples with small ones, cycle after
               cycle, and can visit several modes.

DP-SGLD (Knolle et al. 2021) ties the Gaussian-mechanism noise multiplier of step t to
the step size: sigma_t = sqrt(2 * alpha_t * tau), with temperature tau > 0. A decaying
alpha_t therefore means a *decaying* sigma_t, so later steps cost more privacy: the
accountant composes the changing sigma_t step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StepSchedule:
    """alpha_t = alpha_0 * (1 + t / t0) ** (-gamma); gamma = 0 gives a constant schedule."""

    alpha0: float
    gamma: float = 0.0
    t0: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("lr", self.alpha0)
        if not (math.isfinite(self.gamma) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"decay_gamma must be in [0, 1], got {self.gamma!r}")
        _check_positive("decay_t0", self.t0)

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"step index must be >= 0, got {t}")
        if self.gamma == 0.0:
            return self.alpha0
        return self.alpha0 * (1.0 + t / self.t0) ** (-self.gamma)


@dataclass(frozen=True)
class CyclicalSchedule:
    """alpha_t = alpha_0 (f + (1 - f) (1 + cos(pi (t mod L) / L)) / 2), L = ``cycle_length``,
    f = ``floor``: cosine cycles from alpha_0 down to (almost) f alpha_0.

    Under DP-SGLD (sigma_t = sqrt(2 alpha_t tau)) the small steps at the end of a cycle
    have a small sigma_t and cost the most privacy; a floor f > 0 bounds that cost.
    """

    alpha0: float
    cycle_length: int
    floor: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("lr", self.alpha0)
        if (
            isinstance(self.cycle_length, bool)
            or not isinstance(self.cycle_length, int)
            or self.cycle_length < 1
        ):
            raise ValueError(f"cycle_length must be an integer >= 1, got {self.cycle_length!r}")
        if not (
            isinstance(self.floor, (int, float))
            and math.isfinite(self.floor)
            and 0.0 <= self.floor < 1.0
        ):
            raise ValueError(f"cycle_floor must be in [0, 1), got {self.floor!r}")

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"step index must be >= 0, got {t}")
        phase = (t % self.cycle_length) / self.cycle_length
        return self.alpha0 * (
            self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * phase))
        )


def sgld_noise_multiplier(alpha: float, temperature: float) -> float:
    """sigma = sqrt(2 * alpha * tau): the DP-SGLD noise multiplier for step size alpha."""
    _check_positive("lr", alpha)
    _check_positive("temperature", temperature)
    return math.sqrt(2.0 * alpha * temperature)
