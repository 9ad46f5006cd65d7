"""The shapes of the protocol messages a ``train.secagg`` request may carry, as the site's
door checks them (:func:`fedsgld.flower.secure_door.secagg_door`) before anything else
reads them: site ids as keys, 32-byte public keys, 64-byte signatures, bytes for
ciphertexts, lists of site ids for survivor sets. A message of another shape is a
``ValueError``, which the door turns into a refusal.

:func:`bound_plan` puts the round's mechanism, as the request's own public numbers make it,
into the plan whose context every signature and mask of the round binds
(:mod:`fedsgld.secagg.plan`); :func:`next_plan` is the next round's, for pipelined keys."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fedsgld.core.plan import TrainPlan
from fedsgld.secagg import Mechanism, SecAggPlan
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


def bound_plan(sp: SecAggPlan, plan: TrainPlan, signal_norm: float | None) -> SecAggPlan:
    """``sp`` with the :class:`~fedsgld.secagg.Mechanism` that the request's public numbers
    make (sigma, clip, q and pre-noise of ``plan``, the norm bound ``signal_norm``, the
    plan's dimension, sites, dropouts and colluders), at every step: the site signs its
    keys, agrees its masks and draws its share under that context only. ``ValueError``
    where the numbers make no mechanism, or the plan's bits are not the mechanism's."""
    if plan.clip is None or signal_norm is None:
        raise ValueError("a secure-aggregation request needs a clip and a signal-norm")
    m = Mechanism.derive(
        noise_multiplier=plan.sigma, clip=plan.clip, sample_rate=plan.sample_rate,
        prenoise=plan.prenoise, signal_norm=signal_norm, dim=sp.length, sites=len(sp.sites),
        max_dropouts=sp.max_dropouts, max_colluders=sp.max_colluders,
    )  # fmt: skip
    return replace(sp, mechanism=m)


def next_plan(sp: SecAggPlan, label: bytes, sigma: float) -> SecAggPlan:
    """The next round's plan as this round's (``sp``, bound) implies it, for keys
    advertised one round early: its ``label`` and its mechanism with its ``sigma`` (from the
    run config's schedule; so its bits), all else kept. The server and the site derive it
    alike; a round whose real plan differs advertises its own keys."""
    m = sp.mechanism
    if m is None:
        raise ValueError("a plan without a mechanism has no next round")
    nxt = Mechanism.derive(
        noise_multiplier=sigma, clip=m.params.clip,
        sample_rate=m.sample_rate, prenoise=m.prenoise, signal_norm=m.signal_norm,
        dim=sp.length, sites=len(sp.sites), max_dropouts=sp.max_dropouts,
        max_colluders=sp.max_colluders,
    )  # fmt: skip
    return replace(sp, round_label=label, bits=nxt.params.bits, mechanism=nxt)


__all__ = ["KEY_BYTES", "bound_plan", "next_plan", "step_message"]
