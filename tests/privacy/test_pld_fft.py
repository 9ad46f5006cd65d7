"""The FFT PLD accountant (fedsgld.privacy.pld_fft) against independent references.

References are computed here without fedsgld code: the exact hockey-stick divergence of
one Poisson-subsampled Gaussian step and of the Gaussian mechanism (scipy.stats.norm),
and dp_accounting's PLD accountant (pessimistic connect-the-dots) at a finer
discretisation than ours. The accountant must never be below the reference (it is an
upper bound) and at most 1 % above it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fedsgld.privacy import pld_fft

DELTA = 1e-5


# -- independent references --------------------------------------------------------------
def subsampled_gaussian_delta(q: float, s: float, eps: float) -> float:
    """Exact delta(eps) of one Poisson-subsampled Gaussian step, add/remove adjacency.

    mix = (1 - q) N(0, s^2) + q N(1, s^2), base = N(0, s^2); delta = max over the two
    orders of the pair of sup_A P(A) - e^eps Q(A), attained on a half-line of outputs
    (the likelihood ratio mix/base is increasing in the output)."""

    def remove() -> float:  # P = mix, Q = base, set {o > t} with mix/base(t) = e^eps
        if q < 1.0 and eps <= math.log1p(-q):  # every output qualifies
            return 1.0 - math.exp(eps)
        x = math.log((math.expm1(eps) + q) / q)  # (2t - 1) / (2 s^2)
        t = 0.5 + s * s * x
        p = (1 - q) * norm.sf(t / s) + q * norm.sf((t - 1) / s)
        return p - math.exp(eps) * norm.sf(t / s)

    def add() -> float:  # P = base, Q = mix, set {o < t} with base/mix(t) = e^eps
        y = math.exp(-eps) - 1 + q  # mix/base(t) = e^-eps
        if y <= 0:  # no output qualifies
            return 0.0
        t = 0.5 + s * s * math.log(y / q)
        p = norm.cdf(t / s)
        return p - math.exp(eps) * ((1 - q) * norm.cdf(t / s) + q * norm.cdf((t - 1) / s))

    return max(remove(), add(), 0.0)


def gaussian_epsilon(s: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism (sensitivity 1, noise std s), Balle & Wang 2018."""

    def d(eps: float) -> float:
        return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))

    hi = 1.0
    while d(hi) > delta:
        hi *= 2
    return brentq(lambda e: d(e) - delta, 0.0, hi, xtol=1e-13)


