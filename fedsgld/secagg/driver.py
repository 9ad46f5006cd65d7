"""One whole round of secure aggregation with distributed noise, in one process.

:func:`run_round` is what a transport will do over the network: it plays the K
:class:`~fedsgld.secagg.protocol.SiteParty` objects and the
:class:`~fedsgld.secagg.server.ServerParty`, passing each step's messages along, and lets
sites drop at a chosen step (to test dropout recovery and the abort rule). It returns the
server's dequantised sum and the round's cost: the bytes each party sent and received
(:func:`message_bytes`) and the wall and CPU time of each step, summed over the parties (a deployment
runs the sites in parallel: divide the sites' share by K for its wall time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..privacy.distributed import DDGParameters
from .ddg import decode, encode
from .identity import Consortium, Credentials, ephemeral_credentials
from .plan import Mechanism
from .protocol import SecAggPlan, SiteParty
from .server import ServerParty

STEPS = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask")


def message_bytes(message: object) -> int:
    """Wire size of a message: its bytes payloads, plus 8 bytes for every int and dict key."""
    if isinstance(message, bytes | bytearray):
        return len(message)
    if isinstance(message, Mapping):
        return sum(8 + message_bytes(v) for v in message.values())
    if isinstance(message, list | tuple):
        return sum(message_bytes(v) for v in message)
    return 8


@dataclass
class RoundResult:
    """The server's output and the round's cost."""

    total: np.ndarray  # dequantised sum of the surviving sites' vectors, noise included
    survivors: tuple[int, ...]  # the sites whose input is in the sum (U3)
    sent: dict[int, int] = field(default_factory=dict)  # bytes sent by each site
    received: dict[int, int] = field(default_factory=dict)  # bytes received by each site
    seconds: dict[str, float] = field(default_factory=dict)  # per step, sites and server
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # the same in CPU time
    server: ServerParty | None = None  # its transcript: everything the server received

    @property
    def server_received(self) -> int:
        """Bytes the server received: everything the sites sent."""
        return sum(self.sent.values())

    @property
    def server_sent(self) -> int:
        """Bytes the server sent: everything the sites received."""
        return sum(self.received.values())


def check_site_plan(
    plan: SecAggPlan,
    params: DDGParameters,
    *,
    clip: float,
    noise_multiplier: float,
    sample_rate: float,
    prenoise: float,
    max_dropouts: int,
    max_colluders: int,
    peers: Consortium | None = None,
) -> None:
    """What a site checks before it takes part (its guard, with its policy's values):
    the round names only sites of its key list ``peers`` (the K it accounts with counts
    authenticated sites only), plans for at least the dropouts and colluders its policy
    assumes, the parameters match the plan, account for the clip it applies, and count on
    no more honest shares than the plan leaves, whose noise is at least
    ``noise_multiplier``; and the plan's :class:`~fedsgld.secagg.plan.Mechanism`, which
    every signature and mask of the round binds, is exactly the one the site computes and
    charges (``params``, sigma, ``sample_rate``, ``prenoise``): so every site whose keys
    are in the roster it accepted draws the same share (:mod:`.plan`). Raises
    ``ValueError`` naming the first mismatch."""
    k = len(plan.sites)
    m = plan.mechanism
    unknown = [] if peers is None else [v for v in plan.sites if v not in peers]
    checks = [
        (not unknown, f"the round names site(s) {unknown} outside the site's key list"),
        (plan.max_dropouts >= max_dropouts, f"max_dropouts {plan.max_dropouts} < the policy's {max_dropouts}"),
        (plan.max_colluders >= max_colluders, f"max_colluders {plan.max_colluders} < the policy's {max_colluders}"),
        # two disjoint groups of K - max_dropouts signers (colluders sign both) would let a
        # server unmask each group under its own survivor list: K must exceed 2d + c
        (k > 2 * plan.max_dropouts + plan.max_colluders,
         f"{k} sites are too few for {plan.max_dropouts} dropouts and {plan.max_colluders} "
         "colluders: two survivor lists could each gather enough signatures (needs K > "
         "2 max_dropouts + max_colluders)"),
        ((params.sites, params.dim, params.bits) == (k, plan.length, plan.bits),
         "the mechanism's sites, dimension or bits differ from the plan's"),
        (params.clip == clip, f"the mechanism's clip {params.clip} is not the clip applied, {clip}"),
        (params.honest <= k - plan.max_dropouts - plan.max_colluders,
         f"the mechanism counts on {params.honest} honest shares, more than the plan leaves"),
        (params.noise_multiplier >= noise_multiplier,
         f"the honest noise multiplier {params.noise_multiplier:.6g} < {noise_multiplier:.6g}"),
        (m is not None, "the plan binds no mechanism (sigma, clip, q, pre-noise, shares)"),
        (m is None or m.params == params,
         "the plan's distributed discrete Gaussian (grid, share variance, bits, dimension, "
         "sites) is not the one this site computes from the round's numbers"),
        (m is None or (m.noise_multiplier, m.sample_rate, m.prenoise)
         == (noise_multiplier, sample_rate, prenoise),
         "the plan's sigma, sample rate or pre-noise is not the request's"),
    ]  # fmt: skip
    for ok, why in checks:
        if not ok:
            raise ValueError(f"secure aggregation plan refused: {why}")


def _checked(
    vectors: Mapping[int, np.ndarray] | Sequence[np.ndarray],
    params: DDGParameters,
    drop: Mapping[int, str] | None,
    mechanism: Mechanism | None = None,
) -> tuple[dict[int, np.ndarray], int, dict[int, str]]:
    """``run_round``'s arguments checked: the vectors by site, their one length, the drops."""
    if mechanism is not None and mechanism.params != params:
        raise ValueError("the mechanism's parameters are not the round's params")
    if not isinstance(vectors, Mapping):
        vectors = dict(enumerate(vectors))
    lengths = {np.asarray(v).shape[0] for v in vectors.values()}
    if len(lengths) != 1:
        raise ValueError("all sites' vectors must have one length")
    if len(vectors) != params.sites:
        raise ValueError(f"{len(vectors)} vectors for parameters planned for {params.sites} sites")
    drop = dict(drop or {})
    for when in drop.values():
        if when not in STEPS:
            raise ValueError(f"drop step must be one of {STEPS}, got {when!r}")
    return dict(vectors), lengths.pop(), drop


def run_round(
    vectors: Mapping[int, np.ndarray] | Sequence[np.ndarray],
    params: DDGParameters,
    *,
    round_label: bytes,
    max_dropouts: int = 0,
    max_colluders: int = 0,
    neighbours: int = 0,
    one_shot: bool = False,
    workers: int = 1,
    drop: Mapping[int, str] | None = None,
    encoder: Callable[[int, np.ndarray, SecAggPlan], np.ndarray] | None = None,
    credentials: Mapping[int, Credentials] | None = None,
    mechanism: Mechanism | None = None,
) -> RoundResult:
    """Sum the sites' vectors under secure aggregation with distributed discrete Gaussian
    noise. ``vectors``: {site: S_k} (or a list, sites 0..K-1), all of one length.
    ``neighbours``: 0 for the complete graph, else the sparse neighbourhoods' k
    (:class:`~fedsgld.secagg.plan.SecAggPlan`). ``one_shot`` (max_dropouts = 0 only):
    ``advertise_keys`` and one ``masked_input`` that carries the roster, nothing else.
    ``workers`` > 1: the sites answer
    each step on that many threads, as deployed sites answer at once (each party touches
    only its own state; numpy, ChaCha20 and the OS's randomness release the GIL), the
    server's steps stay in order.
    ``drop``: {site: step} makes a site fall silent from that step of :data:`STEPS` on.
    ``encoder(site, vector, plan)``: the site's encoded contribution, called when the site
    answers the ``masked_input`` step (where a site checks the plan and charges its ledger
    before it draws its share); default :func:`~fedsgld.secagg.ddg.encode`.
    ``credentials``: {site: its long-term key and key list}; default fresh keys for every
    site (:func:`~fedsgld.secagg.identity.ephemeral_credentials`: one party plays them all).
    ``mechanism``: the round's :class:`~fedsgld.secagg.plan.Mechanism` (its ``params``
    are ``params``), bound into the plan's context; None: a bare masking plan, which a
    site's guard (``encoder``) refuses.
    Raises :class:`~fedsgld.secagg.protocol.RoundAborted` when more sites drop than planned.
    """
    vectors, length, drop = _checked(vectors, params, drop, mechanism)
    plan = SecAggPlan(
        round_label=round_label, sites=tuple(vectors), length=params.dim, bits=params.bits,
        max_dropouts=max_dropouts, max_colluders=max_colluders, neighbours=neighbours,
        one_shot=one_shot, mechanism=mechanism,
    )  # fmt: skip
    creds = credentials if credentials is not None else ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}

    def encoded(v: int) -> np.ndarray:
        vector = np.asarray(vectors[v], dtype=np.float64)
        if encoder is not None:
            return encoder(v, vector, plan)
        return encode(vector, params, round_label)

    steps = _Steps(plan, ServerParty(plan), drop)
    threaded = workers > 1 and len(plan.sites) > 1
    with ThreadPoolExecutor(workers) if threaded else contextlib.nullcontext() as pool:
        steps.pool = pool
        modular, survivors = steps.run(sites, encoded)
    res = steps.res
    res.total = steps.timed("decode (server)", decode, modular, params, round_label, length)
    res.survivors = tuple(survivors)
    return res


