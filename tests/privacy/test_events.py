"""Privacy events (fedsgld.privacy.events): the event path gives exactly the old floats.

The accountant's old entry points took bare numbers: ``step(q, sigma)``, ``check(q,
sigma)``, ``max_steps(schedule)`` and ledgers of (q, sigma, count) tuples. Every release
is now an event the accountant spends; these tests check, over a grid of settings, that
spending events records the same ledger and gives bit-identical epsilons as the bare
tuples, and that each PATE answer event gives the analysis' own numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.events import (
    Composed,
    ConfidentGnmaxAnswers,
    GaussianRelease,
    GnmaxAnswers,
    LnmaxAnswers,
    Repeated,
    SubsampledGaussianStep,
    UnsupportedEvent,
    gaussian_steps,
    ledger_entries,
)
from fedsgld.privacy.pate_analysis import gnmax_epsilon_from_counts, lnmax_epsilon_from_counts
from fedsgld.privacy.pate_events import answers_epsilon

DELTA = 1e-5
GRID = [
    (q, sigma, n, accountant, grid)
    for q in (0.01, 0.25, 1.0)
    for sigma in (0.7, 1.1, 4.0)
    for n in (1, 9, 60)
    for accountant, grid in (("pld", 0.0), ("rdp", 0.0), ("pld", 0.01))
]


def _sgld_sigma(t: int) -> float:
    return math.sqrt(2.0 * 0.1 * (1.0 + t / 100.0) ** -0.55 * 10.0)


@pytest.mark.parametrize(("q", "sigma", "n", "accountant", "grid"), GRID)
def test_repeated_steps_give_the_bare_ledgers_epsilons_exactly(q, sigma, n, accountant, grid):
    acc = PrivacyAccountant(delta=DELTA, accountant=accountant, sigma_rel_grid=grid)
    event = Repeated(SubsampledGaussianStep(q, sigma), n)
    before = acc.epsilon_after(event)
    acc.spend(event)
    # the old path: the bare (q, sigma, count) ledger, bucketed as the accountant does
    bare = [(q, acc.bucket(sigma), n)]
    fresh = PrivacyAccountant(delta=DELTA, accountant=accountant, sigma_rel_grid=grid)
    assert acc.ledger == bare
    assert acc.rigorous_epsilon() == fresh.rigorous_epsilon(bare) == before
    ours, theirs = acc.epsilon(), fresh.epsilon(bare)
    assert ours["pld"] == theirs["pld"] and ours["rdp"] == theirs["rdp"]
    assert acc.mu() == pytest.approx(fresh.mu([(q, sigma, n)]), rel=1e-12)  # GDP: exact sigmas


@pytest.mark.parametrize("grid", [0.0, 0.01])
def test_a_decaying_schedule_as_events_equals_stepping_and_the_bare_ledger(grid):
    steps = [(0.01, _sgld_sigma(t)) for t in range(300)]
    by_steps = PrivacyAccountant(delta=DELTA, sigma_rel_grid=grid)
    for q, s in steps:
        by_steps.step(q, s)
    by_event = PrivacyAccountant(delta=DELTA, sigma_rel_grid=grid)
    by_event.spend(Composed(tuple(SubsampledGaussianStep(q, s) for q, s in steps)))
    planned = PrivacyAccountant(delta=DELTA, sigma_rel_grid=grid)
    bare = planned.ledger_after(steps.__getitem__, len(steps))
    assert by_event.ledger == by_steps.ledger == bare
    assert by_event.epsilon() == by_steps.epsilon()
    assert by_event.rigorous_epsilon() == planned.rigorous_epsilon(bare)


@pytest.mark.parametrize("sigma", [0.8, 2.0, 5.0])
def test_a_gaussian_release_is_one_step_at_rate_one_whatever_its_sensitivity(sigma):
    release = GaussianRelease(sigma, sensitivity=math.sqrt(5.0))
    assert release.std == sigma * math.sqrt(5.0)
    assert list(gaussian_steps(release)) == [(1.0, sigma)]
    acc = PrivacyAccountant(delta=DELTA)
    acc.spend(Repeated(release, 3))
    assert acc.ledger == [(1.0, sigma, 3)]
    assert acc.rigorous_epsilon() == PrivacyAccountant(delta=DELTA).rigorous_epsilon(
        [(1.0, sigma, 3)]
    )


def test_ledger_entries_run_length_encode_in_release_order():
    a, b = SubsampledGaussianStep(0.1, 1.0), GaussianRelease(2.0, 3.0)
    event = Composed((Repeated(a, 2), a, b, Composed((Repeated(a, 0), b))))
    assert ledger_entries(event) == [(0.1, 1.0, 3), (1.0, 2.0, 2)]


@pytest.mark.parametrize("budget", [0.5, 2.0, 8.0])
def test_budget_checks_of_events_match_the_old_checks(budget):
    point = (0.05, 1.2)
    old = PrivacyAccountant(delta=DELTA, epsilon_budget=budget)
    new = PrivacyAccountant(delta=DELTA, epsilon_budget=budget)
    assert new.fits(SubsampledGaussianStep(*point)) == old.check(*point)
    fits = old.max_steps(lambda i: point, limit=20_000)
    assert new.affordable(Repeated(SubsampledGaussianStep(*point), 20_000)) == fits < 20_000
    assert new.fits(Repeated(SubsampledGaussianStep(*point), fits))
    assert not new.fits(Repeated(SubsampledGaussianStep(*point), fits + 1))


def test_an_event_over_budget_records_nothing():
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0)
    acc.spend(Repeated(SubsampledGaussianStep(0.05, 1.2), 3))
    ledger, eps = acc.ledger, acc.rigorous_epsilon()
    too_many = Repeated(SubsampledGaussianStep(0.05, 1.2), 10_000)
    with pytest.raises(BudgetExhausted) as err:
        acc.spend(too_many)
    assert acc.ledger == ledger and acc.rigorous_epsilon() == eps
    assert err.value.epsilon == acc.epsilon_after(too_many) > 1.0


def test_pate_answers_are_not_gaussian_steps():
    acc = PrivacyAccountant(delta=DELTA)
    for event in (
        LnmaxAnswers(gamma=0.1, queries=3),
        GnmaxAnswers(sigma=40.0, queries=3),
        ConfidentGnmaxAnswers(sigma=40.0, sigma1=150.0, threshold=200.0, posed=3),
    ):
        with pytest.raises(UnsupportedEvent):
            acc.spend(event)
        with pytest.raises(UnsupportedEvent):
            acc.fits(event)
    assert acc.steps == 0


def test_pate_answer_events_give_the_analysis_numbers_exactly():
    rng = np.random.default_rng(3)
    counts = rng.multinomial(100, [0.85, 0.1, 0.05], size=40)
    answered = rng.random(40) < 0.7
    assert answers_epsilon(
        LnmaxAnswers(gamma=0.05, queries=40, moments=12), counts, delta=DELTA
    ) == lnmax_epsilon_from_counts(counts, gamma=0.05, delta=DELTA, moments=12)
    assert answers_epsilon(
        GnmaxAnswers(sigma=20.0, queries=40), counts, delta=DELTA
    ) == gnmax_epsilon_from_counts(counts, sigma=20.0, delta=DELTA)
    confident = ConfidentGnmaxAnswers(sigma=20.0, sigma1=60.0, threshold=70.0, posed=40)
    assert answers_epsilon(
        confident, counts, delta=DELTA, answered=answered
    ) == gnmax_epsilon_from_counts(
        counts, sigma=20.0, delta=DELTA, threshold=70.0, sigma1=60.0, answered=answered
    )
    with pytest.raises(ValueError, match="rows"):
        answers_epsilon(GnmaxAnswers(sigma=20.0, queries=39), counts, delta=DELTA)


def test_sampling_as_a_wrapper_event_is_the_same_release():
    """PoissonSampled(q, GaussianMechanism(sigma)) is a SubsampledGaussianStep(q, sigma):
    the same ledger and the same epsilons; each ledger says which releases it supports."""
    from fedsgld.privacy.distributed import choose_ddg
    from fedsgld.privacy.events import (
        DistributedDiscreteGaussianStep,
        GaussianMechanism,
        PoissonSampled,
        releases,
    )

    plain = PrivacyAccountant(delta=1e-5)
    wrapped = PrivacyAccountant(delta=1e-5)
    plain.spend(Composed((Repeated(SubsampledGaussianStep(0.01, 1.1), 30), GaussianRelease(3.0))))
    wrapped.spend(
        Composed(
            (
                Repeated(PoissonSampled(0.01, GaussianMechanism(1.1)), 30),
                PoissonSampled(1.0, GaussianMechanism(3.0)),
            )
        )
    )
    assert wrapped.ledger == plain.ledger == [(0.01, 1.1, 30), (1.0, 3.0, 1)]
    assert wrapped.epsilon() == plain.epsilon()
    params = choose_ddg(
        noise_multiplier=1.1, clip=1.0, dim=100, sites=4, max_dropouts=1, signal_norm=50.0
    )
    ddg = DistributedDiscreteGaussianStep(params, 0.05)
    (release,) = releases(ddg)
    assert release.sample_rate == 0.05 and release.event.params == params
    both = Composed((SubsampledGaussianStep(0.01, 1.1), ddg))
    assert plain.ledger_for(SubsampledGaussianStep(0.01, 1.1)) is plain.gaussian
    assert plain.ledger_for(both) is plain.ddg and plain.ledger_for(ddg) is plain.ddg
    assert not plain.gaussian.supports(both) and plain.ddg.supports(both)
    with pytest.raises(UnsupportedEvent, match="answers_epsilon"):
        plain.ledger_for(GnmaxAnswers(sigma=40.0, queries=10))
