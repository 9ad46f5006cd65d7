"""PATE answers as events: the epsilons of a :mod:`fedsgld.privacy.events` PATE event.

A PATE server releases labels by noisy argmax over the teachers' vote histogram. The
release is described by an event (:class:`~fedsgld.privacy.events.LnmaxAnswers`,
:class:`~fedsgld.privacy.events.GnmaxAnswers`,
:class:`~fedsgld.privacy.events.ConfidentGnmaxAnswers`) and accounted here by the analysis
of :mod:`fedsgld.privacy.pate_analysis`: the moments accountant for LNMax, Renyi DP for
GNMax. These are not Gaussian-ledger steps (the PrivacyAccountant refuses them), and each
comes with two numbers: the data-independent epsilon (a guarantee, publishable) and the
data-dependent one (a function of the private votes: not private to release).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsgld.privacy.events import ConfidentGnmaxAnswers, DpEvent, GnmaxAnswers, LnmaxAnswers
from fedsgld.privacy.pate_analysis import (
    check_counts,
    gnmax_epsilon_from_counts,
    lnmax_epsilon_from_counts,
)

__all__ = ["answers_epsilon"]


def _rows(counts: Any, expected: int, what: str) -> np.ndarray:
    counts = check_counts(counts)
    if counts.shape[0] != expected:
        raise ValueError(f"counts has {counts.shape[0]} rows, the event {what} {expected}")
    return counts


def answers_epsilon(
    event: DpEvent, counts: Any, *, delta: float, answered: Any = None
) -> dict[str, float]:
    """``{"data_dependent": ..., "data_independent": ...}`` of a PATE answer event at ``delta``.

    ``counts``: the summed vote histogram (n_queries, num_classes), one row per answered
    query for LNMax and GNMax, one per posed query for Confident-GNMax, whose ``answered``
    (bool, one per posed query) marks the queries that passed the threshold check.
    """
    if isinstance(event, LnmaxAnswers):
        rows = _rows(counts, event.queries, "answers")
        return lnmax_epsilon_from_counts(
            rows, gamma=event.gamma, delta=delta, moments=event.moments
        )
    if isinstance(event, GnmaxAnswers):
        rows = _rows(counts, event.queries, "answers")
        return gnmax_epsilon_from_counts(rows, sigma=event.sigma, delta=delta)
    if isinstance(event, ConfidentGnmaxAnswers):
        rows = _rows(counts, event.posed, "poses")
        return gnmax_epsilon_from_counts(
            rows, sigma=event.sigma, delta=delta, threshold=event.threshold,
            sigma1=event.sigma1, answered=answered,
        )  # fmt: skip
    raise ValueError(f"not a PATE answer event: {event!r}")
