"""The reference accountant: ``dp_accounting``'s privacy loss distributions, cached.

``accountant = "dp_accounting_pld"`` composes one PLD per distinct (q, sigma) of the
ledger (connect-the-dots, pessimistic, ``value_discretization_interval`` chosen by the
accountant's ``pld_discretization``, add-or-remove-one adjacency). It is accurate but
slow for ledgers with many distinct sigmas, so :class:`ReferencePLD` caches the PLD of
every (q, sigma), of every (q, sigma, count) and of the ledger's recent prefixes: the
per-step pattern (the same ledger one step longer) costs one composition.

``dp_accounting`` is imported only when a PLD is built (it is slow to import and only
this accountant needs it).
"""

from __future__ import annotations

from typing import Any

from fedsgld.privacy.ledger import LRU, LedgerKey

__all__ = ["ReferencePLD"]

_PREFIX_CACHE = 64
_ENTRY_CACHE = 256
_POWER_MAX = 512  # self-compose counts above this with one FFT power


class ReferencePLD:
    """Epsilon of ledgers by ``dp_accounting``'s PLD accountant, with its caches."""

    def __init__(self, *, pld_discretization: float) -> None:
        self.pld_discretization = pld_discretization
        self._single_pld = LRU(_ENTRY_CACHE)
        self._entry_pld = LRU(_ENTRY_CACHE)
        self._prefix_pld = LRU(_PREFIX_CACHE)

    def single(self, q: float, sigma: float) -> Any:
        """The PLD of one step (q, sigma)."""
        pld = self._single_pld.lookup((q, sigma))
        if pld is None:
            # optional heavy dependency, only this reference accountant needs it
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

    def entry(self, q: float, sigma: float, count: int) -> Any:
        """The PLD of ``count`` steps (q, sigma)."""
        if count == 1:
            return self.single(q, sigma)
        pld = self._entry_pld.lookup((q, sigma, count))
        if pld is None:
            if count > _POWER_MAX:  # one FFT power
                pld = self.single(q, sigma).self_compose(count)
            elif count % 2:  # short runs: square-and-multiply by pairwise composition is faster
                pld = self.entry(q, sigma, count - 1).compose(self.single(q, sigma))
            else:
                half = self.entry(q, sigma, count // 2)
                pld = half.compose(half)
            self._entry_pld.put((q, sigma, count), pld)
        return pld

    def ledger_pld(self, key: LedgerKey) -> Any:
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
                    pld, start = hit.compose(self.single(q, s)), k
                    self._prefix_pld.put(key[:k], pld)
                    break
        for i in range(start, n):
            entry = self.entry(*key[i])
            pld = entry if pld is None else pld.compose(entry)
            self._prefix_pld.put(key[: i + 1], pld)
        return pld

    def epsilon(self, key: LedgerKey, delta: float) -> float:
        """Epsilon at ``delta`` of the (non-empty) ledger ``key``."""
        return float(self.ledger_pld(key).get_epsilon_for_delta(delta))
