"""The waits that Flower 1.41/1.42 hard-codes, shortened at run time (the fast path's
``fedsgld supernode`` and ``fedsgld superlink``, see :mod:`fedsgld.deploy.fast`): the
SuperNode's sleep after an empty pull (:class:`_Waits`), its reply polls, its SuperExec's
task poll (:class:`_Wakeable`) and the object-pull backoff. Call
:func:`fedsgld.deploy.releases.check_flower` first."""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import sys
import time

from fedsgld.deploy.releases import STOCK, UnsupportedFlower

FLOWER_EMPTY_PULL_SLEEP = 3  # start_client_internal: time.sleep(3) after an empty pull
FLOWER_REPLY_SLEEP = 0.5  # _push_messages: time.sleep(0.5) while the reply is not ready
POLL_BACKOFF = 0.1  # a waiting node polls at most every tenth of the time since its reply
FLOWER_PULL_BACKOFF = (1, 10)  # supercore.constant: PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP
FLOWER_PULL_TRIES = 500  # supercore.constant.PULL_MAX_TRIES_PER_OBJECT
ENV_WAKE = "FEDSGLD_SUPEREXEC_WAKE"  # the datagram socket the SuperExec wrapper waits on
ENV_BACKOFF = "FEDSGLD_PULL_BACKOFF"  # "initial,cap" for the app processes


