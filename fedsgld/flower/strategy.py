"""SGD / DP-SGD / DP-SGLD as a Flower strategy around the core's server step.

:class:`LangevinStrategy` implements Flower's message-based ``Strategy`` interface
(``flwr.serverapp.strategy.Strategy``); the maths is :class:`LangevinServer`'s, which the
in-process engine drives too. The method (``sgd``, ``dpsgd``, ``dpsgld``) is the config's.

``configure_train``  asks the server for the round's plan (step size alpha_t, noise
    multiplier sigma_t, after the accountant's budget check). No plan means the run is
    over (``halt_reason`` says why: rounds done, or the budget would be overspent) and no
    messages are sent. Otherwise one message per site: theta_t and the plan.
``aggregate_train``  checks every reply (:func:`check_train_reply`), drops bad and error
    replies with a logged reason, orders the rest by site id and calls
    ``LangevinServer.apply``: the ledger is persisted, then
    theta <- theta - alpha_t ((sum_k S_k + sigma_t C xi) / L + lambda theta), with the
    noise xi from fedsgld's own generator keyed by (seed, round) and L = q sum_k N_k over
    ALL sites. A dropped site is as if none of its records had been sampled, so the
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
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsgld.calibration.pooling import check_stats
from fedsgld.flower.protocol import EVALUATE, TRAIN, pack_vector, plan_record, unpack_vector
from fedsgld.strategies.server import LangevinServer, RoundPlan

NORM_SLACK = 1e-3  # relative float slack on the bound ||S_k|| <= N_k C


class TooFewSites(RuntimeError):
    """Fewer sites than ``min_sites`` answered a round; the round was not taken."""


class AllSitesFailed(TooFewSites):
    """Every site's reply in a round was missing or rejected; the round was not taken."""


class ReplyRejected(ValueError):
    """A reply failed a check; the message says which."""


@dataclass(frozen=True)
class SiteEntry:
    """Where a site lives and what is public about it."""

    site: int
    node_id: int
    n_train: int
    n_test: int
    num_classes: int
    input_shape: tuple[int, ...]
    label_histogram: list[int] | None = None  # only if the site's policy shares it


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


def _src(msg: Message) -> int | None:
    try:
        return int(msg.metadata.src_node_id)
    except Exception:  # noqa: BLE001 - a malformed reply must not stop the round
        return None


def _decode_vector(rec: Any, key: str, *, size: int | tuple[int, ...], dtype: str) -> np.ndarray:
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


def _site_id_of(msg: Message) -> int:
    meta = msg.content.get("meta") if msg.has_content() else None
    if not isinstance(meta, MetricRecord):
        raise ReplyRejected("no MetricRecord 'meta'")
    sid = meta.get("site-id")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ReplyRejected(f"meta['site-id'] is {sid!r}, expected an integer")
    return sid


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
    fields = sorted(rec.keys())
    if fields != sorted([key, "round", "site-id"]):
        raise ReplyRejected(
            f"record {key!r} has {fields}, expected {sorted([key, 'round', 'site-id'])}"
        )
    sid, rnd = rec.get("site-id"), rec.get("round")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise ReplyRejected(f"{key}['site-id'] is {sid!r}, expected an integer")
    node = _src(msg)
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


