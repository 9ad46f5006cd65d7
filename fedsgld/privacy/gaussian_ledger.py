"""The accountant's Gaussian ledger: Poisson-subsampled Gaussian steps and their epsilon.

The run-length encoded ledger ``[(q, sigma, count), ...]`` of the releases
``PoissonSampled(q, GaussianMechanism(sigma))`` (:mod:`fedsgld.privacy.events`), sigmas
rounded DOWN onto a geometric grid (``sigma_rel_grid``), with its epsilon by GDP (the CLT,
approximate), by fedsgld's FFT PLD, by RDP and by ``dp_accounting``'s PLD (the
reference), and the budget checks of :class:`~fedsgld.privacy.accountant.PrivacyAccountant`
for events made of Gaussian steps only (certified plans make later checks cheap,
:mod:`fedsgld.privacy.budget`). ``whole_run(key)``, when it returns a number, is the
epsilon of the whole run with this ledger at ``key`` (the distributed discrete Gaussian
ledger's, once it holds rounds): the budget uses it instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from fedsgld.privacy import pld_fft
from fedsgld.privacy.budget import (
    BudgetExhausted,
    dominates,
    max_steps_by_runs,
    max_steps_by_search,
    single_step_delta_lower_bound,
)
from fedsgld.privacy.events import DpEvent, gaussian_steps, is_gaussian, releases
from fedsgld.privacy.gdp import gdp_epsilon, gdp_mu
from fedsgld.privacy.ledger import (
    LRU,
    Entry,
    LedgerKey,
    Plan,
    append,
    bucket_down,
    check_count,
    check_q,
    check_sigma,
    normalise,
)
from fedsgld.privacy.rdp import ledger_rdp_epsilon
from fedsgld.privacy.reference_pld import ReferencePLD

REFERENCE_PLD = "dp_accounting_pld"

_MAX_CERTIFIED = 4
_EPS_CACHE = 1024
_BUCKET_CACHE = 100_000
_MERGE = pld_fft.DEFAULT_SIGMA_MERGE  # relative sigma bins of "pld" and "rdp"


def _gdp_mu2(q: float, sigma: float) -> float:
    """One step's contribution q^2 (exp(1/sigma^2) - 1) to mu^2 (inf on overflow)."""
    return gdp_mu([(q, sigma, 1)]) ** 2


