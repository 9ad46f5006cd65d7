"""The per-record path of a site step: sum_i clip_C(grad l_i + rho z_i), in chunks.

For the records of one Poisson sample, in chunks of ``chunk_size``:

    S = sum_i c_i (g_i + rho z_i),   c_i = min(1, C / ||g_i + rho z_i||),   z_i ~ N(0, I_P)

:func:`clipped_sum` is the one entry: per chunk it draws the pre-noise rows
(:mod:`fedsgld.core.prenoise`, on a second thread beside the gradients where that helps),
forms the per-record gradients in the noise's memory (the layer registry of
:mod:`fedsgld.core.grad_samplers`, or ``torch.func.vmap`` of the one-record gradient for any
other module) and clips and sums with the one clip (:mod:`fedsgld.core.clipping`); then the
records given by their gradients (an audit's canaries) the same way. Memory is
O(chunk_size * P) whatever the number of records.

:class:`RecordGradients` is a module seen as a function of a flat parameter vector theta
with its per-record gradients: the ``layers`` path where the module allows it (checked once
against ``torch.func`` on the first two records, and dropped with a warning on a mismatch)
or the ``func`` path. Both give the gradients of a loop over records to float rounding;
the pre-noise rows are drawn the same way for both.

Privacy caveat: each record's sensitivity is C only if ``clip`` is set; pre-noise earns no
credit in the accounting.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedsgld.core.clipping import clip_blocks_and_sum, param_blocks
from fedsgld.core.device import check_generator
from fedsgld.core.grad_samplers import LayerGrads, UnsupportedModel, unfold_patches
from fedsgld.core.prenoise import (
    PrenoiseRows,
    draw_in_background,
    prenoise_values,
    sharing_threads,
)

__all__ = [
    "LayerGrads",
    "RecordGradients",
    "UnsupportedModel",
    "clipped_rows_sum",
    "clipped_sum",
    "unfold_patches",
]


class CustomGradients(Protocol):
    """A model with its own per-record and summed gradients (variational models)."""

    def per_record_grads(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor): ...
    def summed_grad(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor): ...


class RecordGradients:
    """Per-record gradients of ``module`` as a function of a flat theta (the trainable
    parameters ``names`` of ``shapes`` in order, on ``device``).

    ``use_layers``: try the layer registry (``require_layers``: ValueError if the module
    does not allow it). ``custom``: a model whose own gradients replace these."""

    def __init__(
        self,
        module: nn.Module,
        names: list[str],
        shapes: list[tuple[int, ...]],
        *,
        device: torch.device,
        use_layers: bool = True,
        require_layers: bool = False,
        custom: CustomGradients | None = None,
    ) -> None:
        self.module = module
        self.names = names
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.size = int(sum(self.numels))
        self.device = device
        self.buffers = {n: b.detach() for n, b in module.named_buffers()}
        self.custom = custom
        self._func = vmap(grad(self.loss_one), in_dims=(None, 0, 0))
        self.layers: LayerGrads | None = None
        self.checked = False
        if use_layers:
            try:
                self.layers = LayerGrads(module, names, self.numels)
            except UnsupportedModel as err:
                if require_layers:
                    raise ValueError(f"grad_path='layers' does not fit this module: {err}") from err

    # -- the module as a function of theta ------------------------------------------------
    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        if theta.shape != (self.size,):
            raise ValueError(f"theta must have shape ({self.size},), got {tuple(theta.shape)}")
        return {
            name: chunk.view(shape)
            for name, chunk, shape in zip(self.names, theta.split(self.numels), self.shapes)
        }

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, (self.unflatten(theta), self.buffers), (x,))

    def loss_one(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(theta, x.unsqueeze(0)), y.unsqueeze(0))

    def leaf_forward(self, theta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> logits, with the parameters views of a leaf theta that requires grad."""
        params = self.unflatten(theta.detach().requires_grad_(True))
        return lambda x: functional_call(self.module, (params, self.buffers), (x,))

    def on_device(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device, non_blocking=True) for t in ts)

    # -- the layer path and its check -----------------------------------------------------
    def ready(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the layer path may be used; checked once against one record at a time.

        The layer path assumes what the module's code could break unseen: every layer
        sees its records along the first axis, and records meet only in the summed loss.
        So the first time two or more records come, their per-record gradients by the
        layer path and by ordinary autograd on each record alone (:meth:`one_by_one`) are
        compared, and a mismatch turns the layer path off for this model. (Not
        ``torch.func``: its first call imports ``torch._dynamo``, seconds per process,
        which a model on the layer path never needs.)"""
        if self.layers is None:
            return False
        if self.checked or x.shape[0] < 2:
            return True
        xs, ys = x[:2], y[:2]
        try:
            got = self.layers.per_record(self.leaf_forward(theta), xs, ys)
            ref = self.one_by_one(theta.detach(), xs, ys)
        except UnsupportedModel as err:
            self.drop_layers(err)
            return False
        # what the check catches (records mixed) differs at order one; on a GPU, TF32
        # convolutions (cuDNN's default) leave differences near 1e-3 between the paths
        tol = 1e-3 if self.device.type == "cpu" else 2e-2
        # only records whose gradients are finite by both paths are compared: the server's
        # parameters may overflow some records, and what the check decides (the path of
        # every later round) must not depend on that
        both = torch.isfinite(got).all(1) & torch.isfinite(ref).all(1)
        if not bool(both.any()):
            return False  # nothing to compare here: torch.func this time, checked again later
        got, ref = got[both].double(), ref[both].double()
        scale = ref.norm(dim=1, keepdim=True)
        if not bool(((got - ref).norm(dim=1, keepdim=True) <= tol * scale + 1e-6).all()):
            self.drop_layers(
                UnsupportedModel(
                    "its per-record gradients differ from those of one record at a time"
                )
            )
            return False
        self.checked = True
        return True

    def one_by_one(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, P) per-record gradients by ordinary autograd, one record at a time (the
        reference the layer path is checked against; B is small there)."""
        rows = []
        for xi, yi in zip(x, y, strict=True):
            t = theta.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.loss_one(t, xi, yi), t)
            rows.append(g)
        return torch.stack(rows)

    def drop_layers(self, err: UnsupportedModel) -> None:
        warnings.warn(
            f"per-record gradients fall back from layers to torch.func: {err}", stacklevel=3
        )
        self.layers = None

    # -- gradients ------------------------------------------------------------------------
    def per_record(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, P) matrix of per-record loss gradients (rows in the flat parameter order)."""
        if self.custom is not None:
            return self.custom.per_record_grads(theta, x, y)
        theta, x, y = self.on_device(theta, x, y)
        if self.ready(theta, x, y):
            try:
                return self.layers.per_record(self.leaf_forward(theta), x, y)
            except UnsupportedModel as err:
                self.drop_layers(err)
        return self._func(theta.detach(), x, y)

    def summed(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradient of the summed loss (= sum of per-record gradients), by ordinary autograd."""
        if self.custom is not None:
            return self.custom.summed_grad(theta, x, y)
        theta, x, y = self.on_device(theta, x, y)
        t = theta.detach().requires_grad_(True)
        loss = F.cross_entropy(self.logits(t, x), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, t)
        return g

    def chunk_sum(
        self,
        theta: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        sizes: list[int],
        clip: float | None,
        noise: PrenoiseRows | None,
    ) -> torch.Tensor:
        """sum_i clip_C(g_i + row_i) over one chunk of records (on this model's device).

        ``noise`` holds the chunk's pre-noise rows rho z_i, laid out in parameter blocks of
        ``sizes`` (None: no pre-noise, and then ``clip`` must be set)."""
        if noise is None and clip is None:
            raise ValueError("chunk_sum needs clip or pre-noise")
        b = x.shape[0]
        terms = self.layer_terms(theta, x, y, noise)
        if terms is not None:
            if noise is None:
                return self.layers.clipped_sum_norm_first(terms, clip, b)
            blocks = param_blocks(noise.result(), b, self.numels)
            return clip_blocks_and_sum(LayerGrads.add_into(blocks, terms), clip)
        with sharing_threads(noise):
            g = self.per_record(theta, x, y)
        if noise is None:
            return clip_blocks_and_sum([g], clip)
        return clip_blocks_and_sum(add_rows(param_blocks(noise.result(), b, sizes), g), clip)

    def layer_terms(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, draws):
        """The layer registry's terms of these records, computed while ``draws`` (pre-noise
        rows, or None) may be drawn beside them; None where the model takes the
        ``torch.func`` path (a custom gradient, a layer the registry lacks)."""
        if self.custom is None and self.ready(theta, x, y):
            try:
                with sharing_threads(draws):
                    return self.layers.terms(self.leaf_forward(theta), x, y)
            except UnsupportedModel as err:
                self.drop_layers(err)
        return None


