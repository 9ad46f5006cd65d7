"""DP-SGLD's mechanism as pure functions of a flat parameter vector.

Site side (one Langevin step, one site k with N_k records):

    B_k  = {i : u_i < q},  u_i ~ U(0, 1) i.i.d.                 (Poisson sampling)
    S_k  = sum_{i in B_k} clip_C(grad l(theta; x_i, y_i) + rho z_i)

Server side (all sites, expected batch size L = q * sum_k N_k, which is public):

    g          = (sum_k S_k + sigma_t C xi) / L  +  lambda theta      (xi ~ N(0, I))
    theta_next = theta - alpha_t g

with sigma_t = sqrt(2 alpha_t tau) for DP-SGLD, a constant sigma for DP-SGD and 0 (and no
clipping) for SGD. lambda theta is the gradient of a Gaussian prior (weight decay,
lambda = 1 / (prior_std^2 * sum_k N_k) in the per-record normalisation); it touches no
record and is free. Dividing by the expected rather than the realised batch size keeps
the realised size private: a site never reports how many records it sampled.

Privacy caveat: the guarantee is that of the Poisson-subsampled Gaussian mechanism with
noise multiplier sigma_t on sensitivity C, composed over steps by the accountant. It holds
only if every record's contribution is clipped (``clip`` is not None), the sampling is
truly Poisson with rate q, and the noise is drawn by the party that is trusted.

Per-record gradients come from one of two paths, chosen per model (``FlatModel.grad_path``):
``layers`` (every trainable parameter in a Linear or Conv2d layer: per-record gradients from
activations and backpropagated errors, see :mod:`fedsgld.core.per_record`) or ``func``
(anything else: ``torch.func.vmap`` of the one-record gradient). Both give the gradients of
a loop over records to float rounding; the pre-noise rows are drawn the same way for both.

Device: a :class:`FlatModel` lives on one device (``cpu`` or a CUDA GPU); the functions
below move records to it, compute there and return tensors there. Every draw uses the
caller's generator, which must be on that device (see :mod:`fedsgld.core.device`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedsgld.core.clipping import clip_and_sum
from fedsgld.core.device import check_generator, resolve_device
from fedsgld.core.per_record import (
    LayerGrads,
    UnsupportedModel,
    clip_blocks_and_sum,
    clipped_rows_sum,
    param_blocks,
)
from fedsgld.core.prenoise import PrenoiseRows, draw_in_background, sharing_threads

GRAD_PATHS = ("auto", "layers", "func")


class FlatModel:
    """A module seen as a function of one flat parameter vector theta of length P.

    ``device`` moves the module there (None: leave it where it is). ``grad_path`` picks how
    per-record gradients are formed: ``auto`` (``layers`` when the module allows it, else
    ``func``), ``layers`` (ValueError if the module does not allow it) or ``func``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: str | torch.device | None = None,
        grad_path: str = "auto",
    ) -> None:
        if grad_path not in GRAD_PATHS:
            raise ValueError(f"grad_path must be one of {', '.join(GRAD_PATHS)}; got {grad_path!r}")
        if device is not None:
            module.to(resolve_device(device))
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.theta_size = int(sum(self.numels))  # network weights
        self.size = self.theta_size  # what the optimiser moves (2x for variational models)
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.buffers = {n: b.detach() for n, b in module.named_buffers()}
        self._per_record = vmap(grad(self._loss_one), in_dims=(None, 0, 0))
        self._layers: LayerGrads | None = None
        self._layers_checked = False
        # a subclass with its own per-record gradients (variational models) keeps them
        own_grads = type(self).per_record_grads is not FlatModel.per_record_grads
        if grad_path == "layers" and own_grads:
            raise ValueError(f"grad_path='layers' is not available for {type(self).__name__}")
        if grad_path != "func" and not own_grads:
            try:
                self._layers = LayerGrads(module, self.names, self.numels)
            except UnsupportedModel as err:
                if grad_path == "layers":
                    raise ValueError(f"grad_path='layers' does not fit this module: {err}") from err

    @property
    def grad_path(self) -> str:
        """``layers`` or ``func``: how this model's per-record gradients are formed."""
        return "layers" if self._layers is not None else "func"

    def _layers_ready(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the layer path may be used; checked once against ``torch.func``.

        The layer path assumes what the module's code could break unseen: every layer
        sees its records along the first axis, and records meet only in the summed loss.
        So the first time two or more records come, their per-record gradients by both
        paths are compared, and a mismatch turns the layer path off for this model."""
        if self._layers is None:
            return False
        if self._layers_checked or x.shape[0] < 2:
            return True
        xs, ys = x[:2], y[:2]
        try:
            got = self._layers.per_record(self._leaf_forward(theta), xs, ys)
            ref = self._per_record(theta.detach(), xs, ys)
        except UnsupportedModel as err:
            self._drop_layers(err)
            return False
        # what the check catches (records mixed) differs at order one; on a GPU, TF32
        # convolutions (cuDNN's default) leave differences near 1e-3 between the paths
        tol = 1e-3 if self.device.type == "cpu" else 2e-2
        scale = ref.norm(dim=1, keepdim=True)
        if not bool(((got - ref).norm(dim=1, keepdim=True) <= tol * scale + 1e-6).all()):
            self._drop_layers(
                UnsupportedModel("its per-record gradients differ from torch.func's on this module")
            )
            return False
        self._layers_checked = True
        return True

    @property
    def layers_checked(self) -> bool:
        """Whether the layer path is in use and has passed its check against ``torch.func``."""
        return self._layers is not None and self._layers_checked

    def accept_layers_check(self) -> None:
        """Skip the layer path's check: the same module code and architecture passed it
        earlier in this run, in another process (a deployed site runs each round in a new
        process, and the check is a sixth of a small model's round there)."""
        if self._layers is not None:
            self._layers_checked = True

    def _drop_layers(self, err: UnsupportedModel) -> None:
        warnings.warn(
            f"per-record gradients fall back from layers to torch.func: {err}", stacklevel=3
        )
        self._layers = None

    def flatten(self) -> torch.Tensor:
        """The module's current parameters as a flat float32 vector (a copy, on its device)."""
        params = dict(self.module.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names]).float().clone()

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        if theta.shape != (self.theta_size,):
            raise ValueError(
                f"theta must have shape ({self.theta_size},), got {tuple(theta.shape)}"
            )
        out = {}
        for name, chunk, shape in zip(
            self.names, theta.split(self.numels), self.shapes, strict=False
        ):
            out[name] = chunk.view(shape)
        return out

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, (self.unflatten(theta), self.buffers), (x,))

    def _loss_one(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.logits(theta, x.unsqueeze(0))
        return F.cross_entropy(out, y.unsqueeze(0))

    def _leaf_forward(self, theta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> logits, with the parameters views of a leaf theta that requires grad."""
        t = theta.detach().requires_grad_(True)
        params = self.unflatten(t)
        return lambda x: functional_call(self.module, (params, self.buffers), (x,))

    def _on_device(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device, non_blocking=True) for t in ts)

    def per_record_grads(
        self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """(B, P) matrix of per-record loss gradients (rows in the flat parameter order)."""
        theta, x, y = self._on_device(theta, x, y)
        if self._layers_ready(theta, x, y):
            try:
                return self._layers.per_record(self._leaf_forward(theta), x, y)
            except UnsupportedModel as err:
                self._drop_layers(err)
        return self._per_record(theta.detach(), x, y)

    def summed_grad(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradient of the summed loss (= sum of per-record gradients), by ordinary autograd."""
        theta, x, y = self._on_device(theta, x, y)
        t = theta.detach().requires_grad_(True)
        loss = F.cross_entropy(self.logits(t, x), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, t)
        return g

    def clipped_chunk_sum(
        self,
        theta: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        clip: float | None,
        noise: PrenoiseRows | None,
    ) -> torch.Tensor:
        """sum_i clip_C(g_i + row_i) over one chunk of records (on this model's device).

        ``noise`` holds the pre-noise rows rho z_i of the chunk (None: no pre-noise, and then
        ``clip`` must be set). Each record's row gets its own gradient added before the
        record is clipped.
        """
        if noise is None and clip is None:
            raise ValueError("clipped_chunk_sum needs clip or pre-noise")
        b = x.shape[0]
        if self._layers_ready(theta, x, y):
            try:
                with sharing_threads(noise):
                    terms = self._layers.terms(self._leaf_forward(theta), x, y)
            except UnsupportedModel as err:
                self._drop_layers(err)
            else:
                if noise is None:
                    return self._layers.clipped_sum_norm_first(terms, clip, b)
                blocks = param_blocks(noise.result(), b, self.numels)
                return clip_blocks_and_sum(LayerGrads.add_into(blocks, terms), clip)
        with sharing_threads(noise):
            g = self.per_record_grads(theta, x, y)
        if noise is None:
            return clip_and_sum(g, clip=clip)
        blocks = param_blocks(noise.result(), b, self._block_sizes())
        pos = 0
        for blk in blocks:
            blk += g[:, pos : pos + blk.shape[1]]
            pos += blk.shape[1]
        return clip_blocks_and_sum(blocks, clip)

    def _block_sizes(self) -> list[int]:
        """Lengths of the flat vector's parameter blocks (the whole vector for subclasses
        whose flat vector is not the module's parameters)."""
        return self.numels if self.size == self.theta_size else [self.size]

    @torch.no_grad()
    def predict_proba(
        self, theta: torch.Tensor, x: torch.Tensor, batch: int = 2048
    ) -> torch.Tensor:
        """Softmax of the logits, computed on this model's device, returned on x's device."""
        theta = theta.to(self.device)
        return torch.cat(
            [
                self.logits(theta, xb.to(self.device)).softmax(-1).to(x.device)
                for xb in x.split(batch)
            ]
        )


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def clipped_gradient_sum(
    fm: FlatModel,
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    clip: float | None,
    prenoise: float = 0.0,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """sum_i clip_C(grad l_i + rho z_i) over the given records, in chunks of ``chunk_size``.

    z_i ~ N(0, I_P) is drawn from ``generator`` for every record and added to record i's
    gradient before record i is clipped: one draw of chunk x P normals per chunk, in chunk
    order, laid out parameter by parameter (``fedsgld.core.per_record.param_blocks``). On
    the CPU with more than one torch thread, each chunk's draw runs on a second thread
    beside that chunk's gradients (``fedsgld.core.prenoise``); the numbers are the same.
    Memory is O(chunk_size * P) whatever the number of records. With ``clip=None`` and no
    pre-noise this is the plain summed gradient, computed by ordinary autograd. The result
    is on ``fm.device``; records may live elsewhere (each chunk is moved there).
    """
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    prenoise = float(prenoise)
    if not (prenoise >= 0.0 and math.isfinite(prenoise)):
        raise ValueError(f"prenoise must be finite and >= 0, got {prenoise!r}")
    if prenoise > 0.0:
        if generator is None:
            raise ValueError("prenoise > 0 needs an explicit torch.Generator")
        check_generator(generator, fm.device, "pre-noise")
    theta = theta.to(fm.device)
    total = torch.zeros(fm.size, dtype=torch.float32, device=fm.device)
    chunks = list(_chunks(x.shape[0], chunk_size))
    if clip is None and prenoise == 0.0:
        for sl in chunks:
            total += fm.summed_grad(theta, *fm._on_device(x[sl], y[sl]))
        return total
    noise: list[PrenoiseRows | None] = [None] * len(chunks)
    ahead = prenoise > 0.0 and draw_in_background(generator)

    def draw(k: int) -> None:
        # in the background, taking chunk k's pre-noise starts chunk k + 1's (two chunks of
        # noise in memory at most); on the calling thread each chunk draws its own when due
        rows = chunks[k].stop - chunks[k].start
        nxt = (lambda: draw(k + 1)) if ahead and k + 1 < len(chunks) else None
        noise[k] = PrenoiseRows(
            rows, fm.size, std=prenoise, generator=generator, background=ahead, then=nxt
        )

    try:
        for k, sl in enumerate(chunks):
            if prenoise > 0.0 and noise[k] is None:
                draw(k)
            xb, yb = fm._on_device(x[sl], y[sl])
            total += fm.clipped_chunk_sum(theta, xb, yb, clip=clip, noise=noise[k])
            noise[k] = None
    finally:
        for n in noise:
            if n is not None:
                n.wait()  # the generator is never left in use by another thread
    return total


def poisson_sample(n: int, *, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of records selected independently with probability ``sample_rate`` each.

    The uniforms are drawn on the generator's device; so are the indices returned."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    mask = torch.rand(n, generator=generator, device=generator.device) < sample_rate
    return mask.nonzero(as_tuple=True)[0]


def site_step(
    fm: FlatModel,
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sample_rate: float,
    clip: float | None,
    prenoise: float,
    generator: torch.Generator,
    chunk_size: int = 256,
    extra=None,
) -> torch.Tensor:
    """One site's contribution to a Langevin step: the clipped, pre-noised sum S_k.

    Returns only the (P,) sum, on ``fm.device``; the realised batch size stays at the site.
    ``generator`` draws the Poisson sample and the pre-noise and must be on ``fm.device``;
    the records (x, y) may stay on the CPU.

    ``extra``: records given by their gradients instead of (x, y) (an audit's canaries,
    :mod:`fedsgld.studies.audit`), an object with ``count`` (how many) and
    ``gradients(index, clip) -> (len(index), P)``. They are records N .. N + count - 1 of
    the same Poisson sample (one :func:`poisson_sample` call for all) and are pre-noised and
    clipped by the records' clipping
    (:func:`fedsgld.core.per_record.clipped_rows_sum`).
    """
    check_generator(generator, fm.device, "site_step")
    n = x.shape[0]
    count = 0 if extra is None else int(extra.count)
    idx = poisson_sample(n + count, sample_rate=sample_rate, generator=generator)
    taken = idx[idx >= n] - n
    idx = idx[idx < n].to(x.device)
    total = clipped_gradient_sum(
        fm,
        theta,
        x[idx],
        y[idx],
        clip=clip,
        prenoise=prenoise,
        generator=generator,
        chunk_size=chunk_size,
    )
    if count and taken.numel():
        rows = extra.gradients(taken.cpu(), clip)
        total += clipped_rows_sum(
            rows.to(fm.device, torch.float32),
            fm._block_sizes(),
            clip=clip,
            prenoise=prenoise,
            generator=generator,
            chunk_size=chunk_size,
        )
    return total


def langevin_update(
    theta: torch.Tensor,
    summed: torch.Tensor,
    *,
    step_size: float,
    expected_batch: float,
    weight_decay: float,
) -> torch.Tensor:
    """theta - alpha * (noisy / L + lambda * theta): post-processing of a release.

    ``summed`` is the already noised sum sum_k S_k + sigma_t C xi (the noise is drawn
    through a receipt of the ledger that accounts for it, :mod:`fedsgld.core.release`;
    this function draws nothing); ``expected_batch`` is L = q * sum_k N_k. ``theta`` and
    ``summed`` must be on one device.
    """
    if not expected_batch > 0:
        raise ValueError(f"expected batch size must be > 0, got {expected_batch!r}")
    if not (math.isfinite(step_size) and step_size > 0):
        raise ValueError(f"step size must be finite and > 0, got {step_size!r}")
    if theta.device != summed.device:
        raise ValueError(
            f"theta is on {theta.device} but the summed gradient on {summed.device}; "
            "move both to one device"
        )
    g = summed / expected_batch
    if weight_decay:
        g = g + weight_decay * theta
    return theta - step_size * g
