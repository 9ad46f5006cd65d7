"""The split-sigma attack over Flower's in-process grid (in process: tests/privacy/
test_secagg_mechanism.py). After an honest run, the test plays an attacking ServerApp:
it pushes ``train.secagg`` requests of its own to the sites' ClientApps, showing site 0
sigma 8 times the others' with a signal norm picked so that all use the same bits, and
relays the sites' own signed keys. Every site must refuse before its guard charges."""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from test_secagg_flower import Wire, _ddg_rounds, _ledgers, _run

from fedsgld.flower.protocol import SECAGG
from fedsgld.flower.secure_protocol import secagg_plan
from fedsgld.privacy.distributed import choose_ddg
from fedsgld.secagg.crypto import modulus_mask
from fedsgld.secagg.wire import flatten, unflatten

K = 4


def _split(rec) -> dict:
    """Site 0's fields in the attack: sigma x 8 and a signal norm keeping the bits."""
    sigma, bits, d = rec["sigma"], rec["secagg-bits"], rec["secagg-length"]
    high = choose_ddg(noise_multiplier=8 * sigma, clip=rec["clip"], dim=d, sites=K,
                      signal_norm=0.0)  # fmt: skip
    spread = K + 8.0 * math.sqrt(K * high.share_variance + K / 4.0)
    norm = (1.5 * 2.0 ** (bits - 2) - spread) * high.gamma
    assert norm > 0  # the bits leave room for the larger noise: the attack is possible
    assert choose_ddg(noise_multiplier=8 * sigma, clip=rec["clip"], dim=d, sites=K,
                      signal_norm=norm).bits == bits  # fmt: skip
    return {"sigma": 8 * sigma, "signal-norm": norm}


def _push(grid, template: Message, change: dict, body: dict | None = None) -> Message:
    """``template``'s request again with fields ``change`` and, if given, the protocol
    message ``body`` in place of its own."""
    plan = dict(template.content["plan"].items())
    if body is not None:
        plan = {k: v for k, v in plan.items() if not k.startswith("secagg/")}
        plan |= flatten(body, "secagg/")
    plan.update(change)
    msg = Message(RecordDict({"plan": ConfigRecord(plan)}), template.metadata.dst_node_id,
                  SECAGG, group_id="attack")  # fmt: skip
    (reply,) = grid.pull_messages(grid.push_messages([msg]))
    return reply


def _one_shot_round(grid, wire: Wire, rnd: int, site0: dict) -> dict[int, Message]:
    """Round ``rnd`` played by the attacker: keys, then the masked inputs with the roster,
    site 0 shown ``site0``'s fields at both steps."""
    change = {v: {"round": rnd, **(site0 if v == 0 else {})} for v in range(K)}
    keys = {}
    for v in range(K):
        reply = _push(grid, wire.instruction(0, "advertise_keys", v), change[v])
        m = unflatten(reply.content["secagg"], "")
        keys[v] = {k: m[k] for k in ("enc_pk", "mask_pk", "sig")}
    return {v: _push(grid, wire.instruction(0, "masked_input", v), change[v], {"keys": keys})
            for v in range(K)}  # fmt: skip


def test_a_server_showing_one_site_another_sigma_gets_refused_by_every_site(tmp_path):
    wire = Wire()
    grid, _ = _run(tmp_path, wire, rounds=1)
    before = {v: _ddg_rounds(s["ledger"]) for v, s in _ledgers(grid).items()}
    rec = wire.instruction(0, "masked_input", 0).content["plan"]
    replies = _one_shot_round(grid, wire, 5, _split(rec))
    assert all(r.has_error() for r in replies.values())
    assert all("not signed by its key" in r.error.reason for r in replies.values())
    assert {v: _ddg_rounds(s["ledger"]) for v, s in _ledgers(grid).items()} == before
    # control: the same attacker's round with one plan for all is answered and decodes
    replies = _one_shot_round(grid, wire, 6, {})
    assert not any(r.has_error() for r in replies.values())
    sp = secagg_plan(rec, run_key=rec["run-key"], epoch=rec["epoch"], rnd=6)
    ys = [np.frombuffer(unflatten(r.content["secagg"], "")["y"], "<u4").astype(np.uint64)
          for r in replies.values()]  # fmt: skip
    total = sum(ys) & modulus_mask(sp.bits)
    assert ((total.astype(np.float64) / 2**sp.bits + 0.5) % 1.0 - 0.5).std() < 1e-3
    assert {v: _ddg_rounds(s["ledger"]) for v, s in _ledgers(grid).items()} == {
        v: n + 1 for v, n in before.items()
    }


def test_a_site_refuses_a_masked_input_under_another_plan_than_its_keys(tmp_path):
    """Full protocol: keys and shares under one plan, then site 0's masked input asked with
    sigma x 8: its door refuses before the charge (its kept keys were signed for the other
    plan); the same request under the plan it signed is answered and charged."""
    wire = Wire()
    grid, _ = _run(tmp_path, wire, rounds=1, secagg_one_shot=False)
    before = _ddg_rounds(_ledgers(grid)[0]["ledger"])
    at = {"round": 5}
    adv = {v: _push(grid, wire.instruction(0, "advertise_keys", v), at) for v in range(K)}
    keys = {v: {k: m[k] for k in ("enc_pk", "mask_pk", "sig")}
            for v, m in ((v, unflatten(r.content["secagg"], "")) for v, r in adv.items())}  # fmt: skip
    shares = {v: unflatten(_push(grid, wire.instruction(0, "share_keys", v), at,
                                 {"keys": keys}).content["secagg"], "")["shares"]
              for v in range(K)}  # fmt: skip
    inbox = {u: ct for u, s in shares.items() for w, ct in s.items() if w == 0}
    template = wire.instruction(0, "masked_input", 0)
    rec = template.content["plan"]
    theta = {"theta": rec["theta"]}
    attack = _push(grid, template, {**at, **_split(rec), **theta}, {"shares": inbox})
    assert attack.has_error() and "signed its keys of round 5 for another plan" in (
        attack.error.reason
    )
    assert _ddg_rounds(_ledgers(grid)[0]["ledger"]) == before
    honest = _push(grid, template, {**at, **theta}, {"shares": inbox})
    assert not honest.has_error()
    assert _ddg_rounds(_ledgers(grid)[0]["ledger"]) == before + 1
