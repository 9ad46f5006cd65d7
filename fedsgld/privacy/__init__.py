"""Privacy: the accountant (GDP CLT and rigorous cross-checks), noise and clipping."""

from .accountant import BudgetExhausted, PrivacyAccountant
from .clipping import clip_and_sum
from .gdp import gdp_delta, gdp_epsilon, gdp_mu
from .noise import gaussian_noise, os_seed, seeded_generator

__all__ = [
    "BudgetExhausted",
    "PrivacyAccountant",
    "clip_and_sum",
    "gaussian_noise",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "os_seed",
    "seeded_generator",
]
