"""The distributed discrete Gaussian mechanism: a site's encoding and the server's decoding.

Site k, round with public parameters p (:class:`fedsgld.privacy.distributed.DDGParameters`):

1. pad S_k to the power of two d = ``p.dim`` and rotate it: x = H D S_k / sqrt(d), with H
   the Walsh-Hadamard matrix and D a diagonal of public random signs keyed by the round
   (:func:`rotation_signs`). The rotation keeps norms and spreads a vector's mass over
   all coordinates, so that the sum needs fewer bits; it is public and plays no part in
   the privacy guarantee (which holds for every rotation).
2. scale by 1 / gamma and round every coordinate to floor or ceil at random (unbiased:
   :func:`randomized_round`), which moves the vector by less than sqrt(d) grid steps;
3. add the site's share N_Z(0, s^2) per coordinate, drawn exactly from the operating
   system's randomness (:func:`fedsgld.secagg.discrete_gaussian.discrete_gaussian`);
4. reduce modulo 2^bits: the vector that secure aggregation sums.

Server: the modular sum is re-centred into [-2^(bits-1), 2^(bits-1)), multiplied by gamma,
rotated back and cut to the original length (:func:`decode`). With every site present
the result is sum_k S_k + (rounding error) + gamma * (sum of K discrete Gaussian shares),
whose covariance is K s^2 gamma^2 I (the rotation keeps an isotropic covariance).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..privacy.distributed import DDGParameters, rounding_norm_bound
from .crypto import modulus_mask, os_randbytes, public_key_stream
from .discrete_gaussian import BLOCK, RandBytes, discrete_gaussian

GRID_LIMIT = 2.0**61  # |coordinate| in grid steps after scaling: int64 with room to round


@functools.lru_cache(maxsize=4)  # public, and the same for every site of a round
def rotation_signs(label: bytes, dim: int) -> np.ndarray:
    """The public +-1 diagonal D of the round named by ``label`` (float64, length ``dim``;
    read-only: one array serves every party of the round in one process)."""
    bits = np.unpackbits(
        np.frombuffer(public_key_stream(b"rotation|" + label, (dim + 7) // 8), np.uint8)
    )
    signs = 1.0 - 2.0 * bits[:dim].astype(np.float64)
    signs.flags.writeable = False
    return signs


_FACTOR_BITS = 5  #: the Kronecker factors of H_d are at most 2^5 x 2^5
_BLOCK_ROWS = 256  #: rows per product: 256 x 32 x 32 = 2^18 multiply-adds at most


@functools.lru_cache(maxsize=8)
def _sylvester(bits: int) -> np.ndarray:
    """The (unnormalised) Walsh-Hadamard matrix H_{2^bits}: entries (-1)^popcount(i & j)."""
    h = np.ones((1, 1))
    for _ in range(bits):
        h = np.block([[h, h], [h, -h]])
    h.flags.writeable = False
    return h


def hadamard(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform H x / sqrt(d) (d a power of two); its own
    inverse.

    H_d = H_{2^a} (x) H_{2^b} (x) ... (Sylvester's construction is a Kronecker power of
    H_2), so x viewed as a row-major array of shape (2^a, 2^b, ...) is transformed by one
    small matrix along each axis: the last axis by a product, then the axes rotated (one
    transpose) to bring the next one last. 3 factors of 32 x 32 for d = 2^15, where
    in-place butterflies took 15 passes over the vector (4-8x slower here). Each product
    is cut into blocks of at most ``_BLOCK_ROWS`` rows, small enough that the BLAS runs it
    on the calling thread (OpenBLAS threads a product above 2^18 multiply-adds, and its
    idle threads then spin against the sites' own work)."""
    d = x.shape[0]
    k = d.bit_length() - 1
    if d < 1 or d != 1 << k:
        raise ValueError(f"the length must be a power of two, got {d}")
    count = max(1, -(-k // _FACTOR_BITS))
    sizes = [k // count + (i < k % count) for i in range(count)]
    y = np.array(x, dtype=np.float64)
    for bits in reversed(sizes):  # the last axis first; rotating brings the one before
        m = 1 << bits
        h = _sylvester(bits)
        rows = y.reshape(d // m, m)
        out = np.empty_like(rows)
        for start in range(0, d // m, _BLOCK_ROWS):
            np.matmul(rows[start : start + _BLOCK_ROWS], h, out=out[start : start + _BLOCK_ROWS])
        y = out.T.reshape(d) if count > 1 else out.reshape(d)  # (m, rest): the copy rotates
    y /= math.sqrt(d)
    return y


def rotate(vector: np.ndarray, dim: int, label: bytes) -> np.ndarray:
    padded = np.zeros(dim, dtype=np.float64)
    padded[: vector.shape[0]] = vector
    return hadamard(padded * rotation_signs(label, dim))


def unrotate(rotated: np.ndarray, length: int, label: bytes) -> np.ndarray:
    dim = rotated.shape[0]
    return (hadamard(rotated) * rotation_signs(label, dim))[:length]


def randomized_round(
    x: np.ndarray, randbytes: RandBytes = os_randbytes, *, beta: float = 0.0
) -> np.ndarray:
    """Round each coordinate to floor(x_i) + Bernoulli(x_i - floor(x_i)) (unbiased).

    ``beta`` > 0: conditional randomised rounding (Kairouz et al.): repeat until
    ||round(x)||_2 is within :func:`~fedsgld.privacy.distributed.rounding_norm_bound`
    (probability >= 1 - beta per try). beta = 0, the default and what the record-level
    accountant assumes, never repeats: the bound ||x|| + sqrt(d) holds for every draw.
    """
    # beta = 0 checks nothing (the bound holds for every draw); norms without BLAS, whose
    # threads would spin on a busy machine for a one-off dot product
    bound = rounding_norm_bound(_norm(x), x.shape[0], beta) if beta != 0.0 else math.inf
    while True:
        words = np.frombuffer(randbytes(8 * x.shape[0]), dtype="<u8")
        rounded = np.empty(x.shape[0], dtype=np.int64)
        for s in range(0, x.shape[0], BLOCK):  # 64 KiB temporaries (see discrete_gaussian)
            part = x[s : s + BLOCK]
            floor = np.floor(part)
            frac = part - floor
            frac *= 2.0**53  # u 2^-53 < frac with both sides scaled exactly
            out = rounded[s : s + BLOCK]
            np.copyto(out, floor, casting="unsafe")
            out += (words[s : s + BLOCK] >> np.uint64(11)) < frac
        if beta == 0.0 or _norm(rounded.astype(np.float64)) <= bound:
            return rounded


def _norm(x: np.ndarray) -> float:
    """||x||_2 by a pairwise sum (no BLAS call)."""
    return math.sqrt(float(np.add.reduce(x * x)))


def quantise(
    vector: np.ndarray, params: DDGParameters, label: bytes, randbytes: RandBytes = os_randbytes
) -> np.ndarray:
    """Steps 1-2: rotate, scale by 1/gamma, round at random (int64, length ``params.dim``).

    A coordinate beyond +-2^61 grid steps is clamped to it: a failure there would depend on
    the size of the site's sum (its records), and clamping each coordinate moves no pair of
    neighbouring sums further apart (sensitivity C / gamma still). ``vector`` must be
    finite (the site's clipped sum always is: :mod:`fedsgld.core.finite`)."""
    vector = np.asarray(vector, dtype=np.float64)
    if vector.ndim != 1 or vector.shape[0] > params.dim:
        raise ValueError(
            f"vector must be 1-D with at most {params.dim} entries, got {vector.shape}"
        )
    if not np.all(np.isfinite(vector)):
        raise ValueError("vector must be finite")
    scaled = rotate(vector, params.dim, label) / params.gamma
    if not np.max(np.abs(scaled), initial=0.0) < GRID_LIMIT:  # rare: no copy otherwise
        scaled = np.clip(scaled, -GRID_LIMIT, GRID_LIMIT)
    return randomized_round(scaled, randbytes)


def to_modular(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers (int64) as residues modulo 2^bits (uint64)."""
    return np.asarray(values, dtype=np.int64).view(np.uint64) & modulus_mask(bits)


def encode(
    vector: np.ndarray,
    params: DDGParameters,
    label: bytes,
    randbytes: RandBytes = os_randbytes,
) -> np.ndarray:
    """A site's contribution: :func:`quantise`, plus its discrete Gaussian share, mod 2^bits
    (uint64 array of length ``params.dim``). ``label`` names the round (public)."""
    rounded = quantise(vector, params, label, randbytes)
    noisy = rounded + discrete_gaussian(params.share_variance, params.dim, randbytes)
    return to_modular(noisy, params.bits)


def centre(modular: np.ndarray, bits: int) -> np.ndarray:
    """Residues modulo 2^bits as signed integers in [-2^(bits-1), 2^(bits-1)) (int64)."""
    m = np.asarray(modular, dtype=np.uint64) & modulus_mask(bits)
    if bits == 64:
        return m.view(np.int64)
    signed = m.astype(np.int64)
    return np.where(signed >= 1 << (bits - 1), signed - (1 << bits), signed)


def decode(modular_sum: np.ndarray, params: DDGParameters, label: bytes, length: int) -> np.ndarray:
    """The server's estimate of sum_k S_k (plus the noise) from the modular sum."""
    return unrotate(
        centre(modular_sum, params.bits).astype(np.float64) * params.gamma, length, label
    )
