"""One-shot secure-aggregation rounds (``SecAggPlan.one_shot``, no dropouts planned): keys,
then one masked input that comes with the roster; pairwise masks only, no self-mask, no
shares, no consistency or unmask step (fedsgld.secagg.plan, module docstring).

The attacker tests hold exactly what the server receives (the roster and every masked
input) plus the secrets of the sites that collude with it, and try to unmask one honest
site; the control shows the same attack succeeds once every neighbour of the site
colludes."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedsgld.privacy.distributed import choose_ddg
from fedsgld.secagg import (
    RoundAborted,
    SecAggPlan,
    ServerParty,
    SiteParty,
    ephemeral_credentials,
    run_round,
)
from fedsgld.secagg.crypto import modulus_mask
from fedsgld.secagg.protocol import pairwise_masks

SIGMA, CLIP = 1.5, 0.5


def _plan(sites=range(6), **over) -> SecAggPlan:
    return SecAggPlan(**{"round_label": b"one-shot", "sites": tuple(sites), "length": 4096,
                         "bits": 24, "one_shot": True, **over})  # fmt: skip


def _round(plan: SecAggPlan, inputs: dict[int, np.ndarray]):
    """The round played party by party: what each site holds, the server, the sum."""
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    total = server.collect_one_shot([s.one_shot_input(roster, inputs[v])
                                     for v, s in sites.items()])  # fmt: skip
    return sites, server, total


def _inputs(plan: SecAggPlan, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v: rng.integers(0, 1 << plan.bits, plan.length, dtype=np.uint64) for v in plan.sites}


@pytest.mark.parametrize("neighbours", [0, 2, 4])
def test_a_one_shot_round_sums_every_input_exactly(neighbours):
    plan = _plan(range(8), neighbours=neighbours)
    inputs = _inputs(plan, neighbours)
    _, server, total = _round(plan, inputs)
    np.testing.assert_array_equal(total, sum(inputs.values()) & modulus_mask(plan.bits))
    assert [name for name, _ in server.transcript] == ["advertise_keys", "masked_input"]


@pytest.mark.parametrize("workers", [1, 3])
def test_a_one_shot_run_round_carries_the_central_noise(workers):
    """The engine's driver: a one-shot round's decoded sum is the inputs' sum plus noise of
    the central standard deviation sigma C, with the sites on one thread or three."""
    dim, n = 4096, 8
    p = choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=n, max_dropouts=0,
                   max_colluders=0, signal_norm=1000.0)  # fmt: skip
    rng = np.random.default_rng(workers)
    xs = [rng.normal(0, 50.0, dim) for _ in range(n)]
    res = run_round(xs, p, round_label=b"one-shot", one_shot=True, workers=workers)
    assert abs((res.total - sum(xs)).std() / (SIGMA * CLIP) - 1.0) < 0.1
    assert res.survivors == tuple(range(n))
    assert {k for k in res.seconds if "(server)" not in k} == {"advertise_keys", "masked_input"}
    # a site receives the roster and sends its keys and one masked input: no shares
    assert res.sent[0] < 4 * p.dim + 1024


def _attack(plan: SecAggPlan, sites, server, target: int, colluders: set[int]) -> np.ndarray:
    """The server's view plus the colluders' secrets: the target's masked input less every
    pairwise mask it shares with a colluder (from the colluders' own mask keys)."""
    msgs = {name: {m["site"]: m for m in ms} for name, ms in server.transcript}
    y = np.frombuffer(msgs["masked_input"][target]["y"], dtype="<u4").astype(np.uint64)
    pk = msgs["advertise_keys"][target]["mask_pk"]
    for c in colluders & set(plan.neighbourhood(target)):
        # c's total over the one peer `target`; the target added the opposite sign
        y = y + pairwise_masks(plan, c, sites[c]._mask_key, {target: pk})
    return y & modulus_mask(plan.bits)


@pytest.mark.parametrize(("neighbours", "colluders"), [(0, {1, 2, 3}), (4, {1})])
def test_the_server_and_colluders_cannot_unmask_a_site_of_a_one_shot_round(neighbours, colluders):
    """Site 0's input is all zeros. With everything the server receives and the mask keys
    of the colluding sites (three of six, complete graph; one of ten, k = 4 with one
    colluder planned), what is left of it is uniform modulo 2^bits: the masks it shares
    with the honest sites, whose seeds no message ever releases."""
    n = 10 if neighbours else 6
    plan = _plan(range(n), length=20_000, neighbours=neighbours,
                 max_colluders=1 if neighbours else 0)  # fmt: skip
    inputs = _inputs(plan, 7)
    inputs[0][:] = 0
    sites, server, total = _round(plan, inputs)
    np.testing.assert_array_equal(total, sum(inputs.values()) & modulus_mask(plan.bits))
    r = _attack(plan, sites, server, 0, colluders).astype(np.float64) / 2**plan.bits
    assert stats.kstest(r, "uniform").pvalue > 1e-6


def test_the_attack_succeeds_when_every_neighbour_of_the_site_colludes():
    """The control: both ring neighbours of site 0 (k = 2) collude; the same attack then
    recovers site 0's input exactly (the plan refuses k = 2 when two colluders are
    planned)."""
    plan = _plan(range(8), neighbours=2)
    inputs = _inputs(plan, 8)
    sites, server, _ = _round(plan, inputs)
    np.testing.assert_array_equal(_attack(plan, sites, server, 0, {1, 7}), inputs[0])


def _parties(plan: SecAggPlan):
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    return sites, server, roster


def _never() -> np.ndarray:
    raise AssertionError("the input was encoded for a refused roster")


def test_a_site_refuses_an_incomplete_or_forged_roster_before_it_encodes():
    """The roster must hold every site of the plan (no dropouts are planned), each entry
    signed by its site's listed key; a refused roster ends the site's round before its
    input is made (so no share is drawn) and nothing leaves."""
    plan = _plan(range(5))
    sites, _, roster = _parties(plan)
    short = {"keys": {v: k for v, k in roster["keys"].items() if v != 3}}
    with pytest.raises(RoundAborted, match="fewer than 5"):
        sites[0].one_shot_input(short, _never)
    forged = {"keys": {v: dict(k) for v, k in roster["keys"].items()}}
    forged["keys"][2]["mask_pk"] = bytes(32)  # the server's own key in site 2's place
    with pytest.raises(RoundAborted, match="site 2's round keys are not signed"):
        sites[1].one_shot_input(forged, _never)
    with pytest.raises(RoundAborted, match="out of order"):  # the refusal ended its round
        sites[1].one_shot_input(roster, np.zeros(plan.length, dtype=np.uint64))


def test_a_site_answers_one_masked_input_per_round():
    """A second request for the masked input (the same roster, another input) is refused:
    two inputs under the same masks would give their difference away."""
    plan = _plan(range(4))
    sites, _, roster = _parties(plan)
    sites[0].one_shot_input(roster, np.zeros(plan.length, dtype=np.uint64))
    with pytest.raises(RoundAborted, match="out of order"):
        sites[0].one_shot_input(roster, np.ones(plan.length, dtype=np.uint64))


def test_a_missing_site_aborts_a_one_shot_round():
    p = choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=256, sites=5, max_dropouts=0,
                   max_colluders=0, signal_norm=100.0)  # fmt: skip
    with pytest.raises(RoundAborted, match="fewer than K - max_dropouts = 5"):
        run_round([np.ones(256)] * 5, p, round_label=b"x", one_shot=True,
                  drop={2: "masked_input"})  # fmt: skip


