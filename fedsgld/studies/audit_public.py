"""The auditor's public estimate of the records' part of each reading.

A canary's reading y_jt = <G_t, u_j> / C (:mod:`fedsgld.studies.audit`) is its sampled
inclusion plus the mechanism's noise plus the records' clipped gradient sum at the
canary's parameter p_j:

    y_jt = b_jt + e_jt + r_jt,   r_jt = sum_{i in batch t} clip_C(g_i(theta_{t-1}) + rho z_i)[p_j] / C.

r_jt is the same whether canary j is IN or OUT, but it differs from canary to canary and
drifts slowly with the model, so it blurs the scores once the noise is small (with the
server's noise halved, on MNIST-5k's CNN, the likelihood ratio separates IN from OUT by
1.54 standard deviations where the idealised game, which has no r, gives 1.75 to 1.78).

The auditor holds public records of the records' distribution (here: the held-out test
records of the sites, which no site trains on) and, from the released parameters
theta_{t-1} alone, estimates

    r_hat_jt = (L / n) sum_{i in P_t} g_i(theta_{t-1})[p_j] f_i / C,
    f_i = min(1, C / sqrt(||g_i||^2 + rho^2 P)),

the expected clipped sum of an expected batch of L = q N records (L public), from a fresh
random subset P_t of n public records every round (independent estimation errors across
rounds, which the scores average out, instead of one persistent bias). f_i is the clip
factor of the records' own clipping (:func:`fedsgld.core.per_record.clip_factors`) at the
expected norm of a pre-noised gradient (in P dimensions ||g + rho z||^2 concentrates at
||g||^2 + rho^2 P). The scores read y_jt - r_hat_jt.

Soundness: r_hat is a function of the released parameters, the canaries' parameters, the
public settings and records that are independent of the inclusion bits, so every score
stays a function the audit may test (the bounds' validity needs nothing more); the
estimate's quality changes only the audit's power. Privacy caveat: in a deployment the
auditor must hold its own records of the same distribution; the test records used here
stand in for them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedsgld.core.clipping import clip_factors
from fedsgld.core.noise import seeded_generator

#: key part of the generator of the public subsets (beside the audit's other streams)
PUBLIC_STREAM = 0xA0D3


class PublicGradient:
    """The estimate r_hat of the module docstring from public records (x, y) through the
    run's flat model ``fm``; ``sample``: n, the public records per round."""

    def __init__(
        self, fm, x: torch.Tensor, y: torch.Tensor, *, sample: int = 256, seed: int = 0
    ) -> None:
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(f"public records: {x.shape[0]} inputs, {y.shape[0]} labels")
        if not (isinstance(sample, int) and sample >= 1):
            raise ValueError(
                f"sample must be an integer >= 1 (public records a round), got {sample!r}"
            )
        self.fm, self.x, self.y = fm, x, y
        self.sample = min(sample, int(x.shape[0]))
        self._gen = seeded_generator(int(seed), PUBLIC_STREAM)

    @classmethod
    def from_sites(cls, sites, **kw) -> PublicGradient:
        """From every site's held-out test records (none of them trained on)."""
        x = torch.cat([s.x_test for s in sites])
        y = torch.cat([s.y_test for s in sites])
        return cls(sites[0].fm, x, y, **kw)

    @torch.no_grad()
    def estimate(
        self,
        theta: torch.Tensor,
        coords: torch.Tensor,
        *,
        clip: float | None,
        prenoise: float,
        batch: float,
        sample_rate: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(r_hat_.t, s_.t, e_.t), each (m,), at the parameters ``theta`` of the round's
        start, in units of C (squared for s and e): the records' expected part; its
        variance s_j = L (1 - q) mean_i x_ij^2 + L^2 var_i(x_ij) / n with
        x_ij = f_i (g_ij + rho z_ij) (E[x_ij^2] = f_i^2 (g_ij^2 + rho^2)), the Poisson
        sample's spread and the estimate's own error; and e_j = L^2 var_i(x_ij)
        (1 / n_pool + q / L), the variance of the part of the error that persists over the
        rounds (the finite public pool's mean, and the finite records' mean, each off the
        distribution's)."""
        if not (batch > 0 and math.isfinite(batch)):
            raise ValueError(f"the expected batch must be > 0, got {batch!r}")
        idx = torch.randperm(self.x.shape[0], generator=self._gen)[: self.sample]
        first = torch.zeros(len(coords), dtype=torch.float64)
        second = torch.zeros(len(coords), dtype=torch.float64)
        for part in idx.split(256):
            with torch.enable_grad():
                g = self.fm.per_record_grads(theta, self.x[part], self.y[part]).float().cpu()
            f = torch.ones(g.shape[0])
            if clip is not None:
                f = clip_factors((g * g).sum(dim=1) + (prenoise**2) * g.shape[1], clip)
            x = g[:, coords] * f[:, None]
            first += x.sum(dim=0).double()
            second += (x * x).sum(dim=0).double() + (prenoise**2) * float((f * f).sum())
        c = clip if clip is not None else 1.0
        n = len(idx)
        mean, sq = first / n, second / n
        spread = (sq - mean**2).clamp(min=0.0)
        var = batch * (1.0 - sample_rate) * sq + batch**2 * spread / n
        lasting = batch**2 * spread * (1.0 / self.x.shape[0] + sample_rate / batch)
        return (mean * batch / c).numpy(), (var / c**2).numpy(), (lasting / c**2).numpy()


def shrinkage(offsets: np.ndarray, lasting: np.ndarray) -> np.ndarray:
    """w_j in [0, 1], the share of r_hat_j. to subtract: 1 - e_j / rbar_j^2 (James-Stein
    towards 0) with rbar_j the mean of r_hat_jt over the rounds and e_j the mean lasting
    error variance. Over many rounds an error that persists adds up like a signal, so
    r_hat is subtracted only where the records' part stands well above the estimate's
    lasting error."""
    rbar = offsets.mean(axis=1)
    return np.clip(1.0 - lasting.mean(axis=1) / (rbar * rbar + 1e-300), 0.0, 1.0)
