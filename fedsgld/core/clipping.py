"""Per-record pre-noise and L2 clipping (DP-SGLD's site-side transform).

For per-record gradients g_i (rows of a (B, P) matrix):

    g_i'  = g_i + rho * z_i,        z_i ~ N(0, I)        (pre-noise, optional)
    g_i'' = g_i' * min(1, C / ||g_i'||_2)                  (clip to L2 norm <= C)
    S     = sum_i g_i''

Each record then changes S by at most C in L2 norm (add/remove adjacency), which is the
sensitivity the server's Gaussian noise sigma * C is calibrated to. Pre-noise is part of
the DP-SGLD algorithm but earns no credit in the privacy accounting.
"""

from __future__ import annotations

import torch

from fedsgld.core import per_record as layerwise
from fedsgld.core.noise import gaussian_noise


def clip_and_sum(
    per_record: torch.Tensor,
    *,
    clip: float | None,
    prenoise: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pre-noise, clip each row to L2 norm <= ``clip`` and return the sum over rows.

    ``clip=None`` means no clipping (non-private SGD). ``prenoise > 0`` needs a generator.
    """
    if per_record.dim() != 2:
        raise ValueError(
            f"per_record must be (records, params), got shape {tuple(per_record.shape)}"
        )
    g = per_record
    if prenoise > 0.0:
        if generator is None:
            raise ValueError("prenoise > 0 needs an explicit torch.Generator")
        g = gaussian_noise(g.shape, std=prenoise, generator=generator, dtype=g.dtype).add_(g)
    if clip is None:
        return g.sum(dim=0)
    return layerwise.clip_factors(torch.linalg.vector_norm(g, dim=1).square(), clip) @ g
