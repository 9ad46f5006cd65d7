"""Signature checks remembered per process: a remembered answer is only ever the answer
for exactly the same (key, signature, message)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedsgld.secagg import identity


def test_a_remembered_valid_signature_never_vouches_for_other_bytes():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pk, other_pk = identity.public_bytes(key), identity.public_bytes(other)
    msg = b"fedsgld-secagg-v1|advertise|round 7"
    sig = identity.sign(key, msg)
    for _ in range(2):  # the second time from the cache
        assert identity.verify(pk, sig, msg)
    forged = bytes([sig[0] ^ 1]) + sig[1:]
    assert not identity.verify(pk, forged, msg)
    assert not identity.verify(pk, sig, msg + b"8")  # another round's statement
    assert not identity.verify(other_pk, sig, msg)  # another site's key
    assert not identity.verify(pk, bytearray(sig), msg)  # not bytes: refused, not cached
    assert not identity.verify(pk, sig[:-1], msg)
    assert identity.verify(pk, sig, msg)  # and the genuine one still holds
