"""What a site's reply may carry: the releases its guard (:mod:`fedsgld.flower.guard`)
applies to each handler's exact reply, as Flower messages.

Each release gets the instruction, the handler's reply and the noise the guard drew after
the charge (None where nothing is noised), and builds the message that leaves the site:
the public sizes of a ``query`` (:func:`sites_info`), the report and statistics of an
``evaluate``, exact or noised as the site's policy says (:func:`evaluation`). The noised
numbers themselves are :mod:`fedsgld.clients.release`'s; PATE's vote counts are released
by :func:`fedsgld.pate.guard.votes`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from fedsgld.calibration.pooling import report_from_stats
from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.release import noisy_stats

PUBLIC_SITE_KEYS = ("site", "n_train", "n_test", "num_classes", "input_shape")


def sites_info(
    msg: Message,
    reply: Message,
    noise: None,
    *,
    label_histogram: bool | None,
    policy: SitePolicy | None = None,
) -> Message:
    """A node's ``sites`` list: the public sizes; the training-label histogram only where
    ``label_histogram`` is True (None: the message type has no such field); with ``policy``,
    what the site accepts (``placements``; none without a budget, and ``refuses`` says why),
    so that the server plans a run every site will answer."""
    out = []
    for entry in json.loads(str(reply.content["sites"]["json"])):
        public = {k: entry[k] for k in PUBLIC_SITE_KEYS}
        if label_histogram is not None:
            public["label_histogram"] = entry["label_histogram"] if label_histogram else None
        if policy is not None:
            refuses = policy.budget_refusal(int(entry["site"]))
            public["placements"] = [] if refuses else list(policy.placements)
            public["refuses"] = refuses
        out.append(public)
    return Message(RecordDict({"sites": ConfigRecord({"json": json.dumps(out)})}), reply_to=msg)


def evaluation(
    msg: Message, reply: Message, noise: np.ndarray | None, *, policy: SitePolicy, group: str
) -> Message:
    """An evaluation of one model: the site's report and statistics, exact or noised as the
    policy says (each report's ``release`` field says which); test labels and predictions
    only where the policy shares them."""
    c = reply.content
    if policy.evaluation == "exact":
        reports = {g: {**r, "release": "exact"} for g, r in _json(c, "reports").items()}
        stats = _json(c, "stats")
    else:
        probs, labels = c[f"pred-{group}"]["probs"].numpy(), c["labels"]["labels"].numpy()
        s = noisy_stats(probs, labels, noise)
        reports = {group: {**report_from_stats([s]), "release": "dp"}}
        stats = {group: s}
    out: dict[str, Any] = {
        "meta": c["meta"],
        "reports": ConfigRecord({"json": json.dumps(reports)}),
        "stats": ConfigRecord({"json": json.dumps(stats)}),
    }
    if policy.share_predictions:
        out["labels"] = c["labels"]
        out[f"pred-{group}"] = c[f"pred-{group}"]
    return Message(RecordDict(out), reply_to=msg)


def _json(content: RecordDict, name: str) -> dict[str, Any]:
    return json.loads(str(content[name]["json"]))
