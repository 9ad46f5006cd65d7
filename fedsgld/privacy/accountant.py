"""The privacy accountant: a ledger of Poisson-subsampled Gaussian steps and its epsilon.

Every training step t releases S_t + N(0, (sigma_t C)^2 I), where S_t is a sum of records'
gradients, each clipped to L2 norm <= C, and every record enters S_t independently with
probability q_t (Poisson sampling). Neighbouring datasets differ by adding or removing
one record. The accountant keeps the run-length encoded ledger ``[(q, sigma, count), ...]``
and converts it to an (epsilon, delta) guarantee with these accountants:

* ``"gdp"``: Gaussian DP central limit theorem (Dong, Roth & Su 2019), the paper's
  accountant, mu = sqrt(sum_t q_t^2 (exp(1/sigma_t^2) - 1)). APPROXIMATE: it
  under-estimates epsilon (2-12 % for a constant sigma, ~20 % for a decaying DP-SGLD
  schedule ending below sigma = 1). Reported, never used for the budget. It is computed
  on the sigmas as given to :meth:`~PrivacyAccountant.step` (not the rounded ones).
* ``"pld"`` (default): privacy loss distributions composed in the Fourier domain
  (:mod:`fedsgld.privacy.pld_fft`): every distinct step discretised by pessimistic
  connect-the-dots on one shared grid, composed by one product of transforms, truncation
  and the finite window counted in delta. A certified upper bound, within ~0.2 % of the
  exact epsilon, in well under a second for thousands of distinct sigmas.
* ``"rdp"``: Renyi DP (Mironov et al. 2019, conversion of Canonne, Kamath & Steinke 2020;
  :mod:`fedsgld.privacy.rdp`, the formulas of ``dp_accounting.rdp`` vectorised over
  sigma): a valid but looser upper bound.
* ``"dp_accounting_pld"``: the reference, ``dp_accounting``'s PLD accountant (connect-the-
  dots, pessimistic, ``value_discretization_interval = pld_discretization``), one PLD per
  distinct (q, sigma): accurate, but seconds to minutes for a ledger with many distinct
  sigmas. Only computed when chosen as ``accountant``.

The budget check uses the rigorous accountant chosen by ``accountant``.

Conservative sigma grid
-----------------------
``sigma_rel_grid = r > 0`` rounds each sigma DOWN onto the geometric grid
{(1 + r)^k : k integer} before it enters the ledger (r = 0, the default: exact). Epsilon
of the subsampled Gaussian mechanism is non-increasing in sigma, so the bucketed
ledger's epsilon is an upper bound on the exact ledger's; it pays up to a relative
1 - 1/(1+r) of noise per step (about +1.5 % epsilon at r = 0.01 for a decaying DP-SGLD
schedule). It keeps ledgers short, which only the ``"dp_accounting_pld"`` reference
needs. (Internally ``"pld"`` and ``"rdp"`` account steps whose sigmas lie within a
relative 1e-3 of each other together at the smallest of them, which costs about 0.1 %.)

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

Performance: see ``benchmarks/accountant_speed.py`` (epsilon of a 2,000-step DP-SGLD
schedule with a distinct sigma per step: "pld" a fraction of a second; ``max_steps``
searches the step count with a few such evaluations).
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from fedsgld.privacy import pld_fft
from fedsgld.privacy.gdp import gdp_epsilon, gdp_mu
from fedsgld.privacy.rdp import ledger_rdp_epsilon

__all__ = ["ACCOUNTANTS", "BudgetExhausted", "PrivacyAccountant"]

Entry = tuple[float, float, int]
LedgerKey = tuple[Entry, ...]

#: rigorous accountants: fedsgld's FFT PLD (default), Renyi DP, dp_accounting's PLD
ACCOUNTANTS = ("pld", "rdp", "dp_accounting_pld")
REFERENCE_PLD = "dp_accounting_pld"

STATE_VERSION = 1
_STATE_KEYS = ("ledger", "delta", "budget", "accountant", "sigma_rel_grid", "pld_discretization")

_MAX_CERTIFIED = 4
_PREFIX_CACHE = 64
_ENTRY_CACHE = 256
_EPS_CACHE = 1024
_BUCKET_CACHE = 100_000
_POWER_MAX = 512  # self-compose counts above this with one FFT power
_MERGE = pld_fft.DEFAULT_SIGMA_MERGE  # relative sigma bins of "pld" and "rdp"


def _gdp_mu2(q: float, sigma: float) -> float:
    """One step's contribution q^2 (exp(1/sigma^2) - 1) to mu^2 (inf on overflow)."""
    return gdp_mu([(q, sigma, 1)]) ** 2


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