def dp_accounting_epsilon(ledger, discretization: float, delta: float = DELTA) -> float:
    """dp_accounting's PLD accountant (pessimistic connect-the-dots) on the ledger."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=discretization)
    acc.compose(
        dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), int(c)
                )
                for q, s, c in ledger
            ]
        )
    )
    return float(acc.get_epsilon(delta))


def sgld_sigmas(steps: int, a0: float = 0.1, tau: float = 10.0, g: float = 0.55, t0: float = 100.0):
    """sigma_t = sqrt(2 alpha_t tau), alpha_t = a0 (1 + t / t0)^-g (written out here)."""
    return [math.sqrt(2 * a0 * (1 + t / t0) ** (-g) * tau) for t in range(steps)]


def within(value: float, exact: float, rel: float = 0.01) -> bool:
    return exact <= value <= exact * (1 + rel)


# -- one step: the exact hockey stick -------------------------------------------------------
@pytest.mark.parametrize("q, s", [(0.01, 0.6), (0.01, 1.4), (0.2, 1.0), (0.5, 0.8), (1.0, 1.0)])
def test_single_step_delta_is_an_upper_bound_close_to_exact(q, s):
    pld = pld_fft.compose([(q, s, 1)], delta=1e-10)
    for eps in [0.0, 0.01, 0.05, 0.1, 0.3, 0.7, 1.0, 2.0, 3.0, 5.0]:
        exact = subsampled_gaussian_delta(q, s, eps)
        got = pld.delta(eps)
        assert got >= exact - 1e-15, (eps, got, exact)
        assert got <= exact + 0.02 * max(exact, 1e-9) + 1e-12, (eps, got, exact)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
def test_full_batch_composition_is_one_gaussian(sigma):
    # T full-batch steps of noise s compose exactly to one of noise s / sqrt(T)
    for count in (1, 9):
        exact = gaussian_epsilon(sigma / math.sqrt(count), DELTA)
        got = pld_fft.ledger_epsilon([(1.0, sigma, count)], DELTA)
        assert within(got, exact, rel=1e-3), (count, got, exact)


# -- compositions against dp_accounting --------------------------------------------------------
def test_dpsgd_mnist_reference():
    # q = 256/60000, sigma = 1.1, 3515 steps (60 epochs), delta = 1e-5: PLD 1.134
    ledger = [(256 / 60000, 1.1, 3515)]
    exact = dp_accounting_epsilon(ledger, 1e-4)
    assert exact == pytest.approx(1.134, abs=1e-3)
    assert within(pld_fft.ledger_epsilon(ledger, DELTA), exact)


@pytest.mark.parametrize(
    "ledger",
    [
        [(0.01, 0.8, 1000)],
        [(0.01, 1.2, 300), (0.01, 1.0, 200)],
        [(0.01, 1.2, 300), (0.01, 1.0, 200), (0.02, 1.5, 100)],
        [(0.05, 2.0, 400), (1.0, 4.0, 3)],
    ],
)
def test_constant_and_mixed_ledgers_within_one_percent(ledger):
    exact = dp_accounting_epsilon(ledger, 1e-4)
    assert within(pld_fft.ledger_epsilon(ledger, DELTA), exact)


def test_decaying_schedule_every_sigma_distinct():
    # 40 steps of a fast-decaying DP-SGLD schedule, q = 0.05: 40 distinct sigmas 1.41 -> 0.91
    sigmas = sgld_sigmas(40, t0=10.0)
    ledger = [(0.05, s, 1) for s in sigmas]
    exact = dp_accounting_epsilon(ledger, 1e-3)
    got = pld_fft.ledger_epsilon(ledger, DELTA)
    assert within(got, exact)
    # each distinct sigma is composed (merging sigmas within 0.1 % only rounds them down)
    unmerged = pld_fft.ledger_epsilon(ledger, DELTA, sigma_merge=0.0)
    assert within(unmerged, exact) and unmerged <= got * (1 + 1e-9)


# dp_accounting 0.6.0, PLDAccountant(value_discretization_interval=1e-3), every sigma_t of
# alpha_t = 0.1 (1 + t/100)^-0.55, tau = 10, q = 0.01, 2,000 steps, delta = 1e-5; computed
# by test_dpsgld_schedule_2000_steps_against_dp_accounting below (minutes).
EXACT_2000 = 6.18329950665038


def test_dpsgld_schedule_2000_steps():
    ledger = [(0.01, s, 1) for s in sgld_sigmas(2000)]
    got = pld_fft.ledger_epsilon(ledger, DELTA)
    assert within(got, EXACT_2000)
    assert got <= 6.245


@pytest.mark.slow
def test_dpsgld_schedule_2000_steps_against_dp_accounting():
    ledger = [(0.01, s, 1) for s in sgld_sigmas(2000)]
    exact = dp_accounting_epsilon(ledger, 1e-3)
    assert exact == pytest.approx(EXACT_2000, rel=1e-9)
    assert within(pld_fft.ledger_epsilon(ledger, DELTA), exact)


# -- queries ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ledger", [[(256 / 60000, 1.1, 3515)], [(0.01, s, 1) for s in sgld_sigmas(300)]]
)
def test_epsilon_delta_round_trip(ledger):
    pld = pld_fft.compose(ledger, delta=DELTA)
    eps = pld.epsilon(DELTA)
    assert pld.delta(eps) <= DELTA * (1 + 1e-9)
    assert pld.delta(eps * 0.999) > DELTA
    # delta -> epsilon -> delta at other points of the curve
    for target in (1e-3, 1e-4, 1e-5):
        e = pld.epsilon(target)
        assert pld.delta(e) == pytest.approx(target, rel=1e-6)
    for e in (0.5 * eps, eps, 1.5 * eps):
        d = pld.delta(e)
        if d > 1e-9:
            assert pld.epsilon(d) == pytest.approx(e, rel=1e-6)


def test_delta_agrees_with_dp_accounting():
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    ledger = [(0.01, 1.0, 500)]
    pld = pld_fft.compose(ledger, delta=1e-8)
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), 500)
    for eps in (0.5, 1.0, 2.0):
        ref = acc.get_delta(eps)
        assert ref <= pld.delta(eps) <= ref * 1.05
        assert pld_fft.ledger_delta(ledger, eps, delta_floor=1e-8) == pld.delta(eps)


def test_truncation_and_window_masses_are_negligible_and_counted():
    pld = pld_fft.compose([(0.01, s, 1) for s in sgld_sigmas(2000)], delta=DELTA)
    assert all(0.0 <= m < 1e-9 for m in pld.extra_mass)
    (a, b), _ = pld.window
    assert a < 0.0 < pld.epsilon(DELTA) < b
    # a window cut to nothing still gives an upper bound: the lost mass goes into delta
    tight = pld_fft.compose([(0.01, 0.8, 1000)], delta=DELTA, window_mass=0.5)
    loose = pld_fft.compose([(0.01, 0.8, 1000)], delta=DELTA)
    assert tight.epsilon(DELTA) >= loose.epsilon(DELTA) * (1 - 1e-9)


def test_empty_ledger_and_zero_counts():
    assert pld_fft.ledger_epsilon([], DELTA) == 0.0
    assert pld_fft.ledger_epsilon([(0.01, 1.0, 0)], DELTA) == 0.0
    a = pld_fft.ledger_epsilon([(0.01, 1.0, 100), (0.02, 2.0, 0)], DELTA)
    assert a == pld_fft.ledger_epsilon([(0.01, 1.0, 100)], DELTA)


def test_order_and_run_length_do_not_matter():
    sig = sgld_sigmas(200)
    a = pld_fft.ledger_epsilon([(0.01, s, 1) for s in sig], DELTA)
    b = pld_fft.ledger_epsilon([(0.01, s, 1) for s in sig[::-1]], DELTA)
    assert a == pytest.approx(b, rel=1e-9)
    c = pld_fft.ledger_epsilon([(0.01, 1.0, 150)], DELTA)
    d = pld_fft.ledger_epsilon([(0.01, 1.0, 50), (0.01, 1.0, 100)], DELTA)
    assert c == pytest.approx(d, rel=1e-12)


def test_more_steps_or_less_noise_never_lower_epsilon():
    base = pld_fft.ledger_epsilon([(0.01, 1.0, 300)], DELTA)
    assert pld_fft.ledger_epsilon([(0.01, 1.0, 301)], DELTA) > base
    assert pld_fft.ledger_epsilon([(0.01, 0.99, 300)], DELTA) > base
    assert pld_fft.ledger_epsilon([(0.011, 1.0, 300)], DELTA) > base


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"value_interval": 1.0}, "value_interval"),
        ({"rho": 0.0}, "rho"),
        ({"sigma_merge": 0.6}, "sigma_merge"),
        ({"tail": 0.1}, "tail"),
        ({"window_mass": 1.0}, "window_mass"),
    ],
)
def test_invalid_settings_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        pld_fft.compose([(0.01, 1.0, 10)], **kwargs)


@pytest.mark.parametrize(
    "entry", [(0.0, 1.0, 1), (1.5, 1.0, 1), (0.1, 0.0, 1), (0.1, 1.0, -1), (0.1, 1.0, 1.5)]
)
def test_invalid_ledger_entries(entry):
    with pytest.raises(ValueError):
        pld_fft.compose([entry])


def test_many_distinct_sigmas_are_merged_conservatively():
    sig = np.linspace(0.9, 1.0, 1000)
    merged = pld_fft.compose([(0.02, float(s), 1) for s in sig], delta=DELTA)
    assert merged.groups < 120  # bins of relative width 1e-3
    exact = pld_fft.compose([(0.02, float(s), 1) for s in sig], delta=DELTA, sigma_merge=0.0)
    assert exact.groups == 1000
    assert exact.epsilon(DELTA) <= merged.epsilon(DELTA) <= exact.epsilon(DELTA) * 1.003
