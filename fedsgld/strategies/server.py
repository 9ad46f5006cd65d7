"""The server's half of a DP-SGLD / DP-SGD / SGD round, independent of any transport.

Round t (one Langevin step):
  1. ``plan()``: alpha_t = schedule(t), sigma_t (sqrt(2 alpha_t tau) for DP-SGLD, constant
     for DP-SGD, 0 for SGD). Before anything is released, the accountant checks that one
     more Poisson-subsampled Gaussian step (q, sigma_t) keeps the rigorous epsilon within
     the budget; if not, the run halts and says why (the step is never taken).
  2. The sites return clipped, pre-noised sums S_k (see ``fedsgld.clients``).
  3. ``apply()``: the step is charged to the ledger (and the ``on_spend`` hook persists it)
     BEFORE the noise is drawn (:func:`fedsgld.core.release.charge`), then theta <- theta - alpha_t ((sum_k S_k + sigma_t C xi) / L
     + lambda theta) with L = q * sum_k N_k. After burn-in every thin-th iterate is kept
     as a posterior sample (post-processing: no privacy cost).

The Flower strategies and the in-process engine both drive this class, so the maths exists once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedsgld.config import PrivacySettings
from fedsgld.core import streams
from fedsgld.core.mechanism import langevin_update
from fedsgld.core.noise import Randomness
from fedsgld.core.plan import RoundPlan
from fedsgld.core.release import Charged, charge
from fedsgld.core.streams import SERVER_STREAM  # noqa: F401 - the server's key part, re-exported
from fedsgld.posteriors.swag import SwagMoments
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.events import DpEvent, SubsampledGaussianStep, subsampled_steps
from fedsgld.vi import Adam, kl_gradient


class PosteriorSamples:
    """Keeps every ``thin``-th iterate after ``burn_in`` steps; at most ``max_samples`` (the latest).

    With ``swag_rank`` not None it also fits SWAG (:class:`fedsgld.posteriors.swag.SwagMoments`)
    to EVERY such iterate (running moments, and the deviations of the last ``swag_rank``),
    whatever ``max_samples`` keeps.
    """

    def __init__(
        self, *, burn_in: int, thin: int, max_samples: int, swag_rank: int | None = None
    ) -> None:
        self.burn_in, self.thin, self.max_samples = burn_in, thin, max_samples
        self.samples: deque[torch.Tensor] = deque(maxlen=max(max_samples, 1))
        self.steps: deque[int] = deque(maxlen=max(max_samples, 1))
        self.swag = SwagMoments(swag_rank) if swag_rank is not None else None

    def offer(self, step: int, theta: torch.Tensor) -> bool:
        """``step`` = number of completed updates that produced ``theta``."""
        if step <= self.burn_in or (step - self.burn_in) % self.thin:
            return False
        if self.swag is not None:
            self.swag.update(theta)
        if self.max_samples == 0:
            return False
        self.samples.append(theta.detach().clone())
        self.steps.append(step)
        return True

    def __len__(self) -> int:
        return len(self.samples)

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples": list(self.samples),
            "steps": list(self.steps),
            "swag": self.swag.state_dict() if self.swag is not None else None,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.samples.clear()
        self.steps.clear()
        for s, t in zip(d["samples"], d["steps"], strict=False):
            self.samples.append(s)
            self.steps.append(int(t))
        if self.swag is not None:
            if d.get("swag") is None:
                raise ValueError("the checkpoint holds no SWAG moments; resume without SWAG")
            self.swag.load_state_dict(d["swag"])


class LangevinServer:
    """Server state: parameters, step counter, accountant and posterior samples."""

    def __init__(
        self,
        privacy: PrivacySettings,
        *,
        theta: torch.Tensor,
        site_sizes: Sequence[int],
        seed: int = 0,
        rounds: int,
        weight_decay: float = 0.0,
        posterior: PosteriorSamples | None = None,
        on_spend: Callable[[PrivacyAccountant], None] | None = None,
        prior_std: float = 1.0,
        optimizer: str = "sgd",
        randomness: Randomness | None = None,
    ) -> None:
        if len(site_sizes) == 0 or min(site_sizes) < 0 or sum(site_sizes) == 0:
            raise ValueError(
                f"site sizes must be >= 0 with a positive total, got {list(site_sizes)}"
            )
        self.privacy = privacy
        self.theta = theta.detach().clone().float()
        self.site_sizes = [int(n) for n in site_sizes]
        self.expected_batch = privacy.sample_rate * sum(self.site_sizes)
        self.seed = seed
        # the server's own noise: seeded from ``seed`` (simulations) unless given
        self.noise = randomness if randomness is not None else Randomness.seeded(seed)
        self.rounds = rounds
        self.weight_decay = weight_decay
        self.t = 0
        self.halt_reason: str | None = None
        # "is None": an empty PosteriorSamples is falsy (it defines __len__)
        self.posterior = (
            posterior
            if posterior is not None
            else PosteriorSamples(burn_in=0, thin=1, max_samples=0)
        )
        self.on_spend = on_spend
        # called after every released round with (plan, the sites' parameters in "sites"
        # placement, else None): an audit (fedsgld.studies.audit) reads the release here
        self.on_release: Callable[[RoundPlan, list[torch.Tensor] | None], None] | None = None
        self.prior_std = prior_std
        self.optimizer = optimizer
        self.adam = None
        if privacy.variational and optimizer == "adam":
            self.adam = Adam(self.theta.shape[0])
        # noise_placement "sites": round r runs local steps r E .. r E + E - 1 at every site
        self.local = privacy.noise_placement == "sites"
        self.local_steps = privacy.local_steps if self.local else 1
        self.accountant: PrivacyAccountant | None = None
        if privacy.private:
            self.accountant = PrivacyAccountant(
                delta=privacy.delta,
                epsilon_budget=privacy.epsilon,
                accountant=privacy.accountant,
                sigma_rel_grid=privacy.sigma_grid,
            )

    # -- planning ---------------------------------------------------------------
    def schedule_point(self, t: int) -> tuple[float, float]:
        """(q, sigma_t) of step t, as the accountant sees it."""
        return self.privacy.sample_rate, self.privacy.sigma(t)

    def affordable_rounds(self) -> int:
        """How many of the remaining rounds the budget allows along the planned schedule.

        Also certifies that ledger with the accountant, which makes the per-step checks cheap.
        """
        remaining = self.rounds - self.t
        if self.accountant is None or remaining <= 0:
            return max(remaining, 0)
        e, start = self.local_steps, self.t * self.local_steps
        steps = self.accountant.max_steps(
            lambda i: self.schedule_point(start + i), limit=remaining * e
        )
        return steps // e

    def plan(self) -> RoundPlan | None:
        """The next round's plan, or None when the run is over (``halt_reason`` says why)."""
        if self.halt_reason is not None:
            return None
        if self.t >= self.rounds:
            self.halt_reason = f"completed {self.rounds} rounds"
            return None
        e = self.local_steps
        first = self.t * e
        q, sigma = self.schedule_point(first)
        if self.accountant is not None:
            if not self.accountant.fits(self.round_event(first)):
                eps = self.accountant.rigorous_epsilon()
                what = (
                    f"step {self.t + 1}"
                    if not self.local
                    else f"round {self.t + 1} ({e} local steps)"
                )
                self.halt_reason = (
                    f"privacy budget: {what} (sigma={sigma:.4g}) would take epsilon past "
                    f"{self.privacy.epsilon:g} at delta={self.privacy.delta:g}; "
                    f"spent {eps:.4f} in {self.accountant.steps} steps"
                )
                return None
        p = self.privacy
        return RoundPlan(
            round=self.t,
            step_size=p.step_size(first),
            sigma=sigma,
            sample_rate=q,
            clip=p.clip_bound,
            prenoise=p.applied_prenoise,
            local_steps=e,
            first_step=first if self.local else None,
        )

    def round_event(self, first: int) -> DpEvent | None:
        """The privacy event of the round whose first step is ``first``: its steps
        (q, sigma_t), local steps included."""
        return subsampled_steps(self.schedule_point(first + i) for i in range(self.local_steps))

    # -- the step ---------------------------------------------------------------
    def apply(self, plan: RoundPlan, site_sums: Sequence[torch.Tensor]) -> torch.Tensor:
        """Record the privacy spend, add the noise, take the Langevin step."""
        if self.local:
            raise ValueError(
                "noise_placement = 'sites': use begin_local_round / finish_local_round"
            )
        if plan.round != self.t:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.t}")
        total = torch.zeros_like(self.theta)
        for s in site_sums:
            if s.shape != total.shape:
                raise ValueError(
                    f"site sum has shape {tuple(s.shape)}, expected {tuple(total.shape)}"
                )
            total += s
        charged = self._charge(SubsampledGaussianStep(plan.sample_rate, plan.sigma))
        noise_std = plan.sigma * plan.clip if plan.clip is not None else 0.0
        # drawn only now, through the receipt of the persisted charge
        noisy = charged.add_noise(
            total, self.noise, std=noise_std, key=streams.server_noise(self.t)
        )
        return self._step(plan, noisy)

    def _step(self, plan: RoundPlan, noisy: torch.Tensor) -> torch.Tensor:
        """The update on the noisy sum of round ``plan`` (post-processing of the release)."""
        if self.privacy.variational:
            self.theta = self._vi_update(plan, noisy)
        else:
            self.theta = langevin_update(
                self.theta,
                noisy,
                step_size=plan.step_size,
                expected_batch=self.expected_batch,
                weight_decay=self.weight_decay,
            )
        self.t += 1
        self.posterior.offer(self.t, self.theta)
        if self.on_release is not None:
            self.on_release(plan, None)
        return self.theta

    # -- noise placement "sites" -----------------------------------------------------
    def _charge(self, event: DpEvent | None) -> Charged:
        """Charge ``event`` to the ledger and persist it (``on_spend``); the receipt draws."""
        try:
            return charge(self.accountant, event, persist=self.on_spend)
        except BudgetExhausted as err:  # plan() checked; this guards misuse
            self.halt_reason = f"privacy budget: {err}"
            raise

    def begin_local_round(self, plan: RoundPlan) -> Charged:
        """Record the round's local steps in the ledger BEFORE any site runs them.

        With noise at the sites every site releases its own noisy iterates, each local step a
        Poisson-subsampled Gaussian (q, sigma_t) on that site's records. Every site uses the
        same q and sigma schedule, so every site's ledger equals this one and the worst
        site's epsilon is this ledger's; a site that fails the round is counted anyway.
        Returns the receipt the sites' noise is drawn through (:meth:`fedsgld.clients.site.Site.local_round`).
        """
        if not self.local:
            raise ValueError("begin_local_round needs noise_placement = 'sites'")
        if plan.round != self.t or plan.first_step != self.t * self.local_steps:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.t}")
        return self._charge(
            subsampled_steps(
                self.schedule_point(plan.first_step + i) for i in range(plan.local_steps)
            )
        )

    def finish_local_round(
        self, plan: RoundPlan, site_thetas: Sequence[tuple[int, torch.Tensor]]
    ) -> torch.Tensor:
        """theta <- sum_k N_k theta_k / sum_k N_k over the sites that answered (post-processing)."""
        if plan.round != self.t:
            raise ValueError(f"plan is for round {plan.round}, server is at round {self.t}")
        if not site_thetas:
            raise ValueError("finish_local_round needs at least one site's parameters")
        total_n = sum(n for n, _ in site_thetas)
        new = torch.zeros_like(self.theta)
        for n, th in site_thetas:
            if th.shape != new.shape:
                raise ValueError(
                    f"site parameters have shape {tuple(th.shape)}, expected {tuple(new.shape)}"
                )
            new += (n / total_n) * th.float()
        self.theta = new
        self.t += 1
        self.posterior.offer(self.t, self.theta)
        if self.on_release is not None:
            self.on_release(plan, [th for _, th in site_thetas])
        return self.theta

    def _vi_update(self, plan: RoundPlan, noisy: torch.Tensor) -> torch.Tensor:
        """DPVI: g = (sum_k S_k + N(0, (sigma C)^2 I)) / L + grad KL(q || prior) / sum_k N_k,
        then an SGD or Adam step on phi = [mu, rho]. ``noisy`` already holds the noise. The
        KL gradient is added after the noise and is not clipped: it touches no record."""
        g = noisy / self.expected_batch + kl_gradient(self.theta, prior_std=self.prior_std) / sum(
            self.site_sizes
        )
        direction = self.adam.direction(g) if self.adam is not None else g
        return self.theta - plan.step_size * direction

    # -- reporting and checkpoints -----------------------------------------------
    def epsilon(self) -> dict[str, float]:
        if self.accountant is None:
            return {}
        return self.accountant.epsilon()

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta": self.theta.clone(),
            "t": self.t,
            "halt_reason": self.halt_reason,
            "posterior": self.posterior.state_dict(),
            "adam": self.adam.state_dict() if self.adam is not None else None,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.theta = d["theta"].clone()
        self.t = int(d["t"])
        self.halt_reason = d.get("halt_reason")
        self.posterior.load_state_dict(d["posterior"])
        if self.adam is not None and d.get("adam") is not None:
            self.adam.load_state_dict(d["adam"])
