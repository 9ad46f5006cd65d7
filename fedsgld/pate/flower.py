"""PATE over Flower: each SuperNode trains its sites' teachers; only vote histograms leave.

``flwr run . --run-config "task='pate'"`` runs it; the PATE settings are the run-config
keys ``pate.<field>`` of :class:`~fedsgld.pate.train.PateConfig` (``pate.mechanisms`` a
comma-separated string, e.g. ``"lnmax,gnmax"``; ``pate.dataset_options`` a JSON object); ``out``, ``wait-for-sites``,
``round-timeout`` and ``poll-interval`` mean what they mean for DP-SGLD.

Messages (one per (node, site) pair; the node hosts sites as in
:mod:`fedsgld.flower.sites`: ``partition-id``/``num-partitions`` in simulation, or
``site-id`` with ``site-data`` (its own ``.npz``) in a deployment):

``query.pate``     server -> node: ``pate`` (ConfigRecord, the ``pate.*`` keys).
                   reply: ``sites`` (ConfigRecord ``json``: site, n_train, n_test,
                   num_classes, input_shape per hosted site).
``train.pate``     server -> node: ``pate``, ``task`` (ConfigRecord ``site-id``,
                   ``run-key``), ``queries`` (ArrayRecord ``{"x": float32 (n_queries,
                   ...)}``: public data). The site trains ``teachers_per_site`` teachers on
                   disjoint subsets of its own records. reply: ``histogram`` (ArrayRecord
                   ``{"counts": int64 (n_queries, num_classes)}``: the sum of its teachers'
                   one-hot votes, with the site's own Gaussian noise unless its policy
                   sets ``allow_non_private``, rounded to a valid histogram) and
                   ``teachers`` (ConfigRecord: site-id, ``vote-noise-std``, ``accuracy`` =
                   JSON list of each teacher's test accuracy where the site's policy
                   releases exact evaluations, else ``[]``).
``evaluate.pate``  server -> node: ``pate``, ``task``, ``student`` (ArrayRecord: the
                   student's state dict). reply: the records of an ``evaluate`` reply for
                   the group ``student`` (``meta``, ``reports``, ``stats``; ``labels`` and
                   ``pred-student`` only where the site's policy shares predictions).

Every message passes the site's guard first (:mod:`fedsgld.pate.guard` admits PATE's
messages; :mod:`fedsgld.flower.guard`): the noise and what is shared are the site's
policy's decisions, not the server's.

This module holds the messages' settings and the site's handlers. The server
(:func:`fedsgld.pate.server.serve_pate`) takes its public queries from
:func:`~fedsgld.pate.data.pate_split` (the same seeded split as in-process), checks every
histogram and drops a bad one with a logged reason; the analysis covers whatever
histograms were summed. A seeded run equals the in-process
:func:`~fedsgld.pate.train.run_pate` (same split, same teachers, same noise).
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsgld.flower.hosted import hosted_site_ids
from fedsgld.flower.site_evaluation import evaluation_records
from fedsgld.flower.site_files import deployed, own_records
from fedsgld.pate.aggregation import site_histogram
from fedsgld.pate.config import PateConfig
from fedsgld.pate.data import PateSplit, pate_split
from fedsgld.pate.teachers import new_model, predict_proba, train_site_teachers

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
    rec: dict[str, Any] = {}
    for name in RUN_CONFIG_FIELDS:
        v = getattr(config, name)
        if name == "mechanisms":
            v = ",".join(v)
        elif name == "dataset_options":
            v = json.dumps(v, sort_keys=True)
        rec[PREFIX + name] = v
    return ConfigRecord(rec)


# -- the site side (the ClientApp's @query("pate") / @train("pate") / @evaluate("pate")) --

_SPLITS: dict[str, PateSplit] = {}


def site_records(config: PateConfig, node_config: dict[str, Any]) -> dict[int, Any]:
    """The private records of the sites this node hosts (site id -> x/y train/test)."""
    ids = hosted_site_ids(config.sites, node_config)
    if deployed(node_config):  # its own node config's file, and no other
        if config.data_path:
            raise ValueError(
                "the run config names a file (data_path): a deployed site reads only the "
                "files its own node config names (site-data)"
            )
        return {ids[0]: own_records(node_config, ids[0])}
    if "site-data" in node_config:
        raise ValueError("node config site-data needs site-id")
    key = json.dumps(
        {n: getattr(config, n) for n in RUN_CONFIG_FIELDS}, sort_keys=True, default=str
    )
    if key not in _SPLITS:  # the in-process split (same seed): a simulated node's shard
        _SPLITS.clear()
        _SPLITS[key] = pate_split(config)
    split = _SPLITS[key]
    return {k: split.sites[k] for k in ids}


def _setup(msg: Message) -> PateConfig:
    config = pate_config_from_run_config(dict(msg.content["pate"].items()))
    if config.threads:
        torch.set_num_threads(config.threads)
    return config


def _shard(config: PateConfig, context: Context, msg: Message) -> tuple[int, Any]:
    sid = msg.content["task"]["site-id"]
    shards = site_records(config, dict(context.node_config))
    if isinstance(sid, bool) or not isinstance(sid, int) or sid not in shards:
        raise ValueError(f"this node does not host site {sid!r} (it hosts {sorted(shards)})")
    return sid, shards[sid]


def handle_query(msg: Message, context: Context) -> Message:
    config = _setup(msg)
    info = [
        {
            "site": k,
            "n_train": int(s.y_train.shape[0]),
            "n_test": int(s.y_test.shape[0]),
            "num_classes": int(s.num_classes),
            "input_shape": [int(d) for d in s.x_train.shape[1:]],
        }
        for k, s in site_records(config, dict(context.node_config)).items()
    ]
    return Message(RecordDict({"sites": ConfigRecord({"json": json.dumps(info)})}), reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """The site's teachers vote on the public queries; only the histogram is returned."""
    config = _setup(msg)
    sid, s = _shard(config, context, msg)
    x_q = torch.from_numpy(np.ascontiguousarray(msg.content["queries"]["x"].numpy(), np.float32))
    k = int(s.num_classes)
    preds, acc = train_site_teachers(
        config, site_id=sid, x_train=s.x_train, y_train=s.y_train, x_test=s.x_test,
        y_test=s.y_test, x_query=x_q, num_classes=k,
    )  # fmt: skip
    counts = site_histogram(preds, num_classes=k).numpy().astype(np.int64)
    return Message(
        RecordDict(
            {
                "histogram": ArrayRecord({"counts": Array(counts)}),
                "teachers": ConfigRecord({"site-id": sid, "accuracy": json.dumps(acc)}),
            }
        ),
        reply_to=msg,
    )


def handle_evaluate(msg: Message, context: Context) -> Message:
    """The student's evaluation on the site's test split (group ``student``)."""
    config = _setup(msg)
    sid, s = _shard(config, context, msg)
    student = new_model(
        config.student_model, tuple(s.x_train.shape[1:]), int(s.num_classes), config.hidden, 0
    )
    student.load_state_dict(msg.content["student"].to_torch_state_dict())
    probs = predict_proba(student, s.x_test).numpy().astype(np.float32)
    records = evaluation_records(sid, s.y_test.numpy(), {STUDENT: probs})
    return Message(RecordDict(records), reply_to=msg)


__all__ = [
    "EVALUATE",
    "QUERY",
    "RUN_CONFIG_FIELDS",
    "STUDENT",
    "TRAIN",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "pate_config_from_run_config",
    "pate_record",
    "site_records",
]
