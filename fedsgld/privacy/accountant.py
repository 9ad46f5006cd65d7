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

The accountant holds three ledgers and hands each event to the first that ``supports`` it:
the ledger of releases known only by an (epsilon, delta) guarantee or an RDP curve
(:class:`~fedsgld.privacy.approx_ledger.ApproxLedger`; once it holds any, every epsilon is
the whole ledger's PLD composed with their worst-case pairs, :mod:`fedsgld.privacy.approx_dp`),
the distributed discrete Gaussian ledger (:class:`~fedsgld.privacy.ddg_ledger.DDGLedger`,
every event with such a round) and the Gaussian ledger
(:class:`~fedsgld.privacy.gaussian_ledger.GaussianLedger`, events of Gaussian steps only;
an event neither supports, a PATE answer, raises ``UnsupportedEvent``). The budget check
uses the rigorous accountant chosen by ``accountant`` or, once a round of the distributed
discrete Gaussian is recorded, the PLD of the whole run's dominating Gaussian ledger plus
its slack. Sigmas can be rounded DOWN onto a geometric grid before they enter the ledger
(``sigma_rel_grid``).

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
from fedsgld.privacy.approx_ledger import ApproxLedger, DDGLedgerWithApprox
from fedsgld.privacy.budget import BudgetExhausted, dominates, single_step_delta_lower_bound
from fedsgld.privacy.ddg_ledger import DDGLedger
from fedsgld.privacy.events import DpEvent, SubsampledGaussianStep, UnsupportedEvent, releases
from fedsgld.privacy.gaussian_ledger import _MERGE, REFERENCE_PLD, GaussianLedger
from fedsgld.privacy.gdp import gdp_mu
from fedsgld.privacy.ledger import Entry, LedgerKey, normalise, real

__all__ = [
    "ACCOUNTANTS",
    "BudgetExhausted",
    "PrivacyAccountant",
    "dominates",
    "single_step_delta_lower_bound",
]

#: rigorous accountants: fedsgld's FFT PLD (default), Renyi DP, dp_accounting's PLD
ACCOUNTANTS = ("pld", "rdp", REFERENCE_PLD)


class PrivacyAccountant:
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
        self.gaussian = GaussianLedger(
            delta=delta,
            epsilon_budget=epsilon_budget,
            accountant=accountant,
            sigma_rel_grid=sigma_rel_grid,
            pld_discretization=pld_discretization,
            whole_run=self._whole_run,
        )
        self.ddg = DDGLedgerWithApprox(
            delta=delta,
            epsilon_budget=epsilon_budget,
            names=("gdp", "pld", "rdp", accountant),
            gaussian=self.gaussian,
            approx=lambda: self.approx,
        )
        self.approx = ApproxLedger(
            delta=delta,
            epsilon_budget=epsilon_budget,
            gaussian=self.gaussian,
            ddg=lambda: self.ddg.key,
        )
        # the first that supports an event takes it
        self.ledgers: tuple[ApproxLedger | DDGLedger | GaussianLedger, ...] = (
            self.approx,
            self.ddg,
            self.gaussian,
        )

    def _whole_run(self, key: LedgerKey) -> float | None:
        """The whole ledger's epsilon with the Gaussian ledger at ``key`` where another
        ledger holds releases (approximate-DP releases, DDG rounds); else None."""
        joint = self.approx.whole_run(key)
        return joint if joint is not None else self.ddg.whole_run(key)

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(delta={self.delta!r}, epsilon_budget={self.epsilon_budget!r}, "
            f"accountant={self.rigorous_name!r}, sigma_rel_grid={self.sigma_rel_grid!r}, "
            f"pld_discretization={self.pld_discretization!r}; {self.steps} steps in "
            f"{len(self.gaussian.key)} entries)"
        )

    # -- the ledgers -------------------------------------------------------------
    @property
    def ledger(self) -> list[Entry]:
        """The run-length encoded ledger [(q, bucketed sigma, count), ...] in step order."""
        return list(self.gaussian.key)

    @property
    def ddg_ledger(self) -> list:
        """The DDG rounds recorded, [(q, params, count), ...] in order."""
        return self.ddg.entries

    @property
    def approx_ledger(self) -> list:
        """The approximate-DP releases recorded, [(release, count), ...] in order."""
        return self.approx.entries

    @property
    def steps(self) -> int:
        """Total number of recorded releases (Gaussian steps, DDG rounds, approximate-DP
        releases)."""
        return self.gaussian.steps + self.ddg.steps + self.approx.steps

    def bucket(self, sigma: float) -> float:
        """sigma rounded DOWN onto the grid (1 + r)^k, r = ``sigma_rel_grid``; always <= sigma.

        With r = 0 sigma is returned unchanged. Rounding down is conservative because
        epsilon is non-increasing in sigma.
        """
        return self.gaussian.bucket(sigma)

    def ledger_after(
        self, schedule: Callable[[int], tuple[float, float]], steps: int
    ) -> list[Entry]:
        """The ledger after ``steps`` more steps along ``schedule(t) -> (q, sigma)``, t = 0, 1, ...

        Sigma is bucketed as in :meth:`step`; nothing is recorded.
        """
        return self.gaussian.ledger_after(schedule, steps)

    # -- epsilon -----------------------------------------------------------------
    def _key(self, ledger: Iterable[Any] | None) -> LedgerKey:
        return self.gaussian.key if ledger is None else normalise(ledger)

    def epsilon(self, ledger: Iterable[Any] | None = None) -> dict[str, float]:
        """{"gdp": CLT (approximate), "pld": rigorous, "rdp": rigorous} at ``delta``, of the
        recorded ledger or of a given list of (q, sigma, count) (used as given), plus the
        chosen reference accountant. Empty ledger: all 0.0. With DDG rounds recorded,
        every value is the epsilon of the whole run by :mod:`fedsgld.privacy.ddg_ledger`.
        """
        key = self._key(ledger)
        if self.approx.key:  # every value the whole ledger's (fedsgld.privacy.approx_ledger)
            v = self.approx.epsilon(key, self.ddg.key)
            return dict.fromkeys(("gdp", "pld", "rdp", self.rigorous_name), v)
        if self.ddg.key:
            return self.ddg.epsilons(key)
        return self.gaussian.epsilons(key, recorded=ledger is None)

    def rigorous_epsilon(self, ledger: Iterable[Any] | None = None) -> float:
        """Epsilon of the ledger under the rigorous accountant ``rigorous_name`` (budget check);
        with DDG rounds recorded, by :mod:`fedsgld.privacy.ddg_ledger` with them."""
        return self.gaussian.rigorous(self._key(ledger))

    def delta_at(self, epsilon: float, ledger: Iterable[Any] | None = None) -> float:
        """Upper bound on delta at ``epsilon`` of the ledger, by the FFT PLD accountant "pld".

        Resolved down to about 1e-6 of this accountant's ``delta`` (smaller deltas are
        reported as that resolution, never as less than the bound)."""
        epsilon = real("epsilon", epsilon)
        if epsilon < 0.0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        key = self._key(ledger)
        if self.approx.key:
            return self.approx.delta_at(key, self.ddg.key, epsilon)
        if not key:
            return 0.0
        return pld_fft.compose(key, delta=self.delta, sigma_merge=_MERGE).delta(epsilon)

    def mu(self, ledger: Iterable[Any] | None = None) -> float:
        """The Gaussian-DP CLT mu of the ledger (see :func:`fedsgld.privacy.gdp.gdp_mu`);
        for the recorded ledger, at the exact sigmas that were recorded."""
        if ledger is None:
            return math.sqrt(self.gaussian.mu2)
        return gdp_mu(self._key(ledger))

    # -- spending: every release is an event, taken by the ledger that supports it ------
    def ledger_for(self, event: DpEvent) -> ApproxLedger | DDGLedger | GaussianLedger:
        """The first of :attr:`ledgers` that supports ``event``.

        Raises:
            UnsupportedEvent: a PATE answer event (see :mod:`fedsgld.privacy.pate_events`),
                or anything that is not a privacy event.
        """
        for ledger in self.ledgers:
            if ledger.supports(event):
                return ledger
        list(releases(event))  # raises UnsupportedEvent, naming the event
        raise UnsupportedEvent(f"no ledger supports {event!r}")

    def spend(self, event: DpEvent) -> None:
        """Record ``event``: all of it or, when it would take the rigorous epsilon past the
        budget, none (Gaussian sigmas rounded down onto the grid).

        Raises:
            BudgetExhausted: the event does not fit the budget; NOTHING was recorded.
            UnsupportedEvent: a PATE answer event (see :mod:`fedsgld.privacy.pate_events`).
        """
        self.ledger_for(event).spend(event)

    def fits(self, event: DpEvent) -> bool:
        """Whether ``event`` keeps the rigorous epsilon <= budget (True without a budget)."""
        return self.ledger_for(event).fits(event)

    def affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s steps, in order, fit the budget (all without a budget).
        Certifies what fits, as :meth:`max_steps` does."""
        return self.ledger_for(event).affordable(event)

    def epsilon_after(self, event: DpEvent) -> float:
        """The rigorous epsilon the ledger would have with ``event`` (nothing recorded)."""
        return self.ledger_for(event).epsilon_after(event)

    def check(self, q: float, sigma: float) -> bool:
        """:meth:`fits` of one :class:`SubsampledGaussianStep` (q, sigma)."""
        return self.fits(SubsampledGaussianStep(q, sigma))

    def step(self, q: float, sigma: float) -> None:
        """:meth:`spend` of one :class:`SubsampledGaussianStep` (q, sigma): past the budget,
        raises BudgetExhausted and records nothing."""
        self.spend(SubsampledGaussianStep(q, sigma))

    def max_steps(self, schedule: Callable[[int], tuple[float, float]], *, limit: int) -> int:
        """Largest T <= ``limit`` such that T more steps along ``schedule`` stay within budget
        (:meth:`fedsgld.privacy.gaussian_ledger.GaussianLedger.max_steps`: the plan found is
        certified, so the following ``step`` calls along it only run domination checks).

        Raises:
            ValueError: no ``epsilon_budget``, ``limit`` not an integer >= 0, or a bad
                ``schedule(t)`` value.
        """
        return self.gaussian.max_steps(schedule, limit=limit)

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
        state = write_state(self.gaussian.key, self.gaussian.mu2, self._settings())
        if self.ddg.key:
            state["ddg"] = self.ddg.state()
        if self.approx.key:
            state["approx"] = self.approx.state()
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
        self.gaussian.restore(
            normalise((q, self.bucket(s), c) for q, s, c in key), saved_mu2(state, key)
        )
        self.ddg.load(state)
        self.approx.load(state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        """A new accountant with the saved settings and ledger."""
        settings, _ = read_state(state)
        acc = cls(**settings)
        acc.load_state_dict(state)
        return acc