class _Steps:
    """The steps of one round in order (:data:`STEPS`): each asks the sites still answering
    (on the pool's threads, if any), counts the bytes each site sends and receives, and
    times the sites' part and the server's."""

    def __init__(self, plan: SecAggPlan, server: ServerParty, drop: Mapping[int, str]) -> None:
        self.plan, self.server, self.drop = plan, server, drop
        self.pool: ThreadPoolExecutor | None = None
        self.res = RoundResult(total=np.empty(0), survivors=(), server=server)
        self.res.sent = dict.fromkeys(plan.sites, 0)
        self.res.received = dict.fromkeys(plan.sites, 0)

    def live(self, name: str) -> list[int]:
        """The sites still answering at step ``name``."""
        drop = self.drop
        return [
            v for v in self.plan.sites if v not in drop or STEPS.index(drop[v]) > STEPS.index(name)
        ]

    def timed(self, name: str, fn: Callable, *args: object) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.res.seconds[name] = time.perf_counter() - t0
        self.res.cpu_seconds[name] = time.process_time() - c0
        return out

    def step(self, name: str, call: Callable[[int], object], deliver: Callable) -> Any:
        def ask() -> list:
            asked = self.live(name)
            pool = self.pool
            msgs = list(pool.map(call, asked)) if pool is not None else [call(v) for v in asked]
            for v, m in zip(asked, msgs, strict=True):
                self.res.sent[v] += message_bytes(m)
            return msgs

        return self.timed(name + " (server)", deliver, self.timed(name, ask))

    def broadcast(self, name: str, message: object) -> None:
        """The same message to every site still answering at step ``name``."""
        size = message_bytes(message)
        for v in self.live(name):
            self.res.received[v] += size

    def run(
        self, sites: Mapping[int, SiteParty], encoded: Callable[[int], np.ndarray]
    ) -> tuple[object, Sequence[int]]:
        """Every step; the server's modular sum and the survivors."""
        server, step, broadcast = self.server, self.step, self.broadcast
        roster = step("advertise_keys", lambda v: sites[v].advertise_keys(), server.collect_keys)
        if self.plan.one_shot:  # the roster comes with the request for the masked input
            broadcast("masked_input", roster)
            one_shot = lambda v: sites[v].one_shot_input(roster, lambda: encoded(v))  # noqa: E731
            return step("masked_input", one_shot, server.collect_one_shot), self.plan.sites
        broadcast("share_keys", roster)
        inbox = step("share_keys", lambda v: sites[v].share_keys(roster), server.route_shares)
        for v in self.live("masked_input"):
            self.res.received[v] += message_bytes(inbox.get(v, {}))
        masked = lambda v: sites[v].masked_input(inbox[v], encoded(v))  # noqa: E731
        announcement = step("masked_input", masked, server.collect_masked)
        broadcast("consistency", announcement)
        signed = step("consistency", lambda v: sites[v].consistency(announcement),
                      server.collect_signatures)  # fmt: skip
        broadcast("unmask", signed)
        modular = step("unmask", lambda v: sites[v].unmask(signed), server.finish)
        return modular, announcement["survivors"]