def _is_prefix(certified: LedgerKey, candidate: LedgerKey) -> bool:
    """Whether ``candidate`` is the first steps of ``certified`` (the per-step pattern)."""
    n = len(candidate)
    if n == 0:
        return True
    if n > len(certified) or candidate[: n - 1] != certified[: n - 1]:
        return False
    (q, s, c), (q2, s2, c2) = candidate[-1], certified[n - 1]
    return q == q2 and s == s2 and c <= c2


def dominates(certified: LedgerKey, candidate: LedgerKey) -> bool:
    """Whether every step of ``candidate`` maps injectively to a ``certified`` step with the
    same q and a sigma <= its own (Hall's condition, checked per q at every threshold)."""
    if _is_prefix(certified, candidate):
        return True
    if not certified:
        return False
    a = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(certified, dtype=np.float64)
    for q in np.unique(a[:, 0]):
        sa, sb = a[a[:, 0] == q], b[b[:, 0] == q]
        if sb.size == 0:
            return False
        oa, ob = np.argsort(sa[:, 1], kind="stable"), np.argsort(sb[:, 1], kind="stable")
        sig_a, cum_a = sa[oa, 1], np.cumsum(sa[oa, 2])
        sig_b, cum_b = sb[ob, 1], np.cumsum(sb[ob, 2])
        # at every candidate sigma s: #{candidate <= s} <= #{certified <= s}
        n_a = cum_a[np.searchsorted(sig_a, sig_a, side="right") - 1]
        i_b = np.searchsorted(sig_b, sig_a, side="right") - 1
        n_b = np.where(i_b >= 0, cum_b[np.maximum(i_b, 0)], 0.0)
        if np.any(n_a > n_b):
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
            q = _check_q(q, f"schedule({i}): sample rate q")
            sigma = _check_sigma(sigma, f"schedule({i}): noise multiplier sigma")
            self._points.append((q, self.bucket(sigma)))
        return self._points[t]

    def ledger(self, steps: int) -> LedgerKey:
        if steps > 0:
            self.point(steps - 1)
        out = [list(e) for e in self.base]
        for q, s in self._points[:steps]:
            if out and out[-1][0] == q and out[-1][1] == s:
                out[-1][2] += 1
            else:
                out.append([q, s, 1])
        return tuple((q, s, c) for q, s, c in out)


def single_step_delta_lower_bound(key: Iterable[tuple[float, float, int]], eps: float) -> float:
    """max over the ledger's entries of ONE step's delta(eps): a lower bound on the ledger's.

    One Poisson-subsampled Gaussian step (rate q, noise multiplier sigma), remove direction
    (Balle, Barthe & Gaboardi 2018, exact for the Gaussian): delta(eps) = q delta_G(eps'),
    eps' = log(1 + (e^eps - 1) / q), with the Gaussian mechanism's exact profile
    delta_G(e) = Phi(1/(2 sigma) - e sigma) - e^e Phi(-1/(2 sigma) - e sigma)
    (Balle & Wang 2018). Composing more steps never lowers delta(eps), so a value above
    the target delta proves the ledger overspends.
    """
    from scipy.special import log_ndtr, ndtr

    arr = np.asarray([(q, s) for q, s, _ in key], dtype=np.float64)
    q, sigma = arr[:, 0], arr[:, 1]
    with np.errstate(divide="ignore"):
        log1mq = np.where(q < 1.0, np.log1p(-np.minimum(q, 1.0 - 1e-300)), -np.inf)
    e = np.logaddexp(eps, log1mq) - np.log(q)
    a = 1.0 / (2.0 * sigma) - e * sigma
    b = -1.0 / (2.0 * sigma) - e * sigma
    delta_g = ndtr(a) - np.exp(e + log_ndtr(b))
    return float(np.max(q * np.clip(delta_g, 0.0, 1.0)))


