"""Noisy aggregation of teacher votes: LNMax, GNMax and Confident-GNMax.

Only vote histograms leave a site: site k sends ``h_k[q, j]`` = the number of its teachers
voting class j on public query q (the sum of their one-hot votes). The server sums the
sites' histograms, adds noise and releases the argmax:

* LNMax (Papernot et al. 2017): ``argmax_j (n_j + Lap(1/gamma))``, (2 gamma)-DP per query.
* GNMax (Papernot et al. 2018): ``argmax_j (n_j + N(0, sigma^2))``.
* Confident-GNMax (2018): answer only if ``max_j n_j + N(0, sigma_1^2) >= T``, then with
  GNMax(sigma_2); unanswered queries are released as -1.

All noise is drawn from an explicit ``torch.Generator`` (Gaussian through
:func:`fedsgld.core.noise.gaussian_noise`, Laplace through :func:`laplace_noise`), in
float64 so that integer counts are not rounded. Privacy caveat: the server is trusted to
add the noise (central model), and the histograms it receives are not private.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedsgld.core.noise import gaussian_noise


def laplace_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    scale: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Draw i.i.d. Laplace(0, scale) from ``generator``: ``scale * (E_1 - E_2)`` with
    ``E_i = -log(1 - U_i)`` exponential and U_i uniform on [0, 1) (never infinite)."""
    if not isinstance(generator, torch.Generator):
        raise TypeError("laplace_noise needs an explicit torch.Generator (generator=...)")
    scale = float(scale)
    if not (scale >= 0.0 and math.isfinite(scale)):
        raise ValueError(f"Laplace scale must be finite and >= 0, got {scale!r}")
    if scale == 0.0:
        return torch.zeros(shape, dtype=dtype)
    u = torch.rand((2, *tuple(shape)), generator=generator, dtype=torch.float64)
    e = -torch.log1p(-u)
    return ((e[0] - e[1]) * scale).to(dtype)


def site_histogram(site_preds: np.ndarray | torch.Tensor, *, num_classes: int) -> torch.Tensor:
    """A site's vote histogram, (n_queries, num_classes) int64: the sum over its teachers
    of the one-hot votes. ``site_preds`` is (n_teachers_at_site, n_queries)."""
    p = torch.as_tensor(np.asarray(site_preds), dtype=torch.int64)
    if p.ndim != 2:
        raise ValueError(f"site_preds must be (n_teachers, n_queries), got shape {tuple(p.shape)}")
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= num_classes):
        raise ValueError(f"site_preds must lie in [0, num_classes) = [0, {num_classes})")
    onehot = torch.nn.functional.one_hot(p, num_classes)  # (teachers, queries, classes)
    return onehot.sum(dim=0)


def combine_histograms(histograms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The server's total histogram: the sum of the sites' histograms."""
    if not histograms:
        raise ValueError("combine_histograms needs at least one site histogram")
    shape = tuple(histograms[0].shape)
    if any(tuple(h.shape) != shape for h in histograms):
        raise ValueError("site histograms must all have shape (n_queries, num_classes)")
    return torch.stack([h.to(torch.int64) for h in histograms]).sum(dim=0)


def _check(name: str, v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return v


def lnmax_noisy_counts(
    counts: torch.Tensor, *, gamma: float, generator: torch.Generator
) -> torch.Tensor:
    """counts + Lap(1/gamma) on every entry (float64)."""
    gamma = _check("gamma", gamma)
    c = counts.to(torch.float64)
    return c + laplace_noise(c.shape, scale=1.0 / gamma, generator=generator)


def gnmax_noisy_counts(
    counts: torch.Tensor, *, sigma: float, generator: torch.Generator
) -> torch.Tensor:
    """counts + N(0, sigma^2) on every entry (float64)."""
    sigma = _check("sigma", sigma)
    c = counts.to(torch.float64)
    return c + gaussian_noise(c.shape, std=sigma, generator=generator, dtype=torch.float64)


def lnmax(counts: torch.Tensor, *, gamma: float, generator: torch.Generator) -> torch.Tensor:
    """LNMax labels (n_queries,) of a total histogram (n_queries, num_classes)."""
    return lnmax_noisy_counts(counts, gamma=gamma, generator=generator).argmax(dim=1)


def gnmax(counts: torch.Tensor, *, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """GNMax labels (n_queries,) of a total histogram (n_queries, num_classes)."""
    return gnmax_noisy_counts(counts, sigma=sigma, generator=generator).argmax(dim=1)


def confident_gnmax(
    counts: torch.Tensor,
    *,
    threshold: float,
    sigma1: float,
    sigma2: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Confident-GNMax: (labels with -1 where unanswered, answered bool mask).

    Query q is answered iff ``max_j n_qj + N(0, sigma1^2) >= threshold``; answered queries
    get ``argmax_j (n_qj + N(0, sigma2^2))``. Both noises come from ``generator``.
    """
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    sigma1 = _check("sigma1", sigma1)
    c = counts.to(torch.float64)
    top = c.max(dim=1).values
    noisy_top = top + gaussian_noise(
        top.shape, std=sigma1, generator=generator, dtype=torch.float64
    )
    answered = noisy_top >= float(threshold)
    labels = gnmax(c, sigma=sigma2, generator=generator)
    labels = torch.where(answered, labels, torch.full_like(labels, -1))
    return labels, answered


__all__ = [
    "combine_histograms",
    "confident_gnmax",
    "gnmax",
    "gnmax_noisy_counts",
    "laplace_noise",
    "lnmax",
    "lnmax_noisy_counts",
    "site_histogram",
]
