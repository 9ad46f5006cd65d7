"""Approximate-DP releases ((epsilon, delta) or an RDP curve) in the ledgers: against
dp_accounting's PLD of the same worst-case pairs, never below either part, delta adds,
refused past a site's lifetime budget, and a ledger file that round-trips and only grows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dp_accounting.pld import common
from dp_accounting.pld import privacy_loss_distribution as pldlib

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.approx_dp import (
    ApproxDpRelease,
    RdpCurveRelease,
    atoms,
    composed_delta,
    composed_epsilon,
)
from fedsgld.privacy.events import Composed, Repeated, SubsampledGaussianStep, UnsupportedEvent
from fedsgld.privacy.ledger_chain import LedgerChain, verify
from fedsgld.privacy.rdp import DEFAULT_ORDERS, rdp_epsilon

DELTA = 1e-5


def _reference(ledger, pairs, delta=DELTA, h=1e-4):
    """dp_accounting: Gaussian steps (connect-the-dots) composed with from_privacy_parameters."""
    out = None
    for q, s, c in ledger:
        p = pldlib.from_gaussian_mechanism(
            s, sampling_prob=q, value_discretization_interval=h, use_connect_dots=True
        ).self_compose(c)
        out = p if out is None else out.compose(p)
    for e, d in pairs:
        p = pldlib.from_privacy_parameters(
            common.DifferentialPrivacyParameters(e, d), value_discretization_interval=h
        )
        out = p if out is None else out.compose(p)
    return out.get_epsilon_for_delta(delta)


CASES = [
    ([(0.01, 1.0, 300)], [(0.5, 1e-6)]),
    ([(1.0, 3.0, 2)], [(1.0, 1e-7), (0.3, 0.0)]),
    ([], [(1.0, 1e-6)] * 3),
    ([(0.05, 1.5, 100)], [(2.0, 2e-6)]),
]


@pytest.mark.parametrize("ledger, pairs", CASES)
def test_matches_dp_accounting_and_never_below_it(ledger, pairs):
    got = composed_epsilon(ledger, [ApproxDpRelease(e, d) for e, d in pairs], DELTA)
    ref = _reference(ledger, pairs)
    assert ref * (1 - 1e-6) <= got <= ref * 1.01


@pytest.mark.parametrize("ledger, pairs", CASES)
def test_composition_is_never_below_either_part(ledger, pairs):
    releases = [ApproxDpRelease(e, d) for e, d in pairs]
    both = composed_epsilon(ledger, releases, DELTA)
    gauss = composed_epsilon(ledger, [], DELTA)
    alone = composed_epsilon([], releases, DELTA)
    assert both >= gauss and both >= alone
    assert not ledger or both > max(gauss, alone)  # neither part is free


def test_one_release_alone_is_its_own_guarantee():
    # the worst-case pair of (eps0, delta0): delta(eps0) = delta0, and epsilon(delta0) = eps0
    for eps0, d0 in [(0.5, 1e-6), (2.0, 0.0), (1.0, 3e-6)]:
        r = [ApproxDpRelease(eps0, d0)]
        assert composed_delta([], r, eps0, delta=DELTA) == pytest.approx(d0, abs=1e-15)
        assert composed_delta([], r, eps0 * 0.9, delta=DELTA) > d0
        assert composed_epsilon([], r, max(d0, 1e-9) * 1.0000001) == pytest.approx(eps0, rel=1e-6)


def test_delta_adds():
    # a release at delta_0 >= the delta asked about leaves no finite epsilon
    r = [ApproxDpRelease(0.1, 6e-6), ApproxDpRelease(0.1, 5e-6)]
    assert composed_epsilon([(0.01, 1.0, 100)], r, DELTA) == math.inf
    loss, prob, inf = atoms([(0.1, 6e-6), (0.1, 5e-6)])
    assert inf == pytest.approx(1 - (1 - 6e-6) * (1 - 5e-6), rel=1e-12)
    assert prob.sum() + inf == pytest.approx(1.0, abs=1e-15)
    assert composed_epsilon([(0.01, 1.0, 100)], r[:1], DELTA) < math.inf


def test_rdp_curve_release_is_charged_at_a_share_of_delta():
    # a Gaussian of sigma 3 as a curve: charged no less than the exact Gaussian, and no
    # more than its own curve's epsilon at the smallest share of delta
    curve = tuple(DEFAULT_ORDERS / (2 * 3.0**2))
    r = RdpCurveRelease(tuple(DEFAULT_ORDERS), curve, "gaussian")
    got = composed_epsilon([], [r], DELTA)
    exact = composed_epsilon([(1.0, 3.0, 1)], [], DELTA)
    assert exact <= got <= rdp_epsilon(np.asarray(curve), 0.01 * DELTA)[0]
    assert got <= rdp_epsilon(np.asarray(curve), 0.5 * DELTA)[0] + 1e-9


def test_events_validate_and_do_not_mix():
    with pytest.raises(ValueError, match="delta"):
        ApproxDpRelease(1.0, 1.0)
    with pytest.raises(ValueError, match="epsilon"):
        ApproxDpRelease(-1.0, 0.0)
    with pytest.raises(ValueError, match="orders"):
        RdpCurveRelease((1.0,), (0.1,))
    acc = PrivacyAccountant(delta=DELTA)
    with pytest.raises(UnsupportedEvent, match="separate events"):
        acc.spend(Composed((ApproxDpRelease(1.0, 0.0), SubsampledGaussianStep(0.1, 1.0))))
    acc.spend(Repeated(ApproxDpRelease(0.2, 1e-7), 3))
    assert acc.steps == 3 and acc.approx_ledger[0][1] == 3


def test_budget_counts_the_release_and_refuses_past_it():
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=2.0)
    acc.spend(Repeated(SubsampledGaussianStep(0.01, 1.0), 300))  # about 1.07
    assert not acc.fits(ApproxDpRelease(1.0, 1e-6))
    assert acc.fits(ApproxDpRelease(0.5, 1e-6))
    acc.spend(ApproxDpRelease(0.5, 1e-6))
    eps = acc.rigorous_epsilon()
    assert 1.07 < eps <= 2.0 and acc.epsilon()["pld"] == eps
    # later Gaussian steps are checked with the release counted (no stale certificate)
    n = acc.max_steps(lambda t: (0.01, 1.0), limit=10_000)
    alone = PrivacyAccountant(delta=DELTA, epsilon_budget=2.0)
    alone.spend(Repeated(SubsampledGaussianStep(0.01, 1.0), 300))
    assert n < alone.max_steps(lambda t: (0.01, 1.0), limit=10_000)
    acc.spend(Repeated(SubsampledGaussianStep(0.01, 1.0), n))
    assert acc.rigorous_epsilon() <= 2.0


def _site(tmp_path, epsilon=2.0):
    pol = SitePolicy.simulation(epsilon=epsilon, delta=DELTA, state_dir=str(tmp_path))
    return pol, tmp_path / "fedsgld-site-3.json"


def test_site_ledger_refuses_a_release_past_its_lifetime_budget(tmp_path):
    pol, path = _site(tmp_path)
    with SiteLedger.open(3, pol, path) as led:
        led.admit(event=Repeated(SubsampledGaussianStep(0.01, 1.0), 300), round_of=("r", 0, 1))
    before = path.read_bytes()
    with SiteLedger.open(3, pol, path) as led, pytest.raises(PolicyRefused, match="budget"):
        led.admit(event=ApproxDpRelease(1.0, 1e-6), round_of=("selection", 0, 0))
    assert path.read_bytes() == before  # a refused request records nothing


def test_site_ledger_file_round_trips_and_only_grows(tmp_path):
    pol, path = _site(tmp_path)
    curve = tuple(DEFAULT_ORDERS / (2 * 8.0**2))
    with SiteLedger.open(3, pol, path) as led:
        led.admit(event=Repeated(SubsampledGaussianStep(0.01, 1.0), 100), round_of=("r", 0, 1))
        led.admit(event=RdpCurveRelease(tuple(DEFAULT_ORDERS), curve, "sel"),
                  round_of=("selection:x", 0, 0))  # fmt: skip
        eps = led.accountant.rigorous_epsilon()
    state = json.loads(path.read_text())
    assert (
        state["ledger"]["approx"][0][0] == "rdp_curve" and state["ledger"]["approx"][0][2] == "sel"
    )
    with SiteLedger.open(3, pol, path) as again:
        assert again.accountant.rigorous_epsilon() == pytest.approx(eps, rel=1e-12)
        assert again.spent_steps == 101
        with pytest.raises(PolicyRefused, match="already answered"):  # charged once
            again.admit(event=ApproxDpRelease(0.1, 0.0), round_of=("selection:x", 0, 0))
        again.admit(event=ApproxDpRelease(0.1, 1e-7), round_of=("selection:y", 0, 0))
        assert again.accountant.rigorous_epsilon() > eps
    # the server's chain over a ledger holding such releases: sealed, verified, and a
    # shorter copy (the release dropped) refused
    acc = PrivacyAccountant.from_state_dict(json.loads(path.read_text())["ledger"])
    chain = LedgerChain(tmp_path)
    short = acc.state_dict()
    first, link = chain.seal({**short, "approx": short["approx"][:1]}, epoch=0)
    chain.append(link)
    full, link = chain.seal(short, epoch=0)
    chain.append(link)
    verify(tmp_path, full, None, None)
    with pytest.raises(ValueError, match="not the last write"):
        verify(tmp_path, first, None, None)


def test_with_distributed_discrete_gaussian_rounds_the_whole_ledger_counts_both():
    from fedsgld.privacy.distributed import choose_ddg, ddg_epsilon
    from fedsgld.privacy.events import DistributedDiscreteGaussianStep

    params = choose_ddg(noise_multiplier=1.0, clip=1.0, dim=1000, sites=4, signal_norm=4.0)
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=10.0)
    acc.spend(Repeated(DistributedDiscreteGaussianStep(params, 0.01), 50))
    rounds_only = acc.rigorous_epsilon()
    assert rounds_only == pytest.approx(ddg_epsilon([(0.01, params, 50)], DELTA).epsilon)
    acc.spend(ApproxDpRelease(0.5, 1e-6))
    both = acc.rigorous_epsilon()
    assert both > rounds_only and both > composed_epsilon([], [ApproxDpRelease(0.5, 1e-6)], DELTA)
    assert acc.epsilon() == dict.fromkeys(("gdp", "pld", "rdp"), both)
    # a later round is checked with the release counted, and the state round-trips
    acc.spend(DistributedDiscreteGaussianStep(params, 0.01))
    again = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert again.rigorous_epsilon() == pytest.approx(acc.rigorous_epsilon(), rel=1e-12)
    assert again.rigorous_epsilon() > both
