"""What a run evaluates and what it returns: :class:`Evaluation` and :class:`RunResult`.

An :class:`Evaluation` is one model (a group of parameter vectors theta_1..theta_J: the last
iterate, the kept iterates, SWAG draws, or the temperature-scaled last iterate) evaluated
at every site on its test (or validation) split: the predictive probabilities
p(y | x) = (1/J) sum_j softmax(f(x; theta_j)), each site's calibration report, and the
pooled report over all sites' records. Both transports build it with the same two
constructors, so that a seeded run gives the same numbers whichever moved the data:

* :meth:`Evaluation.from_predictions`: the sites shared their predictions (the in-process
  engine always; Flower where every site's policy shares them); the pooled report is
  :func:`~fedsgld.calibration.calibration_report` of the concatenated predictions, in site
  order.
* :meth:`Evaluation.from_statistics`: some site kept its predictions; the pooled report
  and reliability table come from the sites' sufficient statistics
  (:mod:`fedsgld.calibration.pooling`: exact accuracy, NLL, Brier, ECE, MCE; no pooled
  SCE, ACE or AUC).

Only the reports (:attr:`Evaluation.report`) go into results.json; the probabilities stay
in memory (for the plots, the benchmark's curves). Privacy caveat: evaluating a model on a
site's records is a query on private data; what a deployed site releases (exact or noised
reports, predictions or not) is its policy's decision, made at the site before anything
reaches these types (:mod:`fedsgld.flower.release`).

A :class:`RunResult` is what a finished run returns (:func:`fedsgld.engine.run`,
:func:`fedsgld.flower.runner.serve`): results.json's document (read it as a mapping:
``result["privacy"]``), the run directory and the final evaluations by model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsgld.calibration import calibration_report
from fedsgld.calibration.pooling import reliability_from_stats, report_from_stats

#: one site's (probabilities (n, classes), labels (n,)), by site id
SitePredictions = dict[int, tuple[torch.Tensor, torch.Tensor]]

POOLED_FROM_PREDICTIONS = "predictions"
POOLED_FROM_STATISTICS = "site statistics"


@dataclass(frozen=True)
class Evaluation:
    """One model evaluated at every site (see the module docs).

    ``pooled`` and ``sites`` (site id as a string -> report) are results.json's reports.
    ``probs`` / ``labels``: the pooled predictions and labels in site order, and
    ``site_probs`` each site's, where the sites shared them (else None / empty).
    ``missing_sites``: the sites that did not answer (Flower; none in process).
    ``pooled_from``: ``"predictions"`` or ``"site statistics"``. ``reliability``: the
    pooled reliability table from the sites' statistics, where they sent them.
    """

    pooled: dict[str, Any]
    sites: dict[str, dict[str, Any]]
    probs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    site_probs: SitePredictions = field(default_factory=dict)
    missing_sites: list[int] = field(default_factory=list)
    pooled_from: str = POOLED_FROM_PREDICTIONS
    reliability: dict[str, np.ndarray] | None = None

    @classmethod
    def from_predictions(
        cls,
        sites: dict[str, dict[str, Any]],
        site_probs: SitePredictions,
        *,
        missing_sites: Sequence[int] = (),
        stats: Sequence[dict[str, Any]] | None = None,
    ) -> Evaluation:
        """The pooled report over every site's predictions, concatenated in the order of
        ``site_probs`` (probabilities as float32, labels as given). ``stats``: the sites'
        pooling statistics, where they sent them (the reliability table from them)."""
        probs = torch.cat([p for p, _ in site_probs.values()])
        labels = torch.cat([y for _, y in site_probs.values()])
        return cls(
            pooled=calibration_report(probs.numpy(), labels.numpy()),
            sites=sites,
            probs=probs,
            labels=labels,
            site_probs=dict(site_probs),
            missing_sites=list(missing_sites),
            pooled_from=POOLED_FROM_PREDICTIONS,
            reliability=None if stats is None else reliability_from_stats(stats),
        )

    @classmethod
    def from_statistics(
        cls,
        sites: dict[str, dict[str, Any]],
        stats: Sequence[dict[str, Any]],
        *,
        missing_sites: Sequence[int] = (),
    ) -> Evaluation:
        """The pooled report and reliability table from the sites' statistics alone."""
        return cls(
            pooled=report_from_stats(stats),
            sites=sites,
            missing_sites=list(missing_sites),
            pooled_from=POOLED_FROM_STATISTICS,
            reliability=reliability_from_stats(stats),
        )

    @property
    def shared(self) -> bool:
        """Whether the pooled predictions are here (every site shared them)."""
        return self.probs is not None and self.labels is not None

    @property
    def report(self) -> dict[str, Any]:
        """What results.json holds of this model: ``{"pooled": ..., "sites": ...}``."""
        return {"pooled": self.pooled, "sites": self.sites}

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(pooled probabilities, labels) as arrays, for a reliability plot."""
        if self.probs is None or self.labels is None:
            raise ValueError("this evaluation holds no predictions (the sites kept them)")
        return self.probs.numpy(), self.labels.numpy()

    def site_curves(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each site's (probabilities, labels) as arrays, by site id."""
        return {k: (p.numpy(), y.numpy()) for k, (p, y) in self.site_probs.items()}


#: evaluations by model: ``last``, ``posterior``, ``swag``, ``recal``
Evaluations = dict[str, Evaluation]


@dataclass(frozen=True, eq=False)
class RunResult(Mapping[str, Any]):
    """A finished run: results.json's document (``results``; this object reads as that
    mapping, ``result["privacy"]``), the run directory, and the final evaluations by model
    (``last``; ``posterior``, ``swag``, ``recal`` where the run has them), whose
    predictions are kept in memory only."""

    results: dict[str, Any]
    out_dir: Path
    evaluations: Evaluations = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.results[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def last(self) -> Evaluation:
        """The last iterate's evaluation."""
        return self.evaluations["last"]


__all__ = [
    "POOLED_FROM_PREDICTIONS",
    "POOLED_FROM_STATISTICS",
    "Evaluation",
    "Evaluations",
    "RunResult",
    "SitePredictions",
]
