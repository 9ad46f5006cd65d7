"""PATE's messages: one codec per message type, and the typed requests and replies.

Each message type has one encoder (the server's side) and one decoder; a decoder checks
the message's layout and types and raises ``ValueError`` naming what is wrong (the site's
guard turns it into a refusal; the server drops the reply with that reason). What a
request asks of the site's own records (its site, the queries' shape, the student's
layout) is checked by the site's guard (:mod:`fedsgld.pate.guard`), which hands the
handler the request as it admitted it.

The wire format (record names, keys and types) is the one described in
:mod:`fedsgld.pate.flower`: ``pate`` (ConfigRecord, the ``pate.*`` keys), ``task``
(ConfigRecord ``site-id``, ``run-key``), ``queries`` (ArrayRecord ``x``), ``student``
(ArrayRecord, the student's state dict); replies ``sites`` (ConfigRecord ``json``),
``histogram`` (ArrayRecord ``counts``) and ``teachers`` (ConfigRecord ``site-id``,
``accuracy``, ``vote-noise-std``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedsgld.pate.config import PateConfig

PREFIX = "pate."
QUERY = "query.pate"
TRAIN = "train.pate"
EVALUATE = "evaluate.pate"
STUDENT = "student"  # the group name of a student's evaluation
RUN_CONFIG_FIELDS = tuple(f.name for f in fields(PateConfig))


# -- the PATE settings in a run config / ConfigRecord -----------------------------------


def pate_config_from_run_config(run_config: dict[str, Any]) -> PateConfig:
    """:class:`PateConfig` from the ``pate.*`` keys (unknown ``pate.*`` keys raise)."""
    raw = {k[len(PREFIX) :]: v for k, v in run_config.items() if k.startswith(PREFIX)}
    unknown = sorted(set(raw) - set(RUN_CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown PATE run-config keys: {', '.join(PREFIX + k for k in unknown)} "
            f"(valid: {', '.join(PREFIX + k for k in RUN_CONFIG_FIELDS)})"
        )
    if "mechanisms" in raw:
        m = raw["mechanisms"]
        if not isinstance(m, str):
            raise ValueError(f"pate.mechanisms must be a comma-separated string, got {m!r}")
        raw["mechanisms"] = tuple(x.strip() for x in m.split(",") if x.strip())
    if "dataset_options" in raw:
        o = raw["dataset_options"]
        try:
            raw["dataset_options"] = json.loads(o) if isinstance(o, str) else None
        except json.JSONDecodeError:
            raw["dataset_options"] = None
        if not isinstance(raw["dataset_options"], dict):
            raise ValueError(f"pate.dataset_options must be a JSON object string, got {o!r}")
    return PateConfig(**raw)


def pate_record(config: PateConfig) -> ConfigRecord:
    """The ``pate`` record of a request: every field of ``config`` as ``pate.<field>``."""
    rec: dict[str, Any] = {}
    for name in RUN_CONFIG_FIELDS:
        v = getattr(config, name)
        if name == "mechanisms":
            v = ",".join(v)
        elif name == "dataset_options":
            v = json.dumps(v, sort_keys=True)
        rec[PREFIX + name] = v
    return ConfigRecord(rec)


# -- the typed messages ----------------------------------------------------------------


@dataclass(frozen=True)
class PateTask:
    """What every PATE request carries: the run's PATE settings and, for ``train.pate``
    and ``evaluate.pate``, the site it asks (``site_id``) and the run's key."""

    config: PateConfig
    site_id: int | None = None
    run_key: str | None = None


@dataclass(frozen=True)
class VoteRequest:
    """A ``train.pate`` request: the site's teachers vote on ``queries`` (public records,
    float32, one row per query)."""

    task: PateTask
    queries: np.ndarray


@dataclass(frozen=True)
class StudentRequest:
    """An ``evaluate.pate`` request: the student's parameters by state-dict name."""

    task: PateTask
    student: dict[str, np.ndarray]


@dataclass(frozen=True)
class Votes:
    """A ``train.pate`` reply: the site's vote ``counts`` (int64, queries x classes), its
    teachers' test ``accuracy`` (empty where the site does not release it) and the std of
    the noise the site added to the counts."""

    site_id: int
    counts: np.ndarray
    accuracy: tuple[float, ...]
    noise_std: float = 0.0


@dataclass(frozen=True)
class AtSite:
    """A PATE request as the site's guard admitted it: the decoded ``request`` and the
    records of the site it asks (``records``; None for ``query.pate``), which the handler
    computes from (:func:`fedsgld.flower.handoff.admitted`)."""

    request: PateTask | VoteRequest | StudentRequest
    records: Any = None

    @property
    def task(self) -> PateTask:
        """The request's task (settings, site, run key)."""
        return self.request if isinstance(self.request, PateTask) else self.request.task


def _record(content: RecordDict, name: str, kind: type) -> Any:
    rec = content.get(name)
    if not isinstance(rec, kind):
        raise ValueError(f"message has no {kind.__name__} {name!r}")
    return rec


def _task(content: RecordDict, *, site: bool) -> PateTask:
    config = pate_config_from_run_config(dict(_record(content, "pate", ConfigRecord).items()))
    if not site:
        return PateTask(config)
    task = _record(content, "task", ConfigRecord)
    sid, key = task.get("site-id"), task.get("run-key")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ValueError(f"site-id is {sid!r}, expected an integer")
    if not isinstance(key, str) or not key:
        raise ValueError(f"request has no run key (run-key is {key!r})")
    return PateTask(config, sid, key)


