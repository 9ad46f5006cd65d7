"""The pooled standardisation over Flower (``standardize = "pooled"``): the server's side.

Before the first round the server charges the run's ledger with the release
(:class:`~fedsgld.privacy.events.GaussianRelease` at ``standardize_noise_multiplier``,
persisted before anything is asked), then sends every site one ``query.standardize``
message (:func:`fedsgld.flower.protocol.encode_standardize`). Each site's guard checks it
against the site's policy, charges the site's own ledger and answers its moment sums
(:mod:`fedsgld.flower.site_standardize`): noised by the site at the ``sites`` placement,
exact at the ``server`` placement, where the server adds N(0, (sigma sqrt(2 d))^2) to their
sum. The server forms the pooled mean and std (:func:`fedsgld.data.standardize.
pooled_statistics`: post-processing, with the published record counts) and every later
message carries them in the run config's ``standardize_stats``, which each site applies
to its own records. A non-private run asks for the exact sums (sites whose policy allows
non-private requests). The state is kept in the checkpoint: a resumed run reuses it and
releases nothing again; a run cut before that checkpoint releases anew in its new epoch
(fresh noise, charged again: a site refuses the same run key and epoch twice).

At the ``secure`` placement the release is one secure-aggregation round instead of
``query.standardize`` messages (:meth:`fedsgld.flower.secure_rounds.SecureRounds.standardize_sum`,
``train.secagg`` messages of kind ``standardize``): the server derives the round's
distributed discrete Gaussian from the public numbers (sigma, clip sqrt(2 d), q = 1, no
pre-noise, the bound sqrt(2 d) x the published counts on the sum), charges the run's
ledger with it, and each site's guard builds the same mechanism itself, checks it against
its policy and charges its own ledger before it draws its share
(:mod:`fedsgld.flower.secure_site`). The server learns only the noisy sum of the
survivors' moment sums, and divides by the survivors' published counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid

from fedsgld.config import Config
from fedsgld.config.checks import encode_stats
from fedsgld.core import streams
from fedsgld.data.standardize import (
    exact_pooled_statistics,
    pooled_statistics,
    public_scale,
    sensitivity,
)
from fedsgld.flower.exchange import exchange
from fedsgld.flower.protocol import MOMENTS_DTYPE, STANDARDIZE, encode_standardize, run_record
from fedsgld.flower.secure_rounds import SecureRounds
from fedsgld.flower.strategy import LangevinStrategy
from fedsgld.privacy.events import DistributedDiscreteGaussianStep, GaussianRelease
from fedsgld.run.standardization import (
    ReleaseRefused,
    check_fits,
    release_mechanism,
    release_placement,
)
from fedsgld.run.stops import discard_unreleased, released_nothing
from fedsgld.secagg import Mechanism, RoundAborted

Log = Callable[[str], None]


class StandardizationFailed(RuntimeError):
    """Too few sites answered the pooled standardisation; the message names each."""


def _moments(reply: Message, site: int, length: int) -> torch.Tensor:
    """A site's checked moment sums (float64, (length,)); ``ValueError`` says what is wrong."""
    if reply.has_error():
        raise ValueError(str(reply.error.reason or "error reply")[-300:])
    rec = reply.content["moments"]
    if rec.get("site-id") != site:
        raise ValueError(f"the reply is site {rec.get('site-id')!r}'s")
    raw = rec["moments"]
    if not isinstance(raw, bytes) or len(raw) != 8 * length:
        raise ValueError(f"moments must be {length} float64 values")
    v = np.frombuffer(raw, MOMENTS_DTYPE)
    if not np.isfinite(v).all():
        raise ValueError("moments hold non-finite values")
    return torch.from_numpy(v.copy())


