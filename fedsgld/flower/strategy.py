"""SGD / DP-SGD / DP-SGLD as a Flower strategy around the core's server step.

:class:`LangevinStrategy` implements Flower's message-based ``Strategy`` interface
(``flwr.serverapp.strategy.Strategy``); the maths is :class:`LangevinServer`'s, which the
in-process engine drives too. The method (``sgd``, ``dpsgd``, ``dpsgld``) is the config's.

The round is the server's round mode's (:mod:`fedsgld.strategies.modes`): the ServerApp
(:mod:`fedsgld.flower.runner`) asks the server for the round's plan (step size alpha_t,
noise multiplier sigma_t, after the accountant's budget check), and the mode charges what
it must, asks the sites through the runner, and steps. Where the sites answer one train
message each (clipped sums, or parameters after local steps):

``configure_train``  one message per site: theta_t and the round's plan (``self.plan``);
    none without a plan (the run is over: ``halt_reason`` says why).
``aggregate_train``  checks every reply (:func:`fedsgld.flower.replies.check_train_reply`),
    drops bad and error replies with a logged reason, and keeps the rest by site id in
    ``self.answers`` for the mode's step (with server noise: the ledger is persisted, then
    theta <- theta - alpha_t ((sum_k S_k + sigma_t C xi) / L + lambda theta), with the
    noise xi from fedsgld's own generator keyed by (seed, round) and L = q sum_k N_k over
    ALL sites). A dropped site is as if none of its records had been sampled, so the
    accounting stays valid (for failures that do not depend on the site's records; a
    correct site cannot produce a reply the checks reject). If fewer sites than
    ``min_sites`` (default: every site) pass, the round raises :class:`TooFewSites`
    (:class:`AllSitesFailed` when none did) naming the round, the sites that answered and
    every other site's reason, instead of stepping on what is left.
``configure_evaluate`` / ``aggregate_evaluate``  test-split predictions of groups of
    parameter vectors (the last iterate; the posterior samples for Bayesian model
    averaging), per-site and pooled calibration reports.

Reply order and Flower's node ids change from run to run; sorting by site id and
per-site generators keyed by (seed, site, round) make a seeded run reproducible anyway.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsgld.core.plan import RoundPlan, TrainPlan
from fedsgld.flower.evaluation import EvalReply, decode_eval_reply, pool_evaluations
from fedsgld.flower.protocol import (
    EVALUATE,
    TRAIN,
    config_from_record,
    encode_evaluate,
    encode_train,
    pack_vector,
)
from fedsgld.flower.replies import (
    ReplyRejected,
    SiteEntry,
    check_train_reply,
    decode_array,
    source_node,
)
from fedsgld.run.evaluation import Evaluations
from fedsgld.strategies.server import LangevinServer


class TooFewSites(RuntimeError):
    """Fewer sites than ``min_sites`` answered a round; the round was not taken."""


class AllSitesFailed(TooFewSites):
    """Every site's reply in a round was missing or rejected; the round was not taken."""


@dataclass
class Drop:
    round: int
    kind: str  # "train" | "evaluate"
    site: int | None
    node_id: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "kind": self.kind,
            "site": self.site,
            "node_id": self.node_id,
            "reason": self.reason,
        }


