"""The shapes of the protocol messages a ``train.secagg`` request may carry, as the site's
door checks them (:func:`fedsgld.flower.secure_site.secagg_door`) before anything else
reads them: site ids as keys, 32-byte public keys, 64-byte signatures, bytes for
ciphertexts, lists of site ids for survivor sets. A message of another shape is a
``ValueError``, which the door turns into a refusal."""

from __future__ import annotations

from typing import Any

from fedsgld.secagg.identity import SIGNATURE_BYTES

KEY_BYTES = 32


def _ids(d: Any, what: str) -> dict[int, Any]:
    if not isinstance(d, dict) or not all(isinstance(k, int) for k in d):
        raise ValueError(f"{what} must map site ids to values")
    return d


def _key(b: Any, what: str, size: int = KEY_BYTES) -> bytes:
    if not isinstance(b, bytes) or len(b) != size:
        raise ValueError(f"{what} must be {size} bytes")
    return b


def step_message(step: str, m: dict[str, Any], *, one_shot: bool = False) -> dict[str, Any]:
    """The protocol message ``m`` a ``step`` request carries, checked for its shape
    (``ValueError`` otherwise): nothing at ``advertise_keys``; the roster's signed public
    keys; the ciphertexts relayed to this site; the announced survivors (at ``unmask``
    with their signatures of them). Pipelined (``secagg-pipeline``): ``consistency`` may
    ask for the next round's keys (``next_round``), and ``unmask`` may carry the next
    round's roster (``next_keys``, shaped as ``share_keys``'s). In a ``one_shot`` round
    (:attr:`fedsgld.secagg.SecAggPlan.one_shot`) ``masked_input`` carries the roster
    (``keys``) instead of shares, and may ask for the next round's keys; the other steps
    after ``advertise_keys`` are not part of it."""
    want = {"advertise_keys": set(), "share_keys": {"keys"}, "masked_input": {"shares"},
            "consistency": {"survivors"}, "unmask": {"survivors", "signatures"}}[step]  # fmt: skip
    if one_shot and step not in ("advertise_keys", "masked_input"):
        raise ValueError(f"a one-shot round has no {step} step")
    if one_shot and step == "masked_input":
        want = {"keys"}
    if step == ("masked_input" if one_shot else "consistency") and "next_round" in m:
        want = {*want, "next_round"}  # the next round's keys asked for as well
    if step == "unmask" and "next_keys" in m:  # the next round's roster, for its shares
        want = {*want, "next_keys"}
    if set(m) != want:
        raise ValueError(f"a {step} request carries {sorted(m)}, expected {sorted(want)}")
    for roster in ("keys", "next_keys"):  # share_keys's roster, or the next round's
        if roster in m:
            _roster_keys(m[roster])
    if step == "masked_input" and not one_shot:
        for v, ct in _ids(m["shares"], "shares").items():
            if not isinstance(ct, bytes):
                raise ValueError(f"the shares from site {v} must be bytes")
    if "survivors" in m and not isinstance(m["survivors"], list):
        raise ValueError("survivors must be a list of site ids")
    if step == "unmask":
        for v, sig in _ids(m["signatures"], "signatures").items():
            _key(sig, f"site {v}'s signature of the survivors", SIGNATURE_BYTES)
    return m


def _roster_keys(keys: Any) -> None:
    """A roster's signed public keys, checked for their shape (``ValueError`` otherwise)."""
    for v, k in _ids(keys, "keys").items():
        if not isinstance(k, dict) or set(k) != {"enc_pk", "mask_pk", "sig"}:
            raise ValueError(f"keys of site {v} must be enc_pk, mask_pk and sig")
        _key(k["enc_pk"], f"site {v}'s enc_pk"), _key(k["mask_pk"], f"site {v}'s mask_pk")
        _key(k["sig"], f"site {v}'s sig", SIGNATURE_BYTES)


__all__ = ["KEY_BYTES", "step_message"]
