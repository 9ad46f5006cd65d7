"""The privacy accountant: a ledger of Poisson-subsampled Gaussian steps and its epsilon.

Every training step t releases S_t + N(0, (sigma_t C)^2 I), where S_t is a sum of records'
gradients, each clipped to L2 norm <= C, and every record enters S_t independently with
probability q_t (Poisson sampling). Neighbouring datasets differ by adding or removing
one record. The accountant keeps the run-length encoded ledger ``[(q, sigma, count), ...]``
and converts it to an (epsilon, delta) guarantee with three accountants:

* ``"gdp"``: Gaussian DP central limit theorem (Dong, Roth & Su 2019), the paper's
  accountant, mu = sqrt(sum_t q_t^2 (exp(1/sigma_t^2) - 1)). APPROXIMATE: it
  under-estimates epsilon (2-12 % for a constant sigma, ~20 % for a decaying DP-SGLD
  schedule ending below sigma = 1). Reported, never used for the budget.
* ``"pld"``: privacy loss distributions (``dp_accounting``, connect-the-dots, pessimistic
  rounding with ``value_discretization_interval = pld_discretization``): a numerical
  upper bound, tight to about the discretization interval.
* ``"rdp"``: Renyi DP (``dp_accounting.rdp.RdpAccountant``, Mironov et al. 2019 with the
  conversion of Canonne, Kamath & Steinke 2020): a valid but looser upper bound.

The budget check uses the rigorous accountant chosen by ``accountant`` ("pld" or "rdp").

Conservative sigma grid
-----------------------
DP-SGLD's sigma_t = sqrt(2 alpha_t tau) changes every step, and the PLD cost grows with
the number of distinct (q, sigma) entries. Each sigma is therefore rounded DOWN onto the
geometric grid {(1 + r)^k : k integer}, r = ``sigma_rel_grid`` (r = 0: exact). Epsilon
of the subsampled Gaussian mechanism is non-increasing in sigma, so the bucketed ledger's
epsilon is an upper bound on the exact ledger's: accounting stays valid, it only pays up
to a relative 1 - 1/(1+r) of noise per step. A schedule from sigma 1.5 to 0.8 then has
~63 distinct entries on the default 1 % grid instead of one per step.

Certification (why per-step checks are cheap)
----------------------------------------------
A ledger whose rigorous epsilon was computed and found <= budget is "certified". A
candidate ledger A is *dominated* by a certified ledger B when, for every q, the steps of
A can be matched one-to-one to steps of B with the same q and a sigma_B <= sigma_A. By
Hall's theorem (the admissible partners of a step are nested in sigma) this holds iff for
every threshold s:  #{A steps with sigma <= s}  <=  #{B steps with sigma <= s}, per q.
Composition is commutative, adding steps never lowers epsilon and epsilon is
non-increasing in each sigma, so eps(A) <= eps(B) <= budget: A is within budget without
computing anything. :meth:`PrivacyAccountant.max_steps` certifies the ledger at the end
of a planned schedule, after which every :meth:`~PrivacyAccountant.step` along it costs a
domination check, O(#entries log #entries).

Performance (measured at the defaults: pld, r = 0.01, pld_discretization = 1e-3, one
process; the one-off ~1.2 s import of dp_accounting not included). For the DP-SGLD
schedule alpha_0 = 0.05, tau = 22.5, gamma = 0.5, t0 = 88 (sigma_t from 1.50 at t = 0 to
0.80 at t = 1000), q = 0.01, delta = 1e-5, budget 1.0, ``max_steps(..., limit=1000)`` on a
fresh accountant takes about 1.6 s and allows 403 steps (sigma_402 = 0.976, 44 ledger
entries; most of the time is spent building one PLD per distinct sigma). The 403
``step`` calls that follow take about 16 ms in total. Without ``max_steps``, ``check`` +
``step`` per step along the same schedule take about 2.3 s for the 403 steps (each new
step composes one PLD onto the cached prefix). ``epsilon()`` of the final ledger takes
about 1.4 s, mostly RDP curves (~30 ms per distinct (q, sigma), then cached). With
accountant="rdp": 231 steps in about 1.0 s.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .gdp import gdp_epsilon, gdp_mu

__all__ = ["BudgetExhausted", "PrivacyAccountant"]

Entry = tuple[float, float, int]
LedgerKey = tuple[Entry, ...]

ACCOUNTANTS = ("pld", "rdp")


class _DropExcludedOrderWarnings(logging.Filter):
    """dp_accounting warns once per (q, sigma, order) when a fractional RDP order does not
    converge and is left out. Leaving orders out can only raise the RDP epsilon (it is a
    minimum over orders), so the bound stays valid; hundreds of such lines at small sigma
    would bury the run's own output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


