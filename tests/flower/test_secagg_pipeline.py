"""Pipelined secure-aggregation rounds over Flower (``secagg-pipeline``): round t + 1's
keys ride on round t's consistency step and its shares on round t's unmask, so round t + 1
starts at ``masked_input``.

What must hold: a pipelined round unmasks to the small noisy sum as an unpipelined one does
(the pairwise masks agreed on the early keys cancel, the early shares rebuild), the early
roster is authenticated by every site before any share of round t + 1 leaves it, exactly
as at its own ``share_keys``, and a site refuses to advertise keys for any round but the
next."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import RecordDict
from test_secagg_flower import SMALL, EditReply, Wire, _resend, _run

from fedsgld.apps import APPS
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.secure_protocol import secagg_plan
from fedsgld.flower.secure_site import STATE, STATE_NEXT
from fedsgld.secagg import RoundAborted
from fedsgld.secagg.crypto import mask, modulus_mask
from fedsgld.secagg.shamir import combine
from fedsgld.secagg.wire import unflatten

FULL = {"secagg_one_shot": False}  # the full protocol (one-shot rounds: test_secagg_one_shot.py)


def _unmasked_spread(wire: Wire, rnd: int) -> float:
    """The server's attack on round ``rnd``'s whole transcript: every masked input minus its
    rebuilt self mask, summed modulo 2^bits, centred; its standard deviation in units of the
    modulus (about 0.289 if the pairwise masks did not cancel: uniform)."""
    inst = wire.instruction(rnd, "unmask", 0).content["plan"]
    sp = secagg_plan(inst, run_key=inst["run-key"], epoch=inst["epoch"], rnd=rnd)
    masked, unmask = wire.replies(rnd, "masked_input"), wire.replies(rnd, "unmask")
    assert sorted(masked) == sorted(unmask) == [0, 1, 2, 3]
    total = np.zeros(sp.length, dtype=np.uint64)
    for v, m in masked.items():
        y = np.frombuffer(m["y"], dtype="<u4").astype(np.uint64)
        seed = combine({sp.point(u): r["self_mask_shares"][v] for u, r in unmask.items()},
                       sp.threshold)  # fmt: skip
        total = (total + y - mask(seed, sp.length, sp.bits)) & modulus_mask(sp.bits)
    centred = (total.astype(np.float64) / 2**sp.bits + 0.5) % 1.0 - 0.5
    return float(centred.std())


def _steps(wire: Wire, rnd: int) -> set[str]:
    return {
        m.content["plan"]["secagg-step"] for m, _ in wire.seen if m.content["plan"]["round"] == rnd
    }


@pytest.mark.slow  # 7-16 s
def test_a_pipelined_round_unmasks_to_the_sum_an_unpipelined_round_does(tmp_path):
    piped, plain = Wire(), Wire()
    grid, res = _run(tmp_path / "piped", piped, rounds=2, **FULL)
    _, res0 = _run(tmp_path / "plain", plain, rounds=2, **FULL, **{"secagg-pipeline": False})
    assert res["flower"]["secure_aggregation"]["pipelined_rounds"] == 1
    assert res0["flower"]["secure_aggregation"]["pipelined_rounds"] == 0
    # round 1 started at masked_input, with the keys that came with round 0's consistency
    # step and the shares that came with its unmask
    assert _steps(piped, 0) == _steps(plain, 0) == _steps(plain, 1)
    assert {"advertise_keys", "share_keys"} <= _steps(piped, 0)
    assert _steps(piped, 1) == _steps(piped, 0) - {"advertise_keys", "share_keys"}
    early = {v: r["next"] for v, r in piped.replies(0, "consistency").items()}
    sent = unflatten(piped.instruction(0, "unmask", 0).content["plan"], "secagg/")["next_keys"]
    assert early == {v: {"site": v, **e} for v, e in sent.items()}
    shares = {v: r["next_shares"] for v, r in piped.replies(0, "unmask").items()}
    assert sorted(shares) == [0, 1, 2, 3] and all(m["site"] == v for v, m in shares.items())
    for v in range(4):  # round 1's relayed ciphertexts are the ones sent with round 0's unmask
        inbox = unflatten(piped.instruction(1, "masked_input", v).content["plan"], "secagg/")
        assert inbox["shares"] == {u: m["shares"][v] for u, m in shares.items() if u != v}
    last = (*piped.replies(1, "consistency").values(), *piped.replies(1, "unmask").values())
    assert not any({"next", "next_shares"} & set(m) for m in last)  # the last round asks none
    assert not any({"next", "next_shares"} & set(m) for m in plain.replies(0, "unmask").values())
    # the pairwise masks of the early keys cancel: the unmasked sum is the small noisy sum,
    # as in an unpipelined round (a mask left over would make it uniform: spread 0.289)
    spreads = [_unmasked_spread(w, 1) for w in (piped, plain)]
    assert max(spreads) < 1e-3, spreads
    assert max(spreads) / min(spreads) < 3.0, spreads
    # every site charged each round once, and keeps no secret after the last round
    assert res["privacy"]["steps"] == res0["privacy"]["steps"] == 2
    assert not any(slot.format(k) in ctx.state for ctx in grid.contexts.values()
                   for k in range(4) for slot in (STATE, STATE_NEXT))  # fmt: skip


def _swap_early_key() -> EditReply:
    """Replaces site 2's early ``enc_pk`` (the server's relay of round 1's keys) by another
    key, its signature kept: what a server substituting a site's key would send."""
    return EditReply("consistency", 0, 2, lambda m: m["next"].update(enc_pk=bytes(32)))


