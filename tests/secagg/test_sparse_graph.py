"""Sparse neighbourhoods (SecAgg+): each site masks with, and shares its secrets with, only
its k ring neighbours (fedsgld.secagg.plan, module docstring).

The attacker tests hold exactly what the server receives plus the secrets of the sites
that collude with it, and try to unmask one honest site; they fail on a plan whose k is
large enough for the colluders, and succeed (the control) when the colluders are all of
that site's neighbours, which the plan's rule k >= 2 max_dropouts + max_colluders + 1
refuses."""

from __future__ import annotations

import itertools
import math

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
from fedsgld.secagg.crypto import mask, modulus_mask
from fedsgld.secagg.protocol import pairwise_masks
from fedsgld.secagg.shamir import combine

SIGMA, CLIP = 1.5, 0.5


def _connected(nodes: set[int], plan: SecAggPlan) -> bool:
    if not nodes:
        return True
    seen, todo = set(), [min(nodes)]
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        todo += [v for v in plan.neighbourhood(u) if v in nodes and v not in seen]
    return seen == nodes


@pytest.mark.parametrize(("n", "k"), [(5, 2), (8, 2), (8, 4), (9, 4), (10, 6), (12, 4)])
def test_the_graph_is_k_regular_symmetric_and_k_connected(n, k):
    """Harary's H_{k,n}: every site has exactly k neighbours, the relation is symmetric, and
    removing any k - 1 sites leaves the rest connected (checked for every such set)."""
    plan = SecAggPlan(round_label=b"g", sites=range(n), length=1, bits=8, neighbours=k)
    for u in plan.sites:
        nb = plan.neighbourhood(u)
        assert len(nb) == len(set(nb)) == k and u not in nb
        assert all(u in plan.neighbourhood(v) for v in nb)
    for gone in itertools.combinations(plan.sites, k - 1):
        assert _connected(set(plan.sites) - set(gone), plan), gone
    # k removals can cut it (a ring neighbourhood separates its site): k is exact
    assert not _connected(set(plan.sites) - set(plan.neighbourhood(0)), plan) or n - k <= 2


def test_the_complete_graph_is_the_default_and_sites_need_not_be_contiguous():
    plan = SecAggPlan(round_label=b"g", sites=(3, 9, 17, 40), length=1, bits=8)
    assert plan.neighbourhood(9) == (3, 17, 40) and plan.threshold == 4
    sparse = SecAggPlan(round_label=b"g", sites=(40, 3, 9, 17, 22), length=1, bits=8,
                        neighbours=2)  # fmt: skip
    assert sparse.neighbourhood(3) == (9, 40) and sparse.threshold == 3
    assert sparse.context != SecAggPlan(round_label=b"g", sites=(40, 3, 9, 17, 22), length=1,
                                         bits=8).context  # fmt: skip


@pytest.mark.parametrize(
    ("k", "dropouts", "colluders", "why"),
    [
        (3, 0, 0, "even"),
        (2, 1, 0, r"even in \[4, "),  # 2 d + c + 1 = 3: at least 4
        (4, 1, 2, r"even in \[6, "),
        (8, 0, 0, "sites - 2 = 6"),
        (-2, 0, 0, "neighbours must be"),
    ],
)
def test_a_plan_refuses_a_graph_too_sparse_for_its_dropouts_and_colluders(
    k, dropouts, colluders, why
):
    with pytest.raises(ValueError, match=why):
        SecAggPlan(round_label=b"g", sites=range(8), length=1, bits=8, neighbours=k,
                   max_dropouts=dropouts, max_colluders=colluders)  # fmt: skip


def _params(sites: int, dim: int, *, max_dropouts: int = 0, max_colluders: int = 0):
    return choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=sites,
                      max_dropouts=max_dropouts, max_colluders=max_colluders,
                      signal_norm=1000.0)  # fmt: skip


@pytest.mark.parametrize("k", [2, 4, 6])
def test_a_sparse_round_sums_every_input_and_carries_the_central_noise(k):
    dim, n = 4096, 10
    p = _params(n, dim)
    rng = np.random.default_rng(k)
    xs = [rng.normal(0, 50.0, dim) for _ in range(n)]
    res = run_round(xs, p, round_label=b"sparse", neighbours=k)
    err = res.total - sum(xs)
    assert abs(err.std() / (SIGMA * CLIP) - 1.0) < 0.1
    # a site sends k ciphertexts, not n - 1
    shares = {
        m["site"]: m for name, ms in res.server.transcript if name == "share_keys" for m in ms
    }
    assert all(len(m["shares"]) == k for m in shares.values())


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("step", ["share_keys", "masked_input", "consistency", "unmask"])
def test_a_planned_dropout_in_a_sparse_round_completes_with_the_right_sum(step, workers):
    """max_dropouts = 1, k = 4 on 9 sites: site 4 drops at ``step``; the server rebuilds its
    self mask or its mask key from its neighbours alone (the sites answering one after
    the other, or on three threads)."""
    dim, n = 2048, 9
    p = _params(n, dim, max_dropouts=1)
    rng = np.random.default_rng(3)
    xs = [rng.normal(0, 50.0, dim) for _ in range(n)]
    res = run_round(xs, p, round_label=b"sparse-drop", max_dropouts=1, neighbours=4,
                    drop={4: step}, workers=workers)  # fmt: skip
    included = (
        list(range(n)) if step in ("consistency", "unmask") else [v for v in range(n) if v != 4]
    )
    assert res.survivors == tuple(included)
    err = res.total - sum(xs[v] for v in included)
    expected = SIGMA * CLIP * math.sqrt(len(included) / (n - 1))
    assert abs(err.std() / expected - 1.0) < 0.1