_RDP_FILTER = _DropExcludedOrderWarnings()


def _quiet_rdp_order_warnings() -> None:
    absl = logging.getLogger("absl")
    if _RDP_FILTER not in absl.filters:
        absl.addFilter(_RDP_FILTER)


STATE_VERSION = 1
_STATE_KEYS = ("ledger", "delta", "budget", "accountant", "sigma_rel_grid", "pld_discretization")

_MAX_CERTIFIED = 4
_PREFIX_CACHE = 64
_ENTRY_CACHE = 256
_EPS_CACHE = 1024
_BUCKET_CACHE = 100_000
_POWER_MAX = 512  # self-compose counts above this with one FFT power


class BudgetExhausted(RuntimeError):
    """A step would take the rigorous epsilon past the budget; the step was NOT recorded.

    Attributes: ``epsilon`` (the rigorous epsilon the ledger would have with the step) and
    ``budget``.
    """

    def __init__(self, message: str, *, epsilon: float, budget: float) -> None:
        super().__init__(message)
        self.epsilon = epsilon
        self.budget = budget


class _LRU(OrderedDict):
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


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a real number, got nan")
    return value


def _check_q(q: Any, name: str = "sample rate q") -> float:
    q = _real(name, q)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {q!r}")
    return q


def _check_sigma(sigma: Any, name: str = "noise multiplier sigma") -> float:
    sigma = _real(name, sigma)
    if not (0.0 < sigma < math.inf):
        raise ValueError(f"{name} must be finite and > 0, got {sigma!r}")
    return sigma


def _check_count(count: Any, name: str = "step count") -> int:
    if (
        isinstance(count, bool)
        or not isinstance(count, numbers.Real)
        or not math.isfinite(count)
        or count != int(count)
        or count < 0
    ):
        raise ValueError(f"{name} must be an integer >= 0, got {count!r}")
    return int(count)


def _normalise(ledger: Iterable[Any]) -> LedgerKey:
    """Validate (q, sigma, count) entries; drop zero counts; merge consecutive equal (q, sigma)."""
    out: list[list[Any]] = []
    for i, entry in enumerate(ledger):
        try:
            q, sigma, count = entry
        except (TypeError, ValueError):
            raise ValueError(f"ledger entry {i} must be (q, sigma, count), got {entry!r}") from None
        q = _check_q(q, f"ledger entry {i}: sample rate q")
        sigma = _check_sigma(sigma, f"ledger entry {i}: noise multiplier sigma")
        count = _check_count(count, f"ledger entry {i}: step count")
        if count == 0:
            continue
        if out and out[-1][0] == q and out[-1][1] == sigma:
            out[-1][2] += count
        else:
            out.append([q, sigma, count])
    return tuple((q, s, c) for q, s, c in out)


def _append(key: LedgerKey, q: float, sigma: float, count: int) -> LedgerKey:
    if count == 0:
        return key
    if key and key[-1][0] == q and key[-1][1] == sigma:
        return key[:-1] + ((q, sigma, key[-1][2] + count),)
    return key + ((q, sigma, count),)


