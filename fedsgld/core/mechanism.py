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

A site step here draws the Poisson sample and hands the sampled records to the per-record
path once (:func:`fedsgld.core.per_record.clipped_sum`: pre-noise, per-record gradients,
the one clip, the sum). Per-record gradients come from one of two paths, chosen per model
(``FlatModel.grad_path``): ``layers`` (every trainable parameter in a layer of the
registry of :mod:`fedsgld.core.grad_samplers`: gradients from activations and
backpropagated errors) or ``func`` (anything else: ``torch.func.vmap`` of the one-record
gradient). Both give the gradients of a loop over records to float rounding; the pre-noise
rows are drawn the same way for both.

Device: a :class:`FlatModel` lives on one device (``cpu`` or a CUDA GPU); the functions
below move records to it, compute there and return tensors there. Every draw uses the
caller's generator, which must be on that device (see :mod:`fedsgld.core.device`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedsgld.core import batched, per_record
from fedsgld.core.batched import SiteSample
from fedsgld.core.device import check_generator, resolve_device
from fedsgld.core.finite import finite_probs, finite_vector
from fedsgld.core.per_record import RecordGradients

GRAD_PATHS = ("auto", "layers", "func")


class FlatModel:
    """A module seen as a function of one flat parameter vector theta of length P.

    ``device`` moves the module there (None: leave it where it is). ``grad_path`` picks how
    per-record gradients are formed: ``auto`` (``layers`` when the module allows it, else
    ``func``), ``layers`` (ValueError if the module does not allow it) or ``func``. The
    gradients and the per-record path live in :class:`fedsgld.core.per_record.RecordGradients`
    (``self.grads``); a subclass that overrides ``per_record_grads`` and ``summed_grad``
    (variational models) has them used there instead.
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
        # a subclass with its own per-record gradients (variational models) keeps them
        own_grads = type(self).per_record_grads is not FlatModel.per_record_grads
        if grad_path == "layers" and own_grads:
            raise ValueError(f"grad_path='layers' is not available for {type(self).__name__}")
        self.grads = RecordGradients(
            module,
            self.names,
            self.shapes,
            device=self.device,
            use_layers=grad_path != "func" and not own_grads,
            require_layers=grad_path == "layers",
            custom=self if own_grads else None,
        )
        self.buffers = self.grads.buffers

    @property
    def grad_path(self) -> str:
        """``layers`` or ``func``: how this model's per-record gradients are formed."""
        return "layers" if self.grads.layers is not None else "func"

    @property
    def layers_checked(self) -> bool:
        """Whether the layer path is in use and has passed its check against ``torch.func``."""
        return self.grads.layers is not None and self.grads.checked

    def accept_layers_check(self) -> None:
        """Skip the layer path's check: the same module code and architecture passed it
        earlier in this run, in another process (a deployed site runs each round in a new
        process, and the check is a sixth of a small model's round there)."""
        if self.grads.layers is not None:
            self.grads.checked = True

    def flatten(self) -> torch.Tensor:
        """The module's current parameters as a flat float32 vector (a copy, on its device)."""
        params = dict(self.module.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names]).float().clone()

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.grads.unflatten(theta)

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.grads.logits(theta, x)

    def _loss_one(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.grads.loss_one(theta, x, y)

    def _on_device(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.grads.on_device(*ts)

    def per_record_grads(
        self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """(B, P) matrix of per-record loss gradients (rows in the flat parameter order)."""
        return self.grads.per_record(theta, x, y)

    def summed_grad(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradient of the summed loss (= sum of per-record gradients), by ordinary autograd."""
        return self.grads.summed(theta, x, y)

    def _block_sizes(self) -> list[int]:
        """Lengths of the flat vector's parameter blocks (the whole vector for subclasses
        whose flat vector is not the module's parameters)."""
        return self.numels if self.size == self.theta_size else [self.size]

    @torch.no_grad()
    def predict_proba(
        self, theta: torch.Tensor, x: torch.Tensor, batch: int = 2048
    ) -> torch.Tensor:
        """Softmax of the logits, computed on this model's device, returned on x's device;
        a record whose softmax is not finite (its logits overflowed) gets the uniform
        distribution (:func:`fedsgld.core.finite.finite_probs`)."""
        theta = theta.to(self.device)
        return torch.cat(
            [
                finite_probs(self.logits(theta, xb.to(self.device)).softmax(-1)).to(x.device)
                for xb in x.split(batch)
            ]
        )


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
    """sum_i clip_C(grad l_i + rho z_i) over the given records, in chunks of ``chunk_size``
    (:func:`fedsgld.core.per_record.clipped_sum`: z_i ~ N(0, I_P) drawn from ``generator``
    per record, in chunk order, laid out parameter by parameter). With ``clip=None`` and no
    pre-noise this is the plain summed gradient. The result is on ``fm.device``."""
    return per_record.clipped_sum(
        fm.grads,
        theta,
        x,
        y,
        sizes=fm._block_sizes(),
        clip=clip,
        prenoise=prenoise,
        generator=generator,
        chunk_size=chunk_size,
    )


def poisson_sample(n: int, *, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of records selected independently with probability ``sample_rate`` each.

    The uniforms are drawn on the generator's device; so are the indices returned."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    mask = torch.rand(n, generator=generator, device=generator.device) < sample_rate
    return mask.nonzero(as_tuple=True)[0]


def sample_site(
    n: int, *, sample_rate: float, generator: torch.Generator, extra=None, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A site's Poisson sample of its ``n`` records and of ``extra``'s records (an audit's
    canaries, records n .. n + count - 1 of the same sample: one :func:`poisson_sample`
    call for all): the sampled records' indices (on the generator's device) and the
    sampled canaries' gradients (None if none was sampled). The first draw of a site
    step; its pre-noise comes next from the same generator."""
    count = 0 if extra is None else int(extra.count)
    idx = poisson_sample(n + count, sample_rate=sample_rate, generator=generator)
    taken = idx[idx >= n] - n
    rows = extra.gradients(taken.cpu(), clip) if count and taken.numel() else None
    return idx[idx < n], rows


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
    idx, rows = sample_site(
        x.shape[0], sample_rate=sample_rate, generator=generator, extra=extra, clip=clip
    )
    idx = idx.to(x.device)
    return per_record.clipped_sum(
        fm.grads,
        theta,
        x[idx],
        y[idx],
        sizes=fm._block_sizes(),
        clip=clip,
        prenoise=prenoise,
        generator=generator,
        chunk_size=chunk_size,
        rows=rows,
    )


def site_sums(
    fm: FlatModel,
    theta: torch.Tensor,
    samples: list[SiteSample],
    *,
    clip: float | None,
    prenoise: float,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Many sites' contributions at once: row k of the (K, P) result is site k's S_k over
    its drawn sample ``samples[k]`` (:func:`sample_site`, then its own generator draws its
    pre-noise), with one per-record pass over all sites' records and per-site sums
    (:func:`fedsgld.core.batched.segment_clipped_sums`). The same S_k as :func:`site_step`
    to float rounding; on ``fm.device``."""
    for s in samples:
        check_generator(s.generator, fm.device, "site_sums")
    return batched.segment_clipped_sums(
        fm.grads,
        theta,
        samples,
        sizes=fm._block_sizes(),
        clip=clip,
        prenoise=prenoise,
        chunk_size=chunk_size,
    )


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
    ``summed`` must be on one device. An entry beyond float32's range is clamped to it
    (:func:`fedsgld.core.finite.finite_vector`: a function of the noised release, so free).
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
    return finite_vector(theta - step_size * g)