def add_rows(blocks: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    """Add the per-record gradient rows ``g`` (B, P) into ``blocks`` (the same B rows laid
    out parameter block by parameter block), in place; returns ``blocks``."""
    pos = 0
    for blk in blocks:
        blk += g[:, pos : pos + blk.shape[1]]
        pos += blk.shape[1]
    return blocks


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def clipped_sum(
    grads: RecordGradients,
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sizes: list[int],
    clip: float | None,
    prenoise: float = 0.0,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_i clip_C(grad l_i + rho z_i) over the records (x, y), then over the records given
    by their gradients ``rows`` (k, P), in chunks of ``chunk_size``.

    z_i ~ N(0, I_P) is drawn from ``generator`` for every record and added to record i's
    gradient before record i is clipped: one draw of chunk x P normals per chunk, in chunk
    order (the records', then the rows'), laid out parameter by parameter in blocks of
    ``sizes`` (:func:`fedsgld.core.clipping.param_blocks`). On the CPU with more than one
    torch thread, each records chunk's draw runs on a second thread beside that chunk's
    gradients (:mod:`fedsgld.core.prenoise`); the numbers are the same. With ``clip=None``
    and no pre-noise this is the plain summed gradient, by ordinary autograd. The result is
    on ``grads.device``; records may live elsewhere (each chunk is moved there).
    """
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    prenoise = float(prenoise)
    if not (prenoise >= 0.0 and math.isfinite(prenoise)):
        raise ValueError(f"prenoise must be finite and >= 0, got {prenoise!r}")
    if prenoise > 0.0:
        if generator is None:
            raise ValueError("prenoise > 0 needs an explicit torch.Generator")
        check_generator(generator, grads.device, "pre-noise")
    theta = theta.to(grads.device)
    size = sum(sizes)
    total = torch.zeros(size, dtype=torch.float32, device=grads.device)
    chunks = list(_chunks(x.shape[0], chunk_size))
    if clip is None and prenoise == 0.0:
        for sl in chunks:
            total += grads.summed(theta, *grads.on_device(x[sl], y[sl]))
    else:
        _records_sum(grads, total, theta, x, y, chunks, sizes, clip, prenoise, generator)
    if rows is not None and rows.shape[0]:
        total += clipped_rows_sum(
            rows.to(grads.device, torch.float32),
            sizes,
            clip=clip,
            prenoise=prenoise,
            generator=generator,
            chunk_size=chunk_size,
        )
    return total


def _records_sum(grads, total, theta, x, y, chunks, sizes, clip, prenoise, generator) -> None:
    """total += the clipped, pre-noised sum of each chunk, drawing the next chunk's
    pre-noise in the background where that helps (two chunks of noise in memory at most)."""
    size = sum(sizes)
    noise: list[PrenoiseRows | None] = [None] * len(chunks)
    ahead = prenoise > 0.0 and draw_in_background(generator)

    def draw(k: int) -> None:
        # in the background, taking chunk k's pre-noise starts chunk k + 1's; on the
        # calling thread each chunk draws its own when due
        n = chunks[k].stop - chunks[k].start
        nxt = (lambda: draw(k + 1)) if ahead and k + 1 < len(chunks) else None
        noise[k] = PrenoiseRows(
            n, size, std=prenoise, generator=generator, background=ahead, then=nxt
        )

    try:
        for k, sl in enumerate(chunks):
            if prenoise > 0.0 and noise[k] is None:
                draw(k)
            xb, yb = grads.on_device(x[sl], y[sl])
            total += grads.chunk_sum(theta, xb, yb, sizes=sizes, clip=clip, noise=noise[k])
            noise[k] = None
    finally:
        for n in noise:
            if n is not None:
                n.wait()  # the generator is never left in use by another thread


def clipped_rows_sum(
    rows: torch.Tensor,
    sizes: list[int],
    *,
    clip: float | None,
    prenoise: float,
    generator: torch.Generator,
    chunk_size: int = 256,
) -> torch.Tensor:
    """sum_i clip_C(v_i + rho z_i) for records given by their gradients v_i (rows of a
    (k, P) matrix on the generator's device, P = sum(sizes)): the pre-noise rho z_i drawn
    from ``generator`` laid out parameter by parameter (blocks of ``sizes``), then the one
    clip, in chunks of ``chunk_size`` records. The records' own path with pre-noise, for
    gradients that need no model."""
    size = sum(sizes)
    if rows.dim() != 2 or rows.shape[1] != size:
        raise ValueError(f"rows must be (records, {size}), got {tuple(rows.shape)}")
    total = torch.zeros(size, dtype=torch.float32, device=rows.device)
    for start in range(0, rows.shape[0], chunk_size):
        part = rows[start : start + chunk_size]
        k = part.shape[0]
        flat = prenoise_values(k * size, std=prenoise, generator=generator).to(rows.device)
        blocks = param_blocks(flat, k, sizes)
        pos = 0
        for blk in blocks:
            blk += part[:, pos : pos + blk.shape[1]]
            pos += blk.shape[1]
        total += clip_blocks_and_sum(blocks, clip)
    return total
