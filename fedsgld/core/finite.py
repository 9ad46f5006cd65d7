"""Finite answers whatever parameters the server sends: the per-record rules.

The server's numbers are adversarial even when finite: a weight of 1e38 makes the logits
of exactly the records with some feature above a threshold overflow to inf, and a NaN
that reaches a released sum, a failed metric or an exception would tell which records
those are (noise does not hide a NaN; a failure is itself a release). So every per-record
quantity is made finite by a rule of that record alone, before anything is summed:

* a record's gradient (pre-noised or not) with a non-finite entry contributes the zero
  vector, and norms are computed where they cannot overflow
  (:func:`fedsgld.core.clipping.finite_clip_factors`): each record still moves a clipped
  sum by at most C;
* a record's predictive distribution with a non-finite entry is replaced by the uniform
  one (:func:`finite_probs`), so its loss is log K and every metric over it is defined.

Records whose quantities are finite (all ordinary ones) are left bit for bit as they were.
A refusal is decided from the request and the site's policy, before any record is read.
"""

from __future__ import annotations

import torch


def finite_probs(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` (N, K) with every row that holds a non-finite entry replaced by the
    uniform distribution 1/K (one record's rule: the other rows are unchanged, bitwise)."""
    bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    return torch.where(bad, torch.full_like(probs, 1.0 / probs.shape[-1]), probs)


def finite_vector(v: torch.Tensor) -> torch.Tensor:
    """``v`` with inf clamped to the dtype's largest finite value (-inf to the smallest);
    finite entries unchanged. For post-processing of an already noised release (a site's
    parameters after its own noised steps), where an overflow depends on the noise drawn,
    not on the records alone; NaN (which no finite noised step produces) becomes 0."""
    info = torch.finfo(v.dtype)
    return torch.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)


def clip_to_norm(v: torch.Tensor, bound: float) -> torch.Tensor:
    """``v * min(1, bound / ||v||_2)`` in float64, the norm taken there (a finite float32 vector's
    cannot overflow there). The projection onto the ball of radius ``bound`` moves no two
    vectors further apart, so a sum of records clipped to C still changes by at most C
    when one record is added or removed; a sum already within ``bound`` (every sum of at
    most ``bound / C`` clipped records) is returned unchanged. A site's secure-sum input
    is clipped to C times the count it publishes, so the sum of all sites stays within the
    norm the bits are chosen for whatever its true count is: no wrap of the modular sum
    that a record decides."""
    v = v.double()
    norm = float(torch.linalg.vector_norm(v))
    return v if not norm > bound else v * (bound / norm)


__all__ = ["clip_to_norm", "finite_probs", "finite_vector"]