def adjust_pull_backoff(initial: float, cap: float) -> None:
    """Object pulls in this process retry after ``initial`` s, doubling up to ``cap``.

    Flower also stops after 500 tries of one object; with its 1-10 s waits that is over
    an hour, with these a minute: the limit on tries is lifted, so that a pull still
    waits as long as Flower's would, up to Flower's limit on total time (7200 s)."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        kw = dict(fn.__kwdefaults__ or {})
        got = (kw.get("initial_backoff"), kw.get("backoff_cap"), kw.get("max_tries_per_object"))
        if got != (*FLOWER_PULL_BACKOFF, FLOWER_PULL_TRIES):
            raise UnsupportedFlower(f"flwr's {fn.__name__} is not as expected: {STOCK}")
        kw.update(initial_backoff=initial, backoff_cap=cap, max_tries_per_object=None)
        fn.__kwdefaults__ = kw


def backoff_from_env() -> tuple[float, float] | None:
    raw = os.environ.get(ENV_BACKOFF)
    if not raw:
        return None
    initial, cap = (float(x) for x in raw.split(","))
    return initial, cap


class _Waits:
    """Stands in for the ``time`` module inside Flower's ``start_client_internal``: its
    fixed sleeps shortened while a run is active, everything else ``time``'s.

    After a reply has been sent the next message cannot come before the other sites have
    replied and the server has taken its step; rounds are regular, so the first sleep
    after a reply lasts ``predict`` times the shortest of the last three waits from a
    reply to the next message (at most Flower's 3 s; once two are known, so that the
    slow first round of a run sets no wait on its own), and only then does the node poll
    every ``pull_interval``. A wait ends when the pull that found the message *started*
    (not when the message and its objects were stored). When the first pull after the
    predicted wait already finds the message, the wait was too long by an unknown amount
    (the server got faster, or the first rounds were slow): the node forgets its waits
    and polls from the reply in the next round, which measures the wait again. This cuts
    the requests a node makes per round several-fold at the cost of one late pull when
    rounds get shorter."""

    def __init__(
        self, pull_interval: float, reply_poll: float, active_for: float, predict: float
    ) -> None:
        self.pull_interval = pull_interval
        self.reply_poll = reply_poll
        self.active_for = active_for
        self.predict = predict
        self.last_message = -math.inf
        self.sent_at: float | None = None  # when the last reply went out
        self.gaps: list[float] = []  # reply -> next message, the last three rounds
        self.after_reply = False
        self.first_look = False  # the next pull is the first after a predicted wait
        self.debug = bool(os.environ.get("FEDSGLD_WARM_DEBUG"))  # warm.ENV_DEBUG

    def message(self, pulled_at: float) -> None:
        """A message was stored by the pull that started at ``pulled_at`` (monotonic)."""
        now = time.monotonic()
        self.last_message = now
        gap = None if self.sent_at is None else pulled_at - self.sent_at
        if gap is not None:
            # found at the first look after a predicted wait: the wait was too long by an
            # unknown amount, so measure again next round (poll from the reply)
            self.gaps = [] if self.first_look else [*self.gaps[-2:], gap]
            self.sent_at = None
        self.first_look = False
        if self.debug:
            _debug(
                f"message stored ({now - pulled_at:.3f} s to pull)"
                + ("" if gap is None else f", pulled {gap:.3f} s after the reply")
            )

    def replied(self) -> None:
        self.sent_at = time.monotonic()
        self.after_reply = True
        if self.debug:
            _debug("reply pushed")

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_EMPTY_PULL_SLEEP:
            now = time.monotonic()
            if now - self.last_message < self.active_for:
                # poll every pull_interval, or a tenth of the time since the reply if
                # longer: a node whose next message is seconds away (many sites, slow
                # rounds) makes tens of requests per round, not one per pull_interval
                since = 0.0 if self.sent_at is None else now - self.sent_at
                seconds = max(self.pull_interval, POLL_BACKOFF * since)
                if self.after_reply and len(self.gaps) >= 2:  # one slow round is no rule
                    seconds = min(3.0, max(seconds, self.predict * min(self.gaps)))
                    self.first_look = seconds > self.pull_interval
                    if self.debug:
                        _debug(f"first pull after the reply in {seconds:.3f} s")
                else:
                    self.first_look = False
            self.after_reply = False
        elif seconds == FLOWER_REPLY_SLEEP:
            seconds = self.reply_poll
        time.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)


def _debug(msg: str) -> None:
    t = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    print(f"{stamp} [fedsgld supernode {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def adjust_supernode(
    *,
    pull_interval: float,
    reply_poll: float,
    active_for: float,
    predict: float = 0.0,
    wake: str | None = None,
) -> _Waits:
    """Shorten the SuperNode's fixed sleeps in this process (after :func:`check_flower`);
    ``wake``: a datagram socket to signal whenever a message (a task) has been stored."""
    from flwr.supercore.inflatable import inflatable_utils as iu
    from flwr.supernode import start_client_internal as sci

    if (
        sci.time is not time
        or not callable(getattr(sci, "_pull_and_store_message", None))
        or not callable(getattr(sci, "_push_messages", None))
        or sci.pull_objects is not iu.pull_objects
    ):
        raise UnsupportedFlower(f"flwr.supernode.start_client_internal is not as expected: {STOCK}")
    waits = _Waits(pull_interval, reply_poll, active_for, predict)
    pull_and_store, push = sci._pull_and_store_message, sci._push_messages
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if wake else None
    if sender is not None:
        sender.setblocking(False)

    def pull_and_store_message(*args, **kwargs):
        started = time.monotonic()
        run_id = pull_and_store(*args, **kwargs)
        if run_id is not None:  # a message and its task are stored: wake the SuperExec
            waits.message(started)
            if sender is not None:
                with contextlib.suppress(OSError):  # not listening yet, or already woken
                    sender.sendto(b"t", wake)
        return run_id

    def push_messages(*args, **kwargs):
        try:
            return push(*args, **kwargs)
        finally:
            waits.replied()

    sci.time = waits
    sci._pull_and_store_message = pull_and_store_message
    sci._push_messages = push_messages
    return waits


class _Wakeable:
    """Stands in for ``time`` inside Flower's ``run_superexec``: its task-poll sleep ends
    as soon as the SuperNode signals a new task on ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sleep(self, seconds: float) -> None:
        ready, _, _ = select.select([self.sock], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.sock.recv(64)

    def __getattr__(self, name: str):
        return getattr(time, name)
