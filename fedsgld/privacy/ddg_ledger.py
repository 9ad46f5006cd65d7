"""The accountant's second ledger: rounds of the distributed discrete Gaussian.

:class:`~fedsgld.privacy.accountant.PrivacyAccountant` composes Poisson-subsampled
Gaussian steps by privacy loss distributions. A round of
:class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep` is dominated by a
Poisson-subsampled Gaussian step at ``params.dominating_noise_multiplier``, up to a
slack that the whole run adds to epsilon (:mod:`fedsgld.privacy.distributed`,
:mod:`fedsgld.privacy.ddg_dominance`). The accountant keeps those rounds in a second,
run-length encoded ledger ``[(q, DDGParameters, count), ...]`` (:class:`DDGLedger`, held
beside the Gaussian ledger and chosen for the events it ``supports``), and once it holds any,
the epsilon of the WHOLE run (Gaussian steps included, at their recorded sigmas) is
:func:`~fedsgld.privacy.distributed.ddg_epsilon` of both ledgers: the FFT PLD of the
dominating Gaussian ledger plus the slack, for every value ``epsilon()`` reports and for
the budget check. Each (delta, Gaussian ledger, DDG ledger) triple is computed once per
process (:func:`shared_epsilon`, an LRU cache shared by every ledger: a site's admission
asks for the same ledger when it checks a plan and when it charges it, and the simulated
sites of one run, whose ledgers hold the same rounds, ask for the same triple). The value
is a deterministic function of the triple, the key holds every parameter of every
recorded event, so a cached epsilon is exactly the one a fresh computation gives: never
a smaller charge. Without DDG rounds nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
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
    is_gaussian,
    releases,
)
from fedsgld.privacy.gaussian_ledger import GaussianLedger
from fedsgld.privacy.gdp import gdp_mu
from fedsgld.privacy.ledger import LRU, LedgerKey, append, check_q

#: what the result file says of the accounting once a DDG round is in the ledger
ACCOUNTING = (
    "PLD of a dominating Poisson-subsampled Gaussian per round (the sum of discrete "
    "Gaussian shares within a bounded likelihood ratio of a post-processed continuous "
    "Gaussian, the slack added to epsilon), composed with the run's Gaussian steps by "
    "fedsgld's FFT PLD accountant"
)

_CACHE = 1024

DDGKey = tuple[tuple[float, DDGParameters, int], ...]

_SHARED = LRU(_CACHE)
_LOCK = threading.Lock()


def shared_epsilon(delta: float, key: LedgerKey, ddg: DDGKey) -> float:
    """:func:`~fedsgld.privacy.distributed.ddg_epsilon` of the DDG ledger ``ddg`` with the
    Gaussian ledger ``key`` at ``delta``, each triple computed once per process.

    Exact, not approximate: the epsilon depends on nothing but the triple (the DDG
    parameters are frozen, the ledgers' entries are (q, params or sigma, count)), and the
    cache is keyed by all of it, so a hit returns the very float a fresh computation
    returns. Ledgers that differ in any entry, count or delta never share a value."""
    triple = (float(delta), key, ddg)
    with _LOCK:
        cached = _SHARED.lookup(triple)
    if cached is None:
        cached = ddg_epsilon(ddg, delta, gaussian=key).epsilon
        with _LOCK:
            _SHARED.put(triple, cached)
    return cached


def clear_shared_epsilons() -> None:
    """Empty :func:`shared_epsilon`'s cache (for tests that count compositions)."""
    with _LOCK:
        _SHARED.clear()


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
    """The rounds of the distributed discrete Gaussian, and the epsilon of the whole run
    once it holds any (the accountant's second ledger, beside ``gaussian``, whose public
    ledger it reads and, when an event it admits holds Gaussian steps too, commits to).

    It ``supports`` every event with a distributed discrete Gaussian round; its budget
    checks take the event's Gaussian steps with them (the bound of the composition does
    not depend on the order)."""

    def __init__(
        self,
        *,
        delta: float,
        epsilon_budget: float | None,
        names: Sequence[str],
        gaussian: GaussianLedger,
    ) -> None:
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.names = tuple(names)
        self.gaussian = gaussian
        self.key: DDGKey = ()

    def supports(self, event: DpEvent) -> bool:
        """Whether ``event`` holds a distributed discrete Gaussian round."""
        return any(not is_gaussian(r) for r in releases(event))

    @property
    def entries(self) -> list[tuple[float, DDGParameters, int]]:
        """The DDG rounds recorded, [(q, params, count), ...] in order."""
        return list(self.key)

    @property
    def steps(self) -> int:
        return sum(c for _, _, c in self.key)

    def epsilon(self, key: LedgerKey, ddg: DDGKey) -> float:
        """The epsilon of the Gaussian ledger ``key`` and the DDG ledger ``ddg`` together:
        :func:`~fedsgld.privacy.distributed.ddg_epsilon`, each (delta, pair of ledgers)
        computed once per process (:func:`shared_epsilon`, keyed by every event's
        parameters)."""
        if not key and not ddg:
            return 0.0
        return shared_epsilon(self.delta, key, ddg)

    def whole_run(self, key: LedgerKey) -> float | None:
        """The epsilon of the whole run with the Gaussian ledger at ``key``; None while this
        ledger holds no round (the Gaussian ledger's own accountants then apply)."""
        return self.epsilon(key, self.key) if self.key else None

    def epsilons(self, key: LedgerKey) -> dict[str, float]:
        """Every name the accountant reports, all the epsilon of the whole run."""
        v = self.epsilon(key, self.key)
        return dict.fromkeys(self.names, v if math.isfinite(v) else math.inf)

    # -- the budget checks of an event it supports ------------------------------------------
    def _after(self, event: DpEvent) -> tuple[LedgerKey, DDGKey]:
        """Both ledgers as they would be with ``event`` (nothing recorded)."""
        gauss, ddg = ddg_steps(event)
        key = self.gaussian.key
        for q, sigma in gauss:
            key = append(key, check_q(q), self.gaussian.bucket(sigma), 1)
        return key, ddg_append(self.key, ddg)

    def fits(self, event: DpEvent) -> bool:
        if self.epsilon_budget is None:
            self._after(event)  # validated all the same
            return True
        return self.epsilon(*self._after(event)) <= self.epsilon_budget

    def affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s releases, in order, fit (Gaussian steps first, then DDG
        rounds: the bound of the composition does not depend on their order)."""
        gauss, ddg = ddg_steps(event)
        parts: Sequence[DpEvent] = [SubsampledGaussianStep(q, s) for q, s in gauss] + [
            DistributedDiscreteGaussianStep(p, q) for q, p in ddg
        ]
        n = 0
        while n < len(parts) and self.fits(Composed(tuple(parts[: n + 1]))):
            n += 1
        return n

    def epsilon_after(self, event: DpEvent) -> float:
        return self.epsilon(*self._after(event))

    def spend(self, event: DpEvent) -> None:
        """Record all of ``event`` or, past the budget, none."""
        key, ddg = self._after(event)
        if self.epsilon_budget is not None:
            eps = self.epsilon(key, ddg)
            if eps > self.epsilon_budget:
                raise BudgetExhausted(
                    f"release from step {self.gaussian.steps + self.steps + 1} would take "
                    f"epsilon (dominating PLD, with distributed discrete Gaussian rounds) to "
                    f"{eps:.6g} > budget {self.epsilon_budget:g} at delta={self.delta:g}; "
                    "not recorded",
                    epsilon=eps,
                    budget=self.epsilon_budget,
                )
        gauss = ddg_steps(event)[0]
        self.gaussian.commit(key, sum(gdp_mu([(q, s, 1)]) ** 2 for q, s in gauss))
        self.key = ddg

    # -- checkpoints ------------------------------------------------------------------
    def state(self) -> list[list[Any]]:
        return [[q, dataclasses.asdict(p), c] for q, p, c in self.key]

    def load(self, state: Mapping[str, Any]) -> None:
        entries = state.get("ddg", [])
        self.key = tuple(
            (float(q), DDGParameters(**p), int(c)) for q, p, c in entries if int(c) > 0
        )
