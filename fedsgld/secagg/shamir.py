"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A secret s < 2^256 is the constant term of a random polynomial f of degree t - 1 whose
other coefficients are uniform in the field (from :mod:`secrets`); party x (an integer
>= 1) holds f(x). Any t shares give s back by Lagrange interpolation at 0; any t - 1
shares are uniformly distributed whatever s is (information-theoretic secrecy). This is
field arithmetic, not a cryptographic primitive; the keys, encryption and masks of the
protocol come from the ``cryptography`` library (:mod:`fedsgld.secagg.crypto`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

PRIME = (1 << 521) - 1  # a Mersenne prime, larger than every 32-byte secret
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def split(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` (32 bytes) for the parties ``xs`` (distinct integers >= 1),
    any ``threshold`` of which reconstruct it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(x < 1 or x >= PRIME for x in xs):
        raise ValueError(f"share points must be distinct integers >= 1, got {list(xs)}")
    if not (1 <= threshold <= len(xs)):
        raise ValueError(f"threshold must be in [1, {len(xs)}], got {threshold}")
    coeffs = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares {x: f(x)} (uses ``threshold`` of them)."""
    if len(shares) < threshold:
        raise ValueError(f"need {threshold} shares to reconstruct, got {len(shares)}")
    points = sorted(shares.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + int.from_bytes(yi, "big") * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("the shares do not reconstruct a 32-byte secret (inconsistent shares)")
    return secret.to_bytes(SECRET_BYTES, "big")