def dominates(certified: LedgerKey, candidate: LedgerKey) -> bool:
    """Whether every step of ``candidate`` maps injectively to a ``certified`` step with the
    same q and a sigma <= its own (Hall's condition, checked per q at every threshold)."""
    cand: dict[float, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    cert: dict[float, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for q, s, c in candidate:
        cand[q][s] += c
    for q, s, c in certified:
        cert[q][s] += c
    for q, a in cand.items():
        if q not in cert:
            return False
        b = cert[q]
        n_a = n_b = 0
        for s in sorted(set(a) | set(b)):
            n_a += a.get(s, 0)
            n_b += b.get(s, 0)
            if n_a > n_b:
                return False
    return True


class _Plan:
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

    def point(self, t: int) -> tuple[float, float]:
        """(q, bucketed sigma) of step t, validated."""
        point = self.schedule(t)
        try:
            q, sigma = point
        except (TypeError, ValueError):
            raise ValueError(f"schedule({t}) must return (q, sigma), got {point!r}") from None
        q = _check_q(q, f"schedule({t}): sample rate q")
        return q, self.bucket(_check_sigma(sigma, f"schedule({t}): noise multiplier sigma"))

    def ledger(self, steps: int) -> LedgerKey:
        out = [list(e) for e in self.base]
        for t in range(steps):
            q, s = self.point(t)
            if out and out[-1][0] == q and out[-1][1] == s:
                out[-1][2] += 1
            else:
                out.append([q, s, 1])
        return tuple((q, s, c) for q, s, c in out)


class PrivacyAccountant:
    """Ledger of (q, sigma, count) Poisson-subsampled Gaussian steps, its epsilon and the budget.

    Args (keyword-only):
        delta: target delta of the (epsilon, delta) guarantee, in (0, 1).
        epsilon_budget: the budget; None for no budget (``step`` always records).
        accountant: the rigorous accountant used for the budget check, "pld" or "rdp".
        sigma_rel_grid: r in [0, 0.5); each sigma is rounded DOWN to (1 + r)^k before it
            enters the ledger (conservative; 0 = exact). See the module docstring.
        pld_discretization: ``value_discretization_interval`` of the PLD accountant, in
            (0, 0.1]; smaller is tighter and slower.

    Privacy caveat: the guarantee is per record under add/remove adjacency and assumes
    Poisson sampling with the recorded q, noise std sigma * C on sums of records clipped
    to L2 norm C, and noise that the adversary cannot predict. ``epsilon()["gdp"]`` is an
    approximation that can under-estimate epsilon; the budget uses ``rigorous_name``.
    """

    def __init__(
        self,
        *,
        delta: float,
        epsilon_budget: float | None = None,
        accountant: str = "pld",
        sigma_rel_grid: float = 0.01,
        pld_discretization: float = 1e-3,
    ) -> None:
        delta = _real("delta", delta)
        if not (0.0 < delta < 1.0):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if epsilon_budget is not None:
            epsilon_budget = _real("epsilon_budget", epsilon_budget)
            if not (epsilon_budget > 0.0):
                raise ValueError(f"epsilon_budget must be None or > 0, got {epsilon_budget!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)}, got {accountant!r}")
        sigma_rel_grid = _real("sigma_rel_grid", sigma_rel_grid)
        if not (0.0 <= sigma_rel_grid < 0.5):
            raise ValueError(f"sigma_rel_grid must be in [0, 0.5), got {sigma_rel_grid!r}")
        pld_discretization = _real("pld_discretization", pld_discretization)
        if not (0.0 < pld_discretization <= 0.1):
            raise ValueError(f"pld_discretization must be in (0, 0.1], got {pld_discretization!r}")
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.rigorous_name = accountant
        self.sigma_rel_grid = sigma_rel_grid
        self.pld_discretization = pld_discretization
        self._ledger: LedgerKey = ()
        self._certified: list[LedgerKey] = []
        self._bucket_cache: dict[float, float] = {}
        self._single_pld = _LRU(_ENTRY_CACHE)
        self._entry_pld = _LRU(_ENTRY_CACHE)
        self._prefix_pld = _LRU(_PREFIX_CACHE)
        self._rdp_vec: dict[tuple[float, float], Any] = {}
        self._eps_cache = _LRU(_EPS_CACHE)

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(delta={self.delta!r}, epsilon_budget={self.epsilon_budget!r}, "
            f"accountant={self.rigorous_name!r}, sigma_rel_grid={self.sigma_rel_grid!r}, "
            f"pld_discretization={self.pld_discretization!r}; {self.steps} steps in "
            f"{len(self._ledger)} entries)"
        )

    # -- the ledger ------------------------------------------------------------
    @property
    def ledger(self) -> list[Entry]:
        """The run-length encoded ledger [(q, bucketed sigma, count), ...] in step order."""
        return list(self._ledger)

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(c for _, _, c in self._ledger)

    def bucket(self, sigma: float) -> float:
        """sigma rounded DOWN onto the grid (1 + r)^k, r = ``sigma_rel_grid``; always <= sigma.

        With r = 0 sigma is returned unchanged. Rounding down is conservative because
        epsilon is non-increasing in sigma.
        """
        sigma = _check_sigma(sigma)
        r = self.sigma_rel_grid
        if r == 0.0:
            return sigma
        cached = self._bucket_cache.get(sigma)
        if cached is not None:
            return cached
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
        if len(self._bucket_cache) >= _BUCKET_CACHE:
            self._bucket_cache.clear()
        self._bucket_cache[sigma] = value
        return value

    def ledger_after(
        self, schedule: Callable[[int], tuple[float, float]], steps: int
    ) -> list[Entry]:
        """The ledger after ``steps`` more steps along ``schedule(t) -> (q, sigma)``, t = 0, 1, ...

        Sigma is bucketed as in :meth:`step`; nothing is recorded.
        """
        steps = _check_count(steps, "steps")
        return list(_Plan(self._ledger, schedule, self.bucket).ledger(steps))

    # -- epsilon -----------------------------------------------------------------
    def _key(self, ledger: Iterable[Any] | None) -> LedgerKey:
        return self._ledger if ledger is None else _normalise(ledger)

    def epsilon(self, ledger: Iterable[Any] | None = None) -> dict[str, float]:
        """{"gdp": CLT (approximate), "pld": rigorous, "rdp": rigorous} at ``delta``.

        For the recorded ledger (sigma already bucketed), or for a given list of
        (q, sigma, count), which is used as given (no bucketing). Empty ledger: all 0.0.
        """
        key = self._key(ledger)
        return {
            "gdp": self._gdp(key),
            "pld": self._eps("pld", key),
            "rdp": self._eps("rdp", key),
        }

    def rigorous_epsilon(self, ledger: Iterable[Any] | None = None) -> float:
        """Epsilon of the ledger under the rigorous accountant ``rigorous_name`` (budget check)."""
        return self._eps(self.rigorous_name, self._key(ledger))

    def mu(self, ledger: Iterable[Any] | None = None) -> float:
        """The Gaussian-DP CLT mu of the ledger (see :func:`fedsgld.privacy.gdp.gdp_mu`)."""
        return gdp_mu(self._key(ledger))

    def _gdp(self, key: LedgerKey) -> float:
        return float(gdp_epsilon(gdp_mu(key), self.delta)) if key else 0.0

    def _eps(self, name: str, key: LedgerKey) -> float:
        if not key:
            return 0.0
        cached = self._eps_cache.lookup((name, key))
        if cached is not None:
            return cached
        value = self._pld_epsilon(key) if name == "pld" else self._rdp_epsilon(key)
        self._eps_cache.put((name, key), value)
        return value

    # PLD: one PLD per (q, sigma) and per (q, sigma, count), composed prefix by prefix
    def _single(self, q: float, sigma: float) -> Any:
        pld = self._single_pld.lookup((q, sigma))
        if pld is None:
            from dp_accounting import NeighboringRelation
            from dp_accounting.pld import privacy_loss_distribution as pld_lib

            pld = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma,
                sensitivity=1.0,
                pessimistic_estimate=True,
                value_discretization_interval=self.pld_discretization,
                sampling_prob=q,
                use_connect_dots=True,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            )
            self._single_pld.put((q, sigma), pld)
        return pld

    def _entry(self, q: float, sigma: float, count: int) -> Any:
        if count == 1:
            return self._single(q, sigma)
        pld = self._entry_pld.lookup((q, sigma, count))
        if pld is None:
            if count > _POWER_MAX:  # one FFT power
                pld = self._single(q, sigma).self_compose(count)
            elif count % 2:  # short runs: square-and-multiply by pairwise composition is faster
                pld = self._entry(q, sigma, count - 1).compose(self._single(q, sigma))
            else:
                half = self._entry(q, sigma, count // 2)
                pld = half.compose(half)
            self._entry_pld.put((q, sigma, count), pld)
        return pld

    def _pld_of(self, key: LedgerKey) -> Any:
        """PLD of the composition of all entries, reusing the longest cached prefix."""
        n = len(key)
        pld, start = None, 0
        for k in range(n, 0, -1):
            hit = self._prefix_pld.lookup(key[:k])
            if hit is not None:
                pld, start = hit, k
                break
            q, s, c = key[k - 1]
            if c > 1:  # the same ledger one step shorter (the per-step pattern)
                hit = self._prefix_pld.lookup(key[: k - 1] + ((q, s, c - 1),))
                if hit is not None:
                    pld, start = hit.compose(self._single(q, s)), k
                    self._prefix_pld.put(key[:k], pld)
                    break
        for i in range(start, n):
            entry = self._entry(*key[i])
            pld = entry if pld is None else pld.compose(entry)
            self._prefix_pld.put(key[: i + 1], pld)
        return pld

    def _pld_epsilon(self, key: LedgerKey) -> float:
        return float(self._pld_of(key).get_epsilon_for_delta(self.delta))

    # RDP: the per-step RDP curve per (q, sigma), summed with counts
    def _rdp_epsilon(self, key: LedgerKey) -> float:
        from dp_accounting import dp_event
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        _quiet_rdp_order_warnings()

        total = None
        orders = None
        for q, s, c in key:
            vec = self._rdp_vec.get((q, s))
            if vec is None:
                acc = rdp_lib.RdpAccountant()
                acc.compose(
                    dp_event.PoissonSampledDpEvent(
                        sampling_probability=q, event=dp_event.GaussianDpEvent(noise_multiplier=s)
                    )
                )
                vec = (acc.orders, acc.rdp.copy())
                self._rdp_vec[(q, s)] = vec
            orders = vec[0]
            total = c * vec[1] if total is None else total + c * vec[1]
        eps, _ = rdp_lib.compute_epsilon(orders, total, self.delta)
        return float(eps)

    # -- the budget ------------------------------------------------------------------
    def _certify(self, key: LedgerKey) -> None:
        self._certified = [key] + [c for c in self._certified if not dominates(key, c)]
        del self._certified[_MAX_CERTIFIED:]

    def _within_budget(self, key: LedgerKey) -> tuple[bool, float | None]:
        """(ok, epsilon or None when certified by domination without computing)."""
        assert self.epsilon_budget is not None
        if any(dominates(c, key) for c in self._certified):
            return True, None
        eps = self.rigorous_epsilon(key)
        if eps <= self.epsilon_budget:
            self._certify(key)
            return True, eps
        return False, eps

    def check(self, q: float, sigma: float) -> bool:
        """Whether one more step (q, sigma) keeps the rigorous epsilon <= budget (True without a budget)."""
        q, s = _check_q(q), self.bucket(sigma)
        if self.epsilon_budget is None:
            return True
        return self._within_budget(_append(self._ledger, q, s, 1))[0]

    def step(self, q: float, sigma: float) -> None:
        """Record one step (q, sigma), sigma rounded down onto the grid.

        Raises:
            BudgetExhausted: the step would take the rigorous epsilon past the budget. The
                step is NOT recorded (a step that would overspend is never taken).
        """
        q, s = _check_q(q), self.bucket(sigma)
        key = _append(self._ledger, q, s, 1)
        if self.epsilon_budget is not None:
            ok, eps = self._within_budget(key)
            if not ok:
                assert eps is not None
                raise BudgetExhausted(
                    f"step {self.steps + 1} (q={q:g}, sigma={float(sigma):.6g}) would take epsilon "
                    f"({self.rigorous_name}) to {eps:.6g} > budget {self.epsilon_budget:g} at "
                    f"delta={self.delta:g}; not recorded",
                    epsilon=eps,
                    budget=self.epsilon_budget,
                )
        self._ledger = key

    def max_steps(self, schedule: Callable[[int], tuple[float, float]], *, limit: int) -> int:
        """Largest T <= ``limit`` such that T more steps along ``schedule`` stay within budget.

        ``schedule(t) -> (q, sigma)`` for t = 0, 1, ... counts from the CURRENT ledger; each
        sigma is bucketed as in :meth:`step`. The search walks the schedule run by run (a run
        = consecutive steps with the same bucketed (q, sigma), cut so that each run at most
        doubles the steps walked so far, which makes a constant schedule an exponential
        search), checks the ledger at the end of each run, and bisects inside the first run
        that overspends (epsilon is non-decreasing in the number of steps). Every ledger
        found within budget is certified, the last one being the ledger after T steps, so
        the following ``step`` calls along the same schedule only run domination checks.
        See the module docstring for the measured cost.

        Raises:
            ValueError: no ``epsilon_budget``, ``limit`` not an integer >= 0, or a bad
                ``schedule(t)`` value.
        """
        if self.epsilon_budget is None:
            raise ValueError("max_steps needs an epsilon_budget (got None)")
        limit = _check_count(limit, "limit")
        plan = _Plan(self._ledger, schedule, self.bucket)
        key, t = self._ledger, 0
        pending: tuple[float, float] | None = None  # step t's point, if already evaluated
        while t < limit:
            q, s = pending if pending is not None else plan.point(t)
            pending = None
            n, cap = 1, min(limit - t, max(1, t))
            while n < cap:
                nxt = plan.point(t + n)
                if nxt != (q, s):
                    pending = nxt
                    break
                n += 1
            if self._within_budget(_append(key, q, s, n))[0]:
                key, t = _append(key, q, s, n), t + n
                continue
            lo, hi = 0, n  # lo steps of this run fit, hi do not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._within_budget(_append(key, q, s, mid))[0]:
                    lo = mid
                else:
                    hi = mid
            return t + lo
        return t

    # -- checkpoints -------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "budget": self.epsilon_budget,
            "accountant": self.rigorous_name,
            "sigma_rel_grid": self.sigma_rel_grid,
            "pld_discretization": self.pld_discretization,
        }

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: the ledger (as [q, sigma, count] lists) and the settings."""
        return {
            "version": STATE_VERSION,
            "ledger": [[q, s, c] for q, s, c in self._ledger],
            "steps": self.steps,
            **self._settings(),
        }

    @staticmethod
    def _read_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], LedgerKey]:
        if not isinstance(state, Mapping):
            raise ValueError(f"privacy accountant state must be a dict, got {type(state).__name__}")
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(
                f"privacy accountant state version must be {STATE_VERSION}, got {version!r}"
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"privacy accountant state lacks {missing}")
        settings = {
            "delta": state["delta"],
            "epsilon_budget": state["budget"],
            "accountant": state["accountant"],
            "sigma_rel_grid": state["sigma_rel_grid"],
            "pld_discretization": state["pld_discretization"],
        }
        return settings, _normalise(state["ledger"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the ledger of :meth:`state_dict`, replacing the current one.

        The saved settings (delta, budget, accountant, sigma_rel_grid, pld_discretization)
        must EQUAL this accountant's: a mismatch raises ValueError naming the setting,
        rather than silently changing the budget or the guarantee of a resumed run. Use
        :meth:`from_state_dict` to rebuild an accountant with the saved settings. The
        ledger's sigmas are re-bucketed (a no-op for sigmas already on this grid).
        """
        settings, key = self._read_state(state)
        ours = {
            "delta": self.delta,
            "epsilon_budget": self.epsilon_budget,
            "accountant": self.rigorous_name,
            "sigma_rel_grid": self.sigma_rel_grid,
            "pld_discretization": self.pld_discretization,
        }
        for name, value in settings.items():
            if value != ours[name]:
                raise ValueError(
                    f"load_state_dict: the saved {name}={value!r} differs from this accountant's "
                    f"{name}={ours[name]!r}; use PrivacyAccountant.from_state_dict to restore the "
                    "saved settings"
                )
        self._ledger = _normalise((q, self.bucket(s), c) for q, s, c in key)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        """A new accountant with the saved settings and ledger."""
        settings, _ = cls._read_state(state)
        acc = cls(**settings)
        acc.load_state_dict(state)
        return acc