def test_one_shot_and_full_rounds_do_not_mix():
    """A one-shot plan plans no dropouts; its parties refuse the full protocol's steps and
    the other way round; and keys signed for one kind of round do not verify in the
    other (the kind is in the signed context)."""
    with pytest.raises(ValueError, match="a one-shot round plans no dropouts"):
        _plan(range(5), max_dropouts=1)
    plan = _plan(range(4))
    sites, server, roster = _parties(plan)
    with pytest.raises(RoundAborted, match="not part of a one-shot round"):
        sites[0].share_keys(roster)
    sites, server, roster = _parties(plan)
    with pytest.raises(RoundAborted, match="not part of a one-shot round"):
        sites[0].masked_input({"shares": {}}, np.zeros(plan.length, dtype=np.uint64))
    with pytest.raises(RoundAborted, match="no shares to route"):
        server.route_shares([])
    full = SecAggPlan(round_label=plan.round_label, sites=plan.sites, length=plan.length,
                      bits=plan.bits)  # fmt: skip
    assert full.context != plan.context
    creds = ephemeral_credentials(full.sites)
    fsites = {v: SiteParty(v, full, creds[v]) for v in full.sites}
    fserver = ServerParty(full)
    froster = fserver.collect_keys([s.advertise_keys() for s in fsites.values()])
    with pytest.raises(RoundAborted, match="not part of a full round"):
        fsites[0].one_shot_input(froster, np.zeros(plan.length, dtype=np.uint64))
    with pytest.raises(RoundAborted, match="full round has no one-shot step"):
        fserver.collect_one_shot([])
    # site 1's full-round keys, relayed into a one-shot round with the same label
    osites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    oroster = ServerParty(plan).collect_keys([s.advertise_keys() for s in osites.values()])
    mixed = {"keys": {**oroster["keys"], 1: froster["keys"][1]}}
    with pytest.raises(RoundAborted, match="site 1's round keys are not signed"):
        osites[0].one_shot_input(mixed, np.zeros(plan.length, dtype=np.uint64))
    assert plan.threshold == len(plan.sites)  # a dropped site could never be recovered
