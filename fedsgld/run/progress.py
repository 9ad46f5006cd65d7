"""The progress display of a run's rounds (a tqdm bar, or a log line every few seconds)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundInfo:
    """What a per-round callback is told after round ``round`` (1-based count of rounds
    taken): the rounds the budget allows in all, the rigorous epsilon spent (as last
    computed by the progress display, at most a few rounds old; None without an
    accountant), the pooled test accuracy of this round's evaluation (None when the round
    was not evaluated) and the parameters theta (or phi) after the round (read-only)."""

    round: int
    planned: int
    epsilon: float | None
    test_accuracy: float | None
    theta: Any


class Progress:
    """A progress display that is true every round: the rounds the budget allows as the
    total, the epsilon spent so far from the ledger (recomputed at most as often as it is
    cheap), and the last evaluation's test accuracy, labelled as such."""

    def __init__(
        self,
        *,
        enabled: bool | str,
        total: int,
        initial: int,
        desc: str,
        log: Callable[[str], None],
    ) -> None:
        """``enabled``: True, a bar; ``"log"``, a line to ``log`` every few seconds (a
        server's log); False, nothing per round."""
        self.log = log
        self.bar = None
        self.total = total
        self.lines = enabled == "log"
        if enabled is True:
            from tqdm.auto import tqdm  # only where a bar is shown (never at a site)

            self.bar = tqdm(total=total, initial=initial, desc=desc)
        self.eps: float | None = None
        self.eps_round = 0
        self.eps_cost = 0.0
        self.eps_at = -math.inf
        self.acc: tuple[int, float] | None = None
        self.last_log = time.monotonic()

    def epsilon(self, server, *, force: bool = False) -> float | None:
        acc = server.accountant
        if acc is None:
            return None
        now = time.monotonic()
        # recompute when forced, or when the last computation was < 5 % of the time since
        if force or now - self.eps_at >= 20 * self.eps_cost:
            t0 = time.perf_counter()
            self.eps = acc.rigorous_epsilon()
            self.eps_cost = time.perf_counter() - t0
            self.eps_at = time.monotonic()
            self.eps_round = server.t
        return self.eps

    def update(self, server, *, evaluated: float | None = None, force_log: bool = False) -> None:
        if evaluated is not None:
            self.acc = (server.t, evaluated)
        eps = self.epsilon(server, force=evaluated is not None)
        parts = {}
        if eps is not None:
            parts["eps"] = f"{eps:.3f}" + (
                "" if self.eps_round == server.t else f"@{self.eps_round}"
            )
        if self.acc is not None:
            parts["test_acc"] = f"{self.acc[1]:.3f}@{self.acc[0]}"
        if self.bar is not None:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
        elif self.lines and (force_log or time.monotonic() - self.last_log >= 5.0):
            self.last_log = time.monotonic()
            info = ", ".join(f"{k} {v}" for k, v in parts.items())
            self.log(f"round {server.t}/{self.total}" + (f": {info}" if info else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
