"""A round mode: where a round's noise is added, and so how the round goes.

The run's placement is chosen once (:func:`fedsgld.strategies.placement.round_mode`) and
becomes one mode object; every round, on either transport, is the same walk through it::

    plan = server.plan()                 # budget check: mode.round_event(first) fits?
    server.mode.round(transport, plan)   # begin (charge) -> collect (ask the sites) -> finish (step)

:class:`ServerNoise` (placement ``server``): the sites return clipped sums S_k; ``finish``
charges the step (q, sigma_t) to the ledger and persists it, then draws
N(0, (sigma_t C)^2 I) through the receipt and steps on the noisy sum
(:meth:`LangevinServer.step`). Nothing is charged before the sums arrive, so a round whose
sites all fail spends nothing.

:class:`SiteNoise` (placement ``sites``): ``begin`` charges the round's E local steps
(each a Poisson-subsampled Gaussian (q, sigma_t)) BEFORE any site runs them; every site
runs them and returns theta_k; ``finish`` averages theta = sum_k N_k theta_k / sum_k N_k
over the sites that answered (post-processing). A failed round stays counted.

:class:`~fedsgld.strategies.secure_sum.SecureSum` (placement ``secure``): ``begin``
charges the round's distributed discrete Gaussian step; the sites' masked, noised sums
are decoded into one total; ``finish`` steps on it. It has no way to add noise of the
server's own.

The :class:`~fedsgld.strategies.server.LangevinServer` keeps the state (theta, the step
counter, the accountant, the posterior); a mode keeps only what its round needs. A
transport implements :class:`Transport` (the three ways of asking the sites) and never
asks which mode it runs: the mode calls the one way it needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch

from fedsgld.config import PrivacySettings
from fedsgld.core import streams
from fedsgld.core.noise import Randomness
from fedsgld.core.plan import RoundPlan
from fedsgld.core.release import Charged
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.distributed import DDGParameters
from fedsgld.privacy.events import DpEvent, SubsampledGaussianStep, subsampled_steps


class ServerState(Protocol):
    """What a round mode reads and steps of the server that holds it
    (:class:`~fedsgld.strategies.server.LangevinServer`): the server builds its mode, the
    mode never builds a server."""

    theta: torch.Tensor
    t: int
    rounds: int
    privacy: PrivacySettings
    accountant: PrivacyAccountant | None
    site_sizes: list[int]
    run_key: str
    noise: Randomness

    def schedule_point(self, t: int) -> tuple[float, float]: ...

    def charge(self, event: DpEvent | None) -> Charged: ...

    def step(self, plan: RoundPlan, noisy: torch.Tensor) -> torch.Tensor: ...

    def advance(
        self, plan: RoundPlan, theta: torch.Tensor, site_thetas: list[torch.Tensor] | None
    ) -> torch.Tensor: ...


class Transport(Protocol):
    """How a transport asks every site for its part of round ``plan``."""

    def clipped_sums(self, plan: RoundPlan) -> Sequence[torch.Tensor]:
        """Every answering site's clipped, pre-noised sum S_k, in site order."""
        ...

    def local_rounds(self, plan: RoundPlan, paid: Charged) -> Sequence[tuple[int, torch.Tensor]]:
        """Every answering site's (N_k, theta_k) after its noisy local steps, in site order;
        ``paid``: the receipt of the round's charge (the in-process sites draw through it)."""
        ...

    def secure_sum(self, plan: RoundPlan, params: DDGParameters) -> torch.Tensor:
        """The decoded secure sum sum_k S_k + noise of the sites' shares."""
        ...


