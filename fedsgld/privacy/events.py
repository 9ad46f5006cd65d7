"""Privacy events: what each release of fedsgld costs, as values the accountants compose.

A run, a site or a PATE server releases noisy statistics; each release is described here
by a small frozen dataclass (an *event*, in the manner of ``dp_accounting``'s DpEvents)
that says which mechanism ran with which public parameters, and nothing about the data.
The accountants read events instead of bare ``(q, sigma, count)`` tuples:

* :class:`SubsampledGaussianStep`: a Poisson-subsampled Gaussian mechanism (rate q, noise
  multiplier sigma on sums of records clipped to L2 norm C). DP-SGLD, DP-SGD and DPVI
  training steps are all this mechanism (DPVI noises the clipped sum of the variational
  parameters' gradients exactly like DP-SGD), and so are the private recalibration steps
  and the local steps a site takes with ``noise_placement = "sites"``.
* :class:`GaussianRelease`: the Gaussian mechanism on a whole dataset (no sampling): a
  site's noised evaluation statistics (L2 sensitivity sqrt(5)) and its noised PATE vote
  histogram (sensitivity sqrt(2 Q)). ``noise_multiplier`` is the noise std over the
  sensitivity; it is accounted as one step with q = 1.
* :class:`LnmaxAnswers`, :class:`GnmaxAnswers`, :class:`ConfidentGnmaxAnswers`: the
  labels a PATE server releases by noisy argmax. They are NOT in the Gaussian ledger:
  :mod:`fedsgld.privacy.pate_analysis` accounts them (moments accountant for LNMax, Renyi
  DP for GNMax), data-independently from the event alone, and data-dependently from the
  event and the private vote histogram (:func:`~fedsgld.privacy.pate_events.answers_epsilon`).
* :class:`DistributedDiscreteGaussianStep`: one round of the distributed discrete
  Gaussian sum under secure aggregation (:mod:`fedsgld.privacy.distributed`), records
  Poisson-sampled with rate q. It is dominated by a Gaussian step only up to a slack the
  whole run adds to epsilon, so it is NOT in the Gaussian ledger: the accountant keeps it
  in a second ledger (:mod:`fedsgld.privacy.ddg_ledger`); :func:`ddg_steps` flattens an
  event into it.
* :class:`Repeated` (one event ``count`` times) and :class:`Composed` (events in order):
  composition.
* :class:`PoissonSampled` (sampling as a wrapper, as in ``dp_accounting``'s
  ``PoissonSampledDpEvent``) of a :class:`GaussianMechanism` or a
  :class:`DistributedDiscreteGaussian`: the one form every release takes in the ledgers.

:func:`releases` flattens an event into its :class:`PoissonSampled` releases, in order;
each ledger of the accountant says which it ``supports``. :func:`gaussian_steps` gives the
``(q, sigma)`` steps the Gaussian ledger records; :func:`ledger_entries` run-length encodes
them. An event no ledger can hold (PATE answers) raises :class:`UnsupportedEvent`.

Torch-free, like the rest of :mod:`fedsgld.privacy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from fedsgld.privacy.distributed import DDGParameters

__all__ = [
    "ConfidentGnmaxAnswers",
    "Composed",
    "DistributedDiscreteGaussian",
    "DistributedDiscreteGaussianStep",
    "DpEvent",
    "GaussianMechanism",
    "GaussianRelease",
    "GnmaxAnswers",
    "LnmaxAnswers",
    "PoissonSampled",
    "Repeated",
    "SubsampledGaussianStep",
    "UnsupportedEvent",
    "ddg_steps",
    "gaussian_steps",
    "is_gaussian",
    "ledger_entries",
    "releases",
    "subsampled_steps",
]


class UnsupportedEvent(ValueError):
    """The event is not a composition of (subsampled) Gaussian steps."""


@dataclass(frozen=True)
class DpEvent:
    """Base class of every privacy event (a description of a release, never its data)."""


@dataclass(frozen=True)
class SubsampledGaussianStep(DpEvent):
    """One Poisson-subsampled Gaussian step: every record enters the clipped sum with
    probability ``sample_rate`` q, and the sum gets N(0, (noise_multiplier C)^2 I).

    A DP-SGLD step (sigma_t = sqrt(2 alpha_t tau)), a DP-SGD or DPVI step (constant sigma),
    a recalibration step, or one local step of a site that adds the noise itself."""

    sample_rate: float
    noise_multiplier: float


@dataclass(frozen=True)
class GaussianRelease(DpEvent):
    """The Gaussian mechanism on the whole dataset: ``f(D) + N(0, std^2 I)`` with
    ``std = noise_multiplier * sensitivity`` (``sensitivity``: the L2 sensitivity of f to one
    record). Accounted as one step with q = 1 and this ``noise_multiplier``."""

    noise_multiplier: float
    sensitivity: float = 1.0

    @property
    def std(self) -> float:
        """The noise standard deviation, ``noise_multiplier * sensitivity``."""
        return self.noise_multiplier * self.sensitivity


@dataclass(frozen=True)
class DistributedDiscreteGaussianStep(DpEvent):
    """One round of the distributed discrete Gaussian sum (Kairouz, Liu & Steinke 2021)
    with public parameters ``params``, every record in the sites' clipped sums with
    probability ``sample_rate`` q: dominated by the Poisson-subsampled Gaussian at
    ``params.dominating_noise_multiplier``, up to ``params.slack``."""

    params: DDGParameters
    sample_rate: float


@dataclass(frozen=True)
class GaussianMechanism(DpEvent):
    """The Gaussian mechanism with ``noise_multiplier`` (noise std over the L2 sensitivity),
    on the whole dataset unless wrapped in :class:`PoissonSampled`."""

    noise_multiplier: float


@dataclass(frozen=True)
class DistributedDiscreteGaussian(DpEvent):
    """One distributed discrete Gaussian sum with public parameters ``params``, on the
    whole dataset unless wrapped in :class:`PoissonSampled`."""

    params: DDGParameters


@dataclass(frozen=True)
class PoissonSampled(DpEvent):
    """``event`` (a :class:`GaussianMechanism` or a :class:`DistributedDiscreteGaussian`)
    run on a Poisson sample: every record enters independently with probability
    ``sample_rate``. The form every release takes in the ledgers (:func:`releases`)."""

    sample_rate: float
    event: DpEvent


@dataclass(frozen=True)
class LnmaxAnswers(DpEvent):
    """``queries`` labels released by LNMax (``argmax_j n_j + Lap(1/gamma)``), accounted by
    the moments accountant with lambda = 1..``moments``."""

    gamma: float
    queries: int
    moments: int = 8


@dataclass(frozen=True)
class GnmaxAnswers(DpEvent):
    """``queries`` labels released by GNMax (``argmax_j n_j + N(0, sigma^2)``), by RDP."""

    sigma: float
    queries: int


@dataclass(frozen=True)
class ConfidentGnmaxAnswers(DpEvent):
    """Confident-GNMax over ``posed`` queries: the threshold check ``max_j n_j +
    N(0, sigma1^2) >= threshold`` on every posed query, GNMax(``sigma``) on those that pass.
    Data-independently every posed query is charged both (which were answered depends on
    the data)."""

    sigma: float
    sigma1: float
    threshold: float
    posed: int


@dataclass(frozen=True)
class Repeated(DpEvent):
    """``event`` released ``count`` times (adaptively composed)."""

    event: DpEvent
    count: int


@dataclass(frozen=True)
class Composed(DpEvent):
    """``events`` released one after the other (adaptively composed), in this order."""

    events: tuple[DpEvent, ...]


_MECHANISMS = (GaussianMechanism, DistributedDiscreteGaussian)


def releases(event: DpEvent) -> Iterator[PoissonSampled]:
    """``event`` flattened into its releases in order, each a :class:`PoissonSampled` of
    one mechanism: a :class:`SubsampledGaussianStep` (q, sigma) is ``PoissonSampled(q,
    GaussianMechanism(sigma))``, a :class:`GaussianRelease` is sampled with q = 1, a
    :class:`DistributedDiscreteGaussianStep` (params, q) is ``PoissonSampled(q,
    DistributedDiscreteGaussian(params))`` (values unchanged, unvalidated: the ledgers
    validate).

    Raises:
        UnsupportedEvent: a PATE answer event, or anything that is not a DpEvent.
    """
    if isinstance(event, SubsampledGaussianStep):
        yield PoissonSampled(event.sample_rate, GaussianMechanism(event.noise_multiplier))
    elif isinstance(event, GaussianRelease):
        yield PoissonSampled(1.0, GaussianMechanism(event.noise_multiplier))
    elif isinstance(event, DistributedDiscreteGaussianStep):
        yield PoissonSampled(event.sample_rate, DistributedDiscreteGaussian(event.params))
    elif isinstance(event, _MECHANISMS):
        yield PoissonSampled(1.0, event)
    elif isinstance(event, PoissonSampled) and isinstance(event.event, _MECHANISMS):
        yield event
    elif isinstance(event, Repeated):
        for _ in range(event.count):
            yield from releases(event.event)
    elif isinstance(event, Composed):
        for e in event.events:
            yield from releases(e)
    elif isinstance(event, (LnmaxAnswers, GnmaxAnswers, ConfidentGnmaxAnswers)):
        raise UnsupportedEvent(
            f"{type(event).__name__} is accounted by "
            "fedsgld.privacy.pate_events.answers_epsilon, not by the Gaussian ledger"
        )
    else:
        raise UnsupportedEvent(f"not a privacy event: {event!r}")


def is_gaussian(release: PoissonSampled) -> bool:
    """Whether a release of :func:`releases` is a (sampled) Gaussian mechanism."""
    return isinstance(release.event, GaussianMechanism)


def gaussian_steps(event: DpEvent) -> Iterator[tuple[float, float]]:
    """The ``(q, sigma)`` steps of ``event`` in release order, as the Gaussian ledger
    records them (values unchanged, unvalidated: the accountant validates).

    Raises:
        UnsupportedEvent: a distributed discrete Gaussian round or a PATE answer event,
            or anything that is not a DpEvent.
    """
    for r in releases(event):
        if not is_gaussian(r):
            raise UnsupportedEvent(
                "DistributedDiscreteGaussianStep is composed by the DDG ledger "
                "(fedsgld.privacy.ddg_ledger), not by the Gaussian ledger"
            )
        yield r.sample_rate, r.event.noise_multiplier


def ddg_steps(
    event: DpEvent,
) -> tuple[list[tuple[float, float]], list[tuple[float, DDGParameters]]]:
    """``event`` split into its Gaussian steps ``(q, sigma)`` and its distributed discrete
    Gaussian steps ``(q, params)`` (each in release order; composition does not depend
    on the order, so their interleaving does not matter)."""
    gs: list[tuple[float, float]] = []
    ds: list[tuple[float, DDGParameters]] = []
    for r in releases(event):
        if is_gaussian(r):
            gs.append((r.sample_rate, r.event.noise_multiplier))
        else:
            ds.append((r.sample_rate, r.event.params))
    return gs, ds


def ledger_entries(event: DpEvent) -> list[tuple[float, float, int]]:
    """``event``'s steps run-length encoded: ``[(q, sigma, count), ...]`` in release order."""
    out: list[list] = []
    for q, sigma in gaussian_steps(event):
        if out and out[-1][0] == q and out[-1][1] == sigma:
            out[-1][2] += 1
        else:
            out.append([q, sigma, 1])
    return [(q, s, c) for q, s, c in out]


def subsampled_steps(steps: Iterable[tuple[float, float]]) -> DpEvent | None:
    """The event of Poisson-subsampled Gaussian steps ``(q, sigma)`` taken in order: one
    :class:`SubsampledGaussianStep`, their :class:`Composed` sequence, or None for none."""
    events = tuple(SubsampledGaussianStep(q, s) for q, s in steps)
    if not events:
        return None
    return events[0] if len(events) == 1 else Composed(events)
