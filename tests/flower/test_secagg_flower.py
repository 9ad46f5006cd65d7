"""Secure aggregation over Flower (``train.secagg``): the ServerApp and the ClientApp with
their guard, over the in-process grid (fault hooks lose replies; a real deployment:
test_secagg_deploy.py). The server's view, dropouts within and beyond the plan, the
site's own policy, the ledger's charges, and the accounting against the reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flower_support import unmasked_input
from flwr.app import ConfigRecord, Message, RecordDict
from scipy import stats

from fedsgld.apps import APPS
from fedsgld.config import load_config
from fedsgld.federation import Federation
from fedsgld.flower.guard import LEDGER_STATE
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.protocol import SECAGG
from fedsgld.flower.secure_protocol import secagg_plan
from fedsgld.flower.secure_site import STATE
from fedsgld.privacy.distributed import ddg_epsilon
from fedsgld.secagg import RoundAborted, identity
from fedsgld.secagg.crypto import modulus_mask
from fedsgld.secagg.wire import flatten, unflatten

SMALL = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 4,
    "rounds": 3,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 2.0,
    "prenoise": 0.01,
    "epsilon": 30.0,
    "eval_every": 0,
    "checkpoint_every": 1,
    "seed": 5,
    "secure_aggregation": True,
    "noise_placement": "sites",
    "method": "dpsgld",
    "local_steps": 1,
    "hidden": 16,  # P = 1,000: a round's shares take milliseconds
    "round-timeout": 1.0,
    "poll-interval": 0.05,
}


class Wire:
    """Everything the server receives (every reply) and what it sent, by step."""

    def __init__(self, lose=None) -> None:
        self.seen: list[tuple[Message, Message]] = []
        self.lose = lose or (lambda rnd, step, site: False)

    def __call__(self, msg: Message, reply: Message) -> Message | None:
        if msg.metadata.message_type != SECAGG:
            return reply
        plan = msg.content["plan"]
        if self.lose(plan["round"], plan["secagg-step"], plan["site-id"]):
            return None
        self.seen.append((msg, reply))
        return reply

    def replies(self, rnd: int, step: str) -> dict[int, dict]:
        return {
            m.content["plan"]["site-id"]: unflatten(r.content["secagg"], "")
            for m, r in self.seen
            if m.content["plan"]["round"] == rnd
            and m.content["plan"]["secagg-step"] == step
            and not r.has_error()
        }

    def instruction(self, rnd: int, step: str, site: int) -> Message:
        return next(
            m
            for m, _ in self.seen
            if (m.content["plan"]["round"], m.content["plan"]["secagg-step"]) == (rnd, step)
            and m.content["plan"]["site-id"] == site
        )


class EditReply(Wire):
    """Edits one reply before the server sees it: ``edit(m)`` changes site ``site``'s
    protocol message of ``step`` in round ``rnd`` in place, its signatures kept (what a
    server substituting a value of its own would relay to the other sites)."""

    def __init__(self, step: str, rnd: int, site: int, edit) -> None:
        super().__init__()
        self.at, self.edit = (step, rnd, site), edit

    def __call__(self, msg: Message, reply: Message) -> Message | None:
        reply = super().__call__(msg, reply)
        if reply is None or reply.has_error() or msg.metadata.message_type != SECAGG:
            return reply
        plan = msg.content["plan"]
        if (plan["secagg-step"], plan["round"], plan["site-id"]) != self.at:
            return reply
        m = unflatten(reply.content["secagg"], "")
        self.edit(m)
        out = Message(RecordDict({"secagg": ConfigRecord(flatten(m, ""))}), reply_to=msg)
        self.seen[-1] = (msg, out)
        return out


def _run(tmp_path, wire=None, **over):
    cfg = {**SMALL, **over, "out": str(tmp_path / "run")}
    grid = run_local(cfg, **APPS, fault=wire)
    return grid, json.loads((tmp_path / "run" / "results.json").read_text())


def _ddg_rounds(state: dict) -> int:
    """Rounds of the distributed discrete Gaussian in an accountant's saved state."""
    return sum(int(c) for *_, c in state["ddg"])


def _ledgers(grid) -> dict[int, dict]:
    out = {}
    for ctx in grid.contexts.values():
        for k in range(SMALL["sites"]):
            rec = ctx.state.get(LEDGER_STATE.format(k))
            if isinstance(rec, ConfigRecord):
                out[k] = json.loads(str(rec["json"]))
    return out


