"""The Gaussian ledger's values: run-length encoded (q, sigma, count) entries, checked.

The accountant (:mod:`fedsgld.privacy.accountant`) records Poisson-subsampled Gaussian
steps as a tuple of ``(q, sigma, count)`` entries in step order, consecutive equal
``(q, sigma)`` merged (a :data:`LedgerKey`, hashable, so epsilons can be cached per
ledger). This module holds what builds and checks those tuples: the validation of every
number that enters a ledger, :func:`normalise` and :func:`append`, the steps of a planned
schedule (:class:`Plan`) and the small LRU cache the accountants share.

Conservative sigma grid (:func:`bucket_down`)
---------------------------------------------
``sigma_rel_grid = r > 0`` rounds each sigma DOWN onto the geometric grid
{(1 + r)^k : k integer} before it enters the ledger (r = 0, the default: exact). Epsilon
of the subsampled Gaussian mechanism is non-increasing in sigma, so the bucketed
ledger's epsilon is an upper bound on the exact ledger's; it pays up to a relative
1 - 1/(1+r) of noise per step (about +1.5 % epsilon at r = 0.01 for a decaying DP-SGLD
schedule). It keeps ledgers short, which only the ``"dp_accounting_pld"`` reference
needs. (Internally ``"pld"`` and ``"rdp"`` account steps whose sigmas lie within a
relative 1e-3 of each other together at the smallest of them, which costs about 0.1 %.)
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "LRU",
    "Entry",
    "LedgerKey",
    "Plan",
    "append",
    "bucket_down",
    "check_count",
    "check_q",
    "check_sigma",
    "normalise",
    "real",
]

Entry = tuple[float, float, int]
LedgerKey = tuple[Entry, ...]


class LRU(OrderedDict):
    """A small least-recently-used cache."""

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize

    def lookup(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


def real(name: str, value: Any) -> float:
    """``value`` as a float; ValueError naming ``name`` for a non-number, a bool or nan."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a real number, got nan")
    return value


def check_q(q: Any, name: str = "sample rate q") -> float:
    """A sampling rate in (0, 1]."""
    q = real(name, q)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {q!r}")
    return q


def check_sigma(sigma: Any, name: str = "noise multiplier sigma") -> float:
    """A noise multiplier, finite and > 0."""
    sigma = real(name, sigma)
    if not (0.0 < sigma < math.inf):
        raise ValueError(f"{name} must be finite and > 0, got {sigma!r}")
    return sigma


def check_count(count: Any, name: str = "step count") -> int:
    """A step count, an integer >= 0 (an integral float is accepted)."""
    if (
        isinstance(count, bool)
        or not isinstance(count, numbers.Real)
        or not math.isfinite(count)
        or count != int(count)
        or count < 0
    ):
        raise ValueError(f"{name} must be an integer >= 0, got {count!r}")
    return int(count)


def bucket_down(sigma: float, r: float) -> float:
    """The largest (1 + r)^k, k an integer, that is <= ``sigma`` (for r > 0, sigma > 0)."""
    base = 1.0 + r
    k = math.floor(math.log(sigma) / math.log(base))
    # the logarithm can be off by one ulp either way: settle k exactly
    while base**k > sigma:
        k -= 1
    while base ** (k + 1) <= sigma:
        k += 1
    value = base**k
    if not (0.0 < value <= sigma):  # pragma: no cover - guarded by the loops above
        raise ArithmeticError(f"bucketing sigma={sigma!r} gave {value!r}")
    return value


def _merged(steps: Iterable[tuple[float, float, int]]) -> LedgerKey:
    """Run-length merge of consecutive equal (q, sigma)."""
    out: list[list[Any]] = []
    for q, sigma, count in steps:
        if out and out[-1][0] == q and out[-1][1] == sigma:
            out[-1][2] += count
        else:
            out.append([q, sigma, count])
    return tuple((q, s, c) for q, s, c in out)


def normalise(ledger: Iterable[Any]) -> LedgerKey:
    """Validate (q, sigma, count) entries; drop zero counts; merge consecutive equal (q, sigma)."""

    def checked() -> Iterable[tuple[float, float, int]]:
        for i, entry in enumerate(ledger):
            try:
                q, sigma, count = entry
            except (TypeError, ValueError):
                raise ValueError(
                    f"ledger entry {i} must be (q, sigma, count), got {entry!r}"
                ) from None
            q = check_q(q, f"ledger entry {i}: sample rate q")
            sigma = check_sigma(sigma, f"ledger entry {i}: noise multiplier sigma")
            count = check_count(count, f"ledger entry {i}: step count")
            if count:
                yield q, sigma, count

    return _merged(checked())


def append(key: LedgerKey, q: float, sigma: float, count: int) -> LedgerKey:
    """``key`` with ``count`` more steps (q, sigma) at its end."""
    if count == 0:
        return key
    if key and key[-1][0] == q and key[-1][1] == sigma:
        return key[:-1] + ((q, sigma, key[-1][2] + count),)
    return key + ((q, sigma, count),)


class Plan:
    """Steps t = 0, 1, ... of ``schedule``, bucketed, appended to a base ledger."""

    def __init__(
        self,
        base: LedgerKey,
        schedule: Callable[[int], tuple[float, float]],
        bucket: Callable[[float], float],
    ) -> None:
        self.base = base
        self.schedule = schedule
        self.bucket = bucket
        self._points: list[tuple[float, float]] = []

    def point(self, t: int) -> tuple[float, float]:
        """(q, bucketed sigma) of step t, validated (memoised)."""
        while len(self._points) <= t:
            i = len(self._points)
            point = self.schedule(i)
            try:
                q, sigma = point
            except (TypeError, ValueError):
                raise ValueError(f"schedule({i}) must return (q, sigma), got {point!r}") from None
            q = check_q(q, f"schedule({i}): sample rate q")
            sigma = check_sigma(sigma, f"schedule({i}): noise multiplier sigma")
            self._points.append((q, self.bucket(sigma)))
        return self._points[t]

    def ledger(self, steps: int) -> LedgerKey:
        """The base ledger followed by the schedule's first ``steps`` steps."""
        if steps > 0:
            self.point(steps - 1)
        return _merged([*self.base, *((q, s, 1) for q, s in self._points[:steps])])