def test_a_substituted_early_key_is_refused_before_any_share_of_the_next_round(tmp_path):
    """The roster of round 1 comes with round 0's unmask: every site checks it there, as at
    a share_keys step of its own, and refuses the whole request: no share of round 1's
    secrets leaves a site, and none of round 0's either."""
    wire = _swap_early_key()
    with pytest.raises(RoundAborted):
        run_local({**SMALL, **FULL, "out": str(tmp_path / "run"), "rounds": 2}, **APPS,
                  fault=wire)  # fmt: skip
    refusals = [r.error.reason for m, r in wire.seen if m.content["plan"]["round"] == 0
                and m.content["plan"]["secagg-step"] == "unmask" and r.has_error()]  # fmt: skip
    assert len(refusals) == 4  # every site, site 2 itself included
    assert all("site 2's round keys are not signed by its key" in why for why in refusals)
    assert not wire.replies(0, "unmask")  # no share of any secret left a site
    assert not [m for m, _ in wire.seen if m.content["plan"]["round"] == 1]


def test_a_site_advertises_keys_for_the_next_round_only(tmp_path):
    wire = Wire()
    grid, _ = _run(tmp_path, wire, rounds=2, **FULL)
    for bad in (0, 3, True, "1"):  # round 0's consistency may ask for round 1's keys, no other
        got = _resend(grid, wire.instruction(0, "consistency", 1), **{"secagg/next_round": bad})
        assert got.has_error(), bad
        assert "may ask for the keys of round 1 only" in got.error.reason or (
            "malformed request" in got.error.reason
        ), got.error.reason


def test_a_roster_for_the_next_round_needs_its_keys_advertised():
    """An unmask request with a next round's roster, to a site that advertised no keys for
    it (the server skipped the consistency step's request), is refused; without a roster
    and without kept keys the unmask answer is left as it is."""
    from types import SimpleNamespace

    from flwr.app import Context

    from fedsgld.flower.secure_site import _ahead

    r = SimpleNamespace(step="unmask", site=SimpleNamespace(site_id=1), round_of=("k", 0, 0),
                        standardize=False,
                        secure=SimpleNamespace(message={}),
                        secagg=SimpleNamespace(one_shot=False))  # fmt: skip
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(RoundAborted, match="a roster for round 1 without its keys advertised"):
        _ahead(r, None, ctx, {"site": 1}, {0: {}})
    assert _ahead(r, None, ctx, {"site": 1}, None) == {"site": 1}
    assert STATE.format(1) not in ctx.state


def test_the_per_record_gradient_check_is_kept_for_the_runs_later_secure_tasks(tmp_path):
    """A deployed task is a fresh process: the masked_input step reads whether the run's
    model passed the layer-path check from the node's state and records it there, as the
    plain `train` step does, instead of checking it again in every round."""
    from fedsgld.config import Config
    from fedsgld.flower import site_runtime as site_side

    grid, _ = _run(tmp_path, rounds=2)  # one-shot rounds, the default
    config = Config.from_flat({k: v for k, v in SMALL.items() if "-" not in k} | {"rounds": 2})
    for ctx in grid.contexts.values():
        hosted = site_side.hosted_sites(ctx, config)
        assert ctx.state[site_side.LAYERS_STATE]["key"] == hosted.key
        site_side._CACHE.clear()  # a new process: the sites are built again
        fresh = site_side.hosted_sites(ctx, config)
        (site,) = fresh.sites.values()
        assert site.fm.grad_path == "layers" and not site.fm.layers_checked
        site_side.layers_check_from_state(ctx, fresh, site)
        assert site.fm.layers_checked


@pytest.mark.parametrize("value", [1, "true", None])
def test_secagg_pipeline_must_be_true_or_false(value):
    from fedsgld.flower.protocol import split_flower_options

    assert split_flower_options({})["secagg-pipeline"] is True
    with pytest.raises(ValueError, match="secagg-pipeline must be true or false"):
        split_flower_options({"secagg-pipeline": value})