def test_a_flower_run_charges_every_site_and_reports_the_reference_epsilon(tmp_path):
    wire = Wire()
    grid, res = _run(tmp_path, wire, max_dropouts=1)
    p = res["privacy"]
    assert p["steps"] == 3 and p["rigorous_accountant"] == "pld"
    assert p["secure_aggregation"]["mechanism"] == "distributed discrete Gaussian"
    cost = res["flower"]["secure_aggregation"]
    assert cost["rounds"] == 3 and cost["median_server_received_bytes"] > 0
    # the reference: the engine's mechanism of each round, composed by ddg_epsilon
    cfg = load_config(None, {k: v for k, v in SMALL.items() if "-" not in k} | {"max_dropouts": 1})
    server = Federation(cfg, log=lambda s: None).make_server()
    rounds = [(cfg.privacy.sample_rate, server.mode.parameters(t), 1) for t in range(3)]
    ref = ddg_epsilon(rounds, cfg.privacy.delta)[0]
    assert p["epsilon"]["pld"] == pytest.approx(ref, rel=1e-9)
    # every site charged its own ledger once per round, with the round's mechanism
    ledgers = _ledgers(grid)
    assert sorted(ledgers) == [0, 1, 2, 3]
    assert [_ddg_rounds(led["ledger"]) for led in ledgers.values()] == [3, 3, 3, 3]
    # a finished round leaves no secret behind at the site
    assert not any(STATE.format(k) in ctx.state for ctx in grid.contexts.values() for k in range(4))


def test_the_server_cannot_unmask_one_site_from_everything_it_receives(tmp_path):
    """The server's whole view of round 1 (every reply): site 0's masked input minus the
    self mask the server rebuilds from the unmasking shares is uniform modulo 2^bits, while
    the same attack on the sum of all inputs finds the small noisy sum (so the test can
    tell the two apart)."""
    wire = Wire()
    _run(tmp_path, wire, rounds=1, secagg_one_shot=False)  # one-shot: test_secagg_one_shot.py
    inst = wire.instruction(0, "unmask", 0).content["plan"]
    sp = secagg_plan(inst, run_key=inst["run-key"], epoch=inst["epoch"], rnd=0)
    masked, unmask = wire.replies(0, "masked_input"), wire.replies(0, "unmask")
    assert sorted(masked) == [0, 1, 2, 3]

    def residual(v: int) -> np.ndarray:
        return unmasked_input(sp, masked, unmask, v)

    one = residual(0).astype(np.float64) / 2**sp.bits
    assert stats.kstest(one, "uniform").pvalue > 1e-6
    total = sum(residual(v) for v in range(4)) & modulus_mask(sp.bits)
    centred = (total.astype(np.float64) / 2**sp.bits + 0.5) % 1.0
    assert stats.kstest(centred, "uniform").pvalue < 1e-10


def test_sparse_neighbourhoods_over_flower_share_with_the_ring_neighbours_only(tmp_path):
    """secagg_neighbours = 2 of 4 sites: the plan travels with every step, each site sends
    its shares to its two ring neighbours only (never to the opposite site), and the run
    charges every site's ledger each round as the complete graph does."""
    wire = Wire()
    grid, res = _run(tmp_path, wire, secagg_neighbours=2, secagg_one_shot=False)
    assert res["privacy"]["steps"] == 3
    assert res["privacy"]["secure_aggregation"]["neighbours"] == 2
    inst = wire.instruction(1, "masked_input", 0).content["plan"]
    assert inst["secagg-neighbours"] == 2
    for rnd in range(3):
        shares = _shares(wire, rnd)
        assert {v: sorted(int(u) for u in m["shares"]) for v, m in shares.items()} == {
            0: [1, 3],
            1: [0, 2],
            2: [1, 3],
            3: [0, 2],
        }
    assert [_ddg_rounds(led["ledger"]) for led in _ledgers(grid).values()] == [3, 3, 3, 3]


def _shares(wire: Wire, rnd: int) -> dict[int, dict]:
    """Round ``rnd``'s share_keys answers: its own step's, or (pipelined) the ones that came
    with round ``rnd`` - 1's unmask."""
    own = wire.replies(rnd, "share_keys")
    if own:
        return own
    return {v: m["next_shares"] for v, m in wire.replies(rnd - 1, "unmask").items()}


def test_a_dropout_at_unmask_falls_back_to_a_fresh_start_of_the_next_round(tmp_path):
    """Site 2's unmask reply of round 0 is lost (within the plan's one dropout): round 0
    completes from the others' shares, and round 1, whose shares from site 2 never came,
    starts with its own advertise_keys and share_keys instead of the early ones; round 2
    is pipelined again."""
    wire = Wire(lose=lambda rnd, step, site: (rnd, step, site) == (0, "unmask", 2))
    _, res = _run(tmp_path, wire, max_dropouts=1)
    assert res["privacy"]["steps"] == 3
    assert res["flower"]["secure_aggregation"]["pipelined_rounds"] == 1
    steps = [{m.content["plan"]["secagg-step"] for m, _ in wire.seen
              if m.content["plan"]["round"] == rnd} for rnd in range(3)]  # fmt: skip
    assert {"advertise_keys", "share_keys"} <= steps[1]
    assert not {"advertise_keys", "share_keys"} & steps[2]
    assert sorted(wire.replies(1, "share_keys")) == [0, 1, 2, 3]


