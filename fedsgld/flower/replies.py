"""What the server accepts from a site: the checks of every ``train`` reply before
:class:`~fedsgld.flower.strategy.LangevinStrategy` uses it (an ``evaluate`` reply's:
:mod:`fedsgld.flower.evaluation`).

A reply is checked against the instruction it answers (:class:`SiteEntry`: the site and
node asked, and the site's public sizes). A reply that fails raises :class:`ReplyRejected`
naming what is wrong; the strategy drops it with a logged reason. The checks: records and
fields exactly as the protocol says (:mod:`fedsgld.flower.protocol`), the site and node
the instruction named, the round, finite values of the right dtype and shape, and (with
clipping) the bound ||S_k|| <= N_k C no correct site can exceed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedsgld.core.plan import RoundPlan
from fedsgld.flower.protocol import unpack_vector
from fedsgld.secagg.wire import unflatten

NORM_SLACK = 1e-3  # relative float slack on the bound ||S_k|| <= N_k C


class ReplyRejected(ValueError):
    """A reply failed a check; the message says which."""


@dataclass(frozen=True)
class SiteEntry:
    """Where a site lives and what is public about it."""

    site: int
    node_id: int
    n_train: int | None  # the counts the site publishes (None: none; it answers no training)
    n_test: int | None
    num_classes: int
    input_shape: tuple[int, ...]
    label_histogram: list[int] | None = None  # only if the site's policy shares it
    placements: tuple[str, ...] | None = None  # what the site's policy accepts (None: not said)
    refuses: str | None = None  # why the site answers nothing private (None: it has a budget)


def source_node(msg: Message) -> int | None:
    try:
        return int(msg.metadata.src_node_id)
    except Exception:  # noqa: BLE001 - a malformed reply must not stop the round
        return None


def decode_array(rec: Any, key: str, *, size: int | tuple[int, ...], dtype: str) -> np.ndarray:
    if not isinstance(rec, ArrayRecord):
        raise ReplyRejected(f"record is a {type(rec).__name__}, expected an ArrayRecord")
    keys = list(rec.keys())
    if keys != [key]:
        raise ReplyRejected(f"ArrayRecord keys {keys}, expected [{key!r}]")
    arr = rec[key]
    shape = (size,) if isinstance(size, int) else tuple(size)
    if arr.stype != "numpy.ndarray" or arr.dtype != dtype or tuple(arr.shape) != shape:
        raise ReplyRejected(
            f"array {key!r} is {arr.dtype}{tuple(arr.shape)} ({arr.stype}), expected {dtype}{shape}"
        )
    try:
        nd = arr.numpy()
    except Exception as err:  # noqa: BLE001
        raise ReplyRejected(f"array {key!r} does not decode: {err}") from None
    if nd.dtype != np.dtype(dtype) or nd.shape != shape:
        raise ReplyRejected(
            f"array {key!r} decodes to {nd.dtype}{nd.shape}, expected {dtype}{shape}"
        )
    return nd


def site_id_of(msg: Message) -> int:
    meta = msg.content.get("meta") if msg.has_content() else None
    if not isinstance(meta, MetricRecord):
        raise ReplyRejected("no MetricRecord 'meta'")
    sid = meta.get("site-id")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ReplyRejected(f"meta['site-id'] is {sid!r}, expected an integer")
    return sid


def _only_record(msg: Message, entry: SiteEntry | None, key: str) -> ConfigRecord:
    """The reply's one record, ``key`` (a ConfigRecord), of a reply to an open instruction
    that is not an error; else :class:`ReplyRejected`."""
    if entry is None:
        raise ReplyRejected("the reply answers no instruction of this round")
    if msg.has_error():
        err = msg.error
        raise ReplyRejected(f"error reply (code {err.code}): {str(err.reason or '')[-500:]}")
    if not msg.has_content():
        raise ReplyRejected("reply has no content")
    keys = sorted(msg.content.keys())
    if keys != [key]:
        raise ReplyRejected(f"reply records {keys}, expected [{key!r}]")
    rec = msg.content[key]
    if not isinstance(rec, ConfigRecord):
        raise ReplyRejected(f"record {key!r} is a {type(rec).__name__}, expected a ConfigRecord")
    return rec


#: the keys of each secure-aggregation step's reply, besides "site"
SECAGG_REPLY_FIELDS = {
    "advertise_keys": {"enc_pk", "mask_pk", "sig"},
    "share_keys": {"shares"},
    "masked_input": {"y"},
    "consistency": {"sig"},
    "unmask": {"self_mask_shares", "mask_key_shares"},
}


#: what a pipelined request also asks for, and the reply field that carries it: round
#: t + 1's keys with round t's consistency, its shares with round t's unmask; in one-shot
#: rounds its keys with round t's masked input
SECAGG_AHEAD = {"consistency": ("next", "advertise_keys"), "unmask": ("next_shares", "share_keys"),
                "masked_input": ("next", "advertise_keys")}  # fmt: skip


def check_secagg_reply(
    msg: Message, *, entry: SiteEntry | None, step: str, ahead: bool = False
) -> dict[str, Any]:
    """Validate one reply to a ``train.secagg`` step; return the site's protocol message
    or raise :class:`ReplyRejected`: the checks of :func:`check_train_reply` on the reply
    and its node, then the step's fields (:mod:`fedsgld.secagg.wire`). ``ahead``: a
    consistency request (or a one-shot round's masked_input request) that asked for the
    next round's keys too, or an unmask request
    that carried the next round's roster; the reply then also holds the same site's
    answer to that step of the next round (``next``: its ``advertise_keys`` message;
    ``next_shares``: its ``share_keys`` message, :data:`SECAGG_AHEAD`)."""
    rec = _only_record(msg, entry, "secagg")
    try:
        m = unflatten(rec, "")
    except ValueError as err:
        raise ReplyRejected(f"malformed {step} reply: {err}") from None
    node = source_node(msg)
    if m.get("site") != entry.site or node != entry.node_id:
        raise ReplyRejected(
            f"reply names site {m.get('site')!r} from node {node}; node {entry.node_id} was "
            f"asked for site {entry.site}"
        )
    field, of = SECAGG_AHEAD.get(step, ("", "")) if ahead else ("", "")
    want = {"site", *SECAGG_REPLY_FIELDS[step], *((field,) if field else ())}
    if set(m) != want:
        raise ReplyRejected(f"a {step} reply holds {sorted(m)}, expected {sorted(want)}")
    nxt = m.get(field)
    if field and (not isinstance(nxt, dict) or nxt.get("site") != entry.site
                  or set(nxt) != {"site", *SECAGG_REPLY_FIELDS[of]}):  # fmt: skip
        raise ReplyRejected(f"the next round's {of} answer in site {entry.site}'s {step} "
                            "reply is malformed")  # fmt: skip
    return m


def check_train_reply(
    msg: Message,
    *,
    plan: RoundPlan,
    entry: SiteEntry | None,
    size: int,
    key: str = "sum",
) -> torch.Tensor:
    """Validate one training reply; return S_k or raise :class:`ReplyRejected`.

    ``entry`` is the site the instruction this message replies to asked for (None: the
    reply answers no instruction of this round). Checks: not an error; exactly one
    record, ``sum`` (ConfigRecord with exactly ``sum``: float32 (P,) as bytes,
    ``site-id`` and ``round``); it comes from that site's node and names that site and
    round; S_k is finite and (with clipping) ||S_k|| <= N_k C, a bound no correct site can
    exceed. With noise at the sites (``key="theta"``) the reply holds the site's
    parameters after its local steps instead: same checks except the norm bound.
    """
    rec = _only_record(msg, entry, key)
    fields = sorted(rec.keys())
    if fields != sorted([key, "round", "site-id"]):
        raise ReplyRejected(
            f"record {key!r} has {fields}, expected {sorted([key, 'round', 'site-id'])}"
        )
    sid, rnd = rec.get("site-id"), rec.get("round")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ReplyRejected(f"{key}['site-id'] is {sid!r}, expected an integer")
    node = source_node(msg)
    if sid != entry.site or node != entry.node_id:
        raise ReplyRejected(
            f"reply names site {sid} from node {node}; node {entry.node_id} was asked for site {entry.site}"
        )
    if isinstance(rnd, bool) or rnd != plan.round:
        raise ReplyRejected(f"reply is for round {rnd!r}, expected {plan.round}")
    try:
        nd = unpack_vector(rec[key], size=size, name=key)
    except ValueError as err:
        raise ReplyRejected(str(err)) from None
    if not np.isfinite(nd).all():
        raise ReplyRejected(f"{key} has non-finite values")
    s = torch.from_numpy(nd)
    if plan.clip is not None and key == "sum":
        bound = entry.n_train * plan.clip * (1.0 + NORM_SLACK) + 1e-6
        norm = float(torch.linalg.vector_norm(s.double()))
        if norm > bound:
            raise ReplyRejected(
                f"||sum|| = {norm:.6g} exceeds N_k C = {entry.n_train} x {plan.clip:g}"
            )
    return s


__all__ = [
    "NORM_SLACK",
    "decode_array",
    "site_id_of",
    "source_node",
    "ReplyRejected",
    "SiteEntry",
    "check_train_reply",
]
