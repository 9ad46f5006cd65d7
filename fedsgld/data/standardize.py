"""Feature standardisation of tabular sites: per site, or pooled from private sums.

``site`` (FLamby's federated protocol): site k maps every record x to (x - m_k) / s_k with
the mean m_k and standard deviation s_k (ddof 1; 1 where a feature is constant) of ITS OWN
training records. Computed at the site from its records alone; nothing is released.

``pooled``: the pooled training mean and deviation, estimated from one release. With a
public centre c_j and scale s_j per feature (a dataset's declared reference values, else
0 and 1) and the clip B, each record gives

    u_i = clip((x_i - c) / s, -B, B) / B  in [-1, 1]^d,   v_i = (u_i, u_i^2)  in R^{2d},

so ||v_i||_2 <= sqrt(2 d) = Delta whatever the record. Site k's sum V_k = sum_i v_i is
released once with Gaussian noise of std sigma Delta (a Gaussian mechanism, q = 1, noise
multiplier sigma; :class:`~fedsgld.privacy.events.GaussianRelease`), added by the server,
by each site, or through the secure sum, as the run's placement says; the server forms,
with the public N = sum_k N_k,

    mean_u = V[:d] / N,   var_u = max(V[d:] / N - mean_u^2, (0.5 / B)^2),
    mean = c + s B mean_u,   std = s B sqrt(var_u)

(post-processing) and every site applies (x - mean) / std. Clipping biases the estimate
for features outside c +- B s; the floor (half the public scale) keeps a noisy variance
from collapsing. A non-private run (method sgd or vi) uses the exact pooled mean and std
(ddof 1) from the sites' exact sums of x and x^2 (:func:`exact_pooled_statistics`).

Privacy caveat: ``pooled`` is a release on every training record, charged to the run's
ledger (and composed with the training steps inside the one epsilon); ``site`` is free.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fedsgld.config.checks import decode_stats
from fedsgld.data.centres import PUBLIC_SCALES
from fedsgld.data.partition import SiteData

__all__ = [
    "apply_standardization",
    "exact_pooled_statistics",
    "raw_moment_sum",
    "released_standardize",
    "moment_sum",
    "pooled_statistics",
    "public_scale",
    "sensitivity",
    "site_standardize",
    "site_statistics",
]

#: The floor of the estimated std, as a share of the public scale s.
STD_FLOOR = 0.5


def _tabular(x: torch.Tensor, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(
            f"standardize: {what} needs tabular records (N, D), got shape {tuple(x.shape)}; "
            "set standardize = 'none' for images"
        )


def site_statistics(x_train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of a site's own training records (std ddof 1; 1 where it is 0 or
    undefined), float64."""
    _tabular(x_train, "standardize = 'site'")
    x = x_train.double()
    mean = x.mean(0)
    std = x.std(0, unbiased=True) if x.shape[0] > 1 else torch.zeros_like(mean)
    std = torch.where(torch.isfinite(std) & (std > 0), std, torch.ones_like(std))
    return mean, std


def apply_standardization(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std in x's dtype and device."""
    m, s = mean.to(x.device, torch.float64), std.to(x.device, torch.float64)
    return ((x.double() - m) / s).to(x.dtype)


def site_standardize(data: SiteData) -> SiteData:
    """``data`` with its train and test records standardised by its own training records."""
    mean, std = site_statistics(data.x_train)
    return replace(
        data,
        x_train=apply_standardization(data.x_train, mean, std),
        x_test=apply_standardization(data.x_test, mean, std),
    )


def released_standardize(data: SiteData, text: str) -> SiteData:
    """``data`` with its train and test records standardised by the pooled (mean, std) a
    Flower run's server released (``standardize_stats``, :func:`fedsgld.config.checks.
    decode_stats`); ``ValueError`` where their length is not the records' feature count."""
    mean, std = decode_stats(text)
    _tabular(data.x_train, "standardize = 'pooled'")
    d = int(data.x_train.shape[1])
    if len(mean) != d:
        raise ValueError(f"standardize_stats holds {len(mean)} features; the site's records {d}")
    m = torch.tensor(mean, dtype=torch.float64)
    sd = torch.tensor(std, dtype=torch.float64)
    return replace(
        data,
        x_train=apply_standardization(data.x_train, m, sd),
        x_test=apply_standardization(data.x_test, m, sd),
    )


def public_scale(dataset: str, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The public (centre, scale) of ``dataset``'s features: its declared reference values
    (:data:`fedsgld.data.centres.PUBLIC_SCALES`), else 0 and 1 for every feature."""
    declared = PUBLIC_SCALES.get(dataset)
    if declared is None or len(declared) != dim:
        return torch.zeros(dim, dtype=torch.float64), torch.ones(dim, dtype=torch.float64)
    t = torch.tensor(declared, dtype=torch.float64)
    return t[:, 0].clone(), t[:, 1].clone()


def sensitivity(dim: int) -> float:
    """Delta = sqrt(2 d): the L2 bound of one record's (u, u^2)."""
    return math.sqrt(2 * dim)


def moment_sum(
    x: torch.Tensor, centre: torch.Tensor, scale: torch.Tensor, clip: float
) -> torch.Tensor:
    """V = sum_i (u_i, u_i^2), u_i = clip((x_i - c) / s, -B, B) / B (float64, (2 d,)).

    A non-finite feature value counts as c (u = 0): a rule of that record alone, so the
    sum is finite whatever the records."""
    _tabular(x, "standardize = 'pooled'")
    z = (x.double() - centre.to(x.device)) / scale.to(x.device)
    z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    u = z.clamp(-clip, clip) / clip
    return torch.cat([u.sum(0), (u * u).sum(0)]).cpu()


def pooled_statistics(
    noisy_sum: torch.Tensor, n: int, centre: torch.Tensor, scale: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) from the released (noisy) V over n records (post-processing)."""
    d = centre.shape[0]
    v = noisy_sum.double()
    if v.shape != (2 * d,):
        raise ValueError(f"pooled moments: expected {2 * d} sums, got {tuple(v.shape)}")
    mean_u = (v[:d] / n).clamp(-1.0, 1.0)
    second = (v[d:] / n).clamp(0.0, 1.0)
    var_u = (second - mean_u**2).clamp(min=(STD_FLOOR / clip) ** 2)
    return centre + scale * clip * mean_u, scale * clip * var_u.sqrt()


def raw_moment_sum(x: torch.Tensor) -> torch.Tensor:
    """(sum_i x_i, sum_i x_i^2), float64 (2 d,): a non-private run's exact sums."""
    _tabular(x, "standardize = 'pooled'")
    x = x.double()
    return torch.cat([x.sum(0), (x * x).sum(0)]).cpu()


def exact_pooled_statistics(total: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled (mean, std) (ddof 1; 1 where it is 0) from the exact sums of x and x^2."""
    d = total.shape[0] // 2
    mean = total[:d] / n
    var = (total[d:] - n * mean**2).clamp(min=0.0) / max(n - 1, 1)
    std = var.sqrt()
    return mean, torch.where(std > 1e-12, std, torch.ones_like(std))
