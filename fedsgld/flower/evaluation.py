"""The server's side of an ``evaluate`` reply: decoded once, checked, then pooled.

A site answers an ``evaluate`` message (one model group per message: the guard admits one
evaluation per message) with the records its policy lets out (:mod:`fedsgld.flower.release`):
``meta`` (the site id), ``reports`` and ``stats`` (JSON, per group: the site's calibration
report and its pooling statistics), and, only where the site shares its predictions,
``labels`` (int64, n_test) and ``pred-<group>`` (float32, n_test x classes).

:func:`decode_eval_reply` is the one decoder of that reply: it checks the records against
the instruction the reply answers and returns an :class:`EvalReply`, or raises
:class:`~fedsgld.flower.replies.ReplyRejected` naming what is wrong. PATE's
``evaluate.pate`` reply has the same records and the same decoder
(:func:`fedsgld.pate.server.check_student_reply`).
:func:`pool_evaluations` turns the checked replies of every site into one
:class:`~fedsgld.run.evaluation.Evaluation` per group, with the same constructors the
in-process engine uses: over the concatenated predictions in site order when every site
shared them, else from the sites' statistics. Privacy caveat: what a site released
(exact or noised reports, predictions or not) was decided at the site; nothing here asks
for more.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message

from fedsgld.calibration.pooling import check_stats
from fedsgld.flower.replies import (
    ReplyRejected,
    SiteEntry,
    decode_array,
    site_id_of,
    source_node,
)
from fedsgld.run.evaluation import Evaluation, Evaluations


@dataclass(frozen=True)
class EvalReply:
    """One site's checked reply to an ``evaluate`` message.

    ``reports`` and ``stats``: per group, the site's calibration report and pooling
    statistics; ``labels`` (n_test,) and ``probs`` (group -> (n_test, classes)) only where
    the site shared its predictions (else None and empty)."""

    site: int
    reports: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, Any]]
    labels: np.ndarray | None
    probs: dict[str, np.ndarray]

    @property
    def shared(self) -> bool:
        return self.labels is not None


def _check_envelope(msg: Message, entry: SiteEntry | None, groups: list[str]) -> bool:
    """The reply's records and its site and node; whether it shares predictions."""
    if entry is None:
        raise ReplyRejected("the reply answers no instruction of this evaluation")
    if msg.has_error():
        raise ReplyRejected(
            f"error reply (code {msg.error.code}): {str(msg.error.reason or '')[-500:]}"
        )
    if not msg.has_content():
        raise ReplyRejected("reply has no content")
    private = sorted(["meta", "reports", "stats"])
    shared = sorted(["labels", "meta", "reports", "stats", *(f"pred-{g}" for g in groups)])
    keys = sorted(msg.content.keys())
    if keys not in (private, shared):
        raise ReplyRejected(f"reply records {keys}, expected {private} or {shared}")
    sid, node = site_id_of(msg), source_node(msg)
    if sid != entry.site or node != entry.node_id:
        raise ReplyRejected(
            f"reply names site {sid} from node {node}; node {entry.node_id} was asked for site {entry.site}"
        )
    return keys == shared


def _json_record(msg: Message, name: str) -> str:
    rec = msg.content[name]
    if not isinstance(rec, ConfigRecord) or not isinstance(rec.get("json"), str):
        raise ReplyRejected(f"{name} is not a ConfigRecord with a 'json' string")
    return rec["json"]


def _statistics(msg: Message, entry: SiteEntry, groups: list[str]) -> dict[str, dict[str, Any]]:
    text = _json_record(msg, "stats")
    try:
        stats = json.loads(text)
        if not isinstance(stats, dict) or sorted(stats) != sorted(groups):
            raise ValueError("statistics do not cover the requested groups")
        for g in groups:
            check_stats(stats[g])
            if entry.n_test is not None and stats[g]["n"] != entry.n_test:
                raise ValueError(f"statistics count {stats[g]['n']} records, not n_test")
    except ValueError as err:
        raise ReplyRejected(f"bad statistics: {err}") from None
    return stats


def _reports(msg: Message, groups: list[str]) -> dict[str, dict[str, Any]]:
    text = _json_record(msg, "reports")
    try:
        reports = json.loads(text)
    except ValueError as err:
        raise ReplyRejected(f"reports do not parse: {err}") from None
    if not isinstance(reports, dict) or sorted(reports) != sorted(groups):
        raise ReplyRejected("reports do not cover the requested groups")
    if not all(isinstance(reports[g], dict) for g in groups):
        raise ReplyRejected("a group's report is not a JSON object")
    return reports


def decode_eval_reply(msg: Message, entry: SiteEntry | None, groups: Iterable[str]) -> EvalReply:
    """Validate one evaluation reply of the model ``groups``; its :class:`EvalReply`, or
    :class:`~fedsgld.flower.replies.ReplyRejected`. ``entry``: the site the instruction
    asked (None: the reply answers no instruction of this evaluation)."""
    groups = list(groups)
    shared = _check_envelope(msg, entry, groups)
    labels = None
    if shared:
        labels = decode_array(msg.content["labels"], "labels", size=entry.n_test, dtype="int64")
        if labels.size and (labels.min() < 0 or labels.max() >= entry.num_classes):
            raise ReplyRejected("labels out of range")
    stats = _statistics(msg, entry, groups)
    reports = _reports(msg, groups)
    probs: dict[str, np.ndarray] = {}
    for g in groups if shared else ():
        p = decode_array(
            msg.content[f"pred-{g}"],
            "probs",
            size=(entry.n_test, entry.num_classes),
            dtype="float32",
        )
        if not np.isfinite(p).all():
            raise ReplyRejected(f"predictions of group {g!r} are not finite")
        probs[g] = p
    return EvalReply(entry.site, reports, stats, labels, probs)


def pool_evaluations(
    good: dict[int, EvalReply], groups: Iterable[str], *, asked: Iterable[int]
) -> Evaluations:
    """One :class:`~fedsgld.run.evaluation.Evaluation` per group from the checked replies
    ``good`` (site id -> reply; ``asked``: every site the evaluation went to). Pooled over
    the predictions in site order when every site shared them, else from the statistics."""
    order = sorted(good)
    missing = sorted(set(asked) - set(good))
    all_shared = all(good[k].shared for k in order)
    out: Evaluations = {}
    for g in groups:
        sites = {str(k): good[k].reports[g] for k in order}
        stats = [good[k].stats[g] for k in order]
        if all_shared:
            site_probs = {
                k: (torch.from_numpy(good[k].probs[g]), torch.from_numpy(good[k].labels))
                for k in order
            }
            out[g] = Evaluation.from_predictions(
                sites, site_probs, missing_sites=missing, stats=stats
            )
        else:
            out[g] = Evaluation.from_statistics(sites, stats, missing_sites=missing)
    return out


__all__ = ["EvalReply", "decode_eval_reply", "pool_evaluations"]
