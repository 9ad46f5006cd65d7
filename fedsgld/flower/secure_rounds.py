"""The ServerApp's side of a secure-aggregation round over Flower.

With ``secure_aggregation = true`` a training round is five exchanges of ``train.secagg``
messages (:mod:`fedsgld.flower.protocol`), one per protocol step, each site's protocol
message in its own record, the server's half played by
:class:`fedsgld.secagg.ServerParty`:

1. the server's plan (budget check) and the charge of the run's ledger, BEFORE any site
   draws its share (:meth:`~fedsgld.strategies.secure_sum.SecureSum.begin`: a round that
   then aborts stays counted), by the server's round mode, which then asks
   :meth:`SecureRounds.secure_sum` for the round's sum;
2. ``advertise_keys`` to every site, ``share_keys`` (the roster, each entry signed by its
   site) to those that answered, ``masked_input`` (each site's relayed ciphertexts and
   theta_t) to those, ``consistency`` (the survivors U3) to the survivors, ``unmask`` (U3
   and the survivors' signatures of it) to those that signed;
3. decode the modular sum; the round mode takes the Langevin step on it with no noise of
   the server's own (:meth:`~fedsgld.strategies.secure_sum.SecureSum.finish`).

**Pipelined rounds** (``secagg-pipeline = true``, the default): the ``consistency``
request of round t also asks each site to advertise its fresh keys for round t + 1
(``next_round``; the plan of round t + 1 is round t's with round t + 1's label), and the
site's consistency reply carries them (``next``). If every site of the plan sent them,
the ``unmask`` request of round t carries round t + 1's roster (``next_keys``), each site
checks every entry against its key list before any share leaves, and its unmask reply
carries its ``share_keys`` answer of round t + 1 (``next_shares``). Round t + 1 then
starts at ``masked_input``, three exchanges instead of five, when its plan is the one the
keys were signed for and every site of it sent its shares; otherwise (its bits changed
with sigma_t, a site missed a step, a resumed run) it starts with its own
``advertise_keys``, whose keys replace the early ones at the site. Nothing else moves:
the keys are fresh per round and bound to round t + 1's context by the site's
signature, and no step's checks are skipped. Within a round, ``masked_input``,
``consistency`` and ``unmask`` each need what the server collects in the step before
(the relayed shares, the survivor set, its signatures), and round t + 1's
``masked_input`` needs theta_{t+1}, which round t's unmask produces.

**One-shot rounds** (``secagg_one_shot``, the default, with ``max_dropouts = 0``;
:attr:`fedsgld.secagg.SecAggPlan.one_shot`): ``advertise_keys``, then one
``masked_input`` request that carries theta_t and the roster, answered by each site's
masked input (pairwise masks only); the server sums all K. Pipelined, that request also
asks for the keys of round t + 1 (``next_round``) and the replies carry them (``next``),
so round t + 1 is its ``masked_input`` exchange alone: one exchange a round, as a plain
round. With no dropouts planned a missing site aborts the round in the full protocol too,
so its shares, self-masks and consistency check would protect nothing.

**The pooled standardisation's round** (:meth:`SecureRounds.standardize_sum`, from
:mod:`fedsgld.flower.standardize`): the same steps, of kind ``standardize``, for the
sites' 2 d clipped moment sums (round 0 of the run's standardisation key, q = 1, no theta,
never pipelined); the caller has charged the run's ledger with its mechanism first.

A site that does not answer a step before ``round-timeout``, answers with an error (its
guard refused), or answers out of shape is a dropout from that step on, recorded in the
run's dropped replies. More dropouts than the plan's ``max_dropouts`` abort the round
(:class:`fedsgld.secagg.RoundAborted`, at the server, and every honest site refuses to
unmask such a round): nothing is released and the run stops with a checkpoint.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Message, RecordDict

from fedsgld.core.plan import RoundPlan, TrainPlan
from fedsgld.flower.protocol import SECAGG, config_from_record, pack_vector
from fedsgld.flower.replies import check_secagg_reply
from fedsgld.flower.secure_protocol import (
    SecureStep,
    encode_secure,
    secagg_label,
    standardize_label,
)
from fedsgld.flower.secure_requests import next_plan
from fedsgld.flower.strategy import LangevinStrategy
from fedsgld.privacy.distributed import DDGParameters
from fedsgld.secagg import Mechanism, SecAggPlan, ServerParty, decode, message_bytes

Send = Callable[[list[Message]], list[Message]]


@dataclass(frozen=True)
class _Round:
    """What one secure round sums and how it is asked for: its ``kind`` (``"train"``, or
    ``"standardize"``: the pooled standardisation's moment sums,
    :mod:`fedsgld.flower.standardize`), the public numbers of its instruction (``plan``),
    theta_t for ``masked_input`` (None: the sites sum no parameters), the bound on the
    sum's norm the bits are chosen for, the length of the decoded sum, and whether the
    next round's keys may be asked for with it (pipelining)."""

    kind: str
    plan: RoundPlan
    theta: bytes | None
    signal_norm: float
    length: int
    ahead: bool

    def extra(self) -> dict[str, Any]:
        """What ``masked_input`` carries besides the protocol message."""
        return {} if self.theta is None else {"theta": self.theta}


