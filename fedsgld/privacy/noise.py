"""The one function through which all differential-privacy noise is drawn.

Every draw takes an explicit ``torch.Generator``: simulations seed it, deployments seed
it from the operating system (see :func:`os_seeded_generator`). Nothing here touches the
global random state, so no other library can perturb (or predict from) the noise stream.
"""

from __future__ import annotations

import secrets

import torch


def gaussian_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    std: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw N(0, std^2 I) of the given shape from ``generator``.

    ``std`` must be a finite number >= 0 (0 returns zeros, e.g. for non-private SGD).
    The draw is made on the generator's device (a CUDA generator draws on its GPU).
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError("gaussian_noise needs an explicit torch.Generator (generator=...)")
    std = float(std)
    if not (std >= 0.0 and std < float("inf")):
        raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
    if std == 0.0:
        return torch.zeros(shape, dtype=dtype, device=generator.device)
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device).mul_(std)


def seeded_generator(*key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from a tuple of non-negative ints, e.g. (seed, site, round).

    The tuple is mixed with a fixed 64-bit hash so (1, 2) and (2, 1) give unrelated streams.
    ``device`` is where the generator draws (a CUDA generator is a different algorithm, so
    the same key gives different, equally reproducible, numbers on a GPU).
    """
    h = 0x9E3779B97F4A7C15
    for k in key:
        if k < 0:
            raise ValueError(f"generator key parts must be >= 0, got {key}")
        h ^= (int(k) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    g = torch.Generator(device=device)
    g.manual_seed(h & 0x7FFFFFFFFFFFFFFF)
    return g


def os_seed() -> int:
    """A 63-bit seed from the operating system's randomness (for deployments)."""
    return secrets.randbits(63)
