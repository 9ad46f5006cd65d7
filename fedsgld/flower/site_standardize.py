"""A site's handler of ``query.standardize``: its moment sums for the pooled
standardisation, from what its guard admitted (:class:`fedsgld.flower.guard.Standardizing`).

The guard has checked the request against the site's policy and charged the release; this
computes the exact sums (V_k = sum_i (u_i, u_i^2) with u_i the clipped, scaled features,
:func:`fedsgld.data.standardize.moment_sum`; or, for a non-private run, the exact sums of x
and x^2), and the guard's release adds the noise it drew where the site noises
(:func:`fedsgld.flower.release.moments`). The reply carries the sums only: never the
site's record count.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsgld.data.standardize import moment_sum, raw_moment_sum
from fedsgld.flower.guard import Standardizing
from fedsgld.flower.handoff import admitted
from fedsgld.flower.protocol import MOMENTS_DTYPE


def handle_standardize(msg: Message, context: Context) -> Message:
    """The site's moment sums, float64 little-endian (2 d,), and its site id."""
    req: Standardizing = admitted(msg).request
    x = req.site.x_train
    total = raw_moment_sum(x) if req.exact else moment_sum(x, req.centre, req.scale, req.clip)
    data = np.asarray(total.numpy(), dtype=MOMENTS_DTYPE).tobytes()
    rec = ConfigRecord({"moments": data, "site-id": req.site.site_id})
    return Message(RecordDict({"moments": rec}), reply_to=msg)


__all__ = ["handle_standardize"]
