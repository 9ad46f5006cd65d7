"""Mean-field Gaussian variational inference over a network's weights (DPVI).

Variational posterior q(theta) = N(mu, diag(s)^2) with s = softplus(rho), parameters
phi = [mu, rho] (length 2P). Prior p(theta) = N(0, prior_std^2 I). The ELBO over all
N = sum_k N_k records is

    ELBO(phi) = sum_i E_q[log p(y_i | x_i, theta)] - KL(q || p).

Per-record gradients (the data part) use the reparameterisation theta = mu + s * eps with
ONE Monte-Carlo draw eps ~ N(0, I) per step and per site, shared by every record of that
site's batch (each site draws its own eps from its (seed, site, round) generator, so the
summed estimator stays unbiased). d/dphi of -log p(y_i | x_i, mu + s * eps) is computed per
record with torch.func, then pre-noised (optional), clipped to C and summed at the site,
exactly like DP-SGLD's gradients: the privacy mechanism is the same Poisson-subsampled
Gaussian on a clipped sum.

The KL term touches no record: the server adds its gradient AFTER the noise, unclipped,
at no privacy cost (Jälkö et al. 2017; not inside each record's clipped gradient):

    KL = sum_j [log(prior_std / s_j) + (s_j^2 + mu_j^2) / (2 prior_std^2) - 1/2]
    dKL/dmu = mu / prior_std^2,   dKL/drho = (s / prior_std^2 - 1 / s) * sigmoid(rho).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from fedsgld.core.finite import finite_probs
from fedsgld.core.mechanism import FlatModel


def inverse_softplus(x: float) -> float:
    return x + math.log(-math.expm1(-x))


class VariationalModel(FlatModel):
    """A module seen as a function of phi = [mu, rho] (length 2P) through q(theta)."""

    def __init__(
        self, module: nn.Module, *, init_std: float = 1e-3, predict_samples: int = 20
    ) -> None:
        super().__init__(module)
        self.P = self.size
        self.size = 2 * self.P
        self.init_std = init_std
        self.predict_samples = predict_samples
        self._eps = torch.zeros(self.P)
        self._per_record_vi = vmap(grad(self._vi_loss_one), in_dims=(None, 0, 0, None))

    # -- parameters -----------------------------------------------------------
    def flatten(self) -> torch.Tensor:
        mu = super().flatten()
        rho = torch.full_like(mu, inverse_softplus(self.init_std))
        return torch.cat([mu, rho])

    def split(self, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if phi.shape != (self.size,):
            raise ValueError(f"phi must have shape ({self.size},), got {tuple(phi.shape)}")
        return phi[: self.P], phi[self.P :]

    def begin_step(self, generator: torch.Generator) -> None:
        """Draw this step's reparameterisation noise eps ~ N(0, I_P) (shared by the batch)."""
        self._eps = torch.randn(self.P, generator=generator)

    def _theta(self, phi: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        mu, rho = phi[: self.P], phi[self.P :]
        return mu + F.softplus(rho) * eps

    # -- the data term ----------------------------------------------------------
    def _vi_loss_one(self, phi, x, y, eps):
        return self._loss_one(self._theta(phi, eps), x, y)

    def per_record_grads(self, phi: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._per_record_vi(phi.detach(), x, y, self._eps)

    def summed_grad(self, phi: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = phi.detach().requires_grad_(True)
        loss = F.cross_entropy(self.logits(self._theta(p, self._eps), x), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, p)
        return g

    # -- predictions --------------------------------------------------------------
    @torch.no_grad()
    def predict_proba(self, phi: torch.Tensor, x: torch.Tensor, batch: int = 2048) -> torch.Tensor:
        """Predictive distribution: mean softmax over ``predict_samples`` draws from q.

        The draws come from a fixed generator, so predictions are reproducible. A draw whose
        softmax of a record is not finite counts as uniform for that record
        (:func:`fedsgld.core.finite.finite_probs`)."""
        mu, rho = self.split(phi)
        s = F.softplus(rho)
        gen = torch.Generator().manual_seed(12345)
        out = torch.zeros(x.shape[0], 0)
        for i in range(self.predict_samples):
            theta = mu + s * torch.randn(self.P, generator=gen)
            p = torch.cat(
                [finite_probs(self.logits(theta, xb).softmax(-1)) for xb in x.split(batch)]
            )
            out = p if i == 0 else out + p
        return out / self.predict_samples


def kl_gradient(phi: torch.Tensor, *, prior_std: float) -> torch.Tensor:
    """Gradient of KL(q || N(0, prior_std^2 I)) with respect to phi = [mu, rho]."""
    P = phi.shape[0] // 2
    mu, rho = phi[:P], phi[P:]
    s = F.softplus(rho)
    v = prior_std**2
    return torch.cat([mu / v, (s / v - 1.0 / s) * torch.sigmoid(rho)])


def kl_divergence(phi: torch.Tensor, *, prior_std: float) -> float:
    P = phi.shape[0] // 2
    mu, rho = phi[:P], phi[P:]
    s = F.softplus(rho)
    v = prior_std**2
    return float(torch.sum(math.log(prior_std) - torch.log(s) + (s**2 + mu**2) / (2 * v) - 0.5))


class Adam:
    """Adam on the noised gradient (post-processing: no privacy cost). State is checkpointable."""

    def __init__(
        self, size: int, *, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        self.m = torch.zeros(size)
        self.v = torch.zeros(size)
        self.t = 0
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        self.t += 1
        self.m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        mhat = self.m / (1 - self.beta1**self.t)
        vhat = self.v / (1 - self.beta2**self.t)
        return mhat / (vhat.sqrt() + self.eps)

    def state_dict(self) -> dict:
        return {"m": self.m.clone(), "v": self.v.clone(), "t": self.t}

    def load_state_dict(self, d: dict) -> None:
        self.m, self.v, self.t = d["m"].clone(), d["v"].clone(), int(d["t"])
