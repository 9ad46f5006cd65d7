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

Every message passes the site's guard first (:mod:`fedsgld.clients.guard`): the noise
and what is shared are the site's policy's decisions, not the server's.

The server's public queries come from :func:`~fedsgld.pate.train.pate_split` (the same
seeded split as in-process). It checks every histogram (shape, dtype, counts >= 0, each
row summing to the site's number of teachers) and drops a bad one with a logged reason;
the analysis covers whatever histograms were summed. A seeded run equals the in-process
:func:`~fedsgld.pate.train.run_pate` (same split, same teachers, same noise).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsgld.calibration import calibration_report
from fedsgld.calibration.pooling import check_stats, report_from_stats
from fedsgld.pate.aggregation import site_histogram
from fedsgld.pate.train import (
    PateConfig,
    PateSplit,
    _new_model,
    pate_split,
    predict_proba,
    release_and_learn,
    train_site_teachers,
)

_log = logging.getLogger("fedsgld.pate")

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
    from fedsgld.flower.sites import hosted_site_ids, read_site_npz

    ids = hosted_site_ids(config.sites, node_config)
    if "site-data" in node_config:
        if "site-id" not in node_config:
            raise ValueError("node config site-data needs site-id")
        return {ids[0]: read_site_npz(str(node_config["site-data"]), ids[0])}
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
    from fedsgld.flower.sites import evaluation_records

    config = _setup(msg)
    sid, s = _shard(config, context, msg)
    student = _new_model(
        config.student_model, tuple(s.x_train.shape[1:]), int(s.num_classes), config.hidden, 0
    )
    student.load_state_dict(msg.content["student"].to_torch_state_dict())
    probs = predict_proba(student, s.x_test).numpy().astype(np.float32)
    records = evaluation_records(sid, s.y_test.numpy(), {STUDENT: probs})
    return Message(RecordDict(records), reply_to=msg)


# -- the server side ----------------------------------------------------------------------


class PateSitesFailed(RuntimeError):
    """No site returned a usable vote histogram."""


def check_histogram(msg: Message, *, n_queries: int, num_classes: int, teachers: int):
    """(counts, accuracies) of a ``train.pate`` reply, or ValueError naming what is wrong."""
    if msg.has_error():
        raise ValueError(f"error reply: {str(msg.error.reason or '')[-500:]}")
    try:
        counts = msg.content["histogram"]["counts"].numpy()
        acc = json.loads(str(msg.content["teachers"]["accuracy"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed reply ({err})") from None
    if counts.shape != (n_queries, num_classes) or counts.dtype != np.int64:
        raise ValueError(
            f"counts are {counts.dtype}{counts.shape}, expected int64{(n_queries, num_classes)}"
        )
    if counts.min(initial=0) < 0 or np.any(counts.sum(axis=1) != teachers):
        raise ValueError(f"every row must be {teachers} non-negative votes (one per teacher)")
    if not isinstance(acc, list) or len(acc) not in (0, teachers):
        raise ValueError(f"expected {teachers} teacher accuracies, or none")
    return counts, [float(a) for a in acc]


def check_student_reply(msg: Message, *, n_test: int, num_classes: int):
    """(the site's report, its statistics, (probs, labels) or None) of an ``evaluate.pate``
    reply; ValueError (or KeyError) naming what is wrong."""
    c = msg.content
    report = json.loads(str(c["reports"]["json"]))[STUDENT]
    stats = check_stats(json.loads(str(c["stats"]["json"]))[STUDENT])
    if stats["n"] != n_test or not isinstance(report, dict):
        raise ValueError(f"statistics count {stats['n']} records, not n_test = {n_test}")
    if "labels" not in c:
        return report, stats, None
    p, y = c[f"pred-{STUDENT}"]["probs"].numpy(), c["labels"]["labels"].numpy()
    if p.shape != (n_test, num_classes) or y.shape != (n_test,) or not np.isfinite(p).all():
        raise ValueError(f"predictions have shapes {p.shape}, {y.shape}")
    return report, stats, (p, y)


def serve_pate(
    grid: Any, run_config: dict[str, Any], *, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run PATE over ``grid``: teachers at the sites, noisy labels, students, analysis."""
    from fedsgld.engine import new_run_dir
    from fedsgld.flower.protocol import split_flower_options
    from fedsgld.flower.runner import discover, exchange

    log = log or _log.info
    t0 = time.perf_counter()
    config = pate_config_from_run_config(run_config)
    opts = split_flower_options(run_config)
    out = Path(opts["out"]).expanduser() if opts["out"] else new_run_dir(tag="flower-pate")
    out = out.resolve()
    if (out / "results.json").exists():
        raise ValueError(f"output directory {str(out)!r} already holds a run; choose another out")
    if config.threads:
        torch.set_num_threads(config.threads)
    split = pate_split(config)  # the server's public queries
    k = split.num_classes
    rec = pate_record(config)
    sites = discover(
        grid,
        sites=config.sites,
        message=lambda n: Message(RecordDict({"pate": rec}), n, QUERY, group_id="pate"),
        entries=lambda r: [
            (int(e["site"]), e) for e in json.loads(str(r.content["sites"]["json"]))
        ],
        timeout=opts["wait-for-sites"],
        poll=opts["poll-interval"],
        log=log,
    )
    log("PATE sites: " + ", ".join(f"{s}@node {n}" for s, (n, _) in sites.items()))
    queries = ArrayRecord({"x": Array(split.x_query.numpy().astype(np.float32))})
    run_key = secrets.token_hex(8)  # names this run to the sites (their evaluations per run)

    def task(s: int) -> ConfigRecord:
        return ConfigRecord({"site-id": s, "run-key": run_key})

    msgs = [
        Message(
            RecordDict({"pate": rec, "task": task(s), "queries": queries}),
            node,
            TRAIN,
            group_id="pate",
        )  # fmt: skip
        for s, (node, _) in sites.items()
    ]
    replies = exchange(grid, msgs, timeout=opts["round-timeout"], poll=opts["poll-interval"])
    by_id = {m.metadata.message_id: s for m, s in zip(msgs, sites)}  # ids are set at push
    got = {by_id.get(r.metadata.reply_to_message_id): r for r in replies}
    histograms, teacher_acc, dropped = [], [], []
    vote_noise: dict[int, float] = {}  # the std of the noise each site added to its votes
    for s in sites:  # in site order
        try:
            if s not in got:
                raise ValueError(f"no reply within round-timeout {opts['round-timeout']:g} s")
            counts, acc = check_histogram(
                got[s], n_queries=config.queries, num_classes=k, teachers=config.teachers_per_site
            )
        except ValueError as err:
            dropped.append({"site": s, "reason": str(err)})
            log(f"site {s}: histogram dropped: {err}")
            continue
        histograms.append(counts)
        teacher_acc += acc
        vote_noise[s] = float(got[s].content["teachers"].get("vote-noise-std", 0.0))
        log(f"site {s}: {len(acc)} teachers' histogram in ({time.perf_counter() - t0:.1f}s)")
    if not histograms:
        raise PateSitesFailed("no site returned a usable vote histogram: " + "; ".join(
            f"site {d['site']}: {d['reason']}" for d in dropped
        ))  # fmt: skip
    voters = [s for s in sites if s not in {d["site"] for d in dropped}]

    def evaluate(student: torch.nn.Module):
        state = ArrayRecord(student.state_dict())
        ev = [
            Message(
                RecordDict({"pate": rec, "task": task(s), "student": state}),
                sites[s][0],
                EVALUATE,
                group_id="pate",
            )  # fmt: skip
            for s in sites
        ]
        res = exchange(grid, ev, timeout=opts["round-timeout"], poll=opts["poll-interval"])
        ids = {m.metadata.message_id: s for m, s in zip(ev, sites)}
        got: dict[int, tuple[dict, dict, tuple | None]] = {}
        for r in res:
            s = ids.get(r.metadata.reply_to_message_id)
            try:
                if s is None or r.has_error():
                    raise ValueError(str(r.error.reason or "")[-300:] if r.has_error() else "")
                got[s] = check_student_reply(r, n_test=sites[s][1]["n_test"], num_classes=k)
            except (KeyError, TypeError, ValueError) as err:
                log(f"site {s}: student evaluation dropped: {err}")
        if not got:
            raise PateSitesFailed("no site evaluated the student")
        order = sorted(got)
        shared = [got[s][2] for s in order]
        if all(p is not None for p in shared):  # every site shared its predictions
            pooled = calibration_report(*(np.concatenate(a) for a in zip(*shared)))
        else:
            pooled = report_from_stats([got[s][1] for s in order])
        return pooled, [{"site": s, **got[s][0]} for s in order]

    results = release_and_learn(
        config,
        counts=torch.from_numpy(np.sum(histograms, axis=0)),
        split=split,
        teacher_acc=teacher_acc,
        evaluate_student=evaluate,
        out_dir=out,
        log=log,
        t0=t0,
        engine="flower",
        sites_info=[
            {"site": s, "n_train": e["n_train"], "n_test": e["n_test"]}
            for s, (_, e) in sites.items()
        ],
        extra={
            "flower": {
                "nodes": {str(s): n for s, (n, _) in sites.items()},
                "voting_sites": voters,
                "site_vote_noise_std": {str(s): v for s, v in vote_noise.items()},
                "dropped_replies": dropped,
            }
        },
    )
    results["out_dir"] = str(out)
    return results


__all__ = [
    "EVALUATE",
    "QUERY",
    "STUDENT",
    "TRAIN",
    "check_histogram",
    "check_student_reply",
    "site_records",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "pate_config_from_run_config",
    "pate_record",
    "serve_pate",
]
