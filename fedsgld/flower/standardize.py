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

At the ``secure`` placement the release is a secure sum; over Flower that is refused with
one line (the in-process engine runs it: :mod:`fedsgld.run.standardization`).
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
from fedsgld.flower.strategy import LangevinStrategy
from fedsgld.privacy.events import GaussianRelease
from fedsgld.run.standardization import ReleaseRefused, check_fits, release_placement
from fedsgld.run.stops import discard_unreleased, released_nothing

Log = Callable[[str], None]

SECURE_REFUSAL = (
    "standardize = 'pooled' with secure_aggregation = true: over Flower the pooled "
    "standardisation releases at the server or sites placement; its secure sum runs in the "
    "in-process engine (fedsgld simulate). Set noise_placement = 'sites' without secure "
    "aggregation, or standardize = 'site'"
)


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


def _release(lc, grid: Grid, strategy: LangevinStrategy, config: Config,
             *, timeout: float, poll: float, log: Log) -> dict[str, Any]:  # fmt: skip
    server, directory = strategy.server, strategy.directory
    shape = next(iter(directory.values())).input_shape
    if len(shape) != 1:
        raise ValueError(
            f"standardize = 'pooled' needs tabular records (N, D), the sites' are {shape}; "
            "set standardize = 'none' for images"
        )
    d = int(shape[0])
    p = config.privacy
    where = release_placement(config)  # never "secure": serve refuses it (SECURE_REFUSAL)
    sigma, clip, delta = p.standardize_noise_multiplier, p.standardize_clip, sensitivity(d)
    info: dict[str, Any] = {"placement": where, "transport": "flower"}
    charged = None
    if where != "exact":
        event = GaussianRelease(sigma)
        try:
            check_fits(server, event, sigma)
        except ReleaseRefused:  # a new run that released nothing leaves no run files
            if released_nothing(server):
                discard_unreleased(lc.out, created=lc.created)
            raise
        charged = server.charge(event)  # the run's ledger, persisted before any site is asked
        info.update(noise_multiplier=sigma, sensitivity=delta, event="GaussianRelease")
    got, failed = _ask(lc, grid, strategy, config, 2 * d, timeout=timeout, poll=poll)
    for f in failed:
        log(f"standardize: site {f['site']} did not answer: {f['reason']}")
    if len(got) < strategy.min_sites:
        lines = "; ".join(f"site {f['site']}: {f['reason']}" for f in failed)
        raise StandardizationFailed(
            f"the pooled standardisation: {len(got)} of {len(directory)} sites answered "
            f"(min_sites {strategy.min_sites}); {lines}"
        )
    n = sum(int(directory[k].n_train) for k in got)  # the counts the sites publish
    total = torch.stack([got[k] for k in sorted(got)]).sum(0)
    if where == "exact":
        mean, std = exact_pooled_statistics(total, n)
    else:
        if where == "server":
            # the engine's key; the seeded stream holds the epoch (lc.server_randomness)
            key = (streams.SERVER_STREAM, streams.STANDARDIZE_STREAM, 0, 0)
            total = charged.add_noise(total, server.noise, std=sigma * delta, key=key)
        centre, scale = public_scale(config.run.dataset, d)
        mean, std = pooled_statistics(total, n, centre, scale, clip)
        info.update(clip=clip, public_centre=centre.tolist(), public_scale=scale.tolist())
    return {**info, "records": n, "sites": sorted(got), "refused": failed,
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


__all__ = ["SECURE_REFUSAL", "StandardizationFailed", "release_over_flower"]
