"""Calibration metrics (ECE, MCE, SCE, ACE, Brier, NLL, AUC) and reliability plots."""

from fedsgld.calibration.metrics import (
    ace,
    auc,
    bin_index,
    brier,
    calibration_report,
    ece_mce,
    nll,
    reliability_bins,
    sce,
    validate,
)

__all__ = [
    "ace",
    "auc",
    "bin_index",
    "brier",
    "calibration_report",
    "ece_mce",
    "nll",
    "reliability_bins",
    "sce",
    "validate",
]
