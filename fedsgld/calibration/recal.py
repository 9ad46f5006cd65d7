"""Private temperature scaling across sites (``+recal``).

Temperature scaling (Guo et al. 2017) divides a trained model's logits z by one scalar
T > 0 fitted to minimise the negative log-likelihood on held-out records. Here the
held-out records are a calibration split that each site carves out of its TRAINING split
(``recal_fraction``), so they are records of the same patients as the training data, and
the fit is a few noisy clipped-gradient steps on s = log T, run like the training steps:

Site k, step j (its own randomness, the calibration split's logits z_i at the final model):

    B_k = Poisson sample of the calibration split with rate q_r
    g_i = 1[argmax z_i = y_i] - max_c softmax(z_i e^-s)_c    (hit minus top-label confidence,
                                                              one number in [-1, 1] per record)
    S_k = sum_{i in B_k} clip_C(g_i)                          (|g_i| <= 1: no clipping at C_r >= 1)

Server (the same ledger as training, the step recorded BEFORE its noise is drawn):

    s <- s - eta (sum_k S_k + sigma_r C_r xi) / (q_r sum_k n_k),   xi ~ N(0, 1)

where n_k is site k's calibration-split size (public, like the training sizes). The mean of
g is accuracy minus mean confidence: positive for an under-confident model (s falls, T < 1
sharpens), negative for an over-confident one; the top-label confidence falls as T grows,
so the iteration has one root, where mean confidence equals accuracy. The fitted log T is
the mean of the last half of the iterates s_1 .. s_R (post-processing), which damps the
noise of the last steps.

Why this statistic and not the gradient of the NLL with respect to log T
(:func:`temperature_gradients`, fitted this way before): that gradient is unbounded, so it
must be clipped, and clipping is one-sided. Misclassified records carry large negative
gradients (they ask for a higher T) and are the ones clipped, so the clipped fit is pulled
towards sharper predictions. On a DP-SGLD model of MNIST-5k at epsilon 1 (under-confident,
ECE 0.064) the clipped gradient's root was T = 0.65 with no noise at all, where the NLL's
root is T = 0.87: the temperature it fitted left ECE where it was (0.063), while the
confidence gap's root gives 0.026 without noise and about 0.04 at the default noise
(benchmarks/results/calibration_history.md shows the commands). The gap needs no clipping (sensitivity 1 under
adding or removing a record), so it has no such bias.

What to expect: the noise of one step's mean statistic is nu = sigma_r C_r / (q_r sum_k n_k).
With the defaults (20 full-batch steps, sigma_r = 70, C_r = 1: epsilon about 0.21 at delta
1e-5 on its own, less once composed with training) a few hundred calibration records fit
T to about 0.1 in log T; below about 2 sigma_r / q_r records (nu > C_r / 2) the fit is
dominated by noise and can make calibration worse (the run logs a warning). Each step is a
Poisson-subsampled Gaussian mechanism (q_r, sigma_r) on records that are also training
records, so the guarantee composes in the run's one ledger: the run's epsilon is that of
the training steps and the recalibration steps together, and the budget check reserves the
recalibration steps before training starts.

Zhang, Li, Sen, Roukos & Hashimoto (2022) fit an inverse temperature privately with
DP-SGD on held-out logits; this is that idea across sites, on log T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedsgld.core.clipping import clip_and_sum
from fedsgld.core.finite import finite_probs
from fedsgld.core.mechanism import poisson_sample
from fedsgld.core.streams import RECAL_STREAM  # the key part of recalibration's streams


@dataclass(frozen=True)
class RecalPlan:
    """The recalibration's public settings (from a :class:`fedsgld.config.Config`)."""

    steps: int
    sample_rate: float
    noise_multiplier: float | None  # None: no noise (non-private methods)
    clip: float | None  # None: no clipping (non-private methods)
    lr: float

    @classmethod
    def from_config(cls, config) -> RecalPlan | None:
        """None when ``recal_fraction`` is 0 (no recalibration)."""
        run, p = config.run, config.privacy
        if run.recal_fraction == 0:
            return None
        return cls(
            steps=p.recal_steps,
            sample_rate=p.recal_sample_rate,
            noise_multiplier=p.recal_noise_multiplier if p.private else None,
            clip=p.recal_clip if p.private else None,
            lr=run.recal_lr,
        )

    def ledger(self) -> list[tuple[float, float, int]]:
        """The steps the accountant must reserve: [(q_r, sigma_r, steps)], or [] if none."""
        if self.noise_multiplier is None:
            return []
        return [(self.sample_rate, self.noise_multiplier, self.steps)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "lr": self.lr,
        }


