"""The accountant's second ledger: rounds of the distributed discrete Gaussian.

:class:`~fedsgld.privacy.accountant.PrivacyAccountant` composes Poisson-subsampled
Gaussian steps by privacy loss distributions. A round of
:class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep` is dominated by a
Poisson-subsampled Gaussian step at ``params.dominating_noise_multiplier``, up to a
slack that the whole run adds to epsilon (:mod:`fedsgld.privacy.distributed`,
:mod:`fedsgld.privacy.ddg_dominance`). The accountant keeps those rounds in a second,
run-length encoded ledger ``[(q, DDGParameters, count), ...]``, and once it holds any,
the epsilon of the WHOLE run (Gaussian steps included, at their recorded sigmas) is
:func:`~fedsgld.privacy.distributed.ddg_epsilon` of both ledgers: the FFT PLD of the
dominating Gaussian ledger plus the slack, for every value ``epsilon()`` reports and for
the budget check. Each (Gaussian ledger, DDG ledger) pair is computed once (an LRU cache:
a site's admission asks for the same ledger when it checks a plan and when it charges
it). Without DDG rounds nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fedsgld.privacy.budget import BudgetExhausted
from fedsgld.privacy.distributed import DDGParameters, ddg_epsilon
from fedsgld.privacy.events import (
    Composed,
    DistributedDiscreteGaussianStep,
    DpEvent,
    SubsampledGaussianStep,
    ddg_steps,
)
from fedsgld.privacy.gdp import gdp_mu
from fedsgld.privacy.ledger import LRU, LedgerKey, append, check_q

#: what the result file says of the accounting once a DDG round is in the ledger
ACCOUNTING = (
    "PLD of a dominating Poisson-subsampled Gaussian per round (the sum of discrete "
    "Gaussian shares within a bounded likelihood ratio of a post-processed continuous "
    "Gaussian, the slack added to epsilon), composed with the run's Gaussian steps by "
    "fedsgld's FFT PLD accountant"
)

_CACHE = 256

DDGKey = tuple[tuple[float, DDGParameters, int], ...]


def ddg_append(key: DDGKey, steps: Iterable[tuple[float, DDGParameters]]) -> DDGKey:
    """``key`` with ``steps`` (q, params) appended, run-length encoded."""
    out = [list(e) for e in key]
    for q, params in steps:
        q = check_q(q)
        if not isinstance(params, DDGParameters):
            raise ValueError(f"a DDG step needs DDGParameters, got {params!r}")
        if out and out[-1][0] == q and out[-1][1] == params:
            out[-1][2] += 1
        else:
            out.append([q, params, 1])
    return tuple((q, p, c) for q, p, c in out)


class DDGLedger:
    """The DDG half of :class:`~fedsgld.privacy.accountant.PrivacyAccountant` (a mixin: it
    uses the accountant's ``delta``, ``epsilon_budget``, ``bucket``, ``_ledger``)."""

    _ddg: DDGKey = ()

    @property
    def ddg_ledger(self) -> list[tuple[float, DDGParameters, int]]:
        """The DDG rounds recorded, [(q, params, count), ...] in order."""
        return list(self._ddg)

    def _ddg_epsilon(self, key: LedgerKey, ddg: DDGKey) -> float:
        """The epsilon of the Gaussian ledger ``key`` and the DDG ledger ``ddg`` together:
        :func:`~fedsgld.privacy.distributed.ddg_epsilon`, each pair of ledgers computed
        once (the cache is keyed by both ledgers, so by every event's parameters)."""
        if not key and not ddg:
            return 0.0
        cache = self.__dict__.setdefault("_ddg_eps_cache", LRU(_CACHE))
        cached = cache.lookup((key, ddg))
        if cached is None:
            cached = ddg_epsilon(ddg, self.delta, gaussian=key).epsilon
            cache.put((key, ddg), cached)
        return cached

    def _after(self, event: DpEvent) -> tuple[LedgerKey, DDGKey]:
        """Both ledgers as they would be with ``event`` (nothing recorded)."""
        gauss, ddg = ddg_steps(event)
        key = self._ledger
        for q, sigma in gauss:
            key = append(key, check_q(q), self.bucket(sigma), 1)
        return key, ddg_append(self._ddg, ddg)

    def _event_has_ddg(self, event: DpEvent) -> bool:
        return bool(ddg_steps(event)[1])

    def _ddg_fits(self, event: DpEvent) -> bool:
        if self.epsilon_budget is None:
            self._after(event)  # validated all the same
            return True
        return self._ddg_epsilon(*self._after(event)) <= self.epsilon_budget

    def _ddg_affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s releases, in order, fit (Gaussian steps first, then DDG
        rounds: the bound of the composition does not depend on their order)."""
        gauss, ddg = ddg_steps(event)
        parts: Sequence[DpEvent] = [SubsampledGaussianStep(q, s) for q, s in gauss] + [
            DistributedDiscreteGaussianStep(p, q) for q, p in ddg
        ]
        n = 0
        while n < len(parts) and self._ddg_fits(Composed(tuple(parts[: n + 1]))):
            n += 1
        return n

    def _ddg_spend(self, event: DpEvent) -> None:
        """Record all of ``event`` or, past the budget, none."""
        key, ddg = self._after(event)
        if self.epsilon_budget is not None:
            eps = self._ddg_epsilon(key, ddg)
            if eps > self.epsilon_budget:
                raise BudgetExhausted(
                    f"release from step {self.steps + 1} would take epsilon (dominating PLD, with "
                    f"distributed discrete Gaussian rounds) to {eps:.6g} > budget "
                    f"{self.epsilon_budget:g} at delta={self.delta:g}; not recorded",
                    epsilon=eps,
                    budget=self.epsilon_budget,
                )
        gauss = ddg_steps(event)[0]
        self._mu2 += sum(gdp_mu([(q, s, 1)]) ** 2 for q, s in gauss)
        self._ledger, self._ddg = key, ddg
        self._certified = []  # certified without these rounds: no longer dominating

    def _ddg_state(self) -> list[list[Any]]:
        return [[q, dataclasses.asdict(p), c] for q, p, c in self._ddg]

    def _load_ddg_state(self, state: Mapping[str, Any]) -> None:
        entries = state.get("ddg", [])
        self._ddg = tuple(
            (float(q), DDGParameters(**p), int(c)) for q, p, c in entries if int(c) > 0
        )
        self._certified = []

    def _ddg_epsilons(self, key: LedgerKey) -> dict[str, float]:
        """Every name ``epsilon()`` reports, all the epsilon of the whole run (:meth:`_ddg_epsilon`)."""
        v = self._ddg_epsilon(key, self._ddg)
        names = ("gdp", "pld", "rdp", self.rigorous_name)
        return dict.fromkeys(names, v if math.isfinite(v) else math.inf)
