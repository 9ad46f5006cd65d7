"""The cryptographic primitives of secure aggregation, all from the ``cryptography`` library.

* Key agreement: X25519 (private keys are 32 bytes from :func:`os.urandom`).
* Key derivation: HKDF-SHA256 of the X25519 shared secret, bound to the round's context
  and to a purpose label, so that a key is never used for two purposes or two rounds.
* Share transport: ChaCha20-Poly1305 (authenticated encryption) with a random 96-bit
  nonce and the (context, sender, receiver) as associated data, so the server that relays
  a ciphertext can neither read it nor redirect it unnoticed.
* Masks: the ChaCha20 keystream of a 256-bit seed, read as little-endian 32-bit words
  (bits <= 32) or 64-bit words and reduced modulo 2^bits (2^bits divides the word's
  range, so the words stay uniform).
* A site's noise share and randomised rounding: the ChaCha20 keystream of a fresh key
  from :func:`os.urandom` per call (:func:`os_randbytes`).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
_RAW = (serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def new_private_key() -> X25519PrivateKey:
    """A fresh X25519 key from the operating system's randomness."""
    return X25519PrivateKey.from_private_bytes(os.urandom(KEY_BYTES))


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(*_RAW)


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def agree(own: X25519PrivateKey, peer_public: bytes, *, context: bytes, purpose: bytes) -> bytes:
    """A 32-byte key shared by the two holders of (own, peer): HKDF-SHA256 of X25519."""
    if len(peer_public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
    shared = own.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=context, info=purpose).derive(
        shared
    )


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """nonce || ChaCha20-Poly1305(key, nonce, plaintext, aad), nonce from os.urandom."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`; raises ``cryptography.exceptions.InvalidTag`` when the
    ciphertext, its associated data or the key is not the one sealed."""
    return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)


def mask_words(seed: bytes, length: int, bits: int) -> np.ndarray:
    """The raw words of :func:`mask`: ``length`` little-endian words of the ChaCha20
    keystream of ``seed`` (32 bytes), uint32 when bits <= 32, else uint64, before the
    reduction modulo 2^bits (2^bits divides their own modulus, so sums of them may be
    reduced once, at the end)."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed is {KEY_BYTES} bytes, got {len(seed)}")
    width = 4 if bits <= 32 else 8
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(width * length)), dtype=f"<u{width}")


def mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` words uniform modulo 2^bits (uint64): the ChaCha20 keystream of ``seed``
    (32 bytes) read as little-endian words of 4 bytes when bits <= 32, else 8."""
    return mask_words(seed, length, bits).astype(np.uint64) & modulus_mask(bits)


def modulus_mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


def public_key_stream(label: bytes, length: int) -> bytes:
    """``length`` public pseudo-random bytes named by ``label`` (ChaCha20 keyed by
    SHA-256(label)): for public choices everyone must make alike (the rotation)."""
    seed = hashlib.sha256(label).digest()
    return (
        Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor().update(bytes(length))
    )


def os_randbytes(n: int) -> bytes:
    """``n`` uniform bytes for a party's own noise and rounding: the ChaCha20 keystream of
    a fresh 256-bit key from :func:`os.urandom`, used for this call only and then dropped
    (never stored, never sent: the construction of :func:`mask`, and of the operating
    system's own generator). Several times faster than reading ``n`` bytes from the
    operating system when n is large (a site's share takes about 1 MB a round)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")
    key = os.urandom(KEY_BYTES)
    return Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor().update(bytes(n))


def os_secret() -> bytes:
    """32 bytes from the operating system's randomness (a self-mask seed)."""
    return os.urandom(KEY_BYTES)