def _task_records(task: PateTask) -> dict[str, ConfigRecord]:
    if task.site_id is None or task.run_key is None:
        raise ValueError("a train.pate or evaluate.pate request names its site and run key")
    return {
        "pate": pate_record(task.config),
        "task": ConfigRecord({"site-id": task.site_id, "run-key": task.run_key}),
    }


def encode_query(config: PateConfig) -> RecordDict:
    """A ``query.pate`` request."""
    return RecordDict({"pate": pate_record(config)})


def decode_query(content: RecordDict) -> PateTask:
    """The settings of a ``query.pate`` request."""
    return _task(content, site=False)


def encode_train(task: PateTask, queries: np.ndarray) -> RecordDict:
    """A ``train.pate`` request for ``task``'s site on the public ``queries``."""
    x = Array(np.ascontiguousarray(queries, dtype=np.float32))
    return RecordDict({**_task_records(task), "queries": ArrayRecord({"x": x})})


def decode_train(content: RecordDict) -> VoteRequest:
    """A ``train.pate`` request: its task and its queries (float32, at least one row,
    finiteness and shape are the site's guard's checks)."""
    task = _task(content, site=True)
    rec = _record(content, "queries", ArrayRecord)
    if "x" not in rec:
        raise ValueError("queries carry no array 'x'")
    arr = rec["x"]
    if arr.stype != "numpy.ndarray" or arr.dtype != "float32" or len(arr.shape) < 1:
        raise ValueError(f"queries are {arr.dtype}{tuple(arr.shape)}, expected float32 rows")
    if arr.shape[0] < 1:
        raise ValueError("train.pate needs at least one public query")
    return VoteRequest(task, arr.numpy())


def encode_evaluate(task: PateTask, student: ArrayRecord) -> RecordDict:
    """An ``evaluate.pate`` request for the ``student``'s parameters."""
    return RecordDict({**_task_records(task), "student": student})


def decode_evaluate(content: RecordDict) -> StudentRequest:
    """An ``evaluate.pate`` request: its task and the student's arrays by name (their
    layout is checked against the site's model by its guard)."""
    task = _task(content, site=True)
    rec = _record(content, "student", ArrayRecord)
    arrays: dict[str, np.ndarray] = {}
    for k in rec.keys():
        arr = rec[k]
        if arr.stype != "numpy.ndarray":
            raise ValueError(f"student parameter {k!r} is not a numpy array ({arr.stype})")
        arrays[k] = arr.numpy()
    return StudentRequest(task, arrays)


def encode_sites(entries: list[dict[str, Any]]) -> RecordDict:
    """A ``query.pate`` reply: the public sizes of each hosted site."""
    return RecordDict({"sites": ConfigRecord({"json": json.dumps(entries)})})


def decode_sites(content: RecordDict) -> list[dict[str, Any]]:
    """The entries of a ``query.pate`` reply, each with an integer ``site``."""
    entries = json.loads(str(_record(content, "sites", ConfigRecord)["json"]))
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("site"), int) for e in entries
    ):
        raise ValueError("sites must be a JSON list of objects with an integer 'site'")
    return entries


def encode_votes(votes: Votes) -> RecordDict:
    """A ``train.pate`` reply."""
    counts = Array(np.ascontiguousarray(votes.counts, dtype=np.int64))
    teachers = {
        "site-id": votes.site_id,
        "accuracy": json.dumps([float(a) for a in votes.accuracy]),
        "vote-noise-std": float(votes.noise_std),
    }
    return RecordDict(
        {"histogram": ArrayRecord({"counts": counts}), "teachers": ConfigRecord(teachers)}
    )


def decode_votes(content: RecordDict) -> Votes:
    """A ``train.pate`` reply's layout and types (its counts' shape and totals are the
    server's checks: :func:`fedsgld.pate.server.check_histogram`)."""
    counts = _record(content, "histogram", ArrayRecord)["counts"].numpy()
    teachers = _record(content, "teachers", ConfigRecord)
    acc = json.loads(str(teachers["accuracy"]))
    if not isinstance(acc, list) or not all(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in acc
    ):
        raise ValueError(f"accuracy must be a JSON list of numbers, got {teachers['accuracy']!r}")
    sid = teachers.get("site-id")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ValueError(f"site-id is {sid!r}, expected an integer")
    std = teachers.get("vote-noise-std", 0.0)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std >= 0:
        raise ValueError(f"vote-noise-std is {std!r}, expected a number >= 0")
    return Votes(sid, counts, tuple(float(a) for a in acc), float(std))


__all__ = [
    "EVALUATE",
    "AtSite",
    "PREFIX",
    "QUERY",
    "RUN_CONFIG_FIELDS",
    "STUDENT",
    "TRAIN",
    "PateTask",
    "StudentRequest",
    "VoteRequest",
    "Votes",
    "decode_evaluate",
    "decode_query",
    "decode_sites",
    "decode_train",
    "decode_votes",
    "encode_evaluate",
    "encode_query",
    "encode_sites",
    "encode_train",
    "encode_votes",
    "pate_config_from_run_config",
    "pate_record",
]