def scaled_log_probs(logits: torch.Tensor, log_t: float) -> torch.Tensor:
    """log softmax(z / T) with T = exp(log_t)."""
    return torch.log_softmax(logits.double() * math.exp(-log_t), dim=-1)


def temperature_nll(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> float:
    """Mean NLL of softmax(z / T) (for tests and diagnostics; never released by a site)."""
    lp = scaled_log_probs(logits, log_t)
    return float(-lp[torch.arange(labels.shape[0]), labels.long()].mean())


def temperature_gradients(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> torch.Tensor:
    """Per-record d NLL_i / d log T = u_y - sum_c p_c u_c with u = z / T: an (N,) tensor
    (diagnostics: unbounded, so a private fit on it must clip, which biases it)."""
    if logits.dim() != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be (N, K) and labels (N,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    u = logits.double() * math.exp(-log_t)
    p = torch.softmax(u, dim=-1)
    return u[torch.arange(u.shape[0]), labels.long()] - (p * u).sum(dim=-1)


def confidence_gaps(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> torch.Tensor:
    """Per-record 1[argmax z = y] - max_c softmax(z / T)_c, T = exp(log_t): an (N,) tensor
    in [-1, 1] whose mean is accuracy minus mean top-label confidence (a record whose
    softmax is not finite counts as uniform: :func:`fedsgld.core.finite.finite_probs`)."""
    if logits.dim() != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be (N, K) and labels (N,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    p = finite_probs(torch.softmax(logits.double() * math.exp(-log_t), dim=-1))
    conf, pred = p.max(dim=-1)
    return (pred == labels.long()).double() - conf


def site_temperature_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    log_t: float,
    sample_rate: float,
    clip: float | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """One site's contribution to a recalibration step: sum over a Poisson sample (rate
    ``sample_rate``, drawn from ``generator``) of the per-record confidence gaps
    (:func:`confidence_gaps`, in [-1, 1]) clipped to ``clip`` (None: unclipped). A (1,)
    float64 tensor; the sample's size stays at the site."""
    idx = poisson_sample(logits.shape[0], sample_rate=sample_rate, generator=generator)
    if idx.numel() == 0:
        return torch.zeros(1, dtype=torch.float64)
    g = confidence_gaps(logits[idx], labels[idx], log_t)
    return clip_and_sum(g.unsqueeze(1), clip=clip)


def temperature_step(
    log_t: float, noisy_sum: torch.Tensor, *, lr: float, expected_batch: float
) -> float:
    """s <- s - lr * noisy_sum / expected_batch (the noise is already in ``noisy_sum``)."""
    if not expected_batch > 0:
        raise ValueError(f"expected calibration batch must be > 0, got {expected_batch!r}")
    return float(log_t - lr * float(noisy_sum.reshape(-1)[0]) / expected_batch)


def tail_average(iterates: list[float]) -> float:
    """The mean of the last half (rounded up) of the iterates s_1 .. s_R (0.0 when R = 0):
    averaging the noisy iterates is post-processing and damps the noise."""
    if not iterates:
        return 0.0
    tail = iterates[len(iterates) // 2 :]
    return float(sum(tail) / len(tail))


def carve_calibration(
    n_train: int, fraction: float, *, seed: int, site_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a site's training indices into (kept for training, calibration split).

    round(fraction * n_train) records, at least one, chosen by a permutation seeded by
    (seed, site_id): the same split whichever order the sites are built in. Leaves at
    least one training record, else ValueError naming ``recal_fraction``.
    """
    return carve_split(
        n_train, fraction, seed=seed, site_id=site_id, stream=RECAL_STREAM, setting="recal_fraction"
    )


def carve_split(
    n_train: int, fraction: float, *, seed: int, site_id: int, stream: int, setting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, held out) indices of a site's training split: ``fraction`` of them, at least
    one, by a permutation keyed by (seed, stream, site_id). ValueError names ``setting``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{setting} must be in (0, 1) to carve a split, got {fraction!r}")
    n_cal = max(1, round(fraction * n_train))
    if n_train - n_cal < 1:
        raise ValueError(
            f"{setting} = {fraction:g} leaves site {site_id} ({n_train} training records) "
            f"no training record; lower {setting}"
        )
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(stream) * 7919 + int(site_id)) % (2**63))
    perm = torch.randperm(n_train, generator=g)
    return perm[n_cal:].sort().values, perm[:n_cal].sort().values


__all__ = [
    "RECAL_STREAM",
    "RecalPlan",
    "carve_calibration",
    "carve_split",
    "confidence_gaps",
    "scaled_log_probs",
    "site_temperature_sum",
    "tail_average",
    "temperature_gradients",
    "temperature_nll",
    "temperature_step",
]
