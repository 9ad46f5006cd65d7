"""PATE across hospital sites: teachers per site, noisy vote aggregation, a student, and
the privacy analysis of Papernot et al. 2017 (LNMax) and 2018 (GNMax, Confident-GNMax)."""

from fedsgld.privacy.pate_analysis import gnmax_epsilon, lnmax_epsilon, vote_counts

__all__ = ["gnmax_epsilon", "lnmax_epsilon", "vote_counts"]
