"""The server's half of a DP-SGLD / DP-SGD / SGD round, independent of any transport.

Round t (one Langevin step):
  1. ``plan()``: alpha_t = schedule(t), sigma_t (sqrt(2 alpha_t tau) for DP-SGLD, constant
     for DP-SGD, 0 for SGD). Before anything is released, the accountant checks that one
     more Poisson-subsampled Gaussian step (q, sigma_t) keeps the rigorous epsilon within
     the budget; if not, the run halts and says why (the step is never taken).
  2. ``mode.round(transport, plan)``: the run's round mode (:mod:`fedsgld.strategies.modes`,
     chosen once from the placement by :func:`fedsgld.strategies.placement.round_mode`)
     charges the ledger (the ``on_spend`` hook persists it) BEFORE any noise is drawn
     (:func:`fedsgld.core.release.charge`), asks the sites, and steps: with server noise
     theta <- theta - alpha_t ((sum_k S_k + sigma_t C xi) / L + lambda theta) with
     L = q * sum_k N_k (:meth:`LangevinServer.step`). After burn-in every thin-th iterate
     is kept as a posterior sample (post-processing: no privacy cost).

The Flower strategies and the in-process engine both drive this class and its mode, so the
maths exists once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedsgld.config import PrivacySettings
from fedsgld.core.mechanism import langevin_update
from fedsgld.core.noise import Randomness
from fedsgld.core.plan import RoundPlan
from fedsgld.core.release import Charged, charge
from fedsgld.core.streams import SERVER_STREAM  # noqa: F401 - the server's key part, re-exported
from fedsgld.posteriors.swag import SwagMoments
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.events import DpEvent
from fedsgld.strategies.modes import RoundMode
from fedsgld.strategies.placement import round_mode
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
    """Server state: parameters, step counter, accountant and posterior samples; its round
    mode (``mode``: where the noise is added) does the rounds."""

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
        run_key: str = "",
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
        self.run_key = run_key  # the run's public name (it labels secure-sum rounds)
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
        self.accountant: PrivacyAccountant | None = None
        if privacy.private:
            self.accountant = PrivacyAccountant(
                delta=privacy.delta,
                epsilon_budget=privacy.epsilon,
                accountant=privacy.accountant,
                sigma_rel_grid=privacy.sigma_grid,
            )
        self.mode: RoundMode = round_mode(self)  # the placement, chosen once

    @property
    def local_steps(self) -> int:
        """Steps per round (each a ledger step): E with noise at the sites, else 1."""
        return self.mode.local_steps

    # -- planning ---------------------------------------------------------------
    def schedule_point(self, t: int) -> tuple[float, float]:
        """(q, sigma_t) of step t, as the accountant sees it."""
        return self.privacy.sample_rate, self.privacy.sigma(t)

    def affordable_rounds(self) -> int:
        """How many of the remaining rounds the budget allows along the planned schedule.

        Also certifies that ledger with the accountant, which makes the per-step checks cheap.
        """
        return self.mode.affordable_rounds()

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
                what = self.mode.step_name(self.t)
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
            first_step=self.mode.first_step(first),
        )

    def round_event(self, first: int) -> DpEvent | None:
        """The privacy event of the round whose first step is ``first`` (the mode's)."""
        return self.mode.round_event(first)

    # -- what a round mode does to the server -------------------------------------------
    def charge(self, event: DpEvent | None) -> Charged:
        """Charge ``event`` to the ledger and persist it (``on_spend``); the receipt draws."""
        try:
            return charge(self.accountant, event, persist=self.on_spend)
        except BudgetExhausted as err:  # plan() checked; this guards misuse
            self.halt_reason = f"privacy budget: {err}"
            raise

    def step(self, plan: RoundPlan, noisy: torch.Tensor) -> torch.Tensor:
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

    def advance(
        self, plan: RoundPlan, theta: torch.Tensor, site_thetas: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """Take ``theta`` as round ``plan``'s result: count the step, offer it to the
        posterior, tell ``on_release`` (with the sites' parameters where they released them)."""
        self.theta = theta
        self.t += 1
        self.posterior.offer(self.t, self.theta)
        if self.on_release is not None:
            self.on_release(plan, site_thetas)
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
