"""PATE's server over Flower: :func:`serve_pate` and its checks of the sites' replies.

The ServerApp runs :func:`serve_pate` for ``task = "pate"``: it finds the sites
(``query.pate``), sends them the public queries (``train.pate``), checks every vote
histogram (shape, dtype, counts >= 0, each row summing to the site's number of teachers;
:func:`check_histogram`) and drops a bad one with a logged reason, then releases noisy
labels and trains the students as in-process (:func:`fedsgld.pate.train.release_and_learn`),
each student evaluated at the sites (``evaluate.pate``, :func:`check_student_reply`). The
messages: :mod:`fedsgld.pate.flower`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedsgld.flower.evaluation import EvalReply, decode_eval_reply, pool_evaluations
from fedsgld.flower.exchange import discover, exchange
from fedsgld.flower.protocol import split_flower_options
from fedsgld.flower.replies import SiteEntry
from fedsgld.pate.config import PateConfig
from fedsgld.pate.data import pate_split
from fedsgld.pate.protocol import (
    EVALUATE,
    QUERY,
    STUDENT,
    TRAIN,
    PateTask,
    Votes,
    decode_sites,
    decode_votes,
    encode_evaluate,
    encode_query,
    encode_train,
    pate_config_from_run_config,
)
from fedsgld.pate.train import release_and_learn
from fedsgld.run.layout import new_run_dir

_log = logging.getLogger("fedsgld.pate")


class PateSitesFailed(RuntimeError):
    """No site returned a usable vote histogram."""


def check_histogram(msg: Message, *, n_queries: int, num_classes: int, teachers: int) -> Votes:
    """The checked :class:`~fedsgld.pate.protocol.Votes` of a ``train.pate`` reply, or
    ValueError naming what is wrong."""
    if msg.has_error():
        raise ValueError(f"error reply: {str(msg.error.reason or '')[-500:]}")
    try:
        got = decode_votes(msg.content)  # the reply's one decoding
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed reply ({err})") from None
    counts, acc = got.counts, list(got.accuracy)
    if counts.shape != (n_queries, num_classes) or counts.dtype != np.int64:
        raise ValueError(
            f"counts are {counts.dtype}{counts.shape}, expected int64{(n_queries, num_classes)}"
        )
    if counts.min(initial=0) < 0 or np.any(counts.sum(axis=1) != teachers):
        raise ValueError(f"every row must be {teachers} non-negative votes (one per teacher)")
    if len(acc) not in (0, teachers):
        raise ValueError(f"expected {teachers} teacher accuracies, or none")
    return got


def check_student_reply(
    msg: Message, *, site: int, node: int, entry: dict[str, Any], num_classes: int
) -> EvalReply:
    """The checked reply of an ``evaluate.pate`` message from ``site`` at ``node``
    (``entry``: its public sizes from discovery): the evaluate reply's one decoder,
    :func:`fedsgld.flower.evaluation.decode_eval_reply`, for the student's group;
    :class:`~fedsgld.flower.replies.ReplyRejected` (a ValueError) names what is wrong."""
    asked = SiteEntry(
        site=site,
        node_id=node,
        n_train=None if entry.get("n_train") is None else int(entry["n_train"]),
        n_test=None if entry.get("n_test") is None else int(entry["n_test"]),
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in entry.get("input_shape", ())),
    )
    return decode_eval_reply(msg, asked, [STUDENT])


def serve_pate(
    grid: Any, run_config: dict[str, Any], *, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run PATE over ``grid``: teachers at the sites, noisy labels, students, analysis."""
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
    ask = _Asker(grid, config, secrets.token_hex(8), opts)
    sites = discover(
        grid,
        sites=config.sites,
        message=lambda n: Message(encode_query(config), n, QUERY, group_id="pate"),
        entries=lambda r: [(e["site"], e) for e in decode_sites(r.content)],
        timeout=opts["wait-for-sites"],
        poll=opts["poll-interval"],
        log=log,
    )
    log("PATE sites: " + ", ".join(f"{s}@node {n}" for s, (n, _) in sites.items()))
    queries = split.x_query.numpy().astype(np.float32)
    got = dict(ask(sites, partial(encode_train, queries=queries), TRAIN))
    votes = _Votes.collect(got, sites, config, split.num_classes, opts, log, t0)
    results = release_and_learn(
        config,
        counts=torch.from_numpy(np.sum(votes.histograms, axis=0)),
        split=split,
        teacher_acc=votes.teacher_acc,
        evaluate_student=partial(_evaluate_student, ask, sites, split.num_classes, log),
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
                "voting_sites": [s for s in sites if s not in {d["site"] for d in votes.dropped}],
                "site_vote_noise_std": {str(s): v for s, v in votes.noise_std.items()},
                "dropped_replies": votes.dropped,
            }
        },
    )
    results["out_dir"] = str(out)
    return results