def _ask(lc, grid: Grid, strategy: LangevinStrategy, config: Config, length: int,
         *, timeout: float, poll: float) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:  # fmt: skip
    """Every site's moment sums (checked), by site id, and the sites that did not answer."""
    run = run_record(config)
    sent: dict[str, int] = {}
    msgs = []
    for k, e in strategy.directory.items():
        content = encode_standardize(site_id=k, run_key=lc.run_key, epoch=lc.epoch, run=run)
        msgs.append(Message(content, e.node_id, STANDARDIZE, group_id="standardize"))
    replies = exchange(grid, msgs, timeout=timeout, poll=poll)
    for m, k in zip(msgs, strategy.directory, strict=True):
        sent[m.metadata.message_id] = k
    got: dict[int, torch.Tensor] = {}
    failed: list[dict[str, Any]] = []
    for r in replies:
        k = sent.get(r.metadata.reply_to_message_id)
        if k is None or k in got:
            continue
        try:
            got[k] = _moments(r, k, length)
        except (KeyError, TypeError, ValueError) as err:
            failed.append({"site": k, "reason": str(err)})
    failed += [{"site": k, "reason": "no reply in time"} for k in strategy.directory
               if k not in got and all(f["site"] != k for f in failed)]  # fmt: skip
    return got, sorted(failed, key=lambda f: f["site"])


def _charge(lc, server, event, sigma: float):
    """The run's ledger charged with ``event``, persisted before any site is asked (a new
    run whose one release does not fit leaves no run files)."""
    try:
        check_fits(server, event, sigma)
    except ReleaseRefused:
        if released_nothing(server):
            discard_unreleased(lc.out, created=lc.created)
        raise
    return server.charge(event)


def _secure(strategy: LangevinStrategy, mechanism: Mechanism, length: int, send,
            log: Log) -> tuple[list[int], list[dict[str, Any]], torch.Tensor, dict[str, Any]]:  # fmt: skip
    """The secure round: the sites it sums (the survivors), those it does not, the noisy
    total of the survivors' moment sums, and the round's cost."""
    rounds = SecureRounds(strategy, send, pipeline=False)
    try:
        total, survivors = rounds.standardize_sum(mechanism, length=length)
    except RoundAborted as err:  # charged already: a resumed run releases anew
        raise StandardizationFailed(f"the pooled standardisation's secure round: {err}") from None
    log(f"standardize: the secure round summed sites {survivors}")
    failed = [{"site": k, "reason": "dropped out of the secure round"}
              for k in strategy.directory if k not in survivors]  # fmt: skip
    return survivors, failed, total, rounds.summary()


def _secure_release(lc, grid: Grid, strategy: LangevinStrategy, config: Config, d: int,
                    *, timeout: float, poll: float, log: Log):  # fmt: skip
    """The release at the ``secure`` placement: (sites summed, sites not, noisy total, what
    to record of it)."""
    p, directory = config.privacy, strategy.directory
    sigma = p.standardize_noise_multiplier
    mechanism = release_mechanism(
        p, sigma=sigma, dim=2 * d, sites=len(directory),
        records=sum(int(e.n_train) for e in directory.values()),  # the published counts
    )  # fmt: skip
    _charge(lc, strategy.server, DistributedDiscreteGaussianStep(mechanism.params, 1.0), sigma)

    def send(msgs: list[Message]) -> list[Message]:
        return exchange(grid, msgs, timeout=timeout, poll=poll)

    sites, failed, total, cost = _secure(strategy, mechanism, 2 * d, send, log)
    info = {"event": "DistributedDiscreteGaussianStep", "mechanism": mechanism.params.describe(),
            "secure_round": cost}  # fmt: skip
    return sites, failed, total, info


