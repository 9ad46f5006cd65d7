"""Gaussian-DP CLT: mu of a ledger and the mu-GDP <-> (epsilon, delta) conversion.

References are computed here independently: the analytic Gaussian-mechanism trade-off
with scipy.stats.norm (no log space), and dp_accounting's exact Gaussian epsilon
(mu-GDP is exactly the Gaussian mechanism with noise multiplier 1/mu).
"""

from __future__ import annotations

import math

import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fedsgld.privacy.gdp import gdp_delta, gdp_epsilon, gdp_mu


def gaussian_delta(eps: float, s: float) -> float:
    """delta(eps) of the Gaussian mechanism, sensitivity 1, noise std s (Balle & Wang 2018)."""
    return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))


def gaussian_epsilon(s: float, delta: float) -> float:
    if gaussian_delta(0.0, s) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, s) > delta:
        hi *= 2
    return brentq(lambda e: gaussian_delta(e, s) - delta, 0.0, hi, xtol=1e-13)


def test_mu_formula_single_and_heterogeneous():
    q, sigma, T = 0.01, 1.3, 700
    assert gdp_mu([(q, sigma, T)]) == pytest.approx(
        q * math.sqrt(T * (math.exp(1 / sigma**2) - 1)), rel=1e-12
    )
    # run-length encoding does not matter, and entries add in mu^2
    assert gdp_mu([(q, sigma, 300), (q, sigma, 400)]) == pytest.approx(
        gdp_mu([(q, sigma, T)]), rel=1e-12
    )
    mixed = [(0.01, 1.3, 100), (0.02, 0.9, 50), (0.01, 2.0, 10)]
    expected = math.sqrt(
        100 * 0.01**2 * (math.exp(1 / 1.3**2) - 1)
        + 50 * 0.02**2 * (math.exp(1 / 0.9**2) - 1)
        + 10 * 0.01**2 * (math.exp(1 / 2.0**2) - 1)
    )
    assert gdp_mu(mixed) == pytest.approx(expected, rel=1e-12)
    assert gdp_mu([]) == 0.0


def test_mu_overflow_gives_inf_not_error():
    assert gdp_mu([(0.01, 0.03, 10)]) == math.inf  # exp(1/0.03^2) overflows a double
    assert gdp_epsilon(math.inf, 1e-5) == math.inf


@pytest.mark.parametrize(
    "entry", [(0.0, 1.0, 1), (1.5, 1.0, 1), (0.1, 0.0, 1), (0.1, -1.0, 1), (0.1, 1.0, -1)]
)
def test_mu_rejects_invalid_entries(entry):
    with pytest.raises(ValueError):
        gdp_mu([entry])


def test_reference_value_mnist_dpsgd():
    # q = 256/60000, sigma = 1.1, 3515 steps (60 epochs), delta = 1e-5: GDP CLT ~ 1.077
    mu = gdp_mu([(256 / 60000, 1.1, 3515)])
    assert mu == pytest.approx(0.2868, abs=5e-4)
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(1.077, rel=0.01)


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0, 3.0])
def test_delta_is_the_gaussian_mechanism_with_sigma_one_over_mu(mu, eps):
    ref = gaussian_delta(eps, 1.0 / mu)
    assert gdp_delta(eps, mu) == pytest.approx(ref, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 3.0, 10.0, 40.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-9])
def test_epsilon_matches_exact_gaussian_epsilon(mu, delta):
    from dp_accounting import get_epsilon_gaussian

    ref = get_epsilon_gaussian(1.0 / mu, delta)
    assert gdp_epsilon(mu, delta) == pytest.approx(ref, rel=1e-8, abs=1e-10)
    if mu <= 3.0:  # the plain (non-log) formula is accurate here
        assert gdp_epsilon(mu, delta) == pytest.approx(
            gaussian_epsilon(1.0 / mu, delta), rel=1e-7, abs=1e-9
        )


def test_large_epsilon_beyond_a_fixed_bracket():
    # epsilon > 500 (where a fixed [0, 500] bracket fails) is still found
    eps = gdp_epsilon(40.0, 1e-5)
    assert eps > 500
    assert gdp_delta(eps, 40.0) == pytest.approx(1e-5, rel=1e-6)


@pytest.mark.parametrize(
    "mu, eps",
    [
        (0.1, 0.05),
        (0.1, 0.7),
        (0.5, 0.05),
        (0.5, 0.7),
        (0.5, 4.0),
        (2.0, 0.7),
        (2.0, 4.0),
        (8.0, 4.0),
        (8.0, 20.0),
        (8.0, 60.0),
    ],
)
def test_round_trip_eps_delta_eps(mu, eps):
    delta = gdp_delta(eps, mu)
    assert 1e-300 < delta < 1.0
    assert gdp_epsilon(mu, delta) == pytest.approx(eps, rel=1e-7, abs=1e-9)


def test_epsilon_zero_when_delta_at_zero_is_small_enough():
    mu = 0.01
    d0 = gdp_delta(0.0, mu)
    assert d0 == pytest.approx(2 * norm.cdf(mu / 2) - 1, rel=1e-9)
    assert gdp_epsilon(mu, d0 * 1.01) == 0.0
    assert gdp_epsilon(mu, d0 * 0.5) > 0.0
    assert gdp_epsilon(0.0, 1e-5) == 0.0


def test_delta_stable_and_monotone_for_large_epsilon():
    values = [gdp_delta(e, 5.0) for e in (0, 1, 10, 50, 100, 300, 1000)]
    assert all(0.0 <= v <= 1.0 and not math.isnan(v) for v in values)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[2] > 0.0
    assert gdp_delta(1.0, math.inf) == 1.0
    assert gdp_delta(1.0, 0.0) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: gdp_epsilon(-1.0, 1e-5),
        lambda: gdp_epsilon(1.0, 0.0),
        lambda: gdp_epsilon(1.0, 1.0),
        lambda: gdp_delta(-0.1, 1.0),
        lambda: gdp_delta(1.0, -1.0),
    ],
)
def test_invalid_arguments_raise(call):
    with pytest.raises(ValueError):
        call()