class RoundMode(ABC):
    """One placement's round: plan -> charge -> collect -> step (module docstring)."""

    placement: ClassVar[str]  # as a site's policy names it (``placements``)
    settings: ClassVar[str]  # the run-config settings that choose it
    if_failed: ClassVar[str] = "no privacy was spent"  # a failed round's cost, in words
    local_steps: int = 1  # steps per round (the ledger's steps per round)

    def __init__(self, server: ServerState) -> None:
        self.server = server

    # -- planning ----------------------------------------------------------------------
    def round_event(self, first: int) -> DpEvent | None:
        """The privacy event of the round whose first step is ``first``: its steps (q, sigma_t)."""
        point = self.server.schedule_point
        return subsampled_steps(point(first + i) for i in range(self.local_steps))

    def first_step(self, first: int) -> int | None:
        """The plan's ``first_step`` (only site noise numbers its local steps)."""
        return None

    def step_name(self, t: int) -> str:
        """Round ``t`` in the budget's halt message."""
        return f"step {t + 1}"

    def affordable_rounds(self) -> int:
        """How many of the remaining rounds the budget allows along the planned schedule
        (also certifies that ledger with the accountant: the per-step checks get cheap)."""
        s = self.server
        remaining = s.rounds - s.t
        if s.accountant is None or remaining <= 0:
            return max(remaining, 0)
        e, start = self.local_steps, s.t * self.local_steps
        steps = s.accountant.max_steps(lambda i: s.schedule_point(start + i), limit=remaining * e)
        return steps // e

    # -- the round ---------------------------------------------------------------------
    def round(self, transport: Transport, plan: RoundPlan) -> torch.Tensor:
        """Round ``plan``: charge what must be charged before the sites draw anything,
        ask the sites through ``transport``, step; the new theta."""
        receipt = self.begin(plan)
        return self.finish(plan, self.collect(transport, plan, receipt))

    def check(self, plan: RoundPlan) -> None:
        if plan.round != self.server.t:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.server.t}")

    @abstractmethod
    def begin(self, plan: RoundPlan) -> Any:
        """What is charged before any site answers (persisted); the receipt the sites need."""

    @abstractmethod
    def collect(self, transport: Transport, plan: RoundPlan, receipt: Any) -> Any:
        """The sites' answers to round ``plan``, through ``transport``."""

    @abstractmethod
    def finish(self, plan: RoundPlan, replies: Any) -> torch.Tensor:
        """The server's step on the sites' answers; the new theta."""

    # -- reporting ---------------------------------------------------------------------
    @property
    def accounting(self) -> str:
        """The accounting the budget is checked with."""
        acc = self.server.accountant
        return "none" if acc is None else acc.rigorous_name

    def describe(self) -> dict[str, Any]:
        """Entries this mode adds to results.json's ``privacy`` block."""
        return {}

    def ledger_note(self) -> str:
        """What the ledger's ``steps`` count, where it is not one step per round."""
        return ""

    def transport_info(self, protocol_cost: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Entries of a transport's results block: the cost of the round's protocol
        (``protocol_cost()``), where the round is a protocol of several exchanges."""
        return {}


class ServerNoise(RoundMode):
    """Sites send clipped sums; the server charges, then adds N(0, (sigma_t C)^2 I) and steps."""

    placement = "server"
    settings = "noise_placement = 'server'"

    def begin(self, plan: RoundPlan) -> None:
        """Nothing: the step is charged in :meth:`finish`, just before its noise is drawn."""
        return None

    def collect(
        self, transport: Transport, plan: RoundPlan, receipt: None
    ) -> Sequence[torch.Tensor]:
        return transport.clipped_sums(plan)

    def finish(self, plan: RoundPlan, replies: Sequence[torch.Tensor]) -> torch.Tensor:
        """Record the privacy spend (persisted), add the noise, take the Langevin step:
        theta <- theta - alpha_t ((sum_k S_k + sigma_t C xi) / L + lambda theta)."""
        s = self.server
        self.check(plan)
        total = torch.zeros_like(s.theta)
        for x in replies:
            if x.shape != total.shape:
                raise ValueError(
                    f"site sum has shape {tuple(x.shape)}, expected {tuple(total.shape)}"
                )
            total += x
        charged = s.charge(SubsampledGaussianStep(plan.sample_rate, plan.sigma))
        noise_std = plan.sigma * plan.clip if plan.clip is not None else 0.0
        # drawn only now, through the receipt of the persisted charge
        noisy = charged.add_noise(total, s.noise, std=noise_std, key=streams.server_noise(s.t))
        return s.step(plan, noisy)


class SiteNoise(RoundMode):
    """Every site runs E noisy local steps, charged first; the server averages the iterates."""

    placement = "sites"
    settings = "noise_placement = 'sites', secure_aggregation = false"
    if_failed = "its local steps stay counted in the ledger"

    def __init__(self, server: ServerState) -> None:
        super().__init__(server)
        # round r runs local steps r E .. r E + E - 1 at every site
        self.local_steps = server.privacy.local_steps

    def first_step(self, first: int) -> int | None:
        return first

    def step_name(self, t: int) -> str:
        return f"round {t + 1} ({self.local_steps} local steps)"

    def check(self, plan: RoundPlan) -> None:
        t = self.server.t
        if plan.round != t or plan.first_step != t * self.local_steps:
            raise ValueError(f"plan is for round {plan.round}, server is at round {t}")

    def begin(self, plan: RoundPlan) -> Charged:
        """Record the round's local steps in the ledger BEFORE any site runs them.

        Every site releases its own noisy iterates, each local step a Poisson-subsampled
        Gaussian (q, sigma_t) on that site's records. Every site uses the same q and sigma
        schedule, so every site's ledger equals this one and the worst site's epsilon is
        this ledger's; a site that fails the round is counted anyway. Returns the receipt
        the sites' noise is drawn through (:meth:`fedsgld.clients.site.Site.local_round`).
        """
        self.check(plan)
        point = self.server.schedule_point
        return self.server.charge(
            subsampled_steps(point(plan.first_step + i) for i in range(plan.local_steps))
        )

    def collect(
        self, transport: Transport, plan: RoundPlan, receipt: Charged
    ) -> Sequence[tuple[int, torch.Tensor]]:
        return transport.local_rounds(plan, receipt)

    def finish(self, plan: RoundPlan, replies: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """theta <- sum_k N_k theta_k / sum_k N_k over the sites that answered (post-processing)."""
        s = self.server
        super().check(plan)
        if not replies:
            raise ValueError("the round needs at least one site's parameters")
        total_n = sum(n for n, _ in replies)
        new = torch.zeros_like(s.theta)
        for n, th in replies:
            if th.shape != new.shape:
                raise ValueError(
                    f"site parameters have shape {tuple(th.shape)}, expected {tuple(new.shape)}"
                )
            new += (n / total_n) * th.float()
        return s.advance(plan, new, [th for _, th in replies])

    def ledger_note(self) -> str:
        return (
            f" Noise at the sites: 'steps' counts rounds of {self.local_steps} local steps; "
            "the ledger is each site's own (every site uses the same q and sigma_t, so it "
            "is also the worst site's)."
        )
