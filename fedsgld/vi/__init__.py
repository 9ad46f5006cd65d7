"""Differentially private variational inference (DPVI, Jälkö et al. 2017) on fedsgld's sites."""

from fedsgld.vi.model import Adam, VariationalModel, kl_divergence, kl_gradient

__all__ = ["Adam", "VariationalModel", "kl_divergence", "kl_gradient"]