class GaussianLedger:
    """The ledger of Poisson-subsampled Gaussian steps, its epsilons and its budget checks
    (settings as :class:`~fedsgld.privacy.accountant.PrivacyAccountant`'s, validated there)."""

    def __init__(
        self,
        *,
        delta: float,
        epsilon_budget: float | None,
        accountant: str,
        sigma_rel_grid: float,
        pld_discretization: float,
        whole_run: Callable[[LedgerKey], float | None] = lambda key: None,
    ) -> None:
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.rigorous_name = accountant
        self.sigma_rel_grid = sigma_rel_grid
        self.key: LedgerKey = ()
        self.mu2 = 0.0  # GDP mu^2 of the recorded steps at their exact sigmas
        self._whole_run = whole_run
        self._certified: list[LedgerKey] = []
        self._bucket_cache: dict[float, float] = {}
        self._reference = ReferencePLD(pld_discretization=pld_discretization)
        self._rdp_cache: dict[tuple[float, float], Any] = {}
        self._eps_cache = LRU(_EPS_CACHE)

    def supports(self, event: DpEvent) -> bool:
        """Whether every release of ``event`` is a (sampled) Gaussian mechanism."""
        return all(is_gaussian(r) for r in releases(event))

    @property
    def steps(self) -> int:
        return sum(c for _, _, c in self.key)

    def restore(self, key: LedgerKey, mu2: float) -> None:
        """Replace the ledger (a checkpoint's), certificates dropped."""
        self.key, self.mu2, self._certified = key, mu2, []

    def commit(self, key: LedgerKey, mu2_added: float) -> None:
        """Take ``key`` as the ledger (steps another ledger's budget check admitted), mu^2
        grown by ``mu2_added``; certificates dropped (they did not hold those steps)."""
        self.key = key
        self.mu2 += mu2_added
        self._certified = []

    def bucket(self, sigma: float) -> float:
        """sigma rounded DOWN onto the grid (1 + r)^k, r = ``sigma_rel_grid``; always <= sigma.

        With r = 0 sigma is returned unchanged. Rounding down is conservative because
        epsilon is non-increasing in sigma.
        """
        sigma = check_sigma(sigma)
        r = self.sigma_rel_grid
        if r == 0.0:
            return sigma
        cached = self._bucket_cache.get(sigma)
        if cached is not None:
            return cached
        value = bucket_down(sigma, r)
        if len(self._bucket_cache) >= _BUCKET_CACHE:
            self._bucket_cache.clear()
        self._bucket_cache[sigma] = value
        return value

    def ledger_after(
        self, schedule: Callable[[int], tuple[float, float]], steps: int
    ) -> list[Entry]:
        """The ledger after ``steps`` more steps along ``schedule(t) -> (q, sigma)``, t = 0, 1, ...

        Sigma is bucketed as in :meth:`step`; nothing is recorded.
        """
        steps = check_count(steps, "steps")
        return list(Plan(self.key, schedule, self.bucket).ledger(steps))

    # -- epsilon -----------------------------------------------------------------
    def rigorous(self, ledger: Iterable[Any]) -> float:
        """The epsilon the budget uses for ``ledger`` (normalised): the whole run's where
        another ledger holds releases, else the rigorous accountant's."""
        key = normalise(ledger)
        joint = self._whole_run(key)
        if joint is not None:
            return joint
        return self._eps(self.rigorous_name, key)

    def epsilons(self, key: LedgerKey, *, recorded: bool) -> dict[str, float]:
        """{"gdp", "pld", "rdp", rigorous_name} of ``key`` (``recorded``: the GDP value at the
        exact sigmas recorded)."""
        out = {
            "gdp": self._gdp_exact() if recorded else self._gdp(key),
            "pld": self._eps("pld", key),
            "rdp": self._eps("rdp", key),
        }
        if self.rigorous_name not in out:
            out[self.rigorous_name] = self._eps(self.rigorous_name, key)
        return out

    def _gdp(self, key: LedgerKey) -> float:
        return float(gdp_epsilon(gdp_mu(key), self.delta)) if key else 0.0

    def _gdp_exact(self) -> float:
        if not self.key:
            return 0.0
        return float(gdp_epsilon(math.sqrt(self.mu2), self.delta))

    def _eps(self, name: str, key: LedgerKey) -> float:
        if not key:
            return 0.0
        cached = self._eps_cache.lookup((name, key))
        if cached is not None:
            return cached
        if name == "pld":
            value = self._fft_epsilon(key)
        elif name == "rdp":
            value = self._rdp_epsilon(key)
        else:
            value = self._pld_epsilon(key)
        self._eps_cache.put((name, key), value)
        return value

    # the default: fedsgld's FFT PLD (pld_fft), every distinct sigma at once
    def _fft_epsilon(self, key: LedgerKey) -> float:
        return pld_fft.compose(key, delta=self.delta, sigma_merge=_MERGE).epsilon(self.delta)

    # the reference, dp_accounting's PLD (fedsgld.privacy.reference_pld)
    def _pld_epsilon(self, key: LedgerKey) -> float:
        return self._reference.epsilon(key, self.delta)

    # RDP: the per-step RDP curves, vectorised over the distinct (q, sigma), summed with counts
    def _rdp_epsilon(self, key: LedgerKey) -> float:
        groups = pld_fft._groups(key, _MERGE)
        return float(ledger_rdp_epsilon(groups, self.delta, cache=self._rdp_cache)[0])

    # -- the budget ------------------------------------------------------------------
    def _certify(self, key: LedgerKey) -> None:
        self._certified = [key] + [c for c in self._certified if not dominates(key, c)]
        del self._certified[_MAX_CERTIFIED:]

    def _within_budget(self, key: LedgerKey) -> tuple[bool, float | None]:
        """(ok, epsilon or None when certified by domination without computing)."""
        assert self.epsilon_budget is not None
        if any(dominates(c, key) for c in self._certified):
            return True, None
        if key and single_step_delta_lower_bound(key, self.epsilon_budget) > self.delta:
            # one step alone already overspends (e.g. a noise multiplier near 0): refuse
            # without building a privacy loss distribution, whose grid would be enormous
            return False, math.inf
        eps = self.rigorous(key)
        if eps <= self.epsilon_budget:
            self._certify(key)
            return True, eps
        return False, eps

    # -- spending ---------------------------------------------------------------------
    def spend(self, event: DpEvent) -> None:
        """Record the Gaussian steps of ``event`` (sigmas rounded down onto the grid), all of
        them or, when they would take the rigorous epsilon past the budget, none.

        Raises:
            BudgetExhausted: the event does not fit the budget; NOTHING was recorded.
        """
        steps = list(gaussian_steps(event))
        if len(steps) == 1:
            self._record(*steps[0])
            return
        if self.epsilon_budget is not None and not self.fits(event):
            eps = self.epsilon_after(event)
            raise BudgetExhausted(
                f"{len(steps)} steps from step {self.steps + 1} would take epsilon "
                f"({self.rigorous_name}) to {eps:.6g} > budget {self.epsilon_budget:g} at "
                f"delta={self.delta:g}; none recorded",
                epsilon=eps,
                budget=self.epsilon_budget,
            )
        for q, sigma in steps:
            self._record(q, sigma)

    def fits(self, event: DpEvent) -> bool:
        """Whether ``event`` keeps the rigorous epsilon <= budget (True without a budget)."""
        steps = list(gaussian_steps(event))
        if len(steps) == 1:
            q, s = check_q(steps[0][0]), self.bucket(steps[0][1])
            if self.epsilon_budget is None:
                return True
            return self._within_budget(append(self.key, q, s, 1))[0]
        return self.affordable(event) == len(steps)

    def affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s steps, in order, fit the budget (all without a budget).
        Certifies what fits, as :meth:`max_steps` does."""
        steps = list(gaussian_steps(event))
        if self.epsilon_budget is None:
            self.ledger_after(steps.__getitem__, len(steps))  # validated all the same
            return len(steps)
        return self.max_steps(steps.__getitem__, limit=len(steps))

    def epsilon_after(self, event: DpEvent) -> float:
        """The rigorous epsilon the ledger would have with ``event`` (nothing recorded)."""
        steps = list(gaussian_steps(event))
        return self.rigorous(self.ledger_after(steps.__getitem__, len(steps)))

    def _record(self, q: float, sigma: float) -> None:
        q, s = check_q(q), self.bucket(sigma)
        key = append(self.key, q, s, 1)
        if self.epsilon_budget is not None:
            ok, eps = self._within_budget(key)
            if not ok:
                assert eps is not None
                raise BudgetExhausted(
                    f"step {self.steps + 1} (q={q:g}, sigma={float(sigma):.6g}) would take epsilon "
                    f"({self.rigorous_name}) to {eps:.6g} > budget {self.epsilon_budget:g} at "
                    f"delta={self.delta:g}; not recorded",
                    epsilon=eps,
                    budget=self.epsilon_budget,
                )
        self.key = key
        self.mu2 += _gdp_mu2(q, check_sigma(sigma))

    def max_steps(self, schedule: Callable[[int], tuple[float, float]], *, limit: int) -> int:
        """Largest T <= ``limit`` such that T more steps along ``schedule`` stay within budget.

        ``schedule(t) -> (q, sigma)`` for t = 0, 1, ... counts from the CURRENT ledger; each
        sigma is bucketed as in :meth:`step`. A few evaluations of the whole ledger (the
        searches of :mod:`fedsgld.privacy.budget`). Every ledger found within budget is
        certified, the last one being the ledger after T steps, so the following ``step``
        calls along the same schedule only run domination checks.

        Raises:
            ValueError: no ``epsilon_budget``, ``limit`` not an integer >= 0, or a bad
                ``schedule(t)`` value.
        """
        if self.epsilon_budget is None:
            raise ValueError("max_steps needs an epsilon_budget (got None)")
        limit = check_count(limit, "limit")
        plan = Plan(self.key, schedule, self.bucket)
        if self.rigorous_name == REFERENCE_PLD:
            return max_steps_by_runs(self._within_budget, self.key, plan, limit)
        return max_steps_by_search(self._within_budget, plan, limit, self.epsilon_budget)
