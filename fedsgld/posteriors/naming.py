"""Honest names for the models a run reports besides its last iterate.

Every run keeps every ``thin``-th iterate after ``burn_in`` and reports the mean softmax
over them. What that average *is* depends on the method:

* ``dpsgld``: after burn-in, DP-SGLD's iterates are (approximate, tempered) samples of the
  Bayesian posterior, so their mean softmax is a **posterior average** (Bayesian model
  averaging): suffix ``+bma``.
* ``sgd`` and ``dpsgd``: the iterates of an optimiser are not posterior samples; their mean
  softmax is an ensemble along the optimisation path, an **iterate average**: ``+avg``.
* ``dpvi`` and ``vi``: every iterate is a variational posterior q, and the prediction of
  ONE iterate already averages the softmax over draws from q (the last iterate's metrics
  are q's posterior predictive). The average over kept iterates mixes several q along the
  optimisation path: an **iterate average of variational posteriors**, ``+avg``.

SWAG (``+swag``, :mod:`fedsgld.posteriors.swag`) fits a Gaussian to the kept iterates and
averages the softmax over draws from it; temperature scaling (``+recal``,
:mod:`fedsgld.calibration.recal`) rescales the last iterate's logits.
"""

from __future__ import annotations

from typing import Any

LANGEVIN_METHODS = ("dpsgld",)
VARIATIONAL_METHODS = ("dpvi", "vi")

SWAG = {
    "kind": "swag",
    "suffix": "+swag",
    "label": "SWAG average",
}
RECAL = {
    "kind": "temperature_scaling",
    "suffix": "+recal",
    "label": "temperature-scaled last iterate",
}


def iterate_average(method: str) -> dict[str, Any]:
    """``kind``, ``suffix``, ``label`` and ``note`` of the average over kept iterates."""
    if method in LANGEVIN_METHODS:
        return {
            "kind": "posterior_average",
            "suffix": "+bma",
            "label": "posterior average (Bayesian model averaging)",
            "note": "the mean softmax over Langevin samples of the posterior kept after burn-in",
        }
    if method in VARIATIONAL_METHODS:
        return {
            "kind": "iterate_average",
            "suffix": "+avg",
            "label": "iterate average of variational posteriors",
            "note": "each iterate's prediction already averages over draws from its q; this "
            "averages the kept iterates along the optimisation path, which are not posterior "
            "samples",
        }
    return {
        "kind": "iterate_average",
        "suffix": "+avg",
        "label": "iterate average",
        "note": "the mean softmax over optimiser iterates kept after burn-in: an ensemble "
        "along the optimisation path, not samples of a posterior",
    }


__all__ = ["LANGEVIN_METHODS", "RECAL", "SWAG", "VARIATIONAL_METHODS", "iterate_average"]
