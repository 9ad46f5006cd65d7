"""SWAG: a Gaussian fitted to the iterates of one chain, sampled for model averaging.

SWAG (Maddox, Garipov, Izmailov, Vetrov & Wilson 2019) summarises the iterates
theta_1 .. theta_n a run keeps (every ``thin``-th after ``burn_in``) by

    mean        theta_bar = (1/n) sum_i theta_i
    diagonal    Sigma_diag = (1/n) sum_i theta_i^2 - theta_bar^2
    low rank    D = [theta_i - theta_bar_i] for the last K iterates, theta_bar_i being the
                running mean after iterate i (a P x K deviation matrix)

and draws

    theta = theta_bar + Sigma_diag^(1/2) z_1 / sqrt(2) + D z_2 / sqrt(2 (K - 1)),
    z_1 ~ N(0, I_P), z_2 ~ N(0, I_K),

a Gaussian with covariance (Sigma_diag + D D^T / (K - 1)) / 2. With fewer than two
deviations (K < 2, or ``rank`` = 0) it is SWAG-diagonal: theta = theta_bar +
Sigma_diag^(1/2) z_1. The softmax averaged over such draws is the ``+swag`` model.

Privacy: the moments are functions of iterates the run has already released, so fitting
and sampling SWAG is post-processing and costs no privacy; the draws' randomness is not
privacy noise. The moments are accumulated in float64 (Welford's update), so a small
variance around a large mean keeps its digits.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch


class SwagMoments:
    """Running mean and variance of the offered iterates, and the last ``rank`` deviations."""

    def __init__(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"swag_rank must be an integer >= 0, got {rank!r}")
        self.rank = rank
        self.n = 0
        self.mean: torch.Tensor | None = None  # float64
        self._m2: torch.Tensor | None = None  # float64 sum of squared deviations (Welford)
        self.deviations: deque[torch.Tensor] = deque(maxlen=max(rank, 1))

    def update(self, theta: torch.Tensor) -> None:
        """Add one iterate."""
        x = theta.detach().to(torch.float64).reshape(-1)
        if self.mean is None:
            self.mean = torch.zeros_like(x)
            self._m2 = torch.zeros_like(x)
        elif x.shape != self.mean.shape:
            raise ValueError(
                f"iterate has shape {tuple(x.shape)}, expected {tuple(self.mean.shape)}"
            )
        assert self._m2 is not None
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (x - self.mean)
        if self.rank:
            self.deviations.append((x - self.mean).float())

    def __len__(self) -> int:
        return self.n

    @property
    def variance(self) -> torch.Tensor:
        """Sigma_diag: the iterates' per-coordinate (population) variance, float64."""
        if self.mean is None or self._m2 is None:
            raise ValueError("SWAG has no iterates yet")
        return (self._m2 / self.n).clamp_(min=0.0)

    @property
    def used_rank(self) -> int:
        """Deviations the low-rank part uses (0: diagonal only)."""
        k = len(self.deviations) if self.rank else 0
        return k if k >= 2 else 0

    def covariance(self) -> torch.Tensor:
        """The sampled Gaussian's covariance as a dense P x P matrix (for small P, tests)."""
        var = self.variance
        k = self.used_rank
        if k == 0:
            return torch.diag(var)
        d = torch.stack(list(self.deviations), dim=1).to(torch.float64)
        return 0.5 * (torch.diag(var) + d @ d.T / (k - 1))

    def sample(self, count: int, *, generator: torch.Generator) -> list[torch.Tensor]:
        """``count`` float32 draws from the SWAG Gaussian, from ``generator``."""
        if not isinstance(generator, torch.Generator):
            raise TypeError("SwagMoments.sample needs an explicit torch.Generator")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"swag_samples must be an integer >= 0, got {count!r}")
        if self.mean is None:
            raise ValueError("SWAG has no iterates yet")
        std = self.variance.sqrt()
        k = self.used_rank
        d = torch.stack(list(self.deviations), dim=1).to(torch.float64) if k else None
        out = []
        for _ in range(count):
            z1 = torch.randn(self.mean.shape, generator=generator, dtype=torch.float64)
            if d is None:
                theta = self.mean + std * z1
            else:
                z2 = torch.randn(k, generator=generator, dtype=torch.float64)
                theta = (
                    self.mean + (std * z1) / math.sqrt(2.0) + (d @ z2) / math.sqrt(2.0 * (k - 1))
                )
            out.append(theta.float())
        return out

    def describe(self) -> dict[str, Any]:
        return {"iterates": self.n, "rank": self.used_rank, "max_rank": self.rank}

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "n": self.n,
            "mean": None if self.mean is None else self.mean.clone(),
            "m2": None if self._m2 is None else self._m2.clone(),
            "deviations": [d.clone() for d in self.deviations],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if int(d["rank"]) != self.rank:
            raise ValueError(f"SWAG state has rank {d['rank']}, expected {self.rank}")
        self.n = int(d["n"])
        self.mean = None if d["mean"] is None else d["mean"].clone().to(torch.float64)
        self._m2 = None if d["m2"] is None else d["m2"].clone().to(torch.float64)
        self.deviations.clear()
        for dev in d["deviations"]:
            self.deviations.append(dev.clone())


__all__ = ["SwagMoments"]
