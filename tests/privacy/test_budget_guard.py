"""A step that alone overspends is refused at once, without building a huge PLD grid."""

from __future__ import annotations

import math
import time

import pytest

from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.accountant import single_step_delta_lower_bound


@pytest.mark.parametrize("sigma", [1e-9, 1e-5, 1e-2])
def test_a_near_zero_noise_multiplier_is_refused_quickly(sigma):
    acc = PrivacyAccountant(delta=1e-5, epsilon_budget=50.0)
    t0 = time.perf_counter()
    assert acc.max_steps(lambda i: (0.2, sigma), limit=10) == 0
    assert not acc.check(0.2, sigma)
    assert time.perf_counter() - t0 < 30  # no grid of 1e12 points (that ran out of memory)
    assert acc.steps == 0


@pytest.mark.parametrize("q,sigma", [(0.1, 1.0), (0.5, 0.7), (1.0, 2.0), (0.01, 0.5), (0.2, 0.3)])
def test_the_single_step_bound_never_exceeds_the_accountants_delta(q, sigma):
    acc = PrivacyAccountant(delta=1e-5)
    acc.step(q, sigma)
    eps = acc.rigorous_epsilon()
    lower = single_step_delta_lower_bound([(q, sigma, 1)], eps)
    assert 0.0 < lower <= 1e-5 * (1 + 1e-6)
    # and it is not vacuous: q = 1 is the plain Gaussian, whose delta the bound gives exactly
    if q == 1.0:
        assert lower == pytest.approx(1e-5, rel=1e-2)


def test_the_single_step_bound_is_a_number_at_an_infinite_budget_and_at_rate_zero():
    # delta(inf) is 0 for every mechanism; a step at rate 0 releases nothing; neither may
    # turn the bound into NaN and hide another step's overspending
    assert single_step_delta_lower_bound([(1.0, 4.5e-7, 1)], math.inf) == 0.0
    with_zero = single_step_delta_lower_bound([(0.0, 1.0, 3), (0.5, 0.3, 1)], 1.0)
    alone = single_step_delta_lower_bound([(0.5, 0.3, 1)], 1.0)
    assert with_zero == alone > 0.1
