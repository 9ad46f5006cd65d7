"""Many sites' clipped sums in one per-record pass: S_k for every site k of a round.

For sites k = 1..K, each with its own Poisson sample B_k and its own generator G_k:

    S_k = sum_{i in B_k} clip_C(g_i + rho z_i),   z_i ~ N(0, I_P) drawn from G_k

exactly as :func:`fedsgld.core.per_record.clipped_sum` forms each S_k alone, but the
sampled records of all sites go through one per-record gradient pass (in batches of about
``batch_rows`` records), are clipped by the one clip (:mod:`fedsgld.core.clipping`) and are
summed per site (segment sums): the rows of site k add into S_k only. Site k's pre-noise is
drawn from G_k in the same calls and order as its own pass draws it (one
``prenoise_values(n * P)`` per chunk of ``chunk_size`` of its records, laid out parameter
by parameter, then its canaries' rows), so the randomness is the same; only the order of
float additions differs (the same sums to float rounding, not bitwise).

Memory is O(batch_rows * P) for the records plus the (K, P) sums.

Privacy caveat: nothing is pooled across sites. Each record moves only its own site's sum,
by at most C (the one clip; a record whose vector is not finite adds zero); every S_k stays
separate and is charged and noised by the round's mode as if the site had computed it
alone. This is a simulation of many sites in one process: a deployed site computes its
own sum.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from fedsgld.core.clipping import (
    block_sq_norms,
    exact_squared_norms,
    finite_clip_factors,
    param_blocks,
)
from fedsgld.core.per_record import RecordGradients, add_rows, clipped_rows_sum
from fedsgld.core.prenoise import (
    draw_in_background,
    draw_threads,
    prenoise_values,
    sharing_threads,
)

__all__ = ["SiteSample", "segment_clipped_sums"]


@dataclass(frozen=True)
class SiteSample:
    """One site's Poisson-sampled records (x, y), the generator that drew the sample and
    draws its pre-noise next, and its sampled canaries' gradients ``rows`` (k, P) or None."""

    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class _Piece:
    site: int
    sample: SiteSample
    start: int
    stop: int


class _Draws:
    """The pre-noise of a batch's pieces, each from its site's generator in order; on a
    second thread where :func:`draw_in_background` says so (``in_background``)."""

    def __init__(self, pieces: list[_Piece], size: int, std: float) -> None:
        self.values: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._args = (pieces, size, std)
        self.in_background = bool(pieces) and draw_in_background(pieces[0].sample.generator)
        self._threads = draw_threads() if self.in_background else 1
        self._thread = None
        if self.in_background:
            self._thread = threading.Thread(target=self._draw, name="fedsgld-prenoise")
            self._thread.start()
        else:
            self._draw()

    def _draw(self) -> None:
        pieces, size, std = self._args
        threads = self._threads
        try:
            for p in pieces:
                n = (p.stop - p.start) * size
                self.values.append(
                    prenoise_values(n, std=std, generator=p.sample.generator, threads=threads)
                )
        except BaseException as err:  # re-raised by result()
            self._error = err

    def result(self) -> list[torch.Tensor]:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self.values


def _blocks(draws: list[torch.Tensor] | None, pieces, sizes, device) -> list[torch.Tensor]:
    """The batch's (m, numel_j) blocks: the pieces' pre-noise rows, block by block."""
    m = sum(p.stop - p.start for p in pieces)
    if draws is None:
        return param_blocks(torch.zeros(m * sum(sizes), device=device), m, sizes)
    per_piece = [
        param_blocks(d.to(device), p.stop - p.start, sizes)
        for d, p in zip(draws, pieces, strict=True)
    ]
    return [torch.cat([pb[j] for pb in per_piece]) for j in range(len(sizes))]


def _gradients(grads: RecordGradients, theta, x, y, draws):
    """The records' per-record gradients, computed while ``draws`` may run beside them:
    a function adding them into a batch's blocks (layer registry, else ``torch.func``)."""
    terms = grads.layer_terms(theta, x, y, draws)
    if terms is not None:
        return lambda blocks: grads.layers.add_into(blocks, terms)
    with sharing_threads(draws):
        g = grads.per_record(theta, x, y)
    return lambda blocks: add_rows(blocks, g)


