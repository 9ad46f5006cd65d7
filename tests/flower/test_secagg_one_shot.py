"""One-shot secure-aggregation rounds over Flower (``secagg_one_shot``, the default with no
dropouts planned): a round is the sites' keys and one ``masked_input`` exchange that
carries the roster; pipelined, that exchange also collects the next round's keys, so
every round after the first is one exchange, as a plain round.

What must hold: the masks cancel in the sum and nowhere else (the server's attack on its
whole view fails on one site and finds the small noisy sum of all), every roster entry is
authenticated before the site is charged or draws anything, a replayed request is
refused, and no secret of a round is kept after it."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from scipy import stats
from test_secagg_flower import SMALL, EditReply, Wire, _ddg_rounds, _ledgers, _resend, _run

from fedsgld.apps import APPS
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.protocol import SECAGG
from fedsgld.flower.secure_protocol import secagg_plan
from fedsgld.flower.secure_site import STATE, STATE_NEXT
from fedsgld.secagg import RoundAborted
from fedsgld.secagg.crypto import modulus_mask
from fedsgld.secagg.wire import unflatten


def _steps(wire: Wire, rnd: int) -> list[str]:
    return sorted(
        {
            m.content["plan"]["secagg-step"]
            for m, _ in wire.seen
            if m.content["plan"]["round"] == rnd
        }
    )


def test_one_shot_rounds_are_one_exchange_after_the_first_and_sum_exactly(tmp_path):
    wire = Wire()
    grid, res = _run(tmp_path, wire, rounds=3)
    assert res["privacy"]["secure_aggregation"]["one_shot"] is True
    assert res["flower"]["secure_aggregation"]["pipelined_rounds"] == 2
    assert _steps(wire, 0) == ["advertise_keys", "masked_input"]
    assert _steps(wire, 1) == _steps(wire, 2) == ["masked_input"]
    # round 1's roster is the keys the sites sent with round 0's masked inputs
    early = {v: r["next"] for v, r in wire.replies(0, "masked_input").items()}
    sent = unflatten(wire.instruction(1, "masked_input", 0).content["plan"], "secagg/")
    assert early == {v: {"site": v, **k} for v, k in sent["keys"].items()}
    assert not any("next" in m for m in wire.replies(2, "masked_input").values())  # the last
    # the server's attack on round 1: one site's input is uniform, the sum of all is the
    # small noisy sum (a mask left over would make it uniform too: spread 0.289)
    inst = wire.instruction(1, "masked_input", 0).content["plan"]
    sp = secagg_plan(inst, run_key=inst["run-key"], epoch=inst["epoch"], rnd=1)
    assert sp.one_shot
    ys = {
        v: np.frombuffer(m["y"], dtype="<u4").astype(np.uint64)
        for v, m in wire.replies(1, "masked_input").items()
    }
    assert sorted(ys) == [0, 1, 2, 3]
    assert stats.kstest(ys[0].astype(np.float64) / 2**sp.bits, "uniform").pvalue > 1e-6
    total = sum(ys.values()) & modulus_mask(sp.bits)
    centred = (total.astype(np.float64) / 2**sp.bits + 0.5) % 1.0 - 0.5
    assert centred.std() < 1e-3
    # every site charged each round once, and keeps no secret after the last round
    assert [_ddg_rounds(led["ledger"]) for led in _ledgers(grid).values()] == [3, 3, 3, 3]
    assert not any(slot.format(k) in ctx.state for ctx in grid.contexts.values()
                   for k in range(4) for slot in (STATE, STATE_NEXT))  # fmt: skip


def _swap_next_key() -> EditReply:
    """Replaces site 2's next-round ``mask_pk`` in its round 0 reply, its signature kept:
    what a server substituting a key of its own into round 1's roster would relay."""
    return EditReply("masked_input", 0, 2, lambda m: m["next"].update(mask_pk=bytes(32)))


def test_a_substituted_key_is_refused_before_any_site_is_charged_or_draws(tmp_path):
    """Round 1's roster holds a key site 2 never signed: every site's door refuses the
    request before its charge, so no site draws a share or sends a masked input, no
    site's ledger counts round 1, and the round aborts."""
    wire = _swap_next_key()
    with pytest.raises(RoundAborted):
        run_local({**SMALL, "out": str(tmp_path / "run"), "rounds": 2}, **APPS, fault=wire)
    refusals = [r.error.reason for m, r in wire.seen
                if m.content["plan"]["round"] == 1 and r.has_error()]  # fmt: skip
    assert len(refusals) == 4
    assert all("site 2's round keys are not signed by its key" in why for why in refusals)
    assert not wire.replies(1, "masked_input")


def test_the_site_guard_refuses_one_shot_replays_and_steps_of_the_full_protocol(tmp_path):
    wire = Wire()
    grid, _ = _run(tmp_path, wire, rounds=1)
    before = _ledgers(grid)
    masked = wire.instruction(0, "masked_input", 1)
    replay = _resend(grid, masked)
    assert replay.has_error() and "refusing the replayed request" in replay.error.reason
    shares = _resend(grid, masked, **{"secagg-step": "share_keys"})
    assert shares.has_error() and "a one-shot round has no share_keys step" in shares.error.reason
    dropouts = _resend(grid, masked, **{"round": 4, "secagg-dropouts": 1})
    assert dropouts.has_error() and "plans no dropouts" in dropouts.error.reason
    later = _resend(grid, masked, **{"round": 5, "secagg/next_round": 7})
    assert later.has_error() and "may ask for the keys of round 6 only" in later.error.reason
    short = {k: v for k, v in masked.content["plan"].items() if not k.startswith("secagg/keys/3/")}
    fresh = Message(RecordDict({"plan": ConfigRecord(short)}), masked.metadata.dst_node_id,
                    SECAGG, group_id="again")  # round 0's keys, site 3's left out  # fmt: skip
    (incomplete,) = grid.pull_messages(grid.push_messages([fresh]))
    assert incomplete.has_error()
    assert "roster must hold every site of the round" in incomplete.error.reason
    assert _ledgers(grid) == before  # nothing refused was charged