def _plain_release(lc, grid: Grid, strategy: LangevinStrategy, config: Config, d: int,
                   *, timeout: float, poll: float):  # fmt: skip
    """The release at ``server`` or ``sites`` (or a non-private run's exact sums):
    (sites that answered, sites that did not, their total, noised at ``server``, what to
    record of it)."""
    server, p = strategy.server, config.privacy
    where, sigma = release_placement(config), p.standardize_noise_multiplier
    charged = None
    info: dict[str, Any] = {}
    if where != "exact":
        charged = _charge(lc, server, GaussianRelease(sigma), sigma)
        info["event"] = "GaussianRelease"
    got, failed = _ask(lc, grid, strategy, config, 2 * d, timeout=timeout, poll=poll)
    if not got:
        return [], failed, None, info
    total = torch.stack([got[k] for k in sorted(got)]).sum(0)
    if where == "server":
        # the engine's key; the seeded stream holds the epoch (lc.server_randomness)
        key = (streams.SERVER_STREAM, streams.STANDARDIZE_STREAM, 0, 0)
        total = charged.add_noise(total, server.noise, std=sigma * sensitivity(d), key=key)
    return sorted(got), failed, total, info


def _release(lc, grid: Grid, strategy: LangevinStrategy, config: Config,
             *, timeout: float, poll: float, log: Log) -> dict[str, Any]:  # fmt: skip
    directory = strategy.directory
    shape = next(iter(directory.values())).input_shape
    if len(shape) != 1:
        raise ValueError(
            f"standardize = 'pooled' needs tabular records (N, D), the sites' are {shape}; "
            "set standardize = 'none' for images"
        )
    d = int(shape[0])
    p = config.privacy
    where = release_placement(config)
    info: dict[str, Any] = {"placement": where, "transport": "flower"}
    if where != "exact":
        info.update(noise_multiplier=p.standardize_noise_multiplier, sensitivity=sensitivity(d))
    if where == "secure":
        sites, failed, total, more = _secure_release(lc, grid, strategy, config, d,
                                                     timeout=timeout, poll=poll, log=log)  # fmt: skip
    else:
        sites, failed, total, more = _plain_release(lc, grid, strategy, config, d,
                                                    timeout=timeout, poll=poll)  # fmt: skip
    info.update(more)
    for f in failed:
        log(f"standardize: site {f['site']} did not answer: {f['reason']}")
    if len(sites) < strategy.min_sites or total is None:
        lines = "; ".join(f"site {f['site']}: {f['reason']}" for f in failed)
        raise StandardizationFailed(
            f"the pooled standardisation: {len(sites)} of {len(directory)} sites answered "
            f"(min_sites {strategy.min_sites}); {lines}"
        )
    n = sum(int(directory[k].n_train) for k in sites)  # the counts the sites publish
    if where == "exact":
        mean, std = exact_pooled_statistics(total, n)
    else:
        clip = p.standardize_clip
        centre, scale = public_scale(config.run.dataset, d)
        mean, std = pooled_statistics(total, n, centre, scale, clip)
        info.update(clip=clip, public_centre=centre.tolist(), public_scale=scale.tolist())
    return {**info, "records": n, "sites": sites, "refused": failed,
            "mean": mean.tolist(), "std": std.tolist()}  # fmt: skip


def release_over_flower(lc, grid: Grid, strategy: LangevinStrategy, config: Config,
                        *, timeout: float, poll: float, log: Log) -> dict[str, Any] | None:  # fmt: skip
    """Release the pooled moments once (or reuse a resumed run's) and have every later
    message carry the statistics (``strategy.run``); the state kept in the checkpoint
    (None: ``standardize`` is not ``pooled``)."""
    if config.privacy.standardize != "pooled":
        return None
    state = lc.extra_state.get("standardization")
    if state is None:
        state = _release(lc, grid, strategy, config, timeout=timeout, poll=poll, log=log)
        lc.checkpoint(standardization=state)
        log(f"standardize = 'pooled' ({state['placement']}): the pooled mean and std released")
    else:
        log("resume: the pooled standardisation released before is reused")
    stats = encode_stats(state["mean"], state["std"])
    strategy.run = run_record(Config.from_flat({**config.flat(), "standardize_stats": stats}))
    return state


__all__ = ["StandardizationFailed", "release_over_flower"]
