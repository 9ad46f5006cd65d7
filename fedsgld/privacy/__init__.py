"""Privacy accounting, free of torch: privacy events (what each release costs), the
accountants that compose them, the GDP CLT and rigorous cross-checks, noise schedules,
the PATE analysis, audit bounds and the server's ledger chain.

Nothing here imports torch, so the accountant (``fedsgld privacy``) starts fast; the noise
and clipping that the accounting describes are torch maths and live in :mod:`fedsgld.core`.
"""

from __future__ import annotations

from fedsgld.privacy.accountant import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.events import (
    Composed,
    DpEvent,
    GaussianRelease,
    Repeated,
    SubsampledGaussianStep,
)
from fedsgld.privacy.gdp import gdp_delta, gdp_epsilon, gdp_mu

__all__ = [
    "BudgetExhausted",
    "Composed",
    "DpEvent",
    "GaussianRelease",
    "PrivacyAccountant",
    "Repeated",
    "SubsampledGaussianStep",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
]
