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
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from ..privacy.clipping import clip_and_sum
from ..privacy.noise import gaussian_noise


class FlatModel:
    """A module seen as a function of one flat parameter vector theta of length P."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.theta_size = int(sum(self.numels))  # network weights
        self.size = self.theta_size  # what the optimiser moves (2x for variational models)
        self.buffers = {n: b.detach() for n, b in module.named_buffers()}
        self._per_record = vmap(grad(self._loss_one), in_dims=(None, 0, 0))

    def flatten(self) -> torch.Tensor:
        """The module's current parameters as a flat float32 vector (a copy)."""
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

    def per_record_grads(
        self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """(B, P) matrix of per-record loss gradients, vectorised with torch.func."""
        return self._per_record(theta.detach(), x, y)

    def summed_grad(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradient of the summed loss (= sum of per-record gradients), by ordinary autograd."""
        t = theta.detach().requires_grad_(True)
        loss = F.cross_entropy(self.logits(t, x), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, t)
        return g

    @torch.no_grad()
    def predict_proba(
        self, theta: torch.Tensor, x: torch.Tensor, batch: int = 2048
    ) -> torch.Tensor:
        return torch.cat([self.logits(theta, xb).softmax(-1) for xb in x.split(batch)])


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

    Memory is O(chunk_size * P) whatever the number of records. With ``clip=None`` and no
    pre-noise this is the plain summed gradient, computed by ordinary autograd.
    """
    total = torch.zeros(fm.size, dtype=torch.float32)
    if x.shape[0] == 0:
        return total
    for sl in _chunks(x.shape[0], chunk_size):
        if clip is None and prenoise == 0.0:
            total += fm.summed_grad(theta, x[sl], y[sl])
        else:
            g = fm.per_record_grads(theta, x[sl], y[sl])
            total += clip_and_sum(g, clip=clip, prenoise=prenoise, generator=generator)
    return total


def poisson_sample(n: int, *, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of records selected independently with probability ``sample_rate`` each."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    mask = torch.rand(n, generator=generator) < sample_rate
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
) -> torch.Tensor:
    """One site's contribution to a Langevin step: the clipped, pre-noised sum S_k.

    Returns only the (P,) sum; the realised batch size stays at the site.
    """
    idx = poisson_sample(x.shape[0], sample_rate=sample_rate, generator=generator)
    return clipped_gradient_sum(
        fm,
        theta,
        x[idx],
        y[idx],
        clip=clip,
        prenoise=prenoise,
        generator=generator,
        chunk_size=chunk_size,
    )


def langevin_update(
    theta: torch.Tensor,
    summed: torch.Tensor,
    *,
    step_size: float,
    noise_std: float,
    expected_batch: float,
    weight_decay: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """theta - alpha * ((summed + N(0, noise_std^2 I)) / L + lambda * theta).

    ``noise_std`` is sigma_t * C (the Gaussian mechanism on the clipped sum);
    ``expected_batch`` is L = q * sum_k N_k.
    """
    if not expected_batch > 0:
        raise ValueError(f"expected batch size must be > 0, got {expected_batch!r}")
    if not (math.isfinite(step_size) and step_size > 0):
        raise ValueError(f"step size must be finite and > 0, got {step_size!r}")
    noisy = summed + gaussian_noise(
        summed.shape, std=noise_std, generator=generator, dtype=summed.dtype
    )
    g = noisy / expected_batch
    if weight_decay:
        g = g + weight_decay * theta
    return theta - step_size * g
