"""The privacy accountant: reference values, composition, bucketing, the budget rule,
the domination shortcut and checkpoints.

Reference values come from outside the accountant: the analytic Gaussian mechanism
(scipy.stats.norm), dp_accounting's own PLDAccountant / RdpAccountant fed with DpEvents,
and published numbers (q = 256/60000, sigma = 1.1, 3515 steps, delta = 1e-5). The
default "pld" accountant is an upper bound: never below dp_accounting's PLD at a fine
discretisation and at most 1 % above it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fedsgld.privacy.accountant import BudgetExhausted, PrivacyAccountant, dominates
from fedsgld.privacy.gdp import gdp_epsilon, gdp_mu
from fedsgld.privacy.schedules import StepSchedule, sgld_noise_multiplier

DELTA = 1e-5


# -- independent references ---------------------------------------------------------
def gaussian_epsilon(s: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism (sensitivity 1, noise std s), Balle & Wang 2018."""

    def d(eps: float) -> float:
        return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))

    if d(0.0) <= delta:
        return 0.0
    hi = 1.0
    while d(hi) > delta:
        hi *= 2
    return brentq(lambda e: d(e) - delta, 0.0, hi, xtol=1e-13)


def dp_accounting_epsilon(
    ledger, *, kind: str, discretization: float = 1e-3, delta: float = DELTA
) -> float:
    """Epsilon of a ledger straight from dp_accounting's accountants (no fedsgld code)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    event = dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), int(c)
            )
            for q, s, c in ledger
        ]
    )
    acc = (
        PLDAccountant(value_discretization_interval=discretization)
        if kind == "pld"
        else RdpAccountant()
    )
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def within(value: float, exact: float, rel: float = 0.01) -> bool:
    """value is an upper bound on exact, and at most ``rel`` above it."""
    return exact <= value <= exact * (1 + rel)


# the decaying DP-SGLD schedule used by the budget tests: sigma_t from 1.41 down
SCHEDULE = StepSchedule(0.05, 0.5, 20.0)
Q = 0.02


def sgld_point(t: int) -> tuple[float, float]:
    return Q, sgld_noise_multiplier(SCHEDULE(t), 20.0)


def run_until_exhausted(acc: PrivacyAccountant, point=sgld_point, cap: int = 5000):
    n = 0
    while n < cap:
        try:
            acc.step(*point(n))
        except BudgetExhausted as err:
            return n, err
        n += 1
    raise AssertionError(f"budget not exhausted in {cap} steps")


# -- published reference -------------------------------------------------------------
def test_reference_values_mnist_dpsgd():
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    eps = acc.epsilon([(256 / 60000, 1.1, 3515)])
    assert eps["gdp"] == pytest.approx(1.077, rel=0.01)
    exact = dp_accounting_epsilon([(256 / 60000, 1.1, 3515)], kind="pld", discretization=1e-4)
    assert exact == pytest.approx(1.134, abs=1e-3)
    assert within(eps["pld"], exact)
    # the CLT is optimistic, RDP is loose
    assert eps["gdp"] < eps["pld"] < eps["rdp"]
    # the dp_accounting reference, at its own discretization
    ref = PrivacyAccountant(delta=DELTA, accountant="dp_accounting_pld", pld_discretization=1e-4)
    assert ref.rigorous_epsilon([(256 / 60000, 1.1, 3515)]) == pytest.approx(exact, rel=1e-9)


def test_rdp_reference_from_dp_accounting_notes():
    # (sigma 1.2, q 0.01) x 300 then (1.0, 0.01) x 200, delta 1e-5: RDP 1.48262, PLD(1e-4) 1.11898
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    eps = acc.epsilon([(0.01, 1.2, 300), (0.01, 1.0, 200)])
    assert eps["rdp"] == pytest.approx(1.48262, abs=1e-4)
    assert within(eps["pld"], 1.11898)


# -- exact Gaussian mechanism (q = 1) -------------------------------------------------
@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.0, 5.0])
def test_pld_single_full_batch_step_is_the_gaussian_mechanism(sigma):
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    ref = gaussian_epsilon(sigma, DELTA)
    eps = acc.epsilon([(1.0, sigma, 1)])
    assert ref - 1e-9 <= eps["pld"] <= ref + 5e-3  # pessimistic, within the discretization
    assert eps["rdp"] >= ref - 1e-9  # RDP is a valid, looser bound


def test_composition_of_full_batch_gaussians_is_one_gaussian():
    # T steps of noise s compose to noise s / sqrt(T); a mixed ledger to 1/s^2 = sum 1/s_i^2
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    ref = gaussian_epsilon(3.0 / math.sqrt(9), DELTA)
    assert ref - 1e-9 <= acc.epsilon([(1.0, 3.0, 9)])["pld"] <= ref + 1e-2
    mixed = [(1.0, 1.0, 3), (1.0, 2.0, 4)]  # 3/1 + 4/4 = 4 -> s = 0.5
    ref = gaussian_epsilon(0.5, DELTA)
    assert ref - 1e-9 <= acc.epsilon(mixed)["pld"] <= ref + 1e-2


# -- composition ------------------------------------------------------------------------
def test_heterogeneous_ledger_is_the_composition_of_its_parts():
    ledger = [(0.01, 1.2, 300), (0.01, 1.0, 200), (0.02, 1.5, 100)]
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    eps = acc.epsilon(ledger)
    assert within(eps["pld"], dp_accounting_epsilon(ledger, kind="pld", discretization=1e-4))
    assert eps["rdp"] == pytest.approx(dp_accounting_epsilon(ledger, kind="rdp"), rel=1e-9)
    assert eps["gdp"] > 0
    # order does not matter, and every part costs less than the whole
    again = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0).epsilon(ledger[::-1])
    assert again["pld"] == pytest.approx(eps["pld"], rel=1e-9)
    for part in ledger:
        assert acc.epsilon([part])["pld"] < eps["pld"]


def test_rigorous_epsilon_follows_the_chosen_accountant():
    ledger = [(0.01, 1.0, 50)]
    pld = PrivacyAccountant(delta=DELTA, accountant="pld")
    rdp = PrivacyAccountant(delta=DELTA, accountant="rdp")
    ref = PrivacyAccountant(delta=DELTA, accountant="dp_accounting_pld")
    assert PrivacyAccountant(delta=DELTA).rigorous_name == "pld"  # the default
    assert pld.rigorous_name == "pld" and rdp.rigorous_name == "rdp"
    assert pld.rigorous_epsilon(ledger) == pld.epsilon(ledger)["pld"]
    assert rdp.rigorous_epsilon(ledger) == rdp.epsilon(ledger)["rdp"]
    assert rdp.rigorous_epsilon(ledger) != pld.rigorous_epsilon(ledger)
    # the reference is dp_accounting's PLD itself, and only computed when chosen
    assert set(pld.epsilon(ledger)) == {"gdp", "pld", "rdp"}
    assert set(ref.epsilon(ledger)) == {"gdp", "pld", "rdp", "dp_accounting_pld"}
    assert ref.rigorous_epsilon(ledger) == pytest.approx(
        dp_accounting_epsilon(ledger, kind="pld"), rel=1e-9
    )
    assert pld.rigorous_epsilon(ledger) == pytest.approx(ref.rigorous_epsilon(ledger), rel=0.01)


# -- bucketing --------------------------------------------------------------------------
@pytest.mark.parametrize("r", [0.01, 0.05, 0.3])
def test_bucket_rounds_down_onto_the_grid(r):
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=r)
    rng = np.random.default_rng(0)
    sigmas = list(np.exp(rng.uniform(math.log(0.05), math.log(50.0), 500))) + [
        1.0,
        1.0 + r,
        (1.0 + r) ** -7,
    ]
    for s in sigmas:
        b = acc.bucket(float(s))
        assert b <= s
        assert b * (1.0 + r) > s * (1 - 1e-12)  # at most one grid step below
        k = round(math.log(b) / math.log(1.0 + r))
        assert (1.0 + r) ** k == b  # a grid point
        assert acc.bucket(b) == b  # idempotent
    assert acc.bucket(1.0) == 1.0


def test_bucket_zero_grid_is_exact():
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    assert acc.bucket(1.2345678) == 1.2345678


def test_bucketing_only_increases_epsilon():
    exact = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    coarse = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.05)
    for t in range(30):
        exact.step(*sgld_point(t))
        coarse.step(*sgld_point(t))
    assert len(coarse.ledger) < len(exact.ledger) == 30  # the reason for bucketing
    assert coarse.steps == exact.steps == 30
    e, c = exact.epsilon(), coarse.epsilon()
    for name in ("gdp", "pld", "rdp"):
        assert c[name] >= e[name]
    # ... and by no more than shrinking every sigma by the grid factor
    shrunk = [(q, s / 1.05, n) for q, s, n in exact.ledger]
    assert gdp_mu(coarse.ledger) <= gdp_mu(shrunk)
    assert c["pld"] > e["pld"] * 1.001  # the rounding is visible, not a no-op


# -- the budget rule ----------------------------------------------------------------------
def test_step_by_step_never_exceeds_the_budget():
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05)
    n, err = run_until_exhausted(acc)
    assert n > 20 and acc.steps == n
    assert err.budget == 1.0 and err.epsilon > 1.0
    # the refused step was not recorded
    before = acc.state_dict()
    with pytest.raises(BudgetExhausted):
        acc.step(*sgld_point(n))
    assert acc.state_dict() == before and not acc.check(*sgld_point(n))
    # independent accounting (dp_accounting directly, no certification shortcut): the
    # recorded ledger is within budget, and the halt is at most 1 % early
    assert dp_accounting_epsilon(acc.ledger, kind="pld") <= 1.0
    q, s = sgld_point(n)
    one_more = acc.ledger + [(q, acc.bucket(s), 1)]
    assert within(err.epsilon, dp_accounting_epsilon(one_more, kind="pld"))


def test_halting_on_an_exact_decaying_schedule_never_passes_the_budget():
    # every sigma distinct (no grid); the accountant halts, the ledger stays within budget
    def point(t):
        return 0.05, sgld_noise_multiplier(StepSchedule(0.1, 0.55, 10.0)(t), 10.0)

    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=2.0)
    n, err = run_until_exhausted(acc, point=point)
    assert len(acc.ledger) == n > 10  # one entry per step
    assert acc.rigorous_epsilon() <= 2.0 < err.epsilon
    ref = dp_accounting_epsilon(acc.ledger, kind="pld")
    assert ref <= acc.rigorous_epsilon() <= 2.0


def test_max_steps_agrees_with_stepping_and_certifies_the_plan(monkeypatch):
    ref = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05)
    n, _ = run_until_exhausted(ref)
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05)
    assert acc.max_steps(sgld_point, limit=10_000) == n
    assert acc.steps == 0  # planning records nothing
    # the plan is certified: stepping along it computes no epsilon at all
    real_pld, real_rdp = acc.gaussian._fft_epsilon, acc.gaussian._rdp_epsilon

    def forbidden(*args, **kwargs):
        raise AssertionError("epsilon recomputed despite a certified plan")

    monkeypatch.setattr(acc.gaussian, "_fft_epsilon", forbidden)
    monkeypatch.setattr(acc.gaussian, "_rdp_epsilon", forbidden)
    for t in range(n):
        acc.step(*sgld_point(t))
    monkeypatch.setattr(acc.gaussian, "_fft_epsilon", real_pld)
    monkeypatch.setattr(acc.gaussian, "_rdp_epsilon", real_rdp)
    with pytest.raises(BudgetExhausted):
        acc.step(*sgld_point(n))
    assert acc.ledger == ref.ledger


def test_max_steps_limit_and_current_ledger():
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05)
    total = acc.max_steps(sgld_point, limit=10_000)
    assert acc.max_steps(sgld_point, limit=10) == 10
    assert acc.max_steps(sgld_point, limit=0) == 0
    for t in range(20):
        acc.step(*sgld_point(t))
    # counted from the current ledger: the remaining steps along the same schedule
    assert acc.max_steps(lambda t: sgld_point(20 + t), limit=10_000) == total - 20
    with pytest.raises(ValueError, match="epsilon_budget"):
        PrivacyAccountant(delta=DELTA).max_steps(sgld_point, limit=10)
    with pytest.raises(ValueError, match="limit"):
        acc.max_steps(sgld_point, limit=-1)


def test_max_steps_constant_sigma_matches_dp_accounting():
    q, sigma, budget = 0.05, 1.5, 2.0
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=budget, sigma_rel_grid=0.0)
    t = acc.max_steps(lambda _: (q, sigma), limit=100_000)
    assert 100 < t < 200
    assert (
        acc.rigorous_epsilon([(q, sigma, t)]) <= budget < acc.rigorous_epsilon([(q, sigma, t + 1)])
    )
    # dp_accounting: t steps fit, and not many more would (the bound is within 1 %)
    assert dp_accounting_epsilon([(q, sigma, t)], kind="pld", discretization=1e-4) <= budget
    assert dp_accounting_epsilon([(q, sigma, int(t * 1.03) + 1)], kind="pld") > budget


def test_max_steps_exact_decaying_schedule_matches_stepping():
    def point(t):
        return 0.01, sgld_noise_multiplier(StepSchedule(0.1, 0.55, 100.0)(t), 10.0)

    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=3.0)
    t = acc.max_steps(point, limit=100_000)
    assert 300 < t < 2000
    ledger = acc.ledger_after(point, t)
    assert len(ledger) == t  # every sigma distinct
    assert (
        acc.rigorous_epsilon(ledger) <= 3.0 < acc.rigorous_epsilon(acc.ledger_after(point, t + 1))
    )


def test_gdp_underestimates_on_a_decaying_schedule():
    # the paper's regime: sigma from 1.5 down towards 0.8, q = 0.01, budget 1
    sched = StepSchedule(0.05, 0.5, 88.0)

    def point(t):
        return 0.01, sgld_noise_multiplier(sched(t), 22.5)

    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0)
    t = acc.max_steps(point, limit=1000)
    assert 300 < t < 500
    eps = acc.epsilon(acc.ledger_after(point, t))
    assert eps["pld"] <= 1.0
    assert 0.1 < 1 - eps["gdp"] / eps["pld"] < 0.3  # the CLT is ~20 % optimistic here


# -- domination -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "certified, candidate, expected",
    [
        ([(0.1, 1.0, 2)], [(0.1, 1.0, 1), (0.1, 2.0, 1)], True),
        ([(0.1, 1.0, 2)], [(0.1, 1.0, 3)], False),  # more steps
        ([(0.1, 1.0, 2)], [(0.1, 0.9, 1)], False),  # less noise
        ([(0.1, 1.0, 2)], [(0.2, 1.0, 1)], False),  # another q
        ([(0.1, 1.0, 1), (0.1, 3.0, 5)], [(0.1, 1.5, 2)], False),  # Hall fails at s = 1.5
        ([(0.1, 1.0, 1), (0.1, 3.0, 5)], [(0.1, 1.5, 1), (0.1, 3.0, 5)], True),
        ([(0.1, 2.0, 3), (0.2, 1.0, 1)], [(0.2, 1.5, 1), (0.1, 2.0, 2)], True),
        ([(0.1, 2.0, 3)], [], True),
    ],
)
def test_dominates(certified, candidate, expected):
    assert dominates(tuple(certified), tuple(candidate)) is expected


def test_domination_implies_smaller_epsilon_random_ledgers():
    rng = np.random.default_rng(1)
    grid = [0.8, 1.0, 1.25, 1.6]
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    hits = 0
    for _ in range(25):
        cert = [(0.02, float(s), int(rng.integers(1, 40))) for s in rng.choice(grid, 3)]
        cand = [(0.02, float(s), int(rng.integers(1, 40))) for s in rng.choice(grid, 3)]
        if dominates(tuple(cert), tuple(cand)):
            hits += 1
            e_cert, e_cand = acc.epsilon(cert), acc.epsilon(cand)
            # (the FFT grid adapts to the ledger: equal up to its ~0.2 % accuracy)
            assert e_cand["pld"] <= e_cert["pld"] * 1.003
            assert e_cand["rdp"] <= e_cert["rdp"] + 1e-12
    assert hits >= 3


def test_shortcut_answers_equal_full_recomputation():
    budget = 1.0
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=budget, sigma_rel_grid=0.05)
    total = acc.max_steps(sgld_point, limit=10_000)
    independent = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.05)  # no budget, no certificates
    calls = {"n": 0}
    real = acc.gaussian._fft_epsilon

    def counting(key):
        calls["n"] += 1
        return real(key)

    acc.gaussian._fft_epsilon = counting
    answers = []
    for t in (0, total // 2, total - 1):
        while acc.steps < t:
            acc.step(*sgld_point(acc.steps))
        q, s = sgld_point(t)
        for factor in (0.5, 0.97, 1.0, 1.5):
            got = acc.check(q, s * factor)
            want = (
                independent.rigorous_epsilon(acc.ledger + [(q, acc.bucket(s * factor), 1)])
                <= budget
            )
            answers.append(got)
            assert got == want, (t, factor)
    assert True in answers and False in answers
    assert calls["n"] > 0  # some candidates needed recomputation (not all dominated)


# -- ledger, checkpoints, settings -------------------------------------------------------------
def test_ledger_is_run_length_encoded_and_no_budget_always_records():
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.0)
    assert acc.epsilon() == {"gdp": 0.0, "pld": 0.0, "rdp": 0.0}
    assert acc.steps == 0 and acc.ledger == []
    for q, s in [(0.01, 1.0)] * 3 + [(0.01, 2.0), (0.02, 2.0)]:
        acc.step(q, s)
    assert acc.ledger == [(0.01, 1.0, 3), (0.01, 2.0, 1), (0.02, 2.0, 1)]
    assert acc.steps == 5
    for _ in range(5):
        assert acc.check(1.0, 0.1)
        acc.step(1.0, 0.1)  # huge epsilon, but there is no budget
    assert acc.steps == 10 and acc.rigorous_epsilon() > 50


@pytest.mark.parametrize(
    "q, sigma", [(0.0, 1.0), (1.5, 1.0), (0.1, 0.0), (0.1, -1.0), (0.1, math.nan), (0.1, math.inf)]
)
def test_step_rejects_invalid_values(q, sigma):
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0)
    with pytest.raises(ValueError):
        acc.step(q, sigma)
    assert acc.steps == 0


def test_state_dict_round_trip():
    acc = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05, accountant="rdp")
    for t in range(15):
        acc.step(*sgld_point(t))
    state = json.loads(json.dumps(acc.state_dict()))
    assert state["version"] == 1 and state["budget"] == 1.0 and state["accountant"] == "rdp"
    restored = PrivacyAccountant.from_state_dict(state)
    assert restored.ledger == acc.ledger and restored.steps == 15
    assert restored.epsilon() == acc.epsilon()
    assert (restored.delta, restored.epsilon_budget, restored.rigorous_name) == (DELTA, 1.0, "rdp")
    assert (restored.sigma_rel_grid, restored.pld_discretization) == (0.05, 1e-3)
    # load into a fresh accountant with the same settings; both then halt at the same step
    same = PrivacyAccountant(delta=DELTA, epsilon_budget=1.0, sigma_rel_grid=0.05, accountant="rdp")
    same.load_state_dict(state)
    a, _ = run_until_exhausted(acc, point=lambda t: sgld_point(15 + t))
    b, _ = run_until_exhausted(same, point=lambda t: sgld_point(15 + t))
    assert a == b and same.ledger == acc.ledger


@pytest.mark.parametrize(
    "change, setting",
    [
        ({"epsilon_budget": 2.0}, "epsilon_budget"),
        ({"delta": 1e-6}, "delta"),
        ({"accountant": "pld"}, "accountant"),
        ({"sigma_rel_grid": 0.01}, "sigma_rel_grid"),
        ({"pld_discretization": 1e-4}, "pld_discretization"),
    ],
)
def test_load_state_dict_refuses_other_settings(change, setting):
    base = {"delta": DELTA, "epsilon_budget": 1.0, "sigma_rel_grid": 0.05, "accountant": "rdp"}
    acc = PrivacyAccountant(**base)
    acc.step(0.01, 1.0)
    other = PrivacyAccountant(**{**base, **change})
    with pytest.raises(ValueError, match=setting):
        other.load_state_dict(acc.state_dict())
    assert other.steps == 0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(version=99),
        lambda d: d.update(ledger=[[0.01, 1.0]]),
        lambda d: d.update(ledger=[[0.01, -1.0, 3]]),
        lambda d: d.update(ledger=[[2.0, 1.0, 3]]),
        lambda d: d.update(ledger=[[0.01, 1.0, 2.5]]),
        lambda d: d.pop("delta"),
    ],
)
def test_load_state_dict_rejects_bad_states(mutate):
    acc = PrivacyAccountant(delta=DELTA)
    state = acc.state_dict()
    mutate(state)
    with pytest.raises(ValueError):
        PrivacyAccountant(delta=DELTA).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, setting, valid",
    [
        ({"delta": 0.0}, "delta", "(0, 1)"),
        ({"delta": 1.0}, "delta", "(0, 1)"),
        ({"delta": DELTA, "epsilon_budget": 0.0}, "epsilon_budget", "> 0"),
        ({"delta": DELTA, "epsilon_budget": -1.0}, "epsilon_budget", "> 0"),
        ({"delta": DELTA, "accountant": "gdp"}, "accountant", "pld"),
        ({"delta": DELTA, "sigma_rel_grid": -0.01}, "sigma_rel_grid", "[0, 0.5)"),
        ({"delta": DELTA, "sigma_rel_grid": 0.5}, "sigma_rel_grid", "[0, 0.5)"),
        ({"delta": DELTA, "pld_discretization": 0.0}, "pld_discretization", "(0, 0.1]"),
        ({"delta": DELTA, "pld_discretization": 0.2}, "pld_discretization", "(0, 0.1]"),
        ({"delta": "1e-5"}, "delta", "real number"),
    ],
)
def test_invalid_settings_name_the_setting_and_range(kwargs, setting, valid):
    with pytest.raises(ValueError) as info:
        PrivacyAccountant(**kwargs)
    assert setting in str(info.value) and valid in str(info.value)


def test_settings_are_keyword_only():
    with pytest.raises(TypeError):
        PrivacyAccountant(DELTA)  # type: ignore[misc]


def test_rdp_at_small_sigma_is_finite_and_looser_than_pld():
    acc = PrivacyAccountant(delta=1e-4, accountant="rdp")
    for _ in range(50):
        acc.step(0.05, 0.8)
    eps = acc.epsilon()
    assert math.isfinite(eps["rdp"]) and eps["rdp"] >= eps["pld"] > 0
    assert eps["rdp"] == pytest.approx(
        dp_accounting_epsilon([(0.05, 0.8, 50)], kind="rdp", delta=1e-4), rel=1e-9
    )


def test_gdp_is_reported_on_the_exact_sigmas():
    """The paper's GDP is reported for comparison: on the sigmas as stepped, not rounded."""
    acc = PrivacyAccountant(delta=DELTA, sigma_rel_grid=0.05)
    exact = []
    for t in range(40):
        q, s = sgld_point(t)
        acc.step(q, s)
        exact.append((q, s, 1))
    want = gdp_epsilon(gdp_mu(exact), DELTA)
    assert acc.epsilon()["gdp"] == pytest.approx(want, rel=1e-12)
    assert acc.mu() == pytest.approx(gdp_mu(exact), rel=1e-12)
    assert gdp_epsilon(gdp_mu(acc.ledger), DELTA) > want * 1.01  # the rounded ledger's is larger
    # ... and it survives a checkpoint
    restored = PrivacyAccountant.from_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.epsilon()["gdp"] == pytest.approx(want, rel=1e-12)
    # an older state without it falls back to the ledger's sigmas
    old = acc.state_dict()
    del old["gdp_mu2"]
    assert PrivacyAccountant.from_state_dict(old).mu() == pytest.approx(gdp_mu(acc.ledger))


