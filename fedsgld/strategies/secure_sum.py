"""The server's half of a round under secure aggregation with distributed noise.

With ``secure_aggregation = true`` (``noise_placement = "sites"``, ``local_steps = 1``) a
round is the ``server`` placement's step with the noise moved to the sites: every site
sends its clipped, pre-noised sum S_k encoded with its share of the distributed discrete
Gaussian (:mod:`fedsgld.secagg.ddg`) through the masking protocol, and the server learns
only the decoded sum sum_k S_k + noise. :class:`SecureSumServer` plans each round's public
mechanism (:meth:`SecureSumServer.parameters`: :func:`~fedsgld.privacy.distributed.choose_ddg`
for sigma_t, the clip, the model's dimension, the sites and the plan's dropouts and
colluders), checks and charges the run's ledger with the round's
:class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep` (accounted by the PLD of a dominating Gaussian:
:mod:`fedsgld.privacy.ddg_ledger`), and takes the Langevin step on the decoded sum with
no noise of its own (:meth:`SecureSumServer.apply_sum`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fedsgld.core.plan import RoundPlan
from fedsgld.privacy.ddg_ledger import ACCOUNTING
from fedsgld.privacy.distributed import DDGParameters, choose_ddg
from fedsgld.privacy.events import Composed, DistributedDiscreteGaussianStep, DpEvent, Repeated
from fedsgld.secagg import SecAggPlan
from fedsgld.strategies.server import LangevinServer

MECHANISM = "distributed discrete Gaussian"


class SecureSumServer(LangevinServer):
    """:class:`LangevinServer` whose rounds are secure sums with distributed noise."""

    def __init__(self, *args: Any, run_key: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.privacy
        if not p.secure_aggregation:
            raise ValueError("SecureSumServer needs secure_aggregation = true")
        # one step per round, on the sum: the server placement's update
        self.local, self.local_steps = False, 1
        self.max_dropouts, self.max_colluders = p.max_dropouts, p.max_colluders
        self.run_key = run_key
        self.last_parameters: DDGParameters | None = None
        self.last_round: Any = None  # the engine's record of the last round (its transcript)

    # -- the round's public mechanism --------------------------------------------------
    def parameters(self, t: int) -> DDGParameters:
        """The distributed discrete Gaussian of round ``t``: noise multiplier sigma_t at the
        honest shares, ||sum_k S_k|| <= C sum_k N_k for the bit width."""
        p = self.privacy
        return choose_ddg(
            noise_multiplier=p.sigma(t),
            clip=p.clip,
            dim=int(self.theta.shape[0]),
            sites=len(self.site_sizes),
            max_dropouts=self.max_dropouts,
            max_colluders=self.max_colluders,
            signal_norm=p.clip * sum(self.site_sizes),
        )

    def round_event(self, first: int) -> DpEvent:
        return DistributedDiscreteGaussianStep(self.parameters(first), self.privacy.sample_rate)

    def secagg_plan(self, plan: RoundPlan, sites: tuple[int, ...]) -> SecAggPlan:
        """The protocol's public plan of round ``plan`` (the same at every party)."""
        params = self.parameters(plan.round)
        return SecAggPlan(
            round_label=round_label(self.run_key, plan.round),
            sites=sites,
            length=params.dim,
            bits=params.bits,
            max_dropouts=self.max_dropouts,
            max_colluders=self.max_colluders,
        )

    def affordable_rounds(self) -> int:
        """How many remaining rounds the budget allows (bisection over the rounds' events)."""
        remaining = self.rounds - self.t
        if self.accountant is None or remaining <= 0 or self.accountant.epsilon_budget is None:
            return max(remaining, 0)
        events = [self.round_event(self.t + i) for i in range(remaining)]
        if len(set(events)) == 1:

            def fits(n: int) -> bool:
                return self.accountant.fits(Repeated(events[0], n))
        else:

            def fits(n: int) -> bool:
                return self.accountant.fits(Composed(tuple(events[:n])))

        lo, hi = 0, remaining
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # -- the round ---------------------------------------------------------------------
    def begin_round(self, plan: RoundPlan) -> DDGParameters:
        """Charge the round's event to the run's ledger (persisted) BEFORE any site draws
        its share (a round that then aborts stays counted); the round's parameters."""
        if plan.round != self.t:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.t}")
        event = self.round_event(plan.round)
        self._charge(event)
        self.last_parameters = event.params
        return event.params

    def apply_sum(self, plan: RoundPlan, total: torch.Tensor) -> torch.Tensor:
        """The Langevin step on the decoded secure sum ``total`` (its noise already in it:
        the sites' shares), with no noise of the server's own."""
        if plan.round != self.t:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.t}")
        if total.shape != self.theta.shape:
            raise ValueError(
                f"secure sum has shape {tuple(total.shape)}, expected {tuple(self.theta.shape)}"
            )
        return self._step(plan, total.float())

    def secure_block(self) -> dict[str, Any]:
        """results.json's ``privacy.secure_aggregation``."""
        out: dict[str, Any] = {
            "mechanism": MECHANISM,
            "accounting": ACCOUNTING,
            "max_dropouts": self.max_dropouts,
            "max_colluders": self.max_colluders,
            "noise": "each site draws its share from the operating system (not reproducible)",
        }
        if self.last_parameters is not None:
            out["last_round"] = self.last_parameters.describe()
        return out


def round_label(run_key: str, round_: int) -> bytes:
    """The public label that binds every key, mask and rotation of one round."""
    return hashlib.sha256(f"fedsgld secagg|{run_key}|{round_}".encode()).digest()
