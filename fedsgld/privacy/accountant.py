"""The privacy accountant: a ledger of Poisson-subsampled Gaussian steps and its epsilon.

Every training step t releases S_t + N(0, (sigma_t C)^2 I), where S_t is a sum of records'
gradients, each clipped to L2 norm <= C, and every record enters S_t independently with
probability q_t (Poisson sampling). Neighbouring datasets differ by adding or removing
one record. The accountant keeps the run-length encoded ledger ``[(q, sigma, count), ...]``
and converts it to an (epsilon, delta) guarantee with these accountants:

* ``"gdp"``: Gaussian DP central limit theorem (Dong, Roth & Su 2019), the paper's
  accountant. APPROXIMATE (under-estimates epsilon by 2-20 %): reported, never used for
  the budget; computed on the sigmas as given (not the rounded ones).
* ``"pld"`` (default): privacy loss distributions composed in the Fourier domain
  (:mod:`fedsgld.privacy.pld_fft`): every distinct step discretised by pessimistic
  connect-the-dots on one shared grid, composed by one product of transforms, truncation
  and the finite window counted in delta. A certified upper bound, within ~0.2 % of the
  exact epsilon, in well under a second for thousands of distinct sigmas.
* ``"rdp"``: Renyi DP (Mironov et al. 2019, conversion of Canonne, Kamath & Steinke 2020;
  :mod:`fedsgld.privacy.rdp`, the formulas of ``dp_accounting.rdp`` vectorised over
  sigma): a valid but looser upper bound.
* ``"dp_accounting_pld"``: the reference, ``dp_accounting``'s PLD accountant, one PLD per
  distinct (q, sigma): accurate but slow. Only computed when chosen as ``accountant``.

The budget check uses the rigorous accountant chosen by ``accountant`` or, once a round of
the distributed discrete Gaussian is recorded, the PLD of the whole run's dominating
Gaussian ledger plus its slack (:mod:`fedsgld.privacy.ddg_ledger`, the accountant's
second ledger). Sigmas can be rounded DOWN onto a geometric grid before they enter the
ledger (``sigma_rel_grid``).

Every release is a privacy event (:mod:`fedsgld.privacy.events`): ``spend`` records one,
``fits``/``affordable``/``epsilon_after`` check one against the budget (certified plans make
later checks cheap, :mod:`fedsgld.privacy.budget`); ``step``/``check`` do it for one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fedsgld.privacy import pld_fft
from fedsgld.privacy.accountant_state import check_same_settings, read_state, saved_mu2, write_state
from fedsgld.privacy.budget import (
    BudgetExhausted,
    dominates,
    max_steps_by_runs,
    max_steps_by_search,
    single_step_delta_lower_bound,
)
from fedsgld.privacy.ddg_ledger import DDGLedger
from fedsgld.privacy.events import DpEvent, SubsampledGaussianStep, gaussian_steps
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
    real,
)
from fedsgld.privacy.rdp import ledger_rdp_epsilon
from fedsgld.privacy.reference_pld import ReferencePLD

__all__ = [
    "ACCOUNTANTS",
    "BudgetExhausted",
    "PrivacyAccountant",
    "dominates",
    "single_step_delta_lower_bound",
]

#: rigorous accountants: fedsgld's FFT PLD (default), Renyi DP, dp_accounting's PLD
ACCOUNTANTS = ("pld", "rdp", "dp_accounting_pld")
REFERENCE_PLD = "dp_accounting_pld"

_MAX_CERTIFIED = 4
_EPS_CACHE = 1024
_BUCKET_CACHE = 100_000
_MERGE = pld_fft.DEFAULT_SIGMA_MERGE  # relative sigma bins of "pld" and "rdp"


def _gdp_mu2(q: float, sigma: float) -> float:
    """One step's contribution q^2 (exp(1/sigma^2) - 1) to mu^2 (inf on overflow)."""
    return gdp_mu([(q, sigma, 1)]) ** 2