class _Asker:
    """Sends one PATE message to every site and gathers the replies by site."""

    def __init__(self, grid: Any, config: PateConfig, run_key: str, opts: dict[str, Any]):
        self.grid, self.config, self.opts = grid, config, opts
        self.run_key = run_key  # names this run to the sites (their evaluations per run)

    def __call__(
        self,
        sites: dict[int, tuple[int, Any]],
        encode: Callable[[PateTask], RecordDict],
        kind: str,
    ) -> list[tuple[int | None, Message]]:
        """Every reply to the ``kind`` request that ``encode`` writes for each site's task,
        and the site it answers (None: none asked), in the order they came."""
        msgs = [
            Message(encode(self.task(s)), node, kind, group_id="pate")
            for s, (node, _) in sites.items()
        ]
        replies = exchange(
            self.grid, msgs, timeout=self.opts["round-timeout"], poll=self.opts["poll-interval"]
        )
        by_id = {m.metadata.message_id: s for m, s in zip(msgs, sites)}  # ids are set at push
        return [(by_id.get(r.metadata.reply_to_message_id), r) for r in replies]

    def task(self, s: int) -> PateTask:
        return PateTask(self.config, s, self.run_key)


@dataclass
class _Votes:
    """The vote histograms that passed the checks, in site order, and what was dropped."""

    histograms: list[np.ndarray]
    teacher_acc: list[float]
    dropped: list[dict[str, Any]]
    noise_std: dict[int, float]  # the std of the noise each site added to its votes

    @classmethod
    def collect(cls, got, sites, config: PateConfig, k: int, opts, log, t0: float) -> _Votes:
        votes = cls([], [], [], {})
        for s in sites:  # in site order
            try:
                if s not in got:
                    raise ValueError(f"no reply within round-timeout {opts['round-timeout']:g} s")
                reply = check_histogram(
                    got[s], n_queries=config.queries, num_classes=k,
                    teachers=config.teachers_per_site,
                )  # fmt: skip
            except ValueError as err:
                votes.dropped.append({"site": s, "reason": str(err)})
                log(f"site {s}: histogram dropped: {err}")
                continue
            votes.histograms.append(reply.counts)
            votes.teacher_acc += list(reply.accuracy)
            votes.noise_std[s] = reply.noise_std
            log(
                f"site {s}: {len(reply.accuracy)} teachers' histogram in ({time.perf_counter() - t0:.1f}s)"
            )
        if not votes.histograms:
            raise PateSitesFailed("no site returned a usable vote histogram: " + "; ".join(
                f"site {d['site']}: {d['reason']}" for d in votes.dropped
            ))  # fmt: skip
        return votes


def _evaluate_student(
    ask: _Asker, sites: dict[int, tuple[int, Any]], k: int, log, student: torch.nn.Module
):
    """The student's evaluation at every site: (pooled report, per-site reports)."""
    res = ask(sites, partial(encode_evaluate, student=ArrayRecord(student.state_dict())), EVALUATE)
    got: dict[int, EvalReply] = {}
    for s, r in res:
        try:
            if s is None or r.has_error():
                raise ValueError(str(r.error.reason or "")[-300:] if r.has_error() else "")
            node, entry = sites[s]
            got[s] = check_student_reply(r, site=s, node=node, entry=entry, num_classes=k)
        except (KeyError, TypeError, ValueError) as err:
            log(f"site {s}: student evaluation dropped: {err}")
    if not got:
        raise PateSitesFailed("no site evaluated the student")
    # pooled over the predictions when every site shared them, else from the statistics
    pooled = pool_evaluations(got, [STUDENT], asked=sites)[STUDENT].pooled
    return pooled, [{"site": s, **got[s].reports[STUDENT]} for s in sorted(got)]


__all__ = ["PateSitesFailed", "check_histogram", "check_student_reply", "serve_pate"]
