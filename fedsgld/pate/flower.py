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

The messages' codecs and typed requests are in :mod:`fedsgld.pate.protocol`; the site's
guard decodes each request once and its handler here computes from what the guard
admitted (:class:`~fedsgld.pate.protocol.AtSite`), never from the raw record. The server
(:func:`fedsgld.pate.server.serve_pate`) takes its public queries from
:func:`~fedsgld.pate.data.pate_split` (the same seeded split as in-process), checks every
histogram and drops a bad one with a logged reason; the analysis covers whatever
histograms were summed. A seeded run equals the in-process
:func:`~fedsgld.pate.train.run_pate` (same split, same teachers, same noise).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict

from fedsgld.flower.handoff import admitted
from fedsgld.flower.hosted import hosted_site_ids
from fedsgld.flower.site_evaluation import evaluation_records
from fedsgld.flower.site_files import deployed, own_records
from fedsgld.pate.aggregation import site_histogram
from fedsgld.pate.config import PateConfig
from fedsgld.pate.data import PateSplit, pate_split
from fedsgld.pate.protocol import (
    EVALUATE,
    QUERY,
    RUN_CONFIG_FIELDS,
    STUDENT,
    TRAIN,
    AtSite,
    PateTask,
    StudentRequest,
    VoteRequest,
    Votes,
    encode_sites,
    encode_votes,
    pate_config_from_run_config,
    pate_record,
)
from fedsgld.pate.teachers import new_model, predict_proba, train_site_teachers

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


def _setup(msg: Message, kind: type = PateTask) -> AtSite:
    """What the site's guard admitted for ``msg``, a request of type ``kind`` (its
    settings' threads applied)."""
    got = admitted(msg).request
    if not isinstance(got, AtSite) or not isinstance(got.request, kind):
        raise RuntimeError(f"{msg.metadata.message_type}: not a PATE request the guard admitted")
    if got.task.config.threads:
        torch.set_num_threads(got.task.config.threads)
    return got


def handle_query(msg: Message, context: Context) -> Message:
    """The public sizes of the sites this node hosts."""
    config = _setup(msg).task.config
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
    return Message(encode_sites(info), reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """The site's teachers vote on the public queries; only the histogram is returned."""
    got = _setup(msg, VoteRequest)
    req, s = got.request, got.records
    config, sid = req.task.config, int(req.task.site_id)
    x_q = torch.from_numpy(np.ascontiguousarray(req.queries, np.float32))
    k = int(s.num_classes)
    preds, acc = train_site_teachers(
        config, site_id=sid, x_train=s.x_train, y_train=s.y_train, x_test=s.x_test,
        y_test=s.y_test, x_query=x_q, num_classes=k,
    )  # fmt: skip
    counts = site_histogram(preds, num_classes=k).numpy().astype(np.int64)
    return Message(encode_votes(Votes(sid, counts, tuple(acc))), reply_to=msg)


def handle_evaluate(msg: Message, context: Context) -> Message:
    """The student's evaluation on the site's test split (group ``student``)."""
    got = _setup(msg, StudentRequest)
    req, s = got.request, got.records
    config = req.task.config
    student = new_model(
        config.student_model, tuple(s.x_train.shape[1:]), int(s.num_classes), config.hidden, 0
    )
    student.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in req.student.items()})
    probs = predict_proba(student, s.x_test).numpy().astype(np.float32)
    records = evaluation_records(int(req.task.site_id), s.y_test.numpy(), {STUDENT: probs})
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