class PrivacyAccountant(DDGLedger):
    """Ledger of (q, sigma, count) Poisson-subsampled Gaussian steps, its epsilon and the budget.

    Args (keyword-only):
        delta: target delta of the (epsilon, delta) guarantee, in (0, 1).
        epsilon_budget: the budget; None for no budget (``step`` always records).
        accountant: the rigorous accountant used for the budget check: "pld" (default,
            fedsgld's FFT PLD), "rdp" or "dp_accounting_pld" (the reference).
        sigma_rel_grid: r in [0, 0.5); each sigma is rounded DOWN to (1 + r)^k before it
            enters the ledger (conservative; 0 = exact, the default). See the module
            docstring.
        pld_discretization: ``value_discretization_interval`` of the "dp_accounting_pld"
            reference, in (0, 0.1]; smaller is tighter and slower. ("pld" chooses its grid
            itself, see :mod:`fedsgld.privacy.pld_fft`.)

    Privacy caveat: the guarantee is per record under add/remove adjacency and assumes
    Poisson sampling with the recorded q, noise std sigma * C on sums of records clipped
    to L2 norm C, and noise that the adversary cannot predict. ``epsilon()["gdp"]`` is an
    approximation that can under-estimate epsilon; the budget uses ``rigorous_name``.
    """

    def __init__(
        self,
        *,
        delta: float,
        epsilon_budget: float | None = None,
        accountant: str = "pld",
        sigma_rel_grid: float = 0.0,
        pld_discretization: float = 1e-3,
    ) -> None:
        delta = real("delta", delta)
        if not (0.0 < delta < 1.0):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if epsilon_budget is not None:
            epsilon_budget = real("epsilon_budget", epsilon_budget)
            if not (epsilon_budget > 0.0):
                raise ValueError(f"epsilon_budget must be None or > 0, got {epsilon_budget!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)}, got {accountant!r}")
        sigma_rel_grid = real("sigma_rel_grid", sigma_rel_grid)
        if not (0.0 <= sigma_rel_grid < 0.5):
            raise ValueError(f"sigma_rel_grid must be in [0, 0.5), got {sigma_rel_grid!r}")
        pld_discretization = real("pld_discretization", pld_discretization)
        if not (0.0 < pld_discretization <= 0.1):
            raise ValueError(f"pld_discretization must be in (0, 0.1], got {pld_discretization!r}")
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.rigorous_name = accountant
        self.sigma_rel_grid = sigma_rel_grid
        self.pld_discretization = pld_discretization
        self._ledger: LedgerKey = ()
        self._certified: list[LedgerKey] = []
        self._bucket_cache: dict[float, float] = {}
        self._reference = ReferencePLD(pld_discretization=pld_discretization)
        self._rdp_cache: dict[tuple[float, float], Any] = {}
        self._eps_cache = LRU(_EPS_CACHE)
        self._mu2 = 0.0  # GDP mu^2 of the recorded steps at their exact sigmas

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(delta={self.delta!r}, epsilon_budget={self.epsilon_budget!r}, "
            f"accountant={self.rigorous_name!r}, sigma_rel_grid={self.sigma_rel_grid!r}, "
            f"pld_discretization={self.pld_discretization!r}; {self.steps} steps in "
            f"{len(self._ledger)} entries)"
        )

    # -- the ledger ------------------------------------------------------------
    @property
    def ledger(self) -> list[Entry]:
        """The run-length encoded ledger [(q, bucketed sigma, count), ...] in step order."""
        return list(self._ledger)

    @property
    def steps(self) -> int:
        """Total number of recorded steps (Gaussian steps and DDG rounds)."""
        return sum(c for _, _, c in self._ledger) + sum(c for _, _, c in self._ddg)

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
        return list(Plan(self._ledger, schedule, self.bucket).ledger(steps))

    # -- epsilon -----------------------------------------------------------------
    def _key(self, ledger: Iterable[Any] | None) -> LedgerKey:
        return self._ledger if ledger is None else normalise(ledger)

    def epsilon(self, ledger: Iterable[Any] | None = None) -> dict[str, float]:
        """{"gdp": CLT (approximate), "pld": rigorous, "rdp": rigorous} at ``delta``, of the
        recorded ledger or of a given list of (q, sigma, count) (used as given), plus the
        chosen reference accountant. Empty ledger: all 0.0. With DDG rounds recorded,
        every value is the epsilon of the whole run by :mod:`fedsgld.privacy.ddg_ledger`.
        """
        key = self._key(ledger)
        if self._ddg:
            return self._ddg_epsilons(key)
        out = {
            "gdp": self._gdp_exact() if ledger is None else self._gdp(key),
            "pld": self._eps("pld", key),
            "rdp": self._eps("rdp", key),
        }
        if self.rigorous_name not in out:
            out[self.rigorous_name] = self._eps(self.rigorous_name, key)
        return out

    def rigorous_epsilon(self, ledger: Iterable[Any] | None = None) -> float:
        """Epsilon of the ledger under the rigorous accountant ``rigorous_name`` (budget check);
        with DDG rounds recorded, by :mod:`fedsgld.privacy.ddg_ledger` with them."""
        if self._ddg:
            return self._ddg_epsilon(self._key(ledger), self._ddg)
        return self._eps(self.rigorous_name, self._key(ledger))

    def delta_at(self, epsilon: float, ledger: Iterable[Any] | None = None) -> float:
        """Upper bound on delta at ``epsilon`` of the ledger, by the FFT PLD accountant "pld".

        Resolved down to about 1e-6 of this accountant's ``delta`` (smaller deltas are
        reported as that resolution, never as less than the bound)."""
        epsilon = real("epsilon", epsilon)
        if epsilon < 0.0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        key = self._key(ledger)
        if not key:
            return 0.0
        return pld_fft.compose(key, delta=self.delta, sigma_merge=_MERGE).delta(epsilon)

    def mu(self, ledger: Iterable[Any] | None = None) -> float:
        """The Gaussian-DP CLT mu of the ledger (see :func:`fedsgld.privacy.gdp.gdp_mu`);
        for the recorded ledger, at the exact sigmas that were recorded."""
        if ledger is None:
            return math.sqrt(self._mu2)
        return gdp_mu(self._key(ledger))

    def _gdp(self, key: LedgerKey) -> float:
        return float(gdp_epsilon(gdp_mu(key), self.delta)) if key else 0.0

    def _gdp_exact(self) -> float:
        if not self._ledger:
            return 0.0
        return float(gdp_epsilon(math.sqrt(self._mu2), self.delta))

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
        eps = self.rigorous_epsilon(key)
        if eps <= self.epsilon_budget:
            self._certify(key)
            return True, eps
        return False, eps

    # -- spending: every release is an event (fedsgld.privacy.events) ---------------------
    def spend(self, event: DpEvent) -> None:
        """Record the Gaussian steps of ``event`` (sigmas rounded down onto the grid), all of
        them or, when they would take the rigorous epsilon past the budget, none.

        Raises:
            BudgetExhausted: the event does not fit the budget; NOTHING was recorded.
            UnsupportedEvent: a PATE answer event (see :mod:`fedsgld.privacy.pate_events`).
        """
        if self._event_has_ddg(event):
            self._ddg_spend(event)
            return
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
        if self._event_has_ddg(event):
            return self._ddg_fits(event)
        steps = list(gaussian_steps(event))
        if len(steps) == 1:
            q, s = check_q(steps[0][0]), self.bucket(steps[0][1])
            if self.epsilon_budget is None:
                return True
            return self._within_budget(append(self._ledger, q, s, 1))[0]
        return self.affordable(event) == len(steps)

    def affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s steps, in order, fit the budget (all without a budget).
        Certifies what fits, as :meth:`max_steps` does."""
        if self._event_has_ddg(event):
            return self._ddg_affordable(event)
        steps = list(gaussian_steps(event))
        if self.epsilon_budget is None:
            self.ledger_after(steps.__getitem__, len(steps))  # validated all the same
            return len(steps)
        return self.max_steps(steps.__getitem__, limit=len(steps))

    def epsilon_after(self, event: DpEvent) -> float:
        """The rigorous epsilon the ledger would have with ``event`` (nothing recorded)."""
        if self._event_has_ddg(event):
            return self._ddg_epsilon(*self._after(event))
        steps = list(gaussian_steps(event))
        return self.rigorous_epsilon(self.ledger_after(steps.__getitem__, len(steps)))

    def check(self, q: float, sigma: float) -> bool:
        """:meth:`fits` of one :class:`SubsampledGaussianStep` (q, sigma)."""
        return self.fits(SubsampledGaussianStep(q, sigma))

    def step(self, q: float, sigma: float) -> None:
        """:meth:`spend` of one :class:`SubsampledGaussianStep` (q, sigma): past the budget,
        raises BudgetExhausted and records nothing."""
        self.spend(SubsampledGaussianStep(q, sigma))

    def _record(self, q: float, sigma: float) -> None:
        q, s = check_q(q), self.bucket(sigma)
        key = append(self._ledger, q, s, 1)
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
        self._ledger = key
        self._mu2 += _gdp_mu2(q, check_sigma(sigma))

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
        plan = Plan(self._ledger, schedule, self.bucket)
        if self.rigorous_name == REFERENCE_PLD:
            return max_steps_by_runs(self._within_budget, self._ledger, plan, limit)
        return max_steps_by_search(self._within_budget, plan, limit, self.epsilon_budget)

    # -- checkpoints (fedsgld.privacy.accountant_state) --------------------------------
    def _settings(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "budget": self.epsilon_budget,
            "accountant": self.rigorous_name,
            "sigma_rel_grid": self.sigma_rel_grid,
            "pld_discretization": self.pld_discretization,
        }

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: the ledger (as [q, sigma, count] lists), the settings and
        ``gdp_mu2`` (the GDP mu^2 of the recorded steps at their exact sigmas)."""
        state = write_state(self._ledger, self._mu2, self._settings())
        if self._ddg:
            state["ddg"] = self._ddg_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the ledger of :meth:`state_dict`, replacing the current one.

        The saved settings (delta, budget, accountant, sigma_rel_grid, pld_discretization)
        must EQUAL this accountant's: a mismatch raises ValueError naming the setting,
        rather than silently changing the budget or the guarantee of a resumed run. Use
        :meth:`from_state_dict` to rebuild an accountant with the saved settings. The
        ledger's sigmas are re-bucketed (a no-op for sigmas already on this grid).
        """
        settings, key = read_state(state)
        ours = {("epsilon_budget" if k == "budget" else k): v for k, v in self._settings().items()}
        check_same_settings(settings, ours)
        self._ledger = normalise((q, self.bucket(s), c) for q, s, c in key)
        self._mu2 = saved_mu2(state, key)
        self._load_ddg_state(state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        """A new accountant with the saved settings and ledger."""
        settings, _ = read_state(state)
        acc = cls(**settings)
        acc.load_state_dict(state)
        return acc
