"""The round's plan: what every site needs for one round, all of it public.

The server's round mode writes it (:mod:`fedsgld.strategies`), both transports carry it,
and the site's guard checks it against the site's policy (:mod:`fedsgld.clients.guard`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RoundPlan:
    """What every site needs for round ``round`` (all public)."""

    round: int
    step_size: float
    sigma: float
    sample_rate: float
    clip: float | None
    prenoise: float
    local_steps: int = (
        1  # noise_placement "sites": local steps first_step .. first_step + local_steps - 1
    )
    first_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