class PrivacyAccountant:
    """Ledger of (q, sigma, count) Poisson-subsampled Gaussian steps, its epsilon and the budget.

    Args (keyword-only):
        delta: target delta of the (epsilon, delta) guarantee, in (0, 1).
        epsilon_budget: the budget; None for no budget (``step`` always records).
        accountant: the rigorous accountant used for the budget check: "pld" (default,
            fedsgld's FFT PLD), "rdp" or "dp_accounting_pld" (the reference).
        sigma_rel_grid: r in [0, 0.5); each sigma is rounded DOWN to (1 + r)^k before it
            enters the ledger (conservative; 0 = exact, the default). See the module
            docstring.
        pld_discretization: ``value_discretization_interval`` of the "dp_accounting_pld"
            reference, in (0, 0.1]; smaller is tighter and slower. ("pld" chooses its grid
            itself, see :mod:`fedsgld.privacy.pld_fft`.)

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
        sigma_rel_grid: float = 0.0,
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
        self._rdp_cache: dict[tuple[float, float], Any] = {}
        self._eps_cache = _LRU(_EPS_CACHE)
        self._mu2 = 0.0  # GDP mu^2 of the recorded steps at their exact sigmas

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

        For the recorded ledger (sigma already bucketed; "gdp" on the exact sigmas that
        were recorded), or for a given list of (q, sigma, count), which is used as given
        (no bucketing). With ``accountant="dp_accounting_pld"`` the dict also holds that
        reference under its name. Empty ledger: all 0.0.
        """
        key = self._key(ledger)
        out = {
            "gdp": self._gdp_exact() if ledger is None else self._gdp(key),
            "pld": self._eps("pld", key),
            "rdp": self._eps("rdp", key),
        }
        if self.rigorous_name not in out:
            out[self.rigorous_name] = self._eps(self.rigorous_name, key)
        return out

    def rigorous_epsilon(self, ledger: Iterable[Any] | None = None) -> float:
        """Epsilon of the ledger under the rigorous accountant ``rigorous_name`` (budget check)."""
        return self._eps(self.rigorous_name, self._key(ledger))

    def delta_at(self, epsilon: float, ledger: Iterable[Any] | None = None) -> float:
        """Upper bound on delta at ``epsilon`` of the ledger, by the FFT PLD accountant "pld".

        Resolved down to about 1e-6 of this accountant's ``delta`` (smaller deltas are
        reported as that resolution, never as less than the bound)."""
        epsilon = _real("epsilon", epsilon)
        if epsilon < 0.0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        key = self._key(ledger)
        if not key:
            return 0.0
        return pld_fft.compose(key, delta=self.delta, sigma_merge=_MERGE).delta(epsilon)

    def mu(self, ledger: Iterable[Any] | None = None) -> float:
        """The Gaussian-DP CLT mu of the ledger (see :func:`fedsgld.privacy.gdp.gdp_mu`);
        for the recorded ledger, at the exact sigmas that were recorded."""
        if ledger is None:
            return math.sqrt(self._mu2)
        return gdp_mu(self._key(ledger))

    def _gdp(self, key: LedgerKey) -> float:
        return float(gdp_epsilon(gdp_mu(key), self.delta)) if key else 0.0

    def _gdp_exact(self) -> float:
        if not self._ledger:
            return 0.0
        return float(gdp_epsilon(math.sqrt(self._mu2), self.delta))

    def _eps(self, name: str, key: LedgerKey) -> float:
        if not key:
            return 0.0
        cached = self._eps_cache.lookup((name, key))
        if cached is not None:
            return cached
        if name == "pld":
            value = self._fft_epsilon(key)
        elif name == "rdp":
            value = self._rdp_epsilon(key)
        else:
            value = self._pld_epsilon(key)
        self._eps_cache.put((name, key), value)
        return value

    # the default: fedsgld's FFT PLD (pld_fft), every distinct sigma at once
    def _fft_epsilon(self, key: LedgerKey) -> float:
        return pld_fft.compose(key, delta=self.delta, sigma_merge=_MERGE).epsilon(self.delta)

    # the reference, dp_accounting's PLD: one PLD per (q, sigma) and per (q, sigma, count),
    # composed prefix by prefix
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

    # RDP: the per-step RDP curves, vectorised over the distinct (q, sigma), summed with counts
    def _rdp_epsilon(self, key: LedgerKey) -> float:
        groups = pld_fft._groups(key, _MERGE)
        return float(ledger_rdp_epsilon(groups, self.delta, cache=self._rdp_cache)[0])

    # -- the budget ------------------------------------------------------------------
    def _certify(self, key: LedgerKey) -> None:
        self._certified = [key] + [c for c in self._certified if not dominates(key, c)]
        del self._certified[_MAX_CERTIFIED:]

    def _within_budget(self, key: LedgerKey) -> tuple[bool, float | None]:
        """(ok, epsilon or None when certified by domination without computing)."""
        assert self.epsilon_budget is not None
        if any(dominates(c, key) for c in self._certified):
            return True, None
        if key and single_step_delta_lower_bound(key, self.epsilon_budget) > self.delta:
            # one step alone already overspends (e.g. a noise multiplier near 0): refuse
            # without building a privacy loss distribution, whose grid would be enormous
            return False, math.inf
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
        self._mu2 += _gdp_mu2(q, _check_sigma(sigma))

    def max_steps(self, schedule: Callable[[int], tuple[float, float]], *, limit: int) -> int:
        """Largest T <= ``limit`` such that T more steps along ``schedule`` stay within budget.

        ``schedule(t) -> (q, sigma)`` for t = 0, 1, ... counts from the CURRENT ledger; each
        sigma is bucketed as in :meth:`step`. Epsilon is non-decreasing in the number of
        steps, so the search brackets T by doubling the step count and then narrows the
        bracket by interpolating epsilon between its ends (bisection when that stalls):
        a few evaluations of the whole ledger, each a fraction of a second with "pld" or
        "rdp". (With "dp_accounting_pld" it walks the schedule run by run instead, which
        suits that accountant's prefix cache.) Every ledger found within budget is
        certified, the last one being the ledger after T steps, so the following ``step``
        calls along the same schedule only run domination checks.

        Raises:
            ValueError: no ``epsilon_budget``, ``limit`` not an integer >= 0, or a bad
                ``schedule(t)`` value.
        """
        if self.epsilon_budget is None:
            raise ValueError("max_steps needs an epsilon_budget (got None)")
        limit = _check_count(limit, "limit")
        plan = _Plan(self._ledger, schedule, self.bucket)
        if self.rigorous_name == REFERENCE_PLD:
            return self._max_steps_by_runs(plan, limit)
        return self._max_steps_by_search(plan, limit)

    def _max_steps_by_search(self, plan: _Plan, limit: int) -> int:
        budget = self.epsilon_budget
        assert budget is not None

        def ok(t: int) -> tuple[bool, float | None]:
            return self._within_budget(plan.ledger(t))

        if limit == 0:
            return 0
        lo, eps_lo = 0, 0.0  # lo steps fit (eps_lo None: certified without a value)
        t = 1
        while True:  # doubling: lo fits, hi does not
            fits, eps = ok(t)
            if fits:
                lo, eps_lo = t, eps
                if t == limit:
                    return limit
                t = min(2 * t, limit)
                continue
            hi, eps_hi = t, eps
            break
        stall = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if stall < 2 and eps_lo is not None and eps_hi is not None and eps_hi > eps_lo:
                frac = (budget - eps_lo) / (eps_hi - eps_lo)
                guess = lo + int(round(frac * (hi - lo)))
                mid = min(max(guess, lo + 1), hi - 1)
            fits, eps = ok(mid)
            if fits:
                stall = stall + 1 if mid - lo < (hi - lo) // 8 else 0
                lo, eps_lo = mid, eps
            else:
                stall = stall + 1 if hi - mid < (hi - lo) // 8 else 0
                hi, eps_hi = mid, eps
        return lo

    def _max_steps_by_runs(self, plan: _Plan, limit: int) -> int:
        """Walk the schedule run by run (a run = consecutive steps with the same bucketed
        (q, sigma), cut so that each run at most doubles the steps walked so far), check the
        ledger at the end of each run, bisect inside the first run that overspends."""
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
        """A JSON-serialisable dict: the ledger (as [q, sigma, count] lists), the settings and
        ``gdp_mu2`` (the GDP mu^2 of the recorded steps at their exact sigmas)."""
        return {
            "version": STATE_VERSION,
            "ledger": [[q, s, c] for q, s, c in self._ledger],
            "steps": self.steps,
            "gdp_mu2": self._mu2 if math.isfinite(self._mu2) else None,
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
        # GDP at the exact sigmas, when the state has it (older states: the ledger's sigmas)
        mu2 = state.get("gdp_mu2")
        if mu2 is None or isinstance(mu2, bool) or not isinstance(mu2, numbers.Real) or mu2 < 0:
            mu2 = gdp_mu(key) ** 2 if key else 0.0
        self._mu2 = float(mu2)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        """A new accountant with the saved settings and ledger."""
        settings, _ = cls._read_state(state)
        acc = cls(**settings)
        acc.load_state_dict(state)
        return acc