def test_epsilon_delta_epsilon_round_trip():
    def point(t):
        return 0.01, sgld_noise_multiplier(StepSchedule(0.1, 0.55, 100.0)(t), 10.0)

    acc = PrivacyAccountant(delta=DELTA)
    for t in range(300):
        acc.step(*point(t))
    eps = acc.rigorous_epsilon()
    assert acc.delta_at(eps) <= DELTA * (1 + 1e-9)
    assert acc.delta_at(eps) == pytest.approx(DELTA, rel=1e-3)
    assert acc.delta_at(0.9 * eps) > DELTA
    # epsilon at the delta reported for 1.2 eps comes back to 1.2 eps
    d = acc.delta_at(1.2 * eps)
    other = PrivacyAccountant(delta=d)
    other.load_state_dict({**acc.state_dict(), "delta": d})
    assert other.rigorous_epsilon() == pytest.approx(1.2 * eps, rel=1e-4)
    with pytest.raises(ValueError, match="epsilon"):
        acc.delta_at(-1.0)


def test_config_accepts_every_accountant():
    from fedsgld.config import ACCOUNTANTS as CONFIG_ACCOUNTANTS
    from fedsgld.privacy.accountant import ACCOUNTANTS

    assert set(CONFIG_ACCOUNTANTS) == set(ACCOUNTANTS)
    for name in ACCOUNTANTS:
        assert PrivacyAccountant(delta=DELTA, accountant=name).rigorous_name == name
