"""The accountant's second ledger: distributed discrete Gaussian rounds composed by RDP."""

from __future__ import annotations

import pytest

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant, Repeated, SubsampledGaussianStep
from fedsgld.privacy.distributed import choose_ddg, ddg_epsilon
from fedsgld.privacy.events import DistributedDiscreteGaussianStep, UnsupportedEvent, ledger_entries

DELTA = 1e-5
PARAMS = choose_ddg(
    noise_multiplier=1.1, clip=1.0, dim=100, sites=4, max_dropouts=1, signal_norm=50.0
)
Q = 0.05


def test_epsilon_is_ddg_epsilon_of_the_rounds_and_gaussian_steps():
    acc = PrivacyAccountant(delta=DELTA)
    acc.spend(SubsampledGaussianStep(0.02, 3.0))
    acc.spend(Repeated(DistributedDiscreteGaussianStep(PARAMS, Q), 20))
    ref = ddg_epsilon([(Q, PARAMS, 20)], DELTA, gaussian=[(0.02, 3.0, 1)])[0]
    assert acc.rigorous_epsilon() == pytest.approx(ref, rel=1e-12)
    assert all(v == pytest.approx(ref, rel=1e-12) for v in acc.epsilon().values())
    assert acc.steps == 21 and acc.ddg_ledger == [(Q, PARAMS, 20)]
    # the round-trip keeps both ledgers
    back = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert back.rigorous_epsilon() == pytest.approx(ref, rel=1e-12)


def test_ddg_round_past_the_budget_is_refused_and_not_recorded():
    one = ddg_epsilon([(Q, PARAMS, 1)], DELTA)[0]
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=one * 1.2)
    step = DistributedDiscreteGaussianStep(PARAMS, Q)
    assert acc.fits(step)
    acc.spend(step)
    ten = ddg_epsilon([(Q, PARAMS, 10)], DELTA)[0]
    assert ten > one * 1.2  # so that the test means something
    assert acc.affordable(Repeated(step, 10)) < 10
    before = acc.steps
    with pytest.raises(BudgetExhausted):
        acc.spend(Repeated(step, 10))
    assert acc.steps == before
    # a Gaussian step is checked against the whole run too, DDG rounds included
    with pytest.raises(BudgetExhausted):
        for _ in range(1000):
            acc.step(Q, 1.1)
    assert acc.rigorous_epsilon() <= one * 1.2


def test_gaussian_ledger_refuses_a_ddg_round():
    with pytest.raises(UnsupportedEvent):
        ledger_entries(DistributedDiscreteGaussianStep(PARAMS, Q))


def test_site_ledger_admits_a_ddg_round_within_its_budget_only():
    one = ddg_epsilon([(Q, PARAMS, 1)], DELTA)[0]
    policy = SitePolicy.simulation(epsilon=one * 1.2, delta=DELTA)
    ledger = SiteLedger(0, policy)
    step = DistributedDiscreteGaussianStep(PARAMS, Q)
    receipt = ledger.admit(event=step, round_of=("run", 0, 0))
    assert receipt.event == step and receipt.steps == ()
    with pytest.raises(PolicyRefused):
        ledger.admit(event=Repeated(step, 5), round_of=("run", 0, 1))
    assert ledger.accountant.ddg_ledger == [(Q, PARAMS, 1)]


def test_site_admission_composes_each_ledger_once(monkeypatch):
    """Checking a plan and charging it ask for the same pair of ledgers: one PLD, not two;
    the same plan again at the next round is one more (the ledger grew)."""
    from fedsgld.privacy import pld_fft
    from fedsgld.privacy.ddg_ledger import clear_shared_epsilons

    clear_shared_epsilons()
    calls = []
    real_compose = pld_fft.compose

    def counting(*args, **kwargs):
        calls.append(1)
        return real_compose(*args, **kwargs)

    monkeypatch.setattr(pld_fft, "compose", counting)
    policy = SitePolicy.simulation(epsilon=10.0, delta=DELTA)
    ledger = SiteLedger(0, policy)
    step = DistributedDiscreteGaussianStep(PARAMS, Q)
    ledger.admit(event=step, round_of=("run", 0, 0))
    assert len(calls) == 1
    ledger.accountant.rigorous_epsilon()
    ledger.accountant.epsilon()
    assert len(calls) == 1
    ledger.admit(event=step, round_of=("run", 0, 1))
    assert len(calls) == 2
    assert ledger.accountant.rigorous_epsilon() == ddg_epsilon([(Q, PARAMS, 2)], DELTA)[0]