class LangevinStrategy(Strategy):
    """A Flower strategy whose aggregation is ``LangevinServer.apply`` (see module docs).

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
        self.drops: list[Drop] = []
        self.last_train_sites: list[int] = []
        self.evaluation: dict[str, dict[str, Any]] | None = None
        self._sent: list[tuple[Message, SiteEntry]] = []
        self._eval_groups: dict[str, list[int]] = {}

    # -- helpers ---------------------------------------------------------------------
    def _drop(self, rnd: int, kind: str, site: int | None, node: int | None, reason: str) -> None:
        d = Drop(rnd, kind, site, node, reason)
        self.drops.append(d)
        self.log(f"round {rnd}: dropped {kind} reply of site {site} (node {node}): {reason}")

    def _theta_bytes(self, arrays: ArrayRecord) -> bytes:
        nd = _decode_vector(arrays, "theta", size=self.size, dtype="float32")
        if not np.array_equal(nd, self.server.theta.numpy()):
            raise ValueError("configure_train: arrays['theta'] is not the server's current theta")
        return pack_vector(nd)

    # -- training --------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per site with theta_t and the round's plan; none once the run is over."""
        self.plan = plan = self.server.plan()
        if plan is None:
            return []
        theta = self._theta_bytes(arrays)
        if self.server.local:
            # noise at the sites: their releases are counted before any site runs
            self.server.begin_local_round(plan)
        # a node that hosts one site needs no site id: then every site gets the same plan
        # record, which a deployment moves to the SuperLink once per round, not per site
        nodes = [e.node_id for e in self.directory.values()]
        shared = len(set(nodes)) == len(nodes)
        msgs, sent = [], []
        for sid, entry in self.directory.items():
            rec: dict[str, Any] = {} if shared else {"site-id": sid}
            rec |= {
                "round": plan.round,
                "epoch": self.epoch,
                "run-key": self.run_key,
                "sample-rate": plan.sample_rate,
                "sigma": plan.sigma,
                "prenoise": plan.prenoise,
            }
            if plan.clip is not None:
                rec["clip"] = plan.clip
            if self.server.local:
                rec["local-steps"] = plan.local_steps
                rec["first-step"] = plan.first_step
            for k, v in (config or {}).items():
                rec.setdefault(k, v)
            rec["theta"] = theta
            content = RecordDict({"plan": plan_record(rec, self.run)})
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
                self._drop(rnd, kind, entry.site if entry else None, _src(msg), str(err))
            else:
                good[entry.site] = value
            if entry is not None:
                seen.add(entry.site)
        for _m, e in self._sent:
            if e.site not in seen:
                self._drop(rnd, kind, e.site, e.node_id, "no reply before the timeout")
        return good

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check, order by site id, and take the Langevin step on the sum of what passed."""
        plan = self.plan
        if plan is None:
            raise RuntimeError(
                "aggregate_train without a plan (configure_train returned no messages)"
            )
        good = self._match(
            replies,
            plan.round,
            "train",
            lambda m, e: check_train_reply(
                m, plan=plan, entry=e, size=self.size, key="theta" if self.server.local else "sum"
            ),
        )
        if len(good) < self.min_sites:
            self._too_few(plan, sorted(good))
        self.last_train_sites = sorted(good)
        if self.server.local:
            self.server.finish_local_round(
                plan, [(self.directory[k].n_train, good[k]) for k in sorted(good)]
            )
        else:
            self.server.apply(plan, [good[k] for k in sorted(good)])
        metrics: dict[str, Any] = {
            "round": plan.round,
            "sites-ok": len(good),
            "sites-dropped": len(self.directory) - len(good),
            "step-size": plan.step_size,
            "sigma": plan.sigma,
        }
        if self.server.accountant is not None:
            metrics["epsilon"] = self.server.accountant.rigorous_epsilon()
        return ArrayRecord({"theta": Array(self.server.theta.numpy())}), MetricRecord(metrics)

    def _too_few(self, plan: RoundPlan, answered: list[int]) -> None:
        """Fail the run: fewer than ``min_sites`` sites answered round ``plan.round``."""
        reasons = "; ".join(
            f"site {d.site}: {d.reason}"
            for d in self.drops
            if d.round == plan.round and d.kind == "train"
        )
        spent = (
            "its local steps stay counted in the ledger"
            if self.server.local
            else "no privacy was spent"
        )
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
        for sid, entry in self.directory.items():
            rec = ConfigRecord({"site-id": sid, "groups": str(groups), "run-key": self.run_key})
            content = RecordDict({"thetas": arrays, "eval": rec, "run": self.run})
            msgs.append(Message(content, entry.node_id, EVALUATE, group_id=f"eval-{server_round}"))
        self._sent = [(m, self.directory[int(m.content["eval"]["site-id"])]) for m in msgs]
        return msgs

    def _check_eval_reply(self, msg: Message, entry: SiteEntry | None) -> dict[str, Any]:
        if entry is None:
            raise ReplyRejected("the reply answers no instruction of this evaluation")
        if msg.has_error():
            raise ReplyRejected(
                f"error reply (code {msg.error.code}): {str(msg.error.reason or '')[-500:]}"
            )
        if not msg.has_content():
            raise ReplyRejected("reply has no content")
        private = sorted(["meta", "reports", "stats"])
        shared = sorted(
            ["labels", "meta", "reports", "stats", *(f"pred-{g}" for g in self._eval_groups)]
        )
        keys = sorted(msg.content.keys())
        if keys not in (private, shared):
            raise ReplyRejected(f"reply records {keys}, expected {private} or {shared}")
        sid, node = _site_id_of(msg), _src(msg)
        if sid != entry.site or node != entry.node_id:
            raise ReplyRejected(
                f"reply names site {sid} from node {node}; node {entry.node_id} was asked for site {entry.site}"
            )
        labels = None
        if keys == shared:
            labels = _decode_vector(
                msg.content["labels"], "labels", size=entry.n_test, dtype="int64"
            )
            if labels.size and (labels.min() < 0 or labels.max() >= entry.num_classes):
                raise ReplyRejected("labels out of range")
        st = msg.content["stats"]
        if not isinstance(st, ConfigRecord) or not isinstance(st.get("json"), str):
            raise ReplyRejected("stats is not a ConfigRecord with a 'json' string")
        try:
            stats = json.loads(st["json"])
            if not isinstance(stats, dict) or sorted(stats) != sorted(self._eval_groups):
                raise ValueError("statistics do not cover the requested groups")
            for g in self._eval_groups:
                check_stats(stats[g])
                if stats[g]["n"] != entry.n_test:
                    raise ValueError(f"statistics count {stats[g]['n']} records, not n_test")
        except ValueError as err:
            raise ReplyRejected(f"bad statistics: {err}") from None
        rep = msg.content["reports"]
        if not isinstance(rep, ConfigRecord) or not isinstance(rep.get("json"), str):
            raise ReplyRejected("reports is not a ConfigRecord with a 'json' string")
        try:
            reports = json.loads(rep["json"])
        except ValueError as err:
            raise ReplyRejected(f"reports do not parse: {err}") from None
        if not isinstance(reports, dict) or sorted(reports) != sorted(self._eval_groups):
            raise ReplyRejected("reports do not cover the requested groups")
        out: dict[str, Any] = {"labels": labels, "reports": reports, "stats": stats, "probs": {}}
        for g in self._eval_groups if labels is not None else ():
            p = _decode_vector(
                msg.content[f"pred-{g}"],
                "probs",
                size=(entry.n_test, entry.num_classes),
                dtype="float32",
            )
            if not np.isfinite(p).all():
                raise ReplyRejected(f"predictions of group {g!r} are not finite")
            out["probs"][g] = p
        return out

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Per-site reports as the sites computed them. Pooled reports: when every site
        shared its predictions, over the concatenated predictions in site order (as the
        in-process engine computes them); otherwise from the sites' statistics
        (:mod:`fedsgld.calibration.pooling`: exact accuracy, NLL, Brier, ECE, MCE; no
        pooled SCE, ACE or AUC). The full result is kept in ``self.evaluation``; the first
        group's pooled scalars are returned."""
        from fedsgld.calibration import calibration_report
        from fedsgld.calibration.pooling import reliability_from_stats, report_from_stats

        good: dict[int, dict[str, Any]] = self._match(
            replies, server_round, "evaluate", self._check_eval_reply
        )
        if not good:
            self.evaluation = None
            return None
        order = sorted(good)
        all_shared = all(good[k]["labels"] is not None for k in order)
        labels = (
            torch.cat([torch.from_numpy(good[k]["labels"]) for k in order]) if all_shared else None
        )
        self.evaluation = {}
        for g in self._eval_groups:
            stats = [good[k]["stats"][g] for k in order]
            ev: dict[str, Any] = {
                "sites": {str(k): good[k]["reports"][g] for k in order},
                "_missing_sites": sorted(set(self.directory) - set(good)),
                "_pooled_from": "predictions" if all_shared else "site statistics",
                "_reliability": reliability_from_stats(stats),
            }
            if all_shared:
                probs = torch.cat([torch.from_numpy(good[k]["probs"][g]) for k in order])
                ev["pooled"] = calibration_report(probs.numpy(), labels.numpy())
                ev["_probs"], ev["_labels"] = probs, labels
                ev["_site_probs"] = {
                    k: (torch.from_numpy(good[k]["probs"][g]), torch.from_numpy(good[k]["labels"]))
                    for k in order
                }
            else:
                ev["pooled"] = report_from_stats(stats)
                ev["_probs"] = ev["_labels"] = None
                ev["_site_probs"] = {}
            self.evaluation[g] = ev
        first = self.evaluation[next(iter(self._eval_groups))]["pooled"]
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