def test_a_dropout_within_the_plan_completes_the_round(tmp_path):
    wire = Wire(lose=lambda rnd, step, site: (rnd, step, site) == (1, "masked_input", 2))
    _, res = _run(tmp_path, wire, max_dropouts=1)
    assert res["privacy"]["steps"] == 3
    drops = res["flower"]["dropped_replies"]
    assert [(d["round"], d["kind"], d["site"]) for d in drops] == [(1, "secagg masked_input", 2)]
    assert res["round_contributors"] == [
        {"rounds": [0, 0], "sites": [0, 1, 2, 3]},
        {"rounds": [1, 1], "sites": [0, 1, 3]},
        {"rounds": [2, 2], "sites": [0, 1, 2, 3]},
    ]


def test_more_dropouts_than_planned_abort_the_round_and_keep_it_counted(tmp_path):
    wire = Wire(lose=lambda rnd, step, site: rnd == 1 and step == "share_keys" and site in (1, 2))
    with pytest.raises(RoundAborted, match="fewer than K - max_dropouts"):  # rounds unpipelined:
        _run(tmp_path, wire, max_dropouts=1, **{"secagg-pipeline": False})  # round 1 shares keys
    assert not wire.replies(1, "masked_input")  # no site drew a share for the aborted round
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert _ddg_rounds(ledger) == 2  # round 1 was charged before any site drew


def _policy_nodes(tmp_path, texts: dict[int, str], *, impostor: int | None = None) -> list[dict]:
    """Four simulation nodes, each with its own policy file (``texts[k]``, default a budget
    and a shared seed), its long-term key and the consortium's key list (identity.generate).
    ``impostor``: that site signs with a key the others' list does not hold."""
    files, peers = identity.consortium_files(tmp_path / "keys", range(4))
    nodes = []
    for k in range(4):
        key, listed = files[k], peers
        if k == impostor:
            key = tmp_path / "keys" / "impostor.key"
            listed = tmp_path / "keys" / "impostor-peers.toml"
            fake = identity.generate(key)
            listed.write_text("".join(  # its own list holds its own key: it goes ahead
                line if not line.startswith(f"{k} =") else f'{k} = "{fake}"\n'
                for line in peers.read_text().splitlines(keepends=True)))  # fmt: skip
        f = tmp_path / f"site{k}.toml"
        f.write_text(texts.get(k, "epsilon = 50.0\ninsecure_seeded_noise = true\n")
                     + f'signing_key = "{key}"\npeers = "{listed}"\nmin_peers = 3\n')  # fmt: skip
        nodes.append({"partition-id": k, "num-partitions": 4, "privacy-policy": str(f)})
    return nodes


def test_a_site_refuses_a_round_planned_for_fewer_dropouts_than_its_policy(tmp_path):
    nodes = _policy_nodes(tmp_path, {0: "epsilon = 50.0\ninsecure_seeded_noise = true\n"
                                        "max_dropouts = 1\n"})  # fmt: skip
    wire = Wire()
    cfg = {**SMALL, "out": str(tmp_path / "run"), "max_dropouts": 0}
    with pytest.raises(RoundAborted):
        run_local(cfg, **APPS, node_configs=nodes, fault=wire)
    (_, reply), *_ = [(m, r) for m, r in wire.seen if m.content["plan"]["site-id"] == 0]
    assert reply.has_error()
    assert "the round plans for 0 dropouts; policy max_dropouts is 1" in reply.error.reason
    # the same node takes part when the run plans for its dropout
    wire = Wire()
    run_local({**cfg, "max_dropouts": 1, "out": str(tmp_path / "ok")}, **APPS, node_configs=nodes,
              fault=wire)  # fmt: skip
    assert json.loads((tmp_path / "ok" / "results.json").read_text())["privacy"]["steps"] == 3
    assert sorted(wire.replies(0, "consistency")) == [0, 1, 2, 3]


def test_a_roster_with_a_site_the_key_lists_do_not_hold_is_refused_before_any_share(tmp_path):
    """Site 3 signs with a key that sites 0 to 2's lists do not hold (a site the server
    made up, as they see it): all three refuse the roster at share_keys, so no share of
    their secrets leaves, and the round aborts (3 dropouts > max_dropouts = 1)."""
    nodes = _policy_nodes(tmp_path, {}, impostor=3)
    wire = Wire()
    with pytest.raises(RoundAborted, match="fewer than K - max_dropouts"):
        run_local({**SMALL, "out": str(tmp_path / "run"), "max_dropouts": 1}, **APPS,
                  node_configs=nodes, fault=wire)  # fmt: skip
    assert sorted(wire.replies(0, "advertise_keys")) == [0, 1, 2, 3]
    assert sorted(wire.replies(0, "share_keys")) == [3]  # only the impostor's own answer
    refusals = [r.error.reason for m, r in wire.seen
                if m.content["plan"]["secagg-step"] == "share_keys" and r.has_error()]  # fmt: skip
    assert len(refusals) == 3
    assert all("site 3's round keys are not signed by its key in the key list" in why
               for why in refusals)  # fmt: skip
    assert not wire.replies(0, "masked_input")  # nothing was drawn or masked


