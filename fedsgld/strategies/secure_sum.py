"""The round mode of secure aggregation with distributed noise (placement ``secure``).

With ``secure_aggregation = true`` (``noise_placement = "sites"``, ``local_steps = 1``) a
round is the ``server`` placement's step with the noise moved to the sites: every site
sends its clipped, pre-noised sum S_k encoded with its share of the distributed discrete
Gaussian (:mod:`fedsgld.secagg.ddg`) through the masking protocol, and the server learns
only the decoded sum sum_k S_k + noise. :class:`SecureSum` plans each round's public
mechanism (:meth:`SecureSum.parameters`: :func:`~fedsgld.privacy.distributed.choose_ddg`
for sigma_t, the clip, the model's dimension, the sites and the plan's dropouts and
colluders), charges the run's ledger with the round's
:class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep` (accounted by the PLD of
a dominating Gaussian: :mod:`fedsgld.privacy.ddg_ledger`) before any site draws its share
(:meth:`SecureSum.begin`), and takes the Langevin step on the decoded sum
(:meth:`SecureSum.finish`). It is not a :class:`~fedsgld.strategies.modes.ServerNoise`:
it has no method that draws noise of the server's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from fedsgld.core.plan import RoundPlan
from fedsgld.privacy.ddg_ledger import ACCOUNTING
from fedsgld.privacy.distributed import DDGParameters, choose_ddg, dominating_ledger
from fedsgld.privacy.events import Composed, DistributedDiscreteGaussianStep, DpEvent, Repeated
from fedsgld.secagg import Mechanism, SecAggPlan
from fedsgld.strategies.modes import RoundMode, ServerState, Transport

MECHANISM = "distributed discrete Gaussian"


class SecureSum(RoundMode):
    """Rounds that are secure sums with distributed noise: one step per round, on the sum."""

    placement = "secure"
    settings = "noise_placement = 'sites', secure_aggregation = true"

    def __init__(self, server: ServerState) -> None:
        super().__init__(server)
        p = server.privacy
        if not p.secure_aggregation:
            raise ValueError("SecureSum needs secure_aggregation = true")
        self.max_dropouts, self.max_colluders = p.max_dropouts, p.max_colluders
        self.neighbours = p.secagg_neighbours  # 0: the complete graph
        self.one_shot = p.one_shot_rounds  # no dropouts planned: one masking exchange
        self.last_parameters: DDGParameters | None = None
        self.last_round: Any = None  # the engine's record of the last round (its transcript)

    # -- the round's public mechanism --------------------------------------------------
    def parameters(self, t: int) -> DDGParameters:
        """The distributed discrete Gaussian of round ``t``: noise multiplier sigma_t at the
        honest shares, ||sum_k S_k|| <= C sum_k N_k for the bit width."""
        s = self.server
        p = s.privacy
        return choose_ddg(
            noise_multiplier=p.sigma(t),
            clip=p.clip,
            dim=int(s.theta.shape[0]),
            sites=len(s.site_sizes),
            max_dropouts=self.max_dropouts,
            max_colluders=self.max_colluders,
            signal_norm=self.signal_norm,
        )

    @property
    def signal_norm(self) -> float:
        """The bound C sum_k N_k on ||sum_k S_k|| that the bits are chosen for."""
        return self.server.privacy.clip * sum(self.server.site_sizes)

    def mechanism(self, plan: RoundPlan, params: DDGParameters) -> Mechanism:
        """Round ``plan``'s :class:`~fedsgld.secagg.plan.Mechanism` with its distributed
        discrete Gaussian ``params``: what every site checks and every signature binds."""
        return Mechanism(params, plan.sigma, plan.sample_rate, plan.prenoise, self.signal_norm)

    def round_event(self, first: int) -> DpEvent:
        return DistributedDiscreteGaussianStep(
            self.parameters(first), self.server.privacy.sample_rate
        )

    def secagg_plan(self, plan: RoundPlan, sites: tuple[int, ...]) -> SecAggPlan:
        """The protocol's public plan of round ``plan`` (the same at every party)."""
        params = self.parameters(plan.round)
        return SecAggPlan(
            mechanism=self.mechanism(plan, params),
            round_label=round_label(self.server.run_key, plan.round),
            sites=sites,
            length=params.dim,
            bits=params.bits,
            max_dropouts=self.max_dropouts,
            max_colluders=self.max_colluders,
            neighbours=self.neighbours,
            one_shot=self.one_shot,
        )

    def affordable_rounds(self) -> int:
        """How many remaining rounds the budget allows (bisection over the rounds' events)."""
        s = self.server
        acc = s.accountant
        remaining = s.rounds - s.t
        if acc is None or remaining <= 0 or acc.epsilon_budget is None:
            return max(remaining, 0)
        events = [self.round_event(s.t + i) for i in range(remaining)]
        if len(set(events)) == 1:

            def fits(n: int) -> bool:
                return acc.fits(Repeated(events[0], n))
        else:

            def fits(n: int) -> bool:
                return acc.fits(Composed(tuple(events[:n])))

        lo, hi = 0, remaining
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # -- the round ---------------------------------------------------------------------
    def begin(self, plan: RoundPlan) -> DDGParameters:
        """Charge the round's event to the run's ledger (persisted) BEFORE any site draws
        its share (a round that then aborts stays counted); the round's parameters."""
        self.check(plan)
        event = self.round_event(plan.round)
        self.server.charge(event)
        self.last_parameters = event.params
        return event.params

    def collect(
        self, transport: Transport, plan: RoundPlan, receipt: DDGParameters
    ) -> torch.Tensor:
        return transport.secure_sum(plan, receipt)

    def finish(self, plan: RoundPlan, replies: torch.Tensor) -> torch.Tensor:
        """The Langevin step on the decoded secure sum ``replies`` (its noise already in it:
        the sites' shares), with no noise of the server's own."""
        s = self.server
        self.check(plan)
        if replies.shape != s.theta.shape:
            raise ValueError(
                f"secure sum has shape {tuple(replies.shape)}, expected {tuple(s.theta.shape)}"
            )
        return s.step(plan, replies.float())

    # -- reporting ---------------------------------------------------------------------
    @property
    def accounting(self) -> str:
        """PLD: every epsilon the accountant reports is then that of the rounds' distributed
        noise, the FFT PLD of their dominating Gaussian ledger plus its slack
        (:mod:`fedsgld.privacy.ddg_ledger`)."""
        return "none" if self.server.accountant is None else "pld"

    def describe(self) -> dict[str, Any]:
        """results.json's ``privacy.secure_aggregation``: the mechanism and its epsilon."""
        out: dict[str, Any] = {
            "mechanism": MECHANISM,
            "accounting": ACCOUNTING,
            "max_dropouts": self.max_dropouts,
            "max_colluders": self.max_colluders,
            "neighbours": self.neighbours or "all",
            "one_shot": self.one_shot,
            "noise": "each site draws its share from the operating system (not reproducible)",
        }
        if self.last_parameters is not None:
            out["last_round"] = self.last_parameters.describe()
        acc = self.server.accountant
        if acc is None:
            return {}
        ledger, up, down = dominating_ledger(acc.ddg_ledger, acc.ledger)
        out["dominating_ledger"] = [list(e) for e in ledger]  # [(q, sigma, count), ...]
        out["slack"] = [up, down]  # A_up, A_down: epsilon is the ledger's PLD's plus both
        return {"secure_aggregation": {**out, "epsilon": acc.rigorous_epsilon()}}

    def transport_info(self, protocol_cost: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """results.json's ``flower.secure_aggregation``: the rounds' protocol cost."""
        return {"secure_aggregation": protocol_cost()}


def round_label(run_key: str, round_: int) -> bytes:
    """The public label that binds every key, mask and rotation of one round."""
    return hashlib.sha256(f"fedsgld secagg|{run_key}|{round_}".encode()).digest()
