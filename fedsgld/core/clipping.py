"""The one per-record clip (DP-SGLD's and DP-SGD's site-side transform).

For per-record vectors v_i (each record's gradient, pre-noised or not):

    c_i = min(1, C / ||v_i||_2)            (:func:`clip_factors`, the one place it is computed)
    S   = sum_i c_i v_i                      (:func:`clip_blocks_and_sum`)

so that each record changes S by at most C in L2 norm (add/remove adjacency), the
sensitivity the server's Gaussian noise sigma * C is calibrated to. Every clipping path
takes its factors from :func:`clip_factors`: the rows of a matrix (:func:`clip_and_sum`),
rows laid out parameter by parameter (:func:`clip_blocks_and_sum`, the per-record path and
the audit's canaries) and the norm-first sum of
:meth:`fedsgld.core.grad_samplers.LayerGrads.clipped_sum_norm_first`. With pre-noise,
v_i = g_i + rho z_i: pre-noise is part of DP-SGLD but earns no credit in the accounting.
"""

from __future__ import annotations

import torch

from fedsgld.core.noise import gaussian_noise


def clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """c_i = min(1, C / ||v_i||) from the squared norms ||v_i||^2: the one place every
    per-record clipping path (and the audit's canaries, :func:`fedsgld.core.mechanism.site_step`)
    takes its factors from, so that each record's clipped vector has norm <= C."""
    return (clip / (squared_norms.sqrt() + 1e-12)).clamp_(max=1.0)


def param_blocks(flat: torch.Tensor, rows: int, numels: list[int]) -> list[torch.Tensor]:
    """View a flat buffer of ``rows * sum(numels)`` numbers as one contiguous (rows, numel_j)
    block per parameter, in order (parameter-major: block j holds every record's
    values of parameter j). Row i of ``torch.cat(blocks, 1)`` is record i's flat vector."""
    if flat.numel() != rows * sum(numels):
        raise ValueError(f"buffer of {flat.numel()} numbers is not {rows} x {sum(numels)}")
    out, pos = [], 0
    for k in numels:
        out.append(flat[pos : pos + rows * k].view(rows, k))
        pos += rows * k
    return out


def clip_blocks_and_sum(blocks: list[torch.Tensor], clip: float | None) -> torch.Tensor:
    """sum_i min(1, C / ||v_i||) v_i for the records' vectors v_i = row i of cat(blocks, 1),
    without forming that matrix (any pre-noise is already in the blocks). ``clip=None``:
    the plain sum (non-private SGD)."""
    if clip is None:
        return torch.cat([blk.sum(0) for blk in blocks])
    sq = None
    for blk in blocks:
        n = torch.linalg.vector_norm(blk, dim=1).square()
        sq = n if sq is None else sq.add_(n)
    c = clip_factors(sq, clip)
    return torch.cat([c @ blk for blk in blocks])


def clip_and_sum(
    per_record: torch.Tensor,
    *,
    clip: float | None,
    prenoise: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pre-noise, clip each row of a (records, params) matrix to L2 norm <= ``clip`` and
    return the sum over rows (:func:`clip_blocks_and_sum` with one block).

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
    return clip_blocks_and_sum([g], clip)
