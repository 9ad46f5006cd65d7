"""The server's paced polls for replies (no processes started): a grid whose replies come
some time after the push, as a SuperLink's do, is polled far less once rounds are known,
a grid that answers while pushing is never waited on, and a timeout is kept."""

from __future__ import annotations

import time
from types import SimpleNamespace

from fedsgld.flower.exchange import ReplyPacer, exchange, waves


class DelayedGrid:
    """Replies (what ``exchange`` reads of them) become visible ``delay`` s after the push; counts the pulls."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.pulls = 0
        self.pending: dict[str, tuple[float, SimpleNamespace]] = {}

    def push_messages(self, messages):
        ids = []
        for k, _msg in enumerate(messages):
            mid = f"{time.monotonic()}-{k}"
            reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid))
            self.pending[mid] = (time.monotonic() + self.delay, reply)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        self.pulls += 1
        now = time.monotonic()
        ready = [m for m in ids if m in self.pending and self.pending[m][0] <= now]
        return [self.pending.pop(m)[1] for m in ready]


def messages(n: int = 3) -> list[SimpleNamespace]:
    return [SimpleNamespace(metadata=SimpleNamespace(dst_node_id=i)) for i in range(n)]


def test_paced_polls_after_the_first_rounds():
    grid, pacer = DelayedGrid(0.3), ReplyPacer()
    unpaced = []
    for _ in range(3):  # nothing known yet about the first round; then three rounds learnt
        before = grid.pulls
        assert len(exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)) == 3
        unpaced.append(grid.pulls - before)
    assert unpaced[0] >= 20  # every 0.01 s for 0.3 s
    assert min(pacer.recent) >= 0.3
    before = grid.pulls
    t0 = time.monotonic()
    assert len(exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)) == 3
    took = time.monotonic() - t0
    assert grid.pulls - before <= 0.3 * unpaced[0] + 2  # the first 70 % is not polled
    assert took < 0.3 + 0.1  # and the replies are not taken late


def test_a_grid_that_answers_while_pushing_is_never_waited_on():
    grid, pacer = DelayedGrid(0.0), ReplyPacer()
    for _ in range(4):
        exchange(grid, messages(), timeout=10, poll=0.5, pacer=pacer)
    assert pacer.first_wait(0.5) == 0.0


def test_the_timeout_holds_and_an_incomplete_exchange_is_not_learnt():
    grid, pacer = DelayedGrid(5.0), ReplyPacer()
    pacer.record(100.0)  # long rounds learnt earlier must not stretch past the timeout
    pacer.record(100.0)
    t0 = time.monotonic()
    assert exchange(grid, messages(), timeout=0.3, poll=0.05, pacer=pacer) == []
    assert time.monotonic() - t0 < 1.0
    assert pacer.recent == [100.0, 100.0]


def test_one_slow_first_round_sets_no_wait():
    """A run's first round is slow (processes starting, a stock SuperNode's first tasks
    cold); the next round's replies come in a fraction of it and must not wait for most
    of the first round's time."""
    grid, pacer = DelayedGrid(0.8), ReplyPacer()
    exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)  # the slow first round
    grid.delay = 0.1
    t0 = time.monotonic()
    exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)
    assert time.monotonic() - t0 < 0.1 + 0.1  # not 0.7 x 0.8 s
    assert pacer.first_wait(0.01) > 0  # two exchanges known: paced from now on


def test_a_coarse_poll_interval_is_never_made_later():
    """Replies after 0.15 s, polls every 0.2 s (Flower's simulation with the default
    interval): pacing must not land a poll just before the replies and wait a whole
    interval more."""
    grid, pacer = DelayedGrid(0.15), ReplyPacer()
    took = []
    for _ in range(6):
        t0 = time.monotonic()
        exchange(grid, messages(), timeout=10, poll=0.2, pacer=pacer)
        took.append(time.monotonic() - t0)
    assert max(took[3:]) < 0.2 + 0.08, took


def test_only_a_deployments_grid_is_paced():
    from flwr.superlink.grid.http_grid import HttpGrid

    from fedsgld.flower.exchange import polls_are_requests
    from fedsgld.flower.local_grid import LocalGrid

    assert polls_are_requests(HttpGrid.__new__(HttpGrid))
    assert not polls_are_requests(LocalGrid.__new__(LocalGrid))
    assert not polls_are_requests(DelayedGrid(0.0))


def test_rounds_that_get_shorter_are_waited_on_once_at_most():
    """Three slow exchanges, then fast ones: one late first look, then none (a pacer that
    kept waiting for most of the slow time would keep every later round long)."""
    grid, pacer = DelayedGrid(0.6), ReplyPacer()
    for _ in range(3):
        exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)
    grid.delay = 0.05
    took = []
    for _ in range(4):
        t0 = time.monotonic()
        exchange(grid, messages(), timeout=10, poll=0.01, pacer=pacer)
        took.append(time.monotonic() - t0)
    assert took[0] > 0.3  # the one late look (0.7 x 0.6 - 0.01 s)
    assert max(took[1:]) < 0.05 + 0.06, took


def test_a_node_that_hosts_several_sites_gets_one_message_at_a_time():
    """Flower's simulation may run two messages of one node at once on copies of its
    state; the exchange sends them in waves, one message per node each."""

    a, b, c, d = (SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for n in (1, 1, 2, 1))
    assert waves([a, b, c, d]) == [[a, c], [b], [d]]
    assert waves([a, c]) == [[a, c]]


def test_an_unpaced_exchange_looks_again_soon_and_backs_off():
    """A simulation's grid (no pacer): replies 0.15 s after the push with poll 1 s are
    looked for several times before the interval's end (a fixed poll would look twice:
    at 0 and at 1 s), and the looks back off (no busy loop)."""
    grid = DelayedGrid(0.15)
    assert len(exchange(grid, messages(), timeout=10, poll=1.0)) == 3
    assert 3 <= grid.pulls <= 12
