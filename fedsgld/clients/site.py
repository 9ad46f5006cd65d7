"""The site side: a hospital's shard, Poisson sampling, clipped sums, local evaluation.

A site returns only S_k = sum over its Poisson-sampled records of clip_C(g_i + rho z_i);
never the number of records it sampled. Its randomness (sampling and pre-noise) comes
from its own :class:`~fedsgld.core.noise.Randomness`: in a simulation a generator
derived from (seed, 1 + site_id, round), so runs are reproducible whatever order the
sites are called in; in a deployment fresh operating-system entropy that never leaves
the site.

With ``noise_placement = "sites"`` a site instead runs :meth:`Site.local_round`: several
DP-SGLD steps on its own records, adding the Gaussian noise itself (simulation: the
stream (seed, 1 + site_id, step, LOCAL_NOISE_STREAM): :mod:`fedsgld.core.streams`), and
returns its parameters. That noise is drawn through the receipt of the round's charge
(:mod:`fedsgld.core.release`): the ledger that pays for the steps is charged first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedsgld.core import streams
from fedsgld.core.batched import SiteSample
from fedsgld.core.mechanism import FlatModel, langevin_update, sample_site, site_step, site_sums
from fedsgld.core.noise import Randomness
from fedsgld.core.release import Charged
from fedsgld.core.streams import LOCAL_NOISE_STREAM  # noqa: F401 - re-exported (older imports)


class Site:
    #: an audit's canaries (:mod:`fedsgld.studies.audit`): records given by their gradients,
    #: Poisson-sampled, pre-noised and clipped with the site's records
    #: (``site_step(extra=...)``); None: none
    extra_records = None

    def __init__(
        self,
        site_id: int,
        x_train: torch.Tensor,
        y_train: torch.Tensor,
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        model: nn.Module,
        *,
        seed: int = 0,
        chunk_size: int = 256,
        flat_model: FlatModel | None = None,
        randomness: Randomness | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        """``device``: where this site's gradients and predictions are computed (its
        generators draw there too); its records stay where they are and move in chunks."""
        self.site_id = int(site_id)
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test
        self.fm = flat_model if flat_model is not None else FlatModel(model, device=device)
        self.seed = seed
        self.randomness = randomness if randomness is not None else Randomness.seeded(seed)
        self.chunk_size = chunk_size

    @classmethod
    def from_site_data(
        cls,
        data,
        model: nn.Module,
        *,
        seed: int = 0,
        chunk_size: int = 256,
        flat_model: FlatModel | None = None,
        randomness: Randomness | None = None,
        device: str | torch.device | None = None,
    ) -> Site:
        return cls(
            data.site_id,
            data.x_train,
            data.y_train,
            data.x_test,
            data.y_test,
            model,
            seed=seed,
            chunk_size=chunk_size,
            flat_model=flat_model,
            randomness=randomness,
            device=device,
        )

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    def generator(self, round_: int, randomness: Randomness | None = None) -> torch.Generator:
        """The site's stream of round (or local step) ``round_``: its Poisson sample and
        pre-noise, from ``randomness`` (default: the site's own, given when it was built)."""
        rnd = self.randomness if randomness is None else randomness
        return rnd.generator(*streams.site_round(self.site_id, round_), device=self.fm.device)

    def clipped_sum(
        self,
        theta: torch.Tensor,
        *,
        round: int,
        sample_rate: float,
        clip: float | None,
        prenoise: float,
        randomness: Randomness | None = None,
    ) -> torch.Tensor:
        """This site's contribution to round ``round``: the clipped, pre-noised gradient sum.
        ``randomness``: what draws its Poisson sample and pre-noise (default: the site's
        own; a deployed site's guard passes its policy's sampler, never the server's)."""
        gen = self.generator(round, randomness)
        if hasattr(self.fm, "begin_step"):  # variational models draw their eps for this step
            self.fm.begin_step(gen)
        s = site_step(
            self.fm,
            theta,
            self.x_train,
            self.y_train,
            sample_rate=sample_rate,
            clip=clip,
            prenoise=prenoise,
            generator=gen,
            chunk_size=self.chunk_size,
            extra=self.extra_records,
        )
        return s.cpu()  # what leaves the site's device: the (P,) sum, for the server

    def sample(
        self,
        *,
        round: int,
        sample_rate: float,
        clip: float | None,
        randomness: Randomness | None = None,
    ) -> SiteSample:
        """Round ``round``'s Poisson sample of this site's records (and canaries), with the
        generator that drew it, which draws the records' pre-noise next: the first half of
        :meth:`clipped_sum`, for a pass over many sites' samples at once
        (:func:`clipped_sums`)."""
        gen = self.generator(round, randomness)
        idx, rows = sample_site(
            self.num_train,
            sample_rate=sample_rate,
            generator=gen,
            extra=self.extra_records,
            clip=clip,
        )
        idx = idx.to(self.x_train.device)
        return SiteSample(self.x_train[idx], self.y_train[idx], gen, rows)

    @property
    def batchable(self) -> bool:
        """Whether this site's sums can join a pass over many sites (not a variational
        model, which draws its own eps per step and has its own gradients)."""
        return not hasattr(self.fm, "begin_step") and self.fm.grads.custom is None

    def local_round(
        self,
        theta: torch.Tensor,
        *,
        first_step: int,
        local_steps: int,
        privacy,
        weight_decay: float = 0.0,
        charged: Charged | None = None,
        randomness: Randomness | None = None,
        first_sum: torch.Tensor | None = None,
        records: int | None = None,
    ) -> torch.Tensor:
        """``local_steps`` noisy Langevin steps on this site's records (noise placement "sites").

        Step t = first_step + i: S = clipped, pre-noised sum over a Poisson sample (rate q)
        of the site's records, then theta <- theta - alpha_t ((S + sigma_t C xi) / L_k +
        lambda theta) with L_k = q N_k. alpha_t and sigma_t come from the site's own privacy
        settings (a :class:`fedsgld.config.PrivacySettings`), not from the server.

        ``charged``: the receipt of the charge that paid for these steps (the server's
        :meth:`~fedsgld.strategies.modes.SiteNoise.begin` in a
        simulation, the site's ledger, charged by its guard, in a deployment); every
        step's noise is drawn through it, and a round with noise (sigma_t C > 0) refuses to
        start without one. A round without noise (``sgd``) draws none and needs none.
        ``randomness``: what draws the samples and the noise (default: the site's own).
        ``first_sum``: the first step's clipped sum S when it was already computed from the
        same stream (:func:`clipped_sums` over several sites of one process: the engine's
        batched pass); the steps after it are computed here. ``records``: N_k of L_k, the
        count the site publishes (default: its own count, as in a simulation).
        """
        rnd = self.randomness if randomness is None else randomness
        q, clip = privacy.sample_rate, privacy.clip_bound
        stds = [privacy.sigma(first_step + i) * clip if clip is not None else 0.0
                for i in range(local_steps)]  # fmt: skip
        if charged is None and any(std > 0.0 for std in stds):
            raise ValueError(
                "local_round draws noise only through the receipt of its charge (charged=): "
                "charge the ledger that pays for the steps first (fedsgld.core.release.charge)"
            )
        expected = q * (self.num_train if records is None else records)
        if self.num_train == 0 or expected == 0:
            return theta.clone()
        dev = self.fm.device
        theta = theta.to(dev)
        for i, std in enumerate(stds):
            t = first_step + i
            s = (first_sum.to(dev) if i == 0 and first_sum is not None else site_step(
                self.fm,
                theta,
                self.x_train,
                self.y_train,
                sample_rate=q,
                clip=clip,
                prenoise=privacy.applied_prenoise,
                generator=self.generator(t, rnd),
                chunk_size=self.chunk_size,
                extra=self.extra_records,
            ))  # fmt: skip
            noisy = s  # a step without noise (sgd) draws none
            if std > 0.0:
                key = streams.site_local_noise(self.site_id, t)
                noisy = charged.add_noise(s, rnd, std=std, key=key, device=dev)
            theta = langevin_update(
                theta,
                noisy,
                step_size=privacy.step_size(t),
                expected_batch=expected,
                weight_decay=weight_decay,
            )
        return theta.cpu()

    def predict(
        self, thetas: Sequence[torch.Tensor], split: str = "test", x: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean softmax over ``thetas`` (one theta: the plain prediction; several: the
        Bayesian model average over posterior samples) on the test or training split, or
        on the records ``x`` when given."""
        if x is None:
            x = self.x_test if split == "test" else self.x_train
        if len(thetas) == 0:
            raise ValueError("predict needs at least one parameter vector")
        probs = torch.zeros(x.shape[0], 0)
        for i, th in enumerate(thetas):
            p = self.fm.predict_proba(th, x)
            probs = p if i == 0 else probs + p
        return probs / len(thetas)


def can_batch(sites: Sequence[Site]) -> bool:
    """Whether ``sites`` can share one per-record pass: two or more batchable sites with
    one architecture on one device (the same module, or modules without buffers) and one
    chunk size."""
    if len(sites) < 2 or not all(s.batchable for s in sites):
        return False
    first = sites[0]
    return all(
        s.fm.device == first.fm.device
        and s.fm.names == first.fm.names
        and s.fm.shapes == first.fm.shapes
        and s.chunk_size == first.chunk_size
        and (s.fm.module is first.fm.module or not (s.fm.buffers or first.fm.buffers))
        for s in sites
    )


def clipped_sums(
    sites: Sequence[Site],
    theta: torch.Tensor,
    *,
    round: int,
    sample_rate: float,
    clip: float | None,
    prenoise: float,
    batched: bool,
) -> list[torch.Tensor]:
    """Every site's :meth:`Site.clipped_sum` of round ``round``, in order, on the CPU.

    ``batched``: each site draws its sample and pre-noise from its own generator as
    alone, and all sites' records go through one per-record pass with per-site sums
    (:func:`fedsgld.core.mechanism.site_sums`): the same sums to float rounding, not
    bitwise. Sites that cannot share a pass (:func:`can_batch`) and plain sums (no clip,
    no pre-noise) are computed site by site."""
    if batched and can_batch(sites) and (clip is not None or prenoise > 0.0):
        samples = [s.sample(round=round, sample_rate=sample_rate, clip=clip) for s in sites]
        first = sites[0]
        total = site_sums(
            first.fm, theta, samples, clip=clip, prenoise=prenoise, chunk_size=first.chunk_size
        )
        return list(total.cpu().unbind(0))
    return [
        s.clipped_sum(theta, round=round, sample_rate=sample_rate, clip=clip, prenoise=prenoise)
        for s in sites
    ]
