"""The round's plan: what every site needs for one round, all of it public.

The server's round mode writes it (:mod:`fedsgld.strategies`), both transports carry it,
and the site's guard checks it against the site's policy (:mod:`fedsgld.clients.guard`).
:class:`TrainPlan` is one site's instruction built on it, as the Flower transport carries
it (:mod:`fedsgld.flower.protocol` encodes and decodes it) and the site's guard admits it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fedsgld.config import Config


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


VECTOR_DTYPE = np.dtype("<f4")  # how theta_t and S_k travel: float32, little-endian


def unpack_vector(b: Any, *, size: int, name: str) -> np.ndarray:
    """The float32 vector of ``size`` entries in ``b`` (bytes, float32 little-endian);
    ``ValueError`` otherwise."""
    if not isinstance(b, bytes):
        raise ValueError(f"{name} is a {type(b).__name__}, expected bytes (float32 ({size},))")
    if len(b) != size * VECTOR_DTYPE.itemsize:
        raise ValueError(
            f"{name} has {len(b)} bytes, expected float32 ({size},) = "
            f"{size * VECTOR_DTYPE.itemsize} bytes"
        )
    return np.frombuffer(b, dtype=VECTOR_DTYPE).astype(np.float32)


@dataclass(frozen=True)
class TrainPlan:
    """One site's training instruction for round ``round`` (all public): the round's plan as
    the site sees it, who asks (``run_key``, ``epoch``: a resumed run has a new epoch, so a
    site numbers every request it answers), theta_t and the run's config.

    The step size is not part of it: with noise at the server the site only sums, and with
    noise at the sites (``local_steps``, ``first_step`` set) the site takes its step sizes
    and noise multipliers from the run config's schedule, which its guard holds to the
    plan. ``clip`` None: no clipping (a non-private method). ``theta``: theta_t as float32
    little-endian bytes (:func:`unpack_vector` with the site's parameter count), absent
    from the steps of a secure round that send no parameters. ``site_id`` None: the node's
    one site (a plan shared by every node)."""

    round: int
    epoch: int
    run_key: str
    sample_rate: float
    sigma: float
    prenoise: float
    clip: float | None
    config: Config
    theta: bytes | None = None
    site_id: int | None = None
    local_steps: int | None = None
    first_step: int | None = None

    @classmethod
    def of(
        cls,
        plan: RoundPlan,
        *,
        run_key: str,
        epoch: int,
        config: Config,
        theta: bytes | None,
        site_id: int | None = None,
    ) -> TrainPlan:
        """The instruction of ``plan`` for one site (local steps only where the sites add
        the noise: ``plan.first_step`` set)."""
        local = plan.first_step is not None
        return cls(
            round=plan.round,
            epoch=epoch,
            run_key=run_key,
            sample_rate=plan.sample_rate,
            sigma=plan.sigma,
            prenoise=plan.prenoise,
            clip=plan.clip,
            config=config,
            theta=theta,
            site_id=site_id,
            local_steps=plan.local_steps if local else None,
            first_step=plan.first_step if local else None,
        )

    @property
    def round_of(self) -> tuple[str, int, int]:
        """(run key, epoch, round): what a site's ledger numbers the request by."""
        return (self.run_key, self.epoch, self.round)

    def theta_vector(self, size: int) -> np.ndarray:
        """theta_t as a float32 vector of the site's ``size`` parameters (``ValueError``
        for a missing or malformed one)."""
        return unpack_vector(self.theta, size=size, name="theta")