def _counting_compose(monkeypatch) -> list:
    from fedsgld.privacy import pld_fft
    from fedsgld.privacy.ddg_ledger import clear_shared_epsilons

    clear_shared_epsilons()
    calls: list = []
    real_compose = pld_fft.compose

    def counting(*args, **kwargs):
        calls.append(1)
        return real_compose(*args, **kwargs)

    monkeypatch.setattr(pld_fft, "compose", counting)
    return calls


def test_sites_with_the_same_ledger_share_one_composition_and_its_exact_value(monkeypatch):
    """Eight sites admitting the same rounds: one PLD per round for all of them, and every
    site's charge is exactly (==, not approx) the epsilon recomputed from scratch."""
    from fedsgld.privacy.ddg_ledger import clear_shared_epsilons

    calls = _counting_compose(monkeypatch)
    ledgers = [SiteLedger(k, SitePolicy.simulation(epsilon=10.0, delta=DELTA)) for k in range(8)]
    step = DistributedDiscreteGaussianStep(PARAMS, Q)
    for rnd in range(3):
        for ledger in ledgers:
            ledger.admit(event=step, round_of=("run", 0, rnd))
        assert len(calls) == rnd + 1
    cached = [ledger.accountant.rigorous_epsilon() for ledger in ledgers]
    clear_shared_epsilons()
    fresh = ddg_epsilon([(Q, PARAMS, 3)], DELTA)[0]
    assert all(v == fresh for v in cached)
    assert ledgers[0].accountant.rigorous_epsilon() == fresh  # recomputed after clearing


def test_shared_epsilons_never_cross_ledgers_that_differ(monkeypatch):
    """A site with an extra Gaussian release, a site at another delta and a site with
    other DDG parameters each get their own epsilon (each the recomputed value), though
    their DDG rounds are otherwise the same as the first site's."""
    _counting_compose(monkeypatch)
    step = DistributedDiscreteGaussianStep(PARAMS, Q)
    other = choose_ddg(noise_multiplier=1.2, clip=1.0, dim=100, sites=4, max_dropouts=1,
                       signal_norm=50.0)  # fmt: skip
    plain, extra, wide, changed = (
        SiteLedger(k, SitePolicy.simulation(epsilon=10.0, delta=d))
        for k, d in enumerate((DELTA, DELTA, 1e-3, DELTA))
    )
    extra.accountant.spend(SubsampledGaussianStep(0.02, 3.0))
    for rnd in range(2):
        for ledger in (plain, extra, wide):
            ledger.admit(event=step, round_of=("run", 0, rnd))
        changed.admit(event=DistributedDiscreteGaussianStep(other, Q), round_of=("run", 0, rnd))
    want = {
        "plain": ddg_epsilon([(Q, PARAMS, 2)], DELTA)[0],
        "extra": ddg_epsilon([(Q, PARAMS, 2)], DELTA, gaussian=[(0.02, 3.0, 1)])[0],
        "wide": ddg_epsilon([(Q, PARAMS, 2)], 1e-3)[0],
        "changed": ddg_epsilon([(Q, other, 2)], DELTA)[0],
    }
    got = {
        "plain": plain.accountant.rigorous_epsilon(),
        "extra": extra.accountant.rigorous_epsilon(),
        "wide": wide.accountant.rigorous_epsilon(),
        "changed": changed.accountant.rigorous_epsilon(),
    }
    assert got == want
    assert len(set(want.values())) == 4  # so that a shared value would be caught
