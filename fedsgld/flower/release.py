"""What a site's reply may carry: the releases its guard (:mod:`fedsgld.flower.guard`)
applies to each handler's exact reply, as Flower messages.

Each release gets the instruction, the handler's reply and the noise the guard drew after
the charge (None where nothing is noised), and builds the message that leaves the site:
the published sizes of a ``query`` (:func:`sites_info`), the report and statistics of an
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
from fedsgld.flower.protocol import MOMENTS_DTYPE

PUBLIC_SITE_KEYS = ("site", "n_train", "n_test", "num_classes", "input_shape")


def sites_info(
    msg: Message,
    reply: Message,
    noise: None,
    *,
    label_histogram: bool | None,
    policy: SitePolicy,
    placements: bool = True,
) -> Message:
    """A node's ``sites`` list: the record counts its ``policy`` publishes (``n_train``,
    ``n_test``: its ``public_records`` and ``public_test_records``, the exact counts only
    where it says "exact", null where it publishes none), the number of classes and the
    input shape; the training-label histogram only where ``label_histogram`` is True (None:
    the message type has no such field); with ``placements``, what the site accepts (none
    without a budget or a published count, and ``refuses`` says why), so that the server
    plans a run every site will answer."""
    out = []
    for entry in json.loads(str(reply.content["sites"]["json"])):
        public = {k: entry[k] for k in PUBLIC_SITE_KEYS}
        public["n_train"] = policy.published("public_records", int(entry["n_train"]))
        public["n_test"] = policy.published("public_test_records", int(entry["n_test"]))
        if label_histogram is not None:
            public["label_histogram"] = entry["label_histogram"] if label_histogram else None
        if placements:
            sid = int(entry["site"])
            refuses = policy.budget_refusal(sid) or policy.sizes_refusal(sid)
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
        total = policy.published("public_test_records", int(labels.shape[0]))
        s = noisy_stats(probs, labels, noise, total=total)
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


def moments(msg: Message, reply: Message, noise: np.ndarray | None) -> Message:
    """A site's moment sums for the pooled standardisation: as computed, or (noise at the
    site) with the noise the guard drew after the charge added, float64."""
    rec = reply.content["moments"]
    if noise is None:
        return reply
    exact = np.frombuffer(rec["moments"], MOMENTS_DTYPE)
    if exact.shape != noise.shape:
        raise ValueError(f"moments {exact.shape} and their noise {noise.shape} differ")
    out = {**dict(rec.items()), "moments": (exact + noise).astype(MOMENTS_DTYPE).tobytes()}
    return Message(RecordDict({"moments": ConfigRecord(out)}), reply_to=msg)