class LangevinStrategy(Strategy):
    """A Flower strategy around the server's round mode (see module docs).

    ``directory`` maps site id to :class:`SiteEntry` (its node and public sizes); every
    site takes part in every round. ``run`` is the flat config that every message carries,
    so the sites build the same shards as the server (it holds nothing that decides the
    server's noise: the server's randomness never leaves it). ``run_key`` and ``epoch``
    number the requests, so a site can refuse a replayed round; a resumed run has a new
    epoch.
    """

    def __init__(
        self,
        server: LangevinServer,
        directory: dict[int, SiteEntry],
        run: ConfigRecord,
        *,
        log: Callable[[str], None] | None = None,
        run_key: str = "run",
        epoch: int = 0,
        min_sites: int = 0,
    ) -> None:
        if not directory:
            raise ValueError("LangevinStrategy needs at least one site")
        if not 0 <= min_sites <= len(directory):
            raise ValueError(
                f"min_sites must be in [0, {len(directory)}] (0: every site), got {min_sites}"
            )
        self.min_sites = min_sites or len(directory)
        self.server = server
        self.directory = dict(sorted(directory.items()))
        self.run = run
        self.run_key = run_key
        self.epoch = epoch
        self.log = log or logging.getLogger("fedsgld").info
        self.size = int(server.theta.numel())
        self.plan: RoundPlan | None = None
        self.answers: dict[int, torch.Tensor] = {}  # the last round's checked answers
        self.drops: list[Drop] = []
        self.last_train_sites: list[int] = []
        self.evaluation: Evaluations | None = None
        self._sent: list[tuple[Message, SiteEntry]] = []
        self._eval_groups: dict[str, list[int]] = {}

    # -- helpers ---------------------------------------------------------------------
    def _drop(self, rnd: int, kind: str, site: int | None, node: int | None, reason: str) -> None:
        d = Drop(rnd, kind, site, node, reason)
        self.drops.append(d)
        self.log(f"round {rnd}: dropped {kind} reply of site {site} (node {node}): {reason}")

    def _theta_bytes(self, arrays: ArrayRecord) -> bytes:
        nd = decode_array(arrays, "theta", size=self.size, dtype="float32")
        if not np.array_equal(nd, self.server.theta.numpy()):
            raise ValueError("configure_train: arrays['theta'] is not the server's current theta")
        return pack_vector(nd)

    # -- training --------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per site with theta_t and the round's plan (``self.plan``, charged
        by the round mode where the sites' releases must be counted before they run); none
        without a plan."""
        plan = self.plan
        if plan is None:
            return []
        theta = self._theta_bytes(arrays)
        # a node that hosts one site needs no site id: then every site gets the same plan
        # record, which a deployment moves to the SuperLink once per round, not per site
        nodes = [e.node_id for e in self.directory.values()]
        shared = len(set(nodes)) == len(nodes)
        msgs, sent = [], []
        run = config_from_record(self.run)
        for sid, entry in self.directory.items():
            content = encode_train(TrainPlan.of(plan, run_key=self.run_key, epoch=self.epoch,
                                                config=run, theta=theta,
                                                site_id=None if shared else sid))  # fmt: skip
            msgs.append(Message(content, entry.node_id, TRAIN, group_id=f"round-{plan.round}"))
            sent.append((msgs[-1], entry))
        self._sent = sent
        return msgs

    def _match(
        self,
        replies: Iterable[Message],
        rnd: int,
        kind: str,
        check: Callable[[Message, SiteEntry | None], Any],
    ) -> dict[int, Any]:
        """Run ``check`` on every reply against the instruction it answers (by message id);
        log and record each rejection and each site that did not answer."""
        # grids set message ids when they push, so they are read here, not at creation
        by_id = {m.metadata.message_id: e for m, e in self._sent}
        good: dict[int, Any] = {}
        seen: set[int] = set()
        for msg in replies:
            entry = by_id.get(msg.metadata.reply_to_message_id)
            if entry is not None and entry.site in seen:
                entry = None  # a second reply to the same instruction
            try:
                value = check(msg, entry)
            except ReplyRejected as err:
                # the node asked (an error reply the SuperLink makes names itself as source)
                node = entry.node_id if entry else source_node(msg)
                self._drop(rnd, kind, entry.site if entry else None, node, str(err))
            else:
                good[entry.site] = value
            if entry is not None:
                seen.add(entry.site)
        for _m, e in self._sent:
            if e.site not in seen:
                self._drop(rnd, kind, e.site, e.node_id, "no reply before the timeout")
        return good

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message], *, key: str = "sum"
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply (its answer under ``key``: "sum" or "theta"), keep the good ones
        by site id in ``self.answers``; fewer than ``min_sites`` raise :class:`TooFewSites`.
        The step is the round mode's; nothing is returned to aggregate."""
        plan = self.plan
        if plan is None:
            raise RuntimeError(
                "aggregate_train without a plan (configure_train returned no messages)"
            )
        good = self._match(
            replies,
            plan.round,
            "train",
            lambda m, e: check_train_reply(m, plan=plan, entry=e, size=self.size, key=key),
        )
        if len(good) < self.min_sites:
            self._too_few(plan, sorted(good))
        self.last_train_sites = sorted(good)
        self.answers = {k: good[k] for k in sorted(good)}
        metrics: dict[str, Any] = {
            "round": plan.round,
            "sites-ok": len(good),
            "sites-dropped": len(self.directory) - len(good),
            "step-size": plan.step_size,
            "sigma": plan.sigma,
        }
        return None, MetricRecord(metrics)

    def _too_few(self, plan: RoundPlan, answered: list[int]) -> None:
        """Fail the run: fewer than ``min_sites`` sites answered round ``plan.round``."""
        reasons = "; ".join(
            f"site {d.site}: {d.reason}"
            for d in self.drops
            if d.round == plan.round and d.kind == "train"
        )
        spent = self.server.mode.if_failed
        if not answered:
            raise AllSitesFailed(
                f"round {plan.round}: every site failed, so no step was taken and {spent} "
                f"({reasons})"
            )
        raise TooFewSites(
            f"round {plan.round}: {len(answered)} of {len(self.directory)} sites answered "
            f"(sites {answered}), fewer than min_sites = {self.min_sites}, so no step was "
            f"taken and {spent} ({reasons})"
        )

    # -- evaluation ------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """``arrays``: parameter vectors keyed "0", "1", ...; ``config["groups"]``: JSON
        ``{group: [keys]}`` (default: each vector its own group)."""
        groups = config.get("groups") if config else None
        if groups is None:
            groups = json.dumps({k: [int(k)] for k in arrays.keys()})
        self._eval_groups = json.loads(str(groups))
        msgs = []
        sent = []
        for sid, entry in self.directory.items():
            content = encode_evaluate(
                site_id=sid, run_key=self.run_key, groups=self._eval_groups, thetas=arrays,
                run=self.run,
            )  # fmt: skip
            msgs.append(Message(content, entry.node_id, EVALUATE, group_id=f"eval-{server_round}"))
            sent.append((msgs[-1], entry))
        self._sent = sent
        return msgs

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Per-site reports as the sites computed them. Pooled reports: when every site
        shared its predictions, over the concatenated predictions in site order (as the
        in-process engine computes them); otherwise from the sites' statistics
        (:mod:`fedsgld.calibration.pooling`: exact accuracy, NLL, Brier, ECE, MCE; no
        pooled SCE, ACE or AUC). The full result, one
        :class:`~fedsgld.run.evaluation.Evaluation` per group
        (:func:`~fedsgld.flower.evaluation.pool_evaluations`), is kept in
        ``self.evaluation``; the first group's pooled scalars are returned."""
        good: dict[int, EvalReply] = self._match(
            replies,
            server_round,
            "evaluate",
            lambda m, e: decode_eval_reply(m, e, self._eval_groups),
        )
        if not good:
            self.evaluation = None
            return None
        self.evaluation = pool_evaluations(good, self._eval_groups, asked=self.directory)
        first = self.evaluation[next(iter(self._eval_groups))].pooled
        scalars = {
            k: float(v)
            for k, v in first.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        return MetricRecord(scalars)

    def summary(self) -> None:
        s = self.server
        self.log(
            f"LangevinStrategy: method {s.privacy.method}, {len(self.directory)} sites, "
            f"expected batch L = {s.expected_batch:g}, {s.t} of {s.rounds} rounds taken"
        )


# SiteEntry, ReplyRejected and check_train_reply live in fedsgld.flower.replies; they stay
# importable from here (fedsgld.flower.runner imports SiteEntry from this module).
__all__ = [
    "AllSitesFailed",
    "Drop",
    "LangevinStrategy",
    "ReplyRejected",
    "SiteEntry",
    "TooFewSites",
    "check_train_reply",
]
