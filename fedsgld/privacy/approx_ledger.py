"""The accountant's third ledger: releases known only by (epsilon, delta) or an RDP curve.

:class:`~fedsgld.privacy.accountant.PrivacyAccountant` holds a Gaussian ledger, a ledger
of distributed discrete Gaussian rounds and this one, :class:`ApproxLedger`, of
:class:`~fedsgld.privacy.approx_dp.ApproxDpRelease` and
:class:`~fedsgld.privacy.approx_dp.RdpCurveRelease` events (e.g. the charge of a private
hyper-parameter selection). Once it holds any, every epsilon the accountant reports and
every budget check is the epsilon of the WHOLE ledger by
:func:`~fedsgld.privacy.approx_dp.composed_epsilon`: the FFT PLD of the Gaussian steps
composed exactly with the worst-case pairs of these releases (whatever the accountant's
``accountant`` name: RDP has no finite value for an (epsilon, delta) release, and the
PLD composition is the rigorous one). With distributed discrete Gaussian rounds as well,
the rounds enter as their dominating Gaussian steps and their slack is added as
:mod:`fedsgld.privacy.ddg_dominance` states: epsilon(delta) <= epsilon_PLD(delta e^{-A_up})
+ A_up + A_down (the slack argument holds for any other mechanism in the composition).

Recording one of these releases drops the Gaussian ledger's budget certificates (they
were computed without it). The ledger is persisted under the accountant's state key
``"approx"``: ``[[kind, params, label, count], ...]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedsgld.privacy.approx_dp import (
    ApproxDpRelease,
    RdpCurveRelease,
    approx_releases,
    composed_delta,
    composed_epsilon,
)
from fedsgld.privacy.budget import BudgetExhausted
from fedsgld.privacy.ddg_ledger import DDGKey, DDGLedger
from fedsgld.privacy.distributed import dominating_ledger
from fedsgld.privacy.events import DpEvent
from fedsgld.privacy.gaussian_ledger import GaussianLedger
from fedsgld.privacy.ledger import LRU, LedgerKey

__all__ = ["ACCOUNTING", "ApproxKey", "ApproxLedger", "DDGLedgerWithApprox"]

ACCOUNTING = (
    "approximate-DP releases composed as their worst-case (epsilon, delta) pairs with the "
    "PLD of the Gaussian steps (fedsgld.privacy.approx_dp)"
)

Release = ApproxDpRelease | RdpCurveRelease
ApproxKey = tuple[tuple[Release, int], ...]
_CACHE = 256


def _append(key: ApproxKey, releases: Sequence[Release]) -> ApproxKey:
    out = [list(e) for e in key]
    for r in releases:
        if out and out[-1][0] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return tuple((r, int(c)) for r, c in out)


def _flat(key: ApproxKey) -> list[Release]:
    return [r for r, c in key for _ in range(c)]


class ApproxLedger:
    """Approximate-DP releases and the epsilon of the whole ledger with them.

    ``gaussian``: the accountant's Gaussian ledger (its key read, its certificates dropped
    on a record); ``ddg``: a function returning the accountant's DDG rounds."""

    def __init__(
        self,
        *,
        delta: float,
        epsilon_budget: float | None,
        gaussian: GaussianLedger,
        ddg: Callable[[], DDGKey],
    ) -> None:
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.gaussian = gaussian
        self._ddg = ddg
        self.key: ApproxKey = ()
        self._cache = LRU(_CACHE)

    def supports(self, event: DpEvent) -> bool:
        """Whether ``event`` is made of approximate-DP releases (mixed: UnsupportedEvent)."""
        return approx_releases(event) is not None

    @property
    def steps(self) -> int:
        return sum(c for _, c in self.key)

    @property
    def entries(self) -> list[tuple[Release, int]]:
        return list(self.key)

    # -- epsilon ------------------------------------------------------------------------
    def epsilon(self, key: LedgerKey, ddg: DDGKey, approx: ApproxKey | None = None) -> float:
        """Epsilon at ``delta`` of the Gaussian ledger ``key``, the DDG rounds ``ddg`` and
        the approximate-DP releases ``approx`` (default: the recorded ones), cached."""
        approx = self.key if approx is None else approx
        if not key and not ddg and not approx:
            return 0.0
        cached = self._cache.lookup((key, ddg, approx))
        if cached is None:
            ledger, up, down = dominating_ledger(ddg, key)
            d = self.delta * math.exp(-up)
            cached = composed_epsilon(ledger, _flat(approx), d) + up + down if d > 0 else math.inf
            self._cache.put((key, ddg, approx), cached)
        return cached

    def delta_at(self, key: LedgerKey, ddg: DDGKey, epsilon: float) -> float:
        """Upper bound on delta at ``epsilon`` of the whole ledger (resolved to about 1e-6
        of ``delta``)."""
        ledger, up, down = dominating_ledger(ddg, key)
        e = epsilon - up - down
        releases = _flat(self.key)
        base = (
            composed_delta(ledger, releases, e, delta=self.delta)
            if e >= 0.0
            else composed_delta(ledger, releases, 0.0, delta=self.delta) - math.expm1(e)
        )
        return min(1.0, math.exp(up) * base)

    def whole_run(self, key: LedgerKey) -> float | None:
        """The epsilon of the whole ledger with the Gaussian ledger at ``key``; None while
        this ledger holds nothing."""
        return self.epsilon(key, self._ddg()) if self.key else None

    # -- the budget ------------------------------------------------------------------------
    def _after(self, event: DpEvent) -> ApproxKey:
        releases = approx_releases(event)
        if releases is None:
            raise ValueError(f"not an approximate-DP release: {event!r}")
        return _append(self.key, releases)

    def epsilon_after(self, event: DpEvent) -> float:
        return self.epsilon(self.gaussian.key, self._ddg(), self._after(event))

    def fits(self, event: DpEvent) -> bool:
        after = self._after(event)  # validated all the same
        if self.epsilon_budget is None:
            return True
        return self.epsilon(self.gaussian.key, self._ddg(), after) <= self.epsilon_budget

    def affordable(self, event: DpEvent) -> int:
        """How many of ``event``'s releases, in order, fit the budget."""
        releases = approx_releases(event) or []
        if self.epsilon_budget is None:
            return len(releases)
        n = 0
        while n < len(releases) and self.epsilon(
            self.gaussian.key, self._ddg(), _append(self.key, releases[: n + 1])
        ) <= self.epsilon_budget:  # fmt: skip
            n += 1
        return n

    def spend(self, event: DpEvent) -> None:
        """Record all of ``event`` or, past the budget, none (BudgetExhausted)."""
        after = self._after(event)
        if self.epsilon_budget is not None:
            eps = self.epsilon(self.gaussian.key, self._ddg(), after)
            if eps > self.epsilon_budget:
                raise BudgetExhausted(
                    f"{sum(c for _, c in after) - self.steps} approximate-DP release(s) "
                    f"would take epsilon (PLD with their worst-case pairs) to {eps:.6g} > "
                    f"budget {self.epsilon_budget:g} at delta={self.delta:g}; not recorded",
                    epsilon=eps,
                    budget=self.epsilon_budget,
                )
        self.key = after
        self.gaussian.commit(self.gaussian.key, 0.0)  # its certificates did not hold these

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> list[list[Any]]:
        out: list[list[Any]] = []
        for r, c in self.key:
            if isinstance(r, ApproxDpRelease):
                out.append(["epsilon_delta", [r.epsilon, r.delta], r.label, c])
            else:
                rdp = [x if math.isfinite(x) else None for x in r.rdp]
                out.append(["rdp_curve", [list(r.orders), rdp], r.label, c])
        return out

    def load(self, state: Mapping[str, Any]) -> None:
        releases: list[Release] = []
        for i, entry in enumerate(state.get("approx", [])):
            try:
                kind, params, label, count = entry
                if kind == "epsilon_delta":
                    r: Release = ApproxDpRelease(params[0], params[1], label)
                elif kind == "rdp_curve":
                    rdp = tuple(math.inf if x is None else x for x in params[1])
                    r = RdpCurveRelease(tuple(params[0]), rdp, label)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
                count = int(count)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"privacy accountant state: approx entry {i} is invalid ({err})"
                ) from None
            releases += [r] * count
        self.key = _append((), releases)


class DDGLedgerWithApprox(DDGLedger):
    """The DDG ledger, its whole-run epsilon taking the approximate-DP releases with it
    once ``approx()`` holds any."""

    def __init__(self, *, approx: Callable[[], ApproxLedger], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._approx = approx

    def epsilon(self, key: LedgerKey, ddg: DDGKey) -> float:
        approx = self._approx()
        if approx.key:
            return approx.epsilon(key, ddg)
        return super().epsilon(key, ddg)