def _every_site(messages: list[dict[str, Any]], sp: SecAggPlan) -> bool:
    """Whether ``messages`` hold one answer from every site of ``sp``'s plan."""
    return sorted(int(m["site"]) for m in messages) == list(sp.sites)


class SecureRounds:
    """The secure-aggregation rounds of one Flower run (module docstring). ``send`` pushes
    one step's messages and returns the replies that came back in time."""

    def __init__(self, strategy: LangevinStrategy, send: Send, *, pipeline: bool = True) -> None:
        self.strategy, self.send, self.pipeline = strategy, send, pipeline
        self.server = strategy.server
        self.costs: list[dict[str, Any]] = []
        # the next round's server party (keys collected) and the sites' share_keys answers
        # of it, which came with this round's unmask; in one-shot rounds its party and
        # roster, which came with this round's masked inputs
        self.ahead: tuple[ServerParty, Any] | None = None

    def _message(
        self, r: _Round, sp: SecAggPlan, step: str, site: int, body: dict[str, Any],
        theta: bytes | None,
    ) -> RecordDict:  # fmt: skip
        strategy = self.strategy
        train = TrainPlan.of(r.plan, run_key=strategy.run_key, epoch=strategy.epoch,
                             config=config_from_record(strategy.run), theta=theta, site_id=site)  # fmt: skip
        return encode_secure(
            SecureStep(train, step, sp, signal_norm=r.signal_norm, message=body, kind=r.kind)
        )

    def _step(
        self,
        r: _Round,
        sp: SecAggPlan,
        step: str,
        sites: list[int],
        payload: Callable[[int], dict[str, Any]],
        cost: dict[str, Any],
        extra: dict[str, Any] | None = None,
        *,
        ahead: bool = False,
    ) -> list[dict[str, Any]]:
        """Send ``step`` to ``sites``; the well-formed protocol messages that came back (the
        strategy's reply matching: a rejected or missing reply is a logged dropout).
        ``ahead``: an unmask request that asks for the next round's keys as well."""
        strategy, plan = self.strategy, r.plan
        sent = []
        for v in sites:
            body = payload(v)
            content = self._message(r, sp, step, v, body, (extra or {}).get("theta"))
            entry = strategy.directory[v]
            sent.append((Message(content, entry.node_id, SECAGG,
                                 group_id=f"secagg-{plan.round}-{step}"), entry))  # fmt: skip
            cost["server_sent"] += message_bytes(body) + message_bytes(extra or {})
        t0 = time.perf_counter()
        replies = self.send([m for m, _ in sent])
        cost["seconds"][step] = time.perf_counter() - t0
        strategy._sent = sent  # what _match pairs the replies with (ids set by the push)
        good = strategy._match(
            replies,
            plan.round,
            f"secagg {step}",
            lambda m, e: check_secagg_reply(m, entry=e, step=step, ahead=ahead),
        )
        cost["server_received"] += sum(message_bytes(m) for m in good.values())
        return [good[v] for v in sorted(good)]

    def secure_sum(self, plan: RoundPlan, params: DDGParameters) -> torch.Tensor:
        """The decoded secure sum of round ``plan`` (its ledger charged already, for the
        round's distributed discrete Gaussian ``params``)."""
        server, strategy = self.server, self.strategy
        r = _Round("train", plan, pack_vector(server.theta), server.mode.signal_norm,
                   int(server.theta.shape[0]), self.pipeline and plan.round + 1 < server.rounds)  # fmt: skip
        label = secagg_label(strategy.run_key, strategy.epoch, plan.round)
        total, survivors = self._round(r, label, params, server.mode.mechanism(plan, params))
        strategy.last_train_sites = survivors
        return total

    def standardize_sum(
        self, mechanism: Mechanism, *, length: int
    ) -> tuple[torch.Tensor, list[int]]:
        """The pooled standardisation's secure round (:mod:`fedsgld.flower.standardize`):
        the decoded sum of the sites' ``length`` clipped moment sums, with its
        distributed discrete Gaussian noise, and the sites it sums (the survivors). Its
        ``mechanism`` (sigma, clip sqrt(2 d), q = 1, no pre-noise) is charged to the run's
        ledger already; never pipelined, no theta."""
        m = mechanism
        plan = RoundPlan(round=0, step_size=0.0, sigma=m.noise_multiplier, sample_rate=1.0,
                         clip=m.params.clip, prenoise=0.0)  # fmt: skip
        r = _Round("standardize", plan, None, m.signal_norm, length, ahead=False)
        label = standardize_label(self.strategy.run_key, self.strategy.epoch)
        return self._round(r, label, m.params, m)

    def _round(
        self, r: _Round, label: bytes, params: DDGParameters, mechanism: Mechanism
    ) -> tuple[torch.Tensor, list[int]]:
        """One secure round of ``r``: its decoded sum and its survivors."""
        p = self.server.privacy
        sp = SecAggPlan(
            round_label=label, sites=tuple(self.strategy.directory), length=params.dim,
            bits=params.bits, max_dropouts=p.max_dropouts, max_colluders=p.max_colluders,
            neighbours=p.secagg_neighbours, one_shot=p.one_shot_rounds,
            mechanism=mechanism,  # what every signature binds
        )  # fmt: skip
        cost: dict[str, Any] = {"round": r.plan.round, "seconds": {}, "server_sent": 0,
                                "server_received": 0}  # fmt: skip
        if r.kind != "train":
            cost["kind"] = r.kind
        t0 = time.perf_counter()
        if sp.one_shot:
            return self._one_shot(r, sp, params, cost, t0)
        early = self._early(sp)
        if early is None:
            party, roster = self._advertise(r, sp, cost)
            got = self._step(r, sp, "share_keys", sorted(roster["keys"]), lambda v: roster,
                             cost)  # fmt: skip
        else:  # keys and shares came with the last round's consistency and unmask
            party, got = early
            cost["seconds"].update(advertise_keys=0.0, share_keys=0.0)
            cost["pipelined"] = True
        inbox = party.route_shares(got)
        got = self._step(r, sp, "masked_input", sorted(inbox), inbox.__getitem__, cost, r.extra())
        announcement = party.collect_masked(got)
        survivors = list(announcement["survivors"])
        rnd = r.plan.round
        ask = {**announcement, "next_round": rnd + 1} if r.ahead else announcement
        got = self._step(r, sp, "consistency", survivors, lambda v: ask, cost, ahead=r.ahead)
        keys = [m.pop("next") for m in got] if r.ahead else []
        signed = party.collect_signatures(got)
        nxt = self._next_party(sp, rnd + 1, keys)
        ask = {**signed, "next_keys": nxt[1]["keys"]} if nxt else signed
        got = self._step(r, sp, "unmask", sorted(signed["signatures"]), lambda v: ask, cost,
                         ahead=nxt is not None)  # fmt: skip
        if nxt is not None:  # round t + 1's shares, relayed at its masked_input
            self.ahead = (nxt[0], [m.pop("next_shares") for m in got])
        return self._finish(r, sp, params, party.finish(got), survivors, cost, t0)

    def _advertise(
        self, r: _Round, sp: SecAggPlan, cost: dict[str, Any]
    ) -> tuple[ServerParty, dict[str, Any]]:
        """A fresh server party of ``sp`` and the roster of the keys its sites advertise."""
        party = ServerParty(sp)
        got = self._step(r, sp, "advertise_keys", list(sp.sites), lambda v: {}, cost)
        return party, party.collect_keys(got)

    def _finish(
        self, r: _Round, sp: SecAggPlan, params: DDGParameters, modular: Any,
        survivors: list[int], cost: dict[str, Any], t0: float,
    ) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """The round's decoded sum and survivors, its cost recorded."""
        total = decode(modular, params, sp.round_label, r.length)
        cost["seconds"]["round"] = time.perf_counter() - t0
        cost["survivors"] = survivors
        self.costs.append(cost)
        return torch.from_numpy(total), survivors

    def _one_shot(
        self, r: _Round, sp: SecAggPlan, params: DDGParameters, cost: dict[str, Any],
        t0: float,
    ) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """A one-shot round (no dropouts planned: :attr:`SecAggPlan.one_shot`): the roster
        comes with the request for the masked inputs, and every site's reply is the whole
        round. Pipelined, that request also asks for each site's keys of round t + 1 (its
        reply carries them: ``next``), so round t + 1 is this one exchange alone."""
        early, self.ahead = self.ahead, None
        if early is not None and early[0].plan == sp:  # keys from the last round's inputs
            party, roster = early
            cost["seconds"]["advertise_keys"] = 0.0
            cost["pipelined"] = True
        else:
            party, roster = self._advertise(r, sp, cost)
        rnd = r.plan.round
        ask = {"keys": roster["keys"], **({"next_round": rnd + 1} if r.ahead else {})}
        got = self._step(r, sp, "masked_input", list(sp.sites), lambda v: ask, cost, r.extra(),
                         ahead=r.ahead)  # fmt: skip
        keys = [m.pop("next") for m in got] if r.ahead else []
        modular = party.collect_one_shot(got)
        self.ahead = self._next_party(sp, rnd + 1, keys)  # every site's, or None
        return self._finish(r, sp, params, modular, list(sp.sites), cost, t0)

    def _next_party(
        self, sp: SecAggPlan, rnd: int, keys: list[dict[str, Any]]
    ) -> tuple[ServerParty, dict[str, Any]] | None:
        """Round ``rnd``'s server party and roster from the keys its sites advertised with
        this round's consistency step (signed for this round's plan with round ``rnd``'s
        label and sigma: :func:`~fedsgld.flower.secure_requests.next_plan`), if every
        site of the plan advertised; else None (round ``rnd`` then
        starts with its own ``advertise_keys``)."""
        if not _every_site(keys, sp):
            return None
        label = secagg_label(self.strategy.run_key, self.strategy.epoch, rnd)
        party = ServerParty(next_plan(sp, label, self.server.privacy.sigma(rnd)))
        return party, party.collect_keys(keys)

    def _early(self, sp: SecAggPlan) -> tuple[ServerParty, list[dict[str, Any]]] | None:
        """The party of the round of ``sp`` and its ``share_keys`` answers, sent with the
        last round's unmask, if the party's plan is exactly ``sp`` and every site of its
        roster answered; else None."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0].plan != sp:
            return None
        party, shares = ahead
        return (party, shares) if _every_site(shares, sp) else None

    def summary(self) -> dict[str, Any]:
        """results.json's ``flower.secure_aggregation``: the rounds' median cost."""
        if not self.costs:
            return {"rounds": 0}
        med = statistics.median
        steps = sorted({k for c in self.costs for k in c["seconds"]})
        return {
            "rounds": len(self.costs),
            "median_seconds": {k: med(c["seconds"].get(k, 0.0) for c in self.costs) for k in steps},
            "median_server_sent_bytes": med(c["server_sent"] for c in self.costs),
            "median_server_received_bytes": med(c["server_received"] for c in self.costs),
            "pipelined_rounds": sum(bool(c.get("pipelined")) for c in self.costs),
            "bytes": "protocol messages and theta_t (message_bytes), not Flower's framing",
        }
