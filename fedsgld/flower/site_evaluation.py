"""A site's answer to an ``evaluate`` message: the model evaluated at the site.

The site's guard (:mod:`fedsgld.flower.guard`) has decoded the message, checked its
parameter vectors against the site's model and charged the evaluation; the handler computes
from what it admitted (:class:`~fedsgld.clients.guard.Evaluating`), and the guard lets out
only what the site's policy allows of the records built here (:mod:`fedsgld.flower.release`).
PATE's student evaluation builds the same records (:mod:`fedsgld.pate.flower`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsgld.calibration import calibration_report, pooling
from fedsgld.clients.guard import Evaluating
from fedsgld.files import json_default
from fedsgld.flower.handoff import admitted
from fedsgld.flower.site_runtime import threads


def evaluation_records(
    site_id: int, labels: np.ndarray, probs: dict[str, np.ndarray]
) -> dict[str, Any]:
    """The records of an evaluation at a site, exact and complete (the guard decides what
    leaves): ``meta`` (site-id), ``labels``, and per group ``pred-<group>``, the site's
    calibration report (``reports``) and pooling statistics (``stats``)."""
    reports = {g: calibration_report(p, labels) for g, p in probs.items()}
    stats = {g: pooling.pooling_stats(p, labels) for g, p in probs.items()}
    records: dict[str, Any] = {
        "meta": MetricRecord({"site-id": int(site_id)}),
        "labels": ArrayRecord({"labels": Array(labels.astype(np.int64, copy=False))}),
        "reports": ConfigRecord({"json": json.dumps(reports, default=json_default)}),
        "stats": ConfigRecord({"json": json.dumps(stats, default=json_default)}),
    }
    for g, p in probs.items():
        records[f"pred-{g}"] = ArrayRecord({"probs": Array(p.astype(np.float32, copy=False))})
    return records


def handle_evaluate(msg: Message, context: Context) -> Message:
    """The mean softmax of the message's parameter vectors (one model: one vector, or a
    posterior's samples) on the site's test split, evaluated AT the site, from what the
    site's guard admitted (:class:`~fedsgld.clients.guard.Evaluating`)."""
    ev: Evaluating = admitted(msg).request
    threads(ev.config)
    site = ev.site
    probs = {ev.group: site.predict([torch.from_numpy(v.copy()) for v in ev.vectors]).numpy()}
    records = evaluation_records(site.site_id, site.y_test.numpy(), probs)
    return Message(RecordDict(records), reply_to=msg)


__all__ = ["evaluation_records", "handle_evaluate"]
