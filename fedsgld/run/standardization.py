"""The private pooled standardisation (``standardize = "pooled"``): one release, then the
sites' records are standardised with the pooled mean and std it gives.

The maths is :mod:`fedsgld.data.standardize`: each site's sum V_k of its training records'
clipped (u, u^2) (L2 bound Delta = sqrt(2 d) per record), released once as a Gaussian
mechanism of noise multiplier sigma = ``standardize_noise_multiplier``:

* ``server`` placement: the sites send V_k; the server charges
  :class:`~fedsgld.privacy.events.GaussianRelease` (sigma) to the run's ledger (persisted),
  then draws N(0, (sigma Delta)^2 I) on sum_k V_k through the receipt.
* ``sites`` placement: the run's ledger (every site's: the same event at every site) is
  charged first; each site adds its own N(0, (sigma Delta)^2 I) to V_k.
* ``secure`` placement: the round is a secure sum with distributed discrete Gaussian noise
  (:func:`~fedsgld.privacy.distributed.choose_ddg` for sigma, clip Delta, dimension 2 d):
  the run's ledger and every site's own (through its guard) are charged with the
  :class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep` before any share is drawn.

The release comes BEFORE training, so the training steps that follow are planned and
checked against what is left of the one budget: the run's epsilon covers both. A
non-private method uses the exact pooled statistics (nothing to charge). A resumed run
reuses the statistics it released (kept in the checkpoint); it never releases them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedsgld.clients.secure_site import SecureSumSite
from fedsgld.clients.site_ledger import standardization_key
from fedsgld.config import Config
from fedsgld.core import streams
from fedsgld.data.standardize import (
    apply_standardization,
    exact_pooled_statistics,
    moment_sum,
    pooled_statistics,
    public_scale,
    raw_moment_sum,
    sensitivity,
)
from fedsgld.privacy.events import DistributedDiscreteGaussianStep, DpEvent, GaussianRelease
from fedsgld.run.stops import discard_unreleased, released_nothing
from fedsgld.secagg import Mechanism, run_round
from fedsgld.strategies.secure_sum import round_label

__all__ = [
    "ReleaseRefused",
    "check_fits",
    "pooled_standardization",
    "release_mechanism",
    "release_placement",
    "standardize_sites",
]

Log = Callable[[str], None]


def release_placement(config: Config) -> str:
    """Where the pooled release is noised: "exact" (a non-private run), "secure", "sites" or
    "server"."""
    p = config.privacy
    if not p.private:
        return "exact"
    if p.secure_aggregation:
        return "secure"
    return p.noise_placement


def release_mechanism(privacy, *, sigma: float, dim: int, sites: int, records: int) -> Mechanism:
    """The secure release's mechanism from its public numbers, as every party derives it:
    noise multiplier ``sigma`` at the honest shares, clip sqrt(2 d) (one record's (u, u^2)),
    q = 1, no pre-noise, ``dim`` = 2 d sums, the bound sqrt(2 d) x ``records`` (the
    published counts) on the sum that the bits are chosen for, the run's dropouts and
    colluders. Every site's keys and masks bind it."""
    delta_ = sensitivity(dim // 2)
    return Mechanism.derive(
        noise_multiplier=sigma, clip=delta_, sample_rate=1.0, prenoise=0.0,
        signal_norm=delta_ * records, dim=dim, sites=sites,
        max_dropouts=privacy.max_dropouts, max_colluders=privacy.max_colluders,
    )  # fmt: skip


def _secure_total(fed, server, sums: list[torch.Tensor], sigma: float, delta_: float):
    """sum_k V_k + distributed discrete Gaussian noise, through the sites' guards (each
    charges its own ledger) and the masking protocol; the round's event and parameters."""
    p = server.privacy
    mechanism = release_mechanism(p, sigma=sigma, dim=int(sums[0].shape[0]), sites=len(sums),
                                  records=sum(server.site_sizes))  # fmt: skip
    params = mechanism.params
    event = DistributedDiscreteGaussianStep(params, 1.0)
    check_fits(server, event, sigma)
    server.charge(event)  # the run's ledger, persisted before any share exists
    key = standardization_key(server.run_key)
    guards = [
        SecureSumSite(
            g.site_id,
            g.ledger,
            clip=delta_,
            max_dropouts=p.max_dropouts,
            max_colluders=p.max_colluders,
            credentials=g.credentials,
        )  # fmt: skip
        for g in fed.secure_sites()
    ]

    def encoder(i, vector, plan):
        return guards[i].contribution(
            vector, plan=plan, params=params, noise_multiplier=sigma, sample_rate=1.0,
            prenoise=0.0, round_of=(key, 0, 0),
        )  # fmt: skip

    res = run_round(
        {i: v.numpy() for i, v in enumerate(sums)},
        params,
        round_label=round_label(key, 0),
        max_dropouts=p.max_dropouts,
        max_colluders=p.max_colluders,
        neighbours=p.secagg_neighbours,
        one_shot=p.one_shot_rounds,
        workers=1,
        encoder=encoder,
        credentials={i: g.credentials for i, g in enumerate(guards)},
        mechanism=mechanism,
    )
    return torch.from_numpy(np.asarray(res.total, dtype=np.float64)), event, params


class ReleaseRefused(ValueError):
    """The pooled standardisation's release alone does not fit in the budget."""


def check_fits(server, event: DpEvent, sigma: float) -> None:
    """:class:`ReleaseRefused` where the release alone would take the run past its budget."""
    acc = server.accountant
    if acc is not None and not acc.fits(event):
        raise ReleaseRefused(
            f"standardize = 'pooled': its one release (standardize_noise_multiplier = "
            f"{sigma:g}) would take epsilon past the budget {server.privacy.epsilon:g} at "
            f"delta = {server.privacy.delta:g}; raise standardize_noise_multiplier or epsilon"
        )


def _release(fed, server, config: Config, sums: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """sum_k V_k as the placement releases it, charged first; and what to record of it."""
    p = config.privacy
    sigma, dim = p.standardize_noise_multiplier, int(sums[0].shape[0])
    delta_ = sensitivity(dim // 2)
    where = release_placement(config)
    info: dict[str, Any] = {"placement": where, "noise_multiplier": sigma, "sensitivity": delta_}
    if where == "secure":
        total, event, params = _secure_total(fed, server, sums, sigma, delta_)
        info.update(event=type(event).__name__, mechanism=params.describe())
        return total, info
    check_fits(server, GaussianRelease(sigma), sigma)
    charged = server.charge(GaussianRelease(sigma))
    info["event"] = "GaussianRelease"
    std = sigma * delta_
    if where == "server":
        key = (streams.SERVER_STREAM, streams.STANDARDIZE_STREAM, 0, 0)
        return charged.add_noise(torch.stack(sums).sum(0), server.noise, std=std, key=key), info
    noisy = [
        charged.add_noise(
            v,
            s.randomness,
            std=std,
            key=(streams.site_party(s.site_id), streams.STANDARDIZE_STREAM, 0, 0),
        )
        for s, v in zip(fed.sites, sums, strict=True)
    ]  # each site's own noise on its own sum (sites placement)
    return torch.stack(noisy).sum(0), info


def _private_statistics(lc, fed, server, n: int):
    """The pooled (mean, std) from the one private release, and what to record of it."""
    config = lc.config
    centre, scale = public_scale(config.run.dataset, int(fed.sites[0].x_train.shape[1]))
    clip = config.privacy.standardize_clip
    sums = [moment_sum(s.x_train, centre, scale, clip) for s in fed.sites]
    try:
        total, info = _release(fed, server, config, sums)
    except ReleaseRefused:  # a new run that released nothing leaves no run files
        if released_nothing(server):
            discard_unreleased(lc.out, created=lc.created)
        raise
    mean, std = pooled_statistics(total, n, centre, scale, clip)
    return mean, std, {**info, "clip": clip, "public_centre": centre.tolist(),
                       "public_scale": scale.tolist()}  # fmt: skip


def pooled_standardization(lc, fed, server, *, log: Log) -> dict[str, Any] | None:
    """Release the pooled moments once (or reuse a resumed run's), standardise every site's
    records with them; the state kept in the checkpoint (None: ``standardize`` is not
    ``pooled``)."""
    config = lc.config
    if config.privacy.standardize != "pooled":
        return None
    state = lc.extra_state.get("standardization")
    if state is None:
        x0 = fed.sites[0].x_train
        if x0.ndim != 2:
            raise ValueError(
                f"standardize = 'pooled' needs tabular records (N, D), got shape "
                f"{tuple(x0.shape)}; set standardize = 'none' for images"
            )
        n = sum(s.num_train for s in fed.sites)
        if release_placement(config) == "exact":  # a non-private run: the exact pooled statistics
            total = torch.stack([raw_moment_sum(s.x_train) for s in fed.sites]).sum(0)
            mean, std = exact_pooled_statistics(total, n)
            info = {"placement": "exact"}
        else:
            mean, std, info = _private_statistics(lc, fed, server, n)
        state = {**info, "records": n, "mean": mean.tolist(), "std": std.tolist()}
        lc.checkpoint(standardization=state)
        log(f"standardize = 'pooled' ({info['placement']}): the pooled mean and std released")
    else:
        log("resume: the pooled standardisation released before is reused")
    standardize_sites(fed, torch.tensor(state["mean"]), torch.tensor(state["std"]))
    return state


def standardize_sites(fed, mean: torch.Tensor, std: torch.Tensor) -> None:
    """Every site's records (train, test, held-out splits) as (x - mean) / std."""
    for s in fed.sites:
        s.x_train = apply_standardization(s.x_train, mean, std)
        s.x_test = apply_standardization(s.x_test, mean, std)
    fed.val_data = [(apply_standardization(x, mean, std), y) for x, y in fed.val_data]
    fed.cal_data = [(apply_standardization(x, mean, std), y) for x, y in fed.cal_data]
