"""The one release step of every noisy release: charge the ledger, then draw the noise.

A release that protects records (the server's noisy sum of a round, a site's noisy local
step, a recalibration step, a site's noised evaluation) spends privacy. The spend must be
in the ledger, and the ledger on disk, BEFORE the noise exists: a crash after the draw
must never leave a release the ledger does not count. So the noise cannot be drawn on its
own here: :func:`charge` spends the release's privacy event
(:mod:`fedsgld.privacy.events`) in the accountant and persists it, and only the
:class:`Charged` receipt it returns draws the noise of that release.

The draw itself is the party's :meth:`~fedsgld.core.noise.Randomness.gaussian` with the
stream key the caller names (:mod:`fedsgld.core.streams`); nothing here changes which
numbers are drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fedsgld.core.noise import Randomness
from fedsgld.privacy.events import DpEvent, ddg_steps


class Ledger(Protocol):
    """What :func:`charge` needs of an accountant (:class:`fedsgld.privacy.PrivacyAccountant`)."""

    def spend(self, event: DpEvent) -> Any: ...


_ISSUED = object()  # only charge() holds it, so only charge() makes a receipt


class Charged:
    """The receipt of a charge: its ``event`` is in the ledger, persisted.

    The noise of that release is drawn through it (:meth:`noise`, :meth:`add_noise`).
    Made only by :func:`charge`.
    """

    __slots__ = ("event",)

    def __init__(self, event: DpEvent | None, *, _issued: object = None) -> None:
        if _issued is not _ISSUED:
            raise TypeError("a Charged receipt is made only by charge(): the ledger first")
        self.event = event

    @property
    def steps(self) -> tuple[tuple[float, float], ...]:
        """The event's Gaussian steps (q, sigma), in order; () for none (a distributed
        discrete Gaussian round has none: its noise is drawn by :mod:`fedsgld.secagg`)."""
        return () if self.event is None else tuple(ddg_steps(self.event)[0])

    def noise(
        self,
        randomness: Randomness,
        shape: torch.Size | tuple[int, ...],
        *,
        std: float,
        key: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """N(0, std^2 I) from ``randomness``'s stream ``key`` (on ``device`` when given)."""
        where = {} if device is None else {"device": device}
        return randomness.gaussian(shape, std=std, key=key, dtype=dtype, **where)

    def draw(self, sampler: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``sampler(*args, **kwargs)``: a noise of this charge drawn by another sampler than
        the party's Gaussian (a secure-aggregation site's discrete Gaussian share)."""
        return sampler(*args, **kwargs)

    def add_noise(
        self,
        value: torch.Tensor,
        randomness: Randomness,
        *,
        std: float,
        key: tuple[int, ...],
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``value`` + N(0, std^2 I) of ``value``'s shape and dtype."""
        return value + self.noise(
            randomness, value.shape, std=std, key=key, dtype=value.dtype, device=device
        )


def charge(
    ledger: Ledger | None,
    event: DpEvent | None,
    *,
    persist: Callable[[Any], None] | None = None,
) -> Charged:
    """Spend ``event`` in ``ledger`` (all its steps or, past the budget, none), then
    ``persist(ledger)``; return the receipt that draws the release's noise.

    An exception (the budget exhausted, a failed write) leaves no receipt, so no noise is
    drawn. ``ledger`` None: a method without a privacy guarantee, nothing to charge;
    ``event`` None: nothing noised, but the ledger's other records are still persisted.
    """
    if ledger is not None:
        if event is not None:
            ledger.spend(event)
        if persist is not None:
            persist(ledger)
    return Charged(event, _issued=_ISSUED)