def _batch(grads, theta, pieces, *, sizes, clip, prenoise, chunk_size, total, rows_after):
    """total[k] += site k's clipped sum over this batch's records; then each site of
    ``rows_after`` adds its canaries' sum (drawn after its records' pre-noise)."""
    draws = _Draws(pieces, sum(sizes), prenoise) if prenoise > 0.0 else None
    try:
        if pieces:
            x, y = grads.on_device(
                torch.cat([p.sample.x[p.start : p.stop] for p in pieces]),
                torch.cat([p.sample.y[p.start : p.stop] for p in pieces]),
            )
            seg = torch.cat(
                [torch.full((p.stop - p.start,), p.site, dtype=torch.long) for p in pieces]
            ).to(grads.device)
            add = _gradients(grads, theta, x, y, draws)
            blocks = _blocks(None if draws is None else draws.result(), pieces, sizes, grads.device)
            add(blocks)
            _segment_sum(blocks, seg, clip, total)
    finally:
        if draws is not None:
            draws.result()  # the generators are never left in use by another thread
    for k, sample in rows_after:
        total[k] += clipped_rows_sum(
            sample.rows.to(grads.device, torch.float32),
            sizes,
            clip=clip,
            prenoise=prenoise,
            generator=sample.generator,
            chunk_size=chunk_size,
        )


def _segment_sum(blocks, seg, clip: float | None, total: torch.Tensor) -> None:
    """total[seg_i] += c_i v_i, c_i = min(1, C / ||v_i||) (1 without a clip); a record
    whose v_i is not finite adds zero (:func:`fedsgld.core.clipping.finite_clip_factors`)."""
    if clip is not None:
        c, dead = finite_clip_factors(block_sq_norms(blocks), clip, exact_squared_norms(blocks))
        c = c.unsqueeze(1)
        if dead is not None and dead.numel():  # rare: records with a non-finite vector
            for blk in blocks:
                blk.index_fill_(0, dead, 0.0)
    pos = 0
    for blk in blocks:
        if clip is not None:
            blk.mul_(c)
        total[:, pos : pos + blk.shape[1]].index_add_(0, seg, blk)
        pos += blk.shape[1]


def segment_clipped_sums(
    grads: RecordGradients,
    theta: torch.Tensor,
    samples: list[SiteSample],
    *,
    sizes: list[int],
    clip: float | None,
    prenoise: float,
    chunk_size: int = 256,
    batch_rows: int | None = None,
) -> torch.Tensor:
    """(K, P) matrix whose row k is site k's S_k = sum_i clip_C(g_i + rho z_i) over
    ``samples[k]`` (its records, then its canaries' rows), on ``grads.device``.

    Site k's pre-noise comes from ``samples[k].generator`` chunk by chunk of ``chunk_size``
    of its records, as :func:`fedsgld.core.per_record.clipped_sum` draws it; the records
    of all sites go through the per-record pass together, in batches of whole chunks of
    about ``batch_rows`` records (default: ``chunk_size``, at least one chunk)."""
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if prenoise < 0.0:
        raise ValueError(f"prenoise must be >= 0, got {prenoise!r}")
    if clip is None and prenoise == 0.0:
        raise ValueError("segment_clipped_sums needs clip or pre-noise (plain sums: per site)")
    limit = chunk_size if batch_rows is None else max(int(batch_rows), 1)
    theta = theta.to(grads.device)
    total = torch.zeros(len(samples), sum(sizes), dtype=torch.float32, device=grads.device)
    pieces: list[_Piece] = []
    rows_after: list[tuple[int, SiteSample]] = []
    rows = 0

    def flush() -> None:
        nonlocal rows
        _batch(grads, theta, pieces, sizes=sizes, clip=clip, prenoise=prenoise,
               chunk_size=chunk_size, total=total, rows_after=rows_after)  # fmt: skip
        pieces.clear()
        rows_after.clear()
        rows = 0

    for k, s in enumerate(samples):
        n = int(s.x.shape[0])
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            if pieces and rows + stop - start > limit:
                flush()
            pieces.append(_Piece(k, s, start, stop))
            rows += stop - start
        if s.rows is not None and s.rows.shape[0]:
            rows_after.append((k, s))
    flush()
    return total
