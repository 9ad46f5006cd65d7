"""The site's handlers of ``query`` and ``train`` messages: exact answers from what the
site's guard admitted.

Every message reaches a handler through the site's guard (:mod:`fedsgld.flower.guard`),
which has built the node's sites once (:func:`fedsgld.flower.site_runtime.site_runtime`),
decoded and checked the request, charged it, and which releases only what the policy lets
out. A training reply is the clipped, pre-noised sum S_k and the site id (never the
realised batch size), or, with noise at the sites, the site's parameters after its local
steps. A site's samples, pre-noise and noise come from its policy's sampler (the operating
system's entropy unless the policy allows a seeded simulation); nothing that decides them
is sent or received.
"""

from __future__ import annotations

import json

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsgld.clients.guard import Training
from fedsgld.core.release import Charged
from fedsgld.flower.handoff import admitted
from fedsgld.flower.protocol import pack_vector
from fedsgld.flower.site_runtime import SiteRuntime, threads


def handle_query(msg: Message, context: Context) -> Message:
    """The public sizes of the sites this node hosts (the guard lets out what its policy shares)."""
    runtime: SiteRuntime = admitted(msg).request
    info = runtime.hosted.info
    return Message(RecordDict({"sites": ConfigRecord({"json": json.dumps(info)})}), reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """S_k = sum over Poisson-sampled records of clip_C(grad + rho z), via Site.clipped_sum;
    with noise at the sites, the site's parameters after its local steps. Computes from
    what the site's guard admitted (:class:`~fedsgld.clients.guard.Training`: the decoded,
    checked plan, the site, the policy's sampler) and the receipt of its charge."""
    got = admitted(msg)
    t: Training = got.request
    threads(t.plan.config)
    site = t.site
    rnd = t.plan.round
    theta = torch.from_numpy(t.theta)
    if t.at_site:  # the placement the guard checked and charged
        reply = _local_round(msg, t, got.receipt, theta)
    else:
        total = site.clipped_sum(
            theta,
            round=rnd,
            sample_rate=t.sample_rate,
            clip=t.clip,
            prenoise=t.prenoise,
            randomness=t.randomness,
        )
        rec = {"sum": pack_vector(total), "site-id": site.site_id, "round": rnd}
        reply = Message(RecordDict({"sum": ConfigRecord(rec)}), reply_to=msg)
    return reply


def _local_round(
    msg: Message, t: Training, receipt: Charged | None, theta: torch.Tensor
) -> Message:
    """Noise at the sites: this site's local DP-SGLD steps, noise added here and drawn
    through the receipt of the guard's charge; the reply is the site's parameters. Step
    sizes and noise come from the run config's privacy settings (the guard checked that
    the plan's steps are those)."""
    config, site = t.plan.config, t.site
    rnd, e = t.plan.round, config.privacy.local_steps
    new = site.local_round(
        theta,
        first_step=rnd * e,
        local_steps=e,
        privacy=config.privacy,
        weight_decay=config.run.weight_decay,
        charged=receipt,
        randomness=t.randomness,
        records=t.records,
    )
    reply = {"theta": pack_vector(new), "site-id": site.site_id, "round": rnd}
    return Message(RecordDict({"theta": ConfigRecord(reply)}), reply_to=msg)


__all__ = ["handle_query", "handle_train"]
