"""How the site's guard hands what it admitted to the handler behind it.

Flower calls a ClientApp's handler with the message and the node's context only. The
site's guard (:mod:`fedsgld.flower.guard`) has already decoded the message (one codec per
message type: :mod:`fedsgld.flower.protocol`), checked it against the site's policy and
charged the site's ledger; the handler computes from that, never from the raw record.
While the handler of a message runs, the guard holds what it admitted for that message
(:func:`handing`), and the handler takes it (:func:`admitted`). A handler reached without
the guard has nothing to take and computes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from flwr.app import Message

from fedsgld.core.release import Charged


@dataclass(frozen=True)
class Admitted:
    """What the guard admitted for one message: the typed ``request`` its admission decoded
    and checked (:class:`fedsgld.clients.guard.Training` for a ``train`` message), and the
    ``receipt`` of its charge (None: nothing was charged, so nothing may be noised)."""

    request: Any
    receipt: Charged | None


_HELD: ContextVar[tuple[Message, Admitted] | None] = ContextVar("fedsgld_admitted", default=None)


@contextmanager
def handing(msg: Message, admitted: Admitted) -> Iterator[None]:
    """Hold ``admitted`` for ``msg`` while the handler behind the guard runs."""
    token = _HELD.set((msg, admitted))
    try:
        yield
    finally:
        _HELD.reset(token)


def admitted(msg: Message) -> Admitted:
    """What the guard admitted for ``msg``; ``RuntimeError`` where no guard passed it."""
    held = _HELD.get()
    if held is None or held[0] is not msg:
        raise RuntimeError(
            f"{msg.metadata.message_type}: no admission of the site's guard for this message "
            "(a site's handlers run only behind its guard)"
        )
    return held[1]


__all__ = ["Admitted", "admitted", "handing"]
