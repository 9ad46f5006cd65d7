"""Private per-site recalibration (``recal_scope = "site"``): each site its own map.

One temperature for the whole federation cannot fix a site whose label rate differs from
the pooled one (Fed-Heart-Disease: Switzerland 98 % positive, Long Beach 78 %, the pool
about 55 %). Here every site k fits its own (s_k = log T_k, b_k) on its own calibration
split (held out of its training split), and its test predictions become

    p = softmax(z e^{-s_k} + b_k e_1)        (binary: b_k shifts the positive class's logit;
                                              more classes: b_k = 0, temperature only)

a Platt-style map. The fit matches two moments with bounded per-record statistics, so no
clipping biases it (the confidence-gap idea of :mod:`fedsgld.calibration.recal`):

    u_i = (1[argmax p_i = y_i] - max_c p_ic,  p_i1 - 1[y_i = 1]) / sqrt(2)   (||u_i|| <= 1)

Site k, step j: a Poisson sample B_kj of its calibration split (rate q_r), S_kj = sum of
u_i over B_kj plus N(0, (sigma_r C_r)^2 I) drawn by the site from its own stream, then

    s_k <- s_k - eta sqrt(2) S_kj[0] / (q_r n_k),   b_k <- b_k - eta sqrt(2) S_kj[1] / (q_r n_k)

(the first moment is accuracy minus mean confidence: sharpen when under-confident; the
second is mean p_1 minus the label rate: lower b when too many positives are predicted),
each iterate kept in T in [0.1, 10], |b| <= 4 (a noisy step on a tiny site must not
throw the map far off). The fitted values are the mean of the last half of the iterates.
All of this is post-processing of the noisy sums.

Privacy: each step is a subsampled Gaussian mechanism (q_r, sigma_r) with sensitivity
C_r >= 1 on one site's records; the sites' records are disjoint, so one step of every
site costs each record one (q_r, sigma_r) step (parallel composition): the run's ledger,
which every site's records share, is charged once per step, before any site draws its
noise. A site's noise per step is sigma_r C_r / (q_r n_k) on its mean: with small sites
(16 test, 30 training records in Switzerland) the fit is noisy, and the run warns.
"""

from __future__ import annotations

import math

import torch

from fedsgld.core.clipping import clip_and_sum
from fedsgld.core.mechanism import poisson_sample

SCALE = math.sqrt(2.0)
LOG_T_BOUND = math.log(10.0)  # T in [0.1, 10]
BIAS_BOUND = 4.0  # a shift of at most 4 in the positive class's logit


def calibrated_probs(logits: torch.Tensor, log_t: float, bias: float) -> torch.Tensor:
    """softmax(z e^{-log_t} + bias e_1) for two classes; softmax(z e^{-log_t}) otherwise."""
    u = logits.double() * math.exp(-log_t)
    if u.shape[-1] == 2:
        u = u + torch.tensor([0.0, float(bias)], dtype=u.dtype)
    return torch.softmax(u, dim=-1)


def moment_statistics(
    logits: torch.Tensor, labels: torch.Tensor, log_t: float, bias: float
) -> torch.Tensor:
    """Per-record u_i (see the module docs): (N, 2) for two classes, (N, 1) otherwise;
    every row's norm is at most 1."""
    if logits.dim() != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be (N, K) and labels (N,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    p = calibrated_probs(logits, log_t, bias)
    conf, pred = p.max(dim=-1)
    gap = (pred == labels.long()).double() - conf
    if p.shape[-1] != 2:
        return gap.unsqueeze(1)
    rate = p[:, 1] - (labels.long() == 1).double()
    return torch.stack([gap, rate], dim=1) / SCALE


def site_moment_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    log_t: float,
    bias: float,
    sample_rate: float,
    clip: float | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """One site's sum of u_i over a Poisson sample (rate ``sample_rate`` from ``generator``),
    clipped to ``clip`` (None: unclipped; the norms are <= 1 already). Float64, (d,)."""
    d = 2 if logits.shape[-1] == 2 else 1
    idx = poisson_sample(logits.shape[0], sample_rate=sample_rate, generator=generator)
    if idx.numel() == 0:
        return torch.zeros(d, dtype=torch.float64)
    u = moment_statistics(logits[idx], labels[idx], log_t, bias)
    return clip_and_sum(u, clip=clip).reshape(-1)


def moment_step(
    log_t: float, bias: float, noisy_sum: torch.Tensor, *, lr: float, expected_batch: float
) -> tuple[float, float]:
    """(s, b) after one step on a site's noisy sum (module docs)."""
    if not expected_batch > 0:
        raise ValueError(f"expected calibration batch must be > 0, got {expected_batch!r}")
    v = noisy_sum.reshape(-1).double()
    if v.numel() == 1:  # more than two classes: the gap alone, not scaled
        return _box(log_t - lr * float(v[0]) / expected_batch, LOG_T_BOUND), bias
    log_t = _box(log_t - lr * SCALE * float(v[0]) / expected_batch, LOG_T_BOUND)
    return log_t, _box(bias - lr * SCALE * float(v[1]) / expected_batch, BIAS_BOUND)


def _box(v: float, bound: float) -> float:
    return float(min(max(v, -bound), bound))


__all__ = ["calibrated_probs", "moment_statistics", "moment_step", "site_moment_sum"]
