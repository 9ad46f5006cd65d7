"""How the ServerApp exchanges messages with the sites over any Flower ``Grid``.

:func:`exchange` pushes one batch of messages and polls for their replies (paced by a
:class:`ReplyPacer` on a deployment; in :func:`waves` where a node hosts several sites);
:func:`discover` asks every connected node which sites it hosts. The training round loop
(:mod:`fedsgld.flower.runner`), secure-aggregation rounds
(:mod:`fedsgld.flower.secure_rounds`) and PATE's server use them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

DISCOVERY_POLL_S = 0.5
FIRST_POLL_S = 0.002  # an unpaced exchange looks again after this, then backs off to ``poll``


class SitesUnavailable(RuntimeError):
    """Not every site had a connected node before ``wait-for-sites`` ran out."""


class ReplyPacer:
    """When the server first looks for a round's replies.

    A round's replies cannot come before every site has received its message, run its
    task and answered; rounds are regular. So the first poll after a push waits
    :data:`PREDICT` times the shortest of the last three complete exchanges, less one poll
    interval, and only then does the server poll every ``poll`` seconds. Two exchanges
    must be known first: the first round of a run is slow (sites start their processes, a
    stock SuperNode's first tasks run cold) and alone would make the next round wait most
    of its time. An exchange is timed from the end of the push, so a grid that answers
    while pushing (``LocalGrid``) never waits. When every reply is already in at the first
    look after a wait, the wait was too long by an unknown amount: the pacer forgets, and
    the next exchange polls from the start (a paced wait must not keep rounds long: on
    Flower's stock SuperNode, which pulls every 3 s, a late look makes the sites miss
    their next pull). On a deployment every poll is a request to the SuperLink, which
    shares the machines with the sites: this cuts the requests per round several-fold, at
    the cost of one late first look when rounds get shorter."""

    PREDICT = 0.7

    def __init__(self) -> None:
        self.recent: list[float] = []

    def first_wait(self, poll: float) -> float:
        """Seconds to wait before the first poll: one ``poll`` interval less than the
        prediction (a poll may land just before the replies, and the next one comes a
        whole interval later), and none when that saves no poll."""
        if len(self.recent) < 2:  # one slow first round is no rule
            return 0.0
        return max(0.0, self.PREDICT * min(self.recent) - poll)

    def record(self, seconds: float) -> None:
        self.recent = [*self.recent[-2:], seconds]

    def forget(self) -> None:
        self.recent = []


def polls_are_requests(grid: Grid) -> bool:
    """Whether each poll of ``grid`` is a request to a SuperLink (a deployment's
    ``HttpGrid``): only then does :class:`ReplyPacer` pace the polls. Flower's simulation
    polls in process, and sleeping there delays the simulation itself (Ray rounds took
    twice as long)."""
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
    except ImportError:  # another flwr layout: no pacing
        return False
    return isinstance(grid, HttpGrid)


def waves(messages: list[Message]) -> list[list[Message]]:
    """``messages`` in waves with at most one message per node each, in order. A node that
    hosts several sites answers their messages one after the other: Flower's simulation
    may run two messages of one node at once, each on its own copy of the node's
    ``context.state``, and keep only the copy returned last, which would lose the other
    site's ledger update or secure-aggregation state."""
    out: list[list[Message]] = []
    for m in messages:
        node = m.metadata.dst_node_id
        wave = next((w for w in out if all(x.metadata.dst_node_id != node for x in w)), None)
        if wave is None:
            out.append(wave := [])
        wave.append(m)
    return out


def exchange(
    grid: Grid,
    messages: list[Message],
    *,
    timeout: float,
    poll: float,
    pacer: ReplyPacer | None = None,
) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` s have passed.

    The same as ``Grid.send_and_receive`` but polling every ``poll`` seconds at most:
    Flower's deployment grid sleeps 3 s between polls, a large share of a round on
    loopback. With a ``pacer`` (a deployment, where each poll is a request), the first poll
    waits as it says, then every ``poll`` seconds, and a complete exchange is recorded.
    Without one (a simulation, where a poll is a look in memory), replies are taken as
    they arrive: the next look comes :data:`FIRST_POLL_S` after a look that found a reply,
    and the wait doubles after each look that found none, up to ``poll`` (no busy loop:
    a few looks per reply, at most about log2(poll / FIRST_POLL_S) + 1 per quiet stretch).
    Messages to a node that hosts several sites go in :func:`waves`, each with its own
    ``timeout``.
    """
    split = waves(messages)
    if len(split) > 1:
        return [r for w in split for r in exchange(grid, w, timeout=timeout, poll=poll)]
    ids = set(grid.push_messages(messages))
    start = time.monotonic()  # after the push: a grid that answers while pushing waits 0
    deadline = start + timeout
    replies: list[Message] = []
    waited = 0.0
    if pacer is not None and ids:
        waited = max(0.0, min(pacer.first_wait(poll), deadline - time.monotonic()))
        time.sleep(waited)
    first_look = True
    wait = poll if pacer is not None else min(FIRST_POLL_S, poll)
    while ids:
        got = list(grid.pull_messages(ids))
        replies.extend(got)
        ids.difference_update(m.metadata.reply_to_message_id for m in got)
        if not ids or time.monotonic() >= deadline:
            break
        first_look = False
        time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        if pacer is None:
            wait = min(FIRST_POLL_S, poll) if got else min(2 * wait, poll)
    if pacer is not None and not ids:
        if waited > 0 and first_look:
            # every reply was in at the first look: the wait was too long by an unknown
            # amount (rounds got shorter), so the next exchange is not paced and measures
            pacer.forget()
        else:
            pacer.record(time.monotonic() - start)
    return replies


def asked_node(reply: Message, sent: list[Message]) -> int:
    """The node that ``reply`` answers for: the one its message was sent to. An error
    reply the SuperLink makes itself (a node that stopped sending heartbeats) names the
    SuperLink as its source, not the node."""
    for m in sent:
        if m.metadata.message_id == reply.metadata.reply_to_message_id:
            return int(m.metadata.dst_node_id)
    return int(reply.metadata.src_node_id)


def _hosted(
    r: Message,
    node: int,
    sites: int,
    entries: Callable[[Message], list[tuple[int, Any]]],
    errors: dict[int, str],
    log: Callable[[str], None],
) -> list[tuple[int, Any]]:
    """The (site, entry) pairs of ``node``'s answer ``r``; none where it is an error or
    bad (recorded in ``errors`` and logged against the node)."""
    if r.has_error():
        errors[node] = str(r.error.reason or "")[-500:]
        log(f"node {node} could not prepare its sites: {errors[node]}")
        return []
    try:
        pairs = entries(r)
        for site, _ in pairs:
            if not 0 <= site < sites:
                raise ValueError(f"site {site} is not in 0..{sites - 1}")
    except (KeyError, TypeError, ValueError) as err:
        errors[node] = f"bad query reply: {err}"
        log(f"node {node}: {errors[node]}")
        return []
    return pairs


def discover(
    grid: Grid,
    *,
    sites: int,
    message: Callable[[int], Message],
    entries: Callable[[Message], list[tuple[int, Any]]],
    timeout: float,
    poll: float,
    log: Callable[[str], None],
) -> dict[int, tuple[int, Any]]:
    """Ask every connected node which sites it hosts until sites 0..sites-1 are all found.

    ``message(node_id)`` builds the question; ``entries(reply)`` parses an answer into
    (site, entry) pairs (``KeyError``/``TypeError``/``ValueError`` for a bad answer, which is
    logged against its node). Returns site -> (node id, entry), by site. A site claimed by
    two nodes is an error; sites still missing after ``timeout`` raise
    :class:`SitesUnavailable` naming every node's problem.
    """
    want = set(range(sites))
    deadline = time.monotonic() + timeout
    asked: set[int] = set()
    found: dict[int, tuple[int, Any]] = {}
    errors: dict[int, str] = {}
    while True:
        new = sorted(set(grid.get_node_ids()) - asked)
        if new:
            left = max(deadline - time.monotonic(), 1.0)
            msgs = [message(n) for n in new]
            replies = exchange(grid, msgs, timeout=left, poll=poll)
            asked.update(new)
            for r in replies:
                node = asked_node(r, msgs)
                pairs = _hosted(r, node, sites, entries, errors, log)
                for site, entry in pairs:
                    if site in found:
                        raise ValueError(
                            f"site {site} is hosted by nodes {found[site][0]} and {node}; "
                            "each site must have exactly one node"
                        )
                    found[site] = (node, entry)
        if set(found) == want:
            return dict(sorted(found.items()))
        if time.monotonic() >= deadline:
            missing = sorted(want - set(found))
            detail = "; ".join(f"node {n}: {e}" for n, e in errors.items())
            raise SitesUnavailable(
                f"sites {missing} had no working node after {timeout:g} s "
                f"({len(asked)} node(s) answered){'; ' + detail if detail else ''}"
            )
        time.sleep(DISCOVERY_POLL_S)


__all__ = [
    "DISCOVERY_POLL_S",
    "ReplyPacer",
    "SitesUnavailable",
    "asked_node",
    "discover",
    "exchange",
    "polls_are_requests",
    "waves",
]
