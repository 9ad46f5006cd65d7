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

Floating point: the server's parameters are finite but may be chosen so that some records'
logits overflow. A record whose vector v_i has a non-finite entry contributes the zero
vector (c_i = 0 and its row zeroed), a rule of that record alone; a finite v_i whose
float32 squared norm overflows has its norm recomputed in float64 (which cannot overflow
for float32 entries) and is clipped as usual (:func:`finite_clip_factors`). So S is finite
and each record still moves it by at most C. Records whose float32 squared norm is finite
(all ordinary ones) take exactly the factors they took before, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedsgld.core.noise import gaussian_noise


def clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """c_i = min(1, C / ||v_i||) from the squared norms ||v_i||^2: the one place every
    per-record clipping path (and the audit's canaries, :func:`fedsgld.core.mechanism.site_step`)
    takes its factors from, so that each record's clipped vector has norm <= C."""
    return (clip / (squared_norms.sqrt() + 1e-12)).clamp_(max=1.0)


def finite_clip_factors(
    squared_norms: torch.Tensor, clip: float, exact: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The clip factors c_i of records whose vectors may not be finite, and the records
    that contribute zero (indices; None when every squared norm is finite).

    Where the float32 squared norm is not finite (a non-finite entry, or a norm beyond
    float32's range), ``exact(idx)`` gives those records' squared norms in float64: a
    finite one is clipped by it, a non-finite one (the record's vector holds inf or NaN)
    gets c_i = 0 and is returned, for the caller to zero its row (0 * inf is NaN). Each
    record's factor depends on its own vector only; the other records' are those of
    :func:`clip_factors`, unchanged."""
    c = clip_factors(squared_norms, clip)
    bad = ~torch.isfinite(squared_norms)
    if not bool(bad.any()):
        return c, None
    idx = bad.nonzero(as_tuple=True)[0]
    sq = exact(idx)
    ok = torch.isfinite(sq)
    exact_c = (clip / (sq.sqrt() + 1e-12)).clamp_(max=1.0)
    c[idx] = torch.where(ok, exact_c, torch.zeros_like(exact_c)).to(c.dtype)
    return c, idx[~ok]


def exact_squared_norms(blocks: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """idx -> the float64 squared norms of rows ``idx`` of cat(blocks, 1) (finite for
    finite float32 entries: at most P * 1.2e77)."""

    def exact(idx: torch.Tensor) -> torch.Tensor:
        sq = torch.zeros(idx.shape[0], dtype=torch.float64, device=idx.device)
        for blk in blocks:
            sq += torch.linalg.vector_norm(blk[idx], dim=1, dtype=torch.float64).square()
        return sq

    return exact


def block_sq_norms(blocks: list[torch.Tensor]) -> torch.Tensor:
    """||v_i||^2 of the rows of cat(blocks, 1), in float32 (as every clip computes them)."""
    sq = None
    for blk in blocks:
        n = torch.linalg.vector_norm(blk, dim=1).square()
        sq = n if sq is None else sq.add_(n)
    return sq


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
    without forming that matrix (any pre-noise is already in the blocks); a record whose
    v_i is not finite adds zero (:func:`finite_clip_factors`). ``clip=None``: the plain
    sum (non-private SGD, no rule: nothing private is released)."""
    if clip is None:
        return torch.cat([blk.sum(0) for blk in blocks])
    c, dead = finite_clip_factors(block_sq_norms(blocks), clip, exact_squared_norms(blocks))
    if dead is not None and dead.numel():  # rare: records with a non-finite vector
        blocks = [blk.index_fill(0, dead, 0.0) for blk in blocks]
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