def _resend(grid, msg: Message, **change) -> Message:
    plan = dict(msg.content["plan"].items())
    plan.update(change)
    fresh = Message(RecordDict({"plan": ConfigRecord(plan)}), msg.metadata.dst_node_id, SECAGG,
                    group_id="again")  # fmt: skip
    (reply,) = grid.pull_messages(grid.push_messages([fresh]))
    return reply


def test_the_site_guard_refuses_replays_malformed_steps_and_steps_out_of_order(tmp_path):
    wire = Wire()
    grid, _ = _run(tmp_path, wire, rounds=1, secagg_one_shot=False)
    before = _ledgers(grid)
    replay = _resend(grid, wire.instruction(0, "masked_input", 1))
    assert replay.has_error() and "refusing the replayed request" in replay.error.reason
    bad_key = _resend(grid, wire.instruction(0, "share_keys", 1), **{"secagg/keys/0/enc_pk": b"x"})
    assert bad_key.has_error() and "malformed request" in bad_key.error.reason
    order = _resend(grid, wire.instruction(0, "unmask", 1))  # its round is over
    assert order.has_error() and "no secure-aggregation round in progress" in order.error.reason
    # the site builds the round's mechanism itself: a plan with other bits is refused
    bits = _resend(grid, wire.instruction(0, "masked_input", 2), **{"round": 5, "secagg-bits": 20})
    assert bits.has_error() and "dimension or bits differ from the plan's" in bits.error.reason
    # a server's own ServerApp asking for a graph too sparse for the dropouts it plans
    sparse = _resend(grid, wire.instruction(0, "masked_input", 3),
                     **{"round": 6, "secagg-dropouts": 1, "secagg-neighbours": 2})  # fmt: skip
    assert sparse.has_error() and "neighbours must be 0" in sparse.error.reason
    assert _ledgers(grid) == before  # nothing refused was charged


@pytest.mark.parametrize("key", ["max_dropouts", "max_colluders"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_policy_file_with_a_bad_dropout_or_colluder_count_names_the_key(tmp_path, key, value):
    from fedsgld.clients.policy import SitePolicy

    f = tmp_path / "policy.toml"
    f.write_text(f"epsilon = 4.0\n{key} = {str(value).lower()}\n")
    with pytest.raises(ValueError, match=f"policy {key}"):
        SitePolicy.from_file(f)
    f.write_text(f"epsilon = 4.0\n{key} = 2\n")
    assert getattr(SitePolicy.from_file(f), key) == 2


def test_a_site_publishing_fewer_records_than_it_holds_clips_its_input_to_what_it_publishes(
    tmp_path, monkeypatch
):
    """The bits of a secure sum are chosen for ||sum_k S_k|| <= C sum_k (published N_k). A
    site that publishes fewer records than it holds could push the sum past that norm, and
    whether the modular sum then wraps would depend on its records. Its input is clipped to
    C x its published count (a projection: each record still moves it by at most C), so
    the sum stays within the norm the plan states; the control: without that clip the
    sites' sums exceed it."""
    from fedsgld.flower import secure_site

    seen = []
    real = secure_site.clip_to_norm

    def spy(v, bound):
        out = real(v, bound)
        seen.append((float(v.double().norm()), float(out.double().norm()), bound))
        return out

    monkeypatch.setattr(secure_site, "clip_to_norm", spy)
    published = "public_records = 5\nmin_expected_batch = 1\n"
    nodes = _policy_nodes(tmp_path, {k: "epsilon = 50.0\ninsecure_seeded_noise = true\n"
                                         + published for k in range(4)})  # fmt: skip
    wire = Wire()
    cfg = {**SMALL, "out": str(tmp_path / "run"), "max_dropouts": 0}
    run_local(cfg, **APPS, node_configs=nodes, fault=wire)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["privacy"]["steps"] == 3
    inst = wire.instruction(0, "masked_input", 0).content["plan"]
    assert inst["signal-norm"] == pytest.approx(inst["clip"] * 4 * 5)  # C x published counts
    assert len(seen) == 12 and all(b == pytest.approx(inst["clip"] * 5) for *_, b in seen)
    assert all(after <= b * (1 + 1e-12) for _, after, b in seen)
    assert any(before > b for before, _, b in seen)  # the control: the clip was needed
