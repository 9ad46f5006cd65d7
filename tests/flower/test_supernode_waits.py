"""The fast path's SuperNode waits (``fedsgld.deploy.waits._Waits``), on a simulated clock:
Flower's loop after a reply (pull, sleep 3 s after every empty pull) against a server whose
next message is ready a fixed time after the node's reply. No processes started."""

from __future__ import annotations

import pytest

from fedsgld.deploy import waits as fast  # the fast path's waits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def time(self) -> float:
        return self.now


def simulate(monkeypatch, *, ready_after, pull_s: float, rounds: int = 30):
    """Per round: (seconds from the reply to the pull that found the message, empty pulls).
    ``ready_after``: seconds from the reply to the next message, or one per round."""
    if isinstance(ready_after, (int, float)):
        ready_after = [ready_after] * rounds
    clock = Clock()
    monkeypatch.setattr(fast, "time", clock)
    waits = fast._Waits(pull_interval=0.05, reply_poll=0.01, active_for=60.0, predict=0.7)
    out = []
    waits.message(clock.now)  # the run's first message
    for rnd in range(rounds):
        clock.now += 0.3  # the task
        waits.replied()
        sent = clock.now
        ready = sent + ready_after[rnd]
        empty = 0
        while True:  # Flower's loop: pull; after an empty pull, sleep(3)
            started = clock.now
            clock.now += pull_s if clock.now >= ready else 0.01  # an empty pull is quick
            if started >= ready:
                waits.message(started)
                break
            empty += 1
            waits.sleep(fast.FLOWER_EMPTY_PULL_SLEEP)
        out.append((started - sent, empty))
    return out


@pytest.mark.parametrize("pull_s", [0.02, 0.2])
def test_waits_settle_just_past_the_servers_time_whatever_a_pull_costs(monkeypatch, pull_s):
    rounds = simulate(monkeypatch, ready_after=0.3, pull_s=pull_s)
    late = [gap - 0.3 for gap, _ in rounds[10:]]
    empties = [e for _, e in rounds[10:]]
    # the message is found within about one pull interval of being ready, ...
    assert max(late) < 0.05 + 0.01 + 1e-9, late
    # ... with a handful of requests per round instead of one per 0.05 s from the reply
    assert max(empties) <= 4, empties
    assert sum(empties) / len(empties) < 0.3 / 0.05


def test_slow_first_rounds_do_not_hold_back_the_rounds_after(monkeypatch):
    """The first rounds of a run are slow (other sites start cold): once the server answers
    quickly, one pull is late (the wait learnt from the slow rounds), none after it."""
    ready = [3.4] * 3 + [0.3] * 12
    rounds = simulate(monkeypatch, ready_after=ready, pull_s=0.05, rounds=len(ready))
    late = [gap - r for (gap, _), r in zip(rounds, ready, strict=True)]
    assert max(late[4:]) < 0.05 + 0.01 + 1e-9, late


def test_a_slow_first_round_sets_no_wait(monkeypatch):
    ready = [3.4] + [0.3] * 14  # the run's first round: sites start cold
    rounds = simulate(monkeypatch, ready_after=ready, pull_s=0.05, rounds=len(ready))
    late = [gap - r for (gap, _), r in zip(rounds, ready, strict=True)]
    assert max(late[1:]) < 0.05 + 0.01 + 1e-9, late
    # a long wait is polled at a tenth of its length: late by at most that, few requests
    assert late[0] < fast.POLL_BACKOFF * 3.4 + 0.06 and rounds[0][1] < 40, rounds[0]


def test_an_idle_node_keeps_flowers_sleep(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(fast, "time", clock)
    waits = fast._Waits(pull_interval=0.05, reply_poll=0.01, active_for=60.0, predict=0.7)
    waits.sleep(fast.FLOWER_EMPTY_PULL_SLEEP)
    assert clock.now == 1003.0  # no message yet: Flower's 3 s
    waits.message(clock.now)
    clock.now += 61.0  # nothing for longer than active_for
    t = clock.now
    waits.sleep(fast.FLOWER_EMPTY_PULL_SLEEP)
    assert clock.now - t == 3.0
    t = clock.now
    waits.sleep(fast.FLOWER_REPLY_SLEEP)  # waiting for the ClientApp's reply: always short
    assert clock.now - t == pytest.approx(0.01)