def test_two_neighbours_of_one_site_dropping_abort_the_sparse_round():
    """With max_dropouts = 1, sites 3 and 5 (both neighbours of 4) silent at masked_input
    leave too few of site 4's holders... and too few inputs: the round aborts."""
    p = _params(9, 256, max_dropouts=1)
    with pytest.raises(RoundAborted, match="fewer than"):
        run_round([np.ones(256)] * 9, p, round_label=b"x", max_dropouts=1, neighbours=4,
                  drop={3: "masked_input", 5: "masked_input"})  # fmt: skip


def _round(plan: SecAggPlan, inputs: dict[int, np.ndarray]):
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    ann = server.collect_masked([s.masked_input(inbox[v], inputs[v]) for v, s in sites.items()])
    signed = server.collect_signatures([s.consistency(ann) for s in sites.values()])
    total = server.finish([s.unmask(signed) for s in sites.values()])
    return sites, server, total


def _attack(plan: SecAggPlan, sites, server, target: int, colluders: set[int]) -> np.ndarray:
    """The server's view plus the colluders' secrets: the target's masked input less its
    self mask (rebuilt from the unmasking answers, as the server does) and less every
    pairwise mask the colluders share with it (from their own mask keys)."""
    msgs = {name: {m["site"]: m for m in ms} for name, ms in server.transcript}
    y = np.frombuffer(msgs["masked_input"][target]["y"], dtype="<u4").astype(np.uint64)
    shares = {plan.point(u): m["self_mask_shares"][target]
              for u, m in msgs["unmask"].items() if target in m["self_mask_shares"]}  # fmt: skip
    y = y - mask(combine(shares, plan.threshold), plan.length, plan.bits)
    for c in colluders & set(plan.neighbourhood(target)):
        key = sites[c]._mask_key  # the colluder's own secret
        # c's total over the one peer `target`; the target added the opposite sign
        y = y + pairwise_masks(plan, c, key, {target: msgs["advertise_keys"][target]["mask_pk"]})
    return y & modulus_mask(plan.bits)


def test_colluders_and_the_server_cannot_unmask_a_site_of_a_sparse_round():
    """10 sites, k = 4, one colluder planned (and present: site 1, a neighbour of site 0).
    Site 0's input is all zeros; with everything the server and site 1 hold, what is left of
    it is still uniform modulo 2^bits (its two other honest neighbours' masks)."""
    plan = SecAggPlan(round_label=b"atk", sites=range(10), length=20_000, bits=24,
                      max_colluders=1, neighbours=4)  # fmt: skip
    rng = np.random.default_rng(5)
    inputs = {v: rng.integers(0, 1 << 24, plan.length, dtype=np.uint64) for v in plan.sites}
    inputs[0][:] = 0
    sites, server, total = _round(plan, inputs)
    np.testing.assert_array_equal(total, sum(inputs.values()) & modulus_mask(24))
    r = _attack(plan, sites, server, 0, {1}).astype(np.float64) / 2**24
    assert stats.kstest(r, "uniform").pvalue > 1e-6


def test_the_attack_succeeds_when_every_neighbour_colludes():
    """The control: k = 2 with max_colluders = 0 planned, but both neighbours of site 0
    (sites 1 and 9) collude. The same attack then recovers site 0's input exactly, which is
    why a plan needs k >= 2 max_dropouts + max_colluders + 1 (here it would refuse k = 2 for
    two colluders)."""
    plan = SecAggPlan(round_label=b"atk", sites=range(10), length=2_000, bits=24, neighbours=2)
    rng = np.random.default_rng(6)
    inputs = {v: rng.integers(0, 1 << 24, plan.length, dtype=np.uint64) for v in plan.sites}
    sites, server, _ = _round(plan, inputs)
    np.testing.assert_array_equal(_attack(plan, sites, server, 0, {1, 9}), inputs[0])
    with pytest.raises(ValueError, match="neighbours must be"):
        SecAggPlan(round_label=b"atk", sites=range(10), length=2_000, bits=24, neighbours=2,
                   max_colluders=2)  # fmt: skip


def test_a_site_refuses_shares_from_a_site_outside_its_neighbourhood():
    """The server relays a ciphertext from a non-neighbour (site 5 to site 0, k = 2 of 10):
    site 0 refuses before it draws or masks anything."""
    plan = SecAggPlan(round_label=b"route", sites=range(10), length=8, bits=16, neighbours=2)
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    forged = {"shares": {**inbox[0]["shares"], 5: inbox[4]["shares"][5]}}
    with pytest.raises(RoundAborted, match="do not allow"):
        sites[0].masked_input(forged, np.zeros(8, dtype=np.uint64))
