"""The f-DP test against the accountant's own trade-off curve (its PLD): the curve against
the Gaussian mechanism's exact one, its validity under the null, and the correction for
reporting the larger of two bounds."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from fedsgld.privacy import audit_bounds as ab
from fedsgld.privacy import audit_tradeoff as at
from fedsgld.privacy import pld_fft
from fedsgld.studies.audit_scores import likelihood_ratio, plan_guess, simulated_readings

DELTA = 1e-5


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_the_curve_of_one_gaussian_step_is_the_gaussian_curve_from_below(sigma):
    """One unsubsampled step is 1/sigma-GDP: h(x) = Phi(Phi^-1(x) - 1/sigma). The PLD's
    curve is pessimistic (never above it) and within 1e-5 of it."""
    h = at.pld_inverse_blow_up(pld_fft.compose([(1.0, sigma, 1)], delta=DELTA))
    n = NormalDist()
    for x in (1e-3, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
        exact = n.cdf(n.inv_cdf(x) - 1.0 / sigma)
        assert exact - 1e-5 <= h(x) <= exact + 1e-12


def test_a_subsampled_curve_is_weaker_than_its_clt_and_monotone():
    """300 steps at q 0.064, sigma 1.455 (the demo's DP-SGD): the CLT's mu-GDP curve is
    below the accountant's epsilon (the CLT under-estimates); h increases with x and with
    the noise."""
    curves = at.LedgerCurves([(0.064, 1.455, 300)], DELTA)
    assert curves.epsilon(0) == pytest.approx(3.99, abs=0.02)
    h, h_less_noise = curves.inverse_blow_up(0), curves.inverse_blow_up(32)  # s = 1, 2
    xs = np.linspace(0.001, 0.999, 50)
    assert np.all(np.diff([h(x) for x in xs]) >= 0)
    assert all(h_less_noise(x) <= h(x) for x in xs)
    assert curves.epsilon(32) > 3 * curves.epsilon(0)


def _null_play(m, seed, *, q=0.064, sigma=1.455, steps=40):
    """The idealised subsampled game of the claimed mechanism itself (the null)."""
    variances = [sigma**2] * steps
    inc, y = simulated_readings(m, q, variances, seed=seed)
    return inc, likelihood_ratio(y, q, variances)


def test_the_accountant_curve_is_rejected_rarely_when_the_mechanism_is_what_it_claims():
    """Under the null (40 steps of the claimed mechanism, 2,000 canaries, the best guess of
    each play tested at 5 %, no correction: the most the test could be fooled) the
    accountant's curve is rejected in at most 4 of 40 plays; a mechanism with half the
    noise (the same plays at sigma / 2) is rejected in most of them."""
    curves = at.LedgerCurves([(0.064, 1.455, 40)], DELTA)
    h = curves.inverse_blow_up(0)
    rejected = broken = 0
    for seed in range(40):
        for sigma, count in ((1.455, "null"), (1.455 / 2, "broken")):
            inc, s = _null_play(2000, seed, sigma=sigma)
            r, v = ab.count_correct(s, inc, 40, 0)
            if ab.fdp_rejects(2000, r, v, h, 0.05):
                if count == "null":
                    rejected += 1
                else:
                    broken += 1
    assert rejected <= 4 and broken >= 30, (rejected, broken)


def test_audit_run_splits_the_significance_between_the_two_bounds():
    """The headline is the larger of one-run and f-DP: each is tested at half of 5 %, and
    inside each the planned guess takes 80 % of it, the grid the rest."""
    inc, s = _null_play(2000, 0, sigma=0.5)
    rows = np.stack([s, -s])
    b = at.audit_run(rows, inc, delta=DELTA, ledger=[(0.064, 1.455, 40)], planned=[(0, 40, 0)])
    grid = 2 * len(ab.guess_pairs(2000))
    assert b["fdp"].tries == b["one_run"].tries == grid + 1
    if (b["fdp"].row, b["fdp"].k_in, b["fdp"].k_out) == (0, 40, 0):
        assert b["fdp"].significance == pytest.approx(0.025 * 0.8)
    else:
        assert b["fdp"].significance == pytest.approx(0.025 * 0.2 / grid)
    assert b["fdp"].epsilon > b["fdp"].scale > 1.0  # sigma / 2.9: flagged
    assert b["fdp"].epsilon > at.LedgerCurves([(0.064, 1.455, 40)], DELTA).epsilon(0)
    no_ledger = at.audit_run(rows, inc, delta=DELTA, planned=[(0, 40, 0)])
    assert no_ledger["fdp"].epsilon == no_ledger["gdp"].epsilon


def test_the_planned_guess_depends_only_on_public_settings():
    a = plan_guess(2000, 0.064, [1.455**2] * 40, delta=DELTA, significance=0.025)
    assert a == plan_guess(2000, 0.064, [1.455**2] * 40, delta=DELTA, significance=0.025)
    assert a in ab.guess_pairs(2000)


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="ledger must hold"):
        at.LedgerCurves([], DELTA)
    with pytest.raises(ValueError, match="alpha must be in"):
        at.scaled_ledger_epsilon(
            10, 2, 2, at.LedgerCurves([(1.0, 1.0, 1)], DELTA), alpha=0.0, rejects=ab.fdp_rejects
        )
    with pytest.raises(ValueError, match="planned_share"):
        at.audit_run(np.zeros((1, 4)), np.array([1, 0, 1, 0], bool), delta=DELTA,
                     planned=[(0, 1, 0)], planned_share=1.0)  # fmt: skip


def test_audit_run_under_the_null_reports_nothing_in_most_seeds():
    """Scores independent of who is IN (two rows, a planned guess and the grid): the
    headline's two bounds are both 0 in at least 36 of 40 seeds."""
    m, hits = 400, 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        inc, rows = rng.random(m) < 0.5, rng.standard_normal((2, m))
        got = at.audit_run(
            rows, inc, delta=DELTA, ledger=[(0.064, 1.455, 40)], planned=[(0, 20, 0)]
        )
        hits += got["one_run"].epsilon > 0 or got["fdp"].epsilon > 0
    assert hits <= 4, hits


def test_a_slack_lowers_the_curve_and_adds_to_epsilon_as_the_accountant_does():
    """A ledger that dominates the run only up to a slack (a secure sum's): the curve tested
    is e^{-down} h(e^{-up} x), never above the slack-free one, and each scale's epsilon is
    the accountant's (:func:`fedsgld.privacy.ddg_dominance.dominated_epsilon`)."""
    from fedsgld.privacy.ddg_dominance import dominated_epsilon

    ledger = [(0.064, 1.455, 40)]
    plain = at.LedgerCurves(ledger, DELTA)
    up, down = 0.02, 0.03
    slack = at.LedgerCurves(ledger, DELTA, slack_up=up, slack_down=down)
    h0, h1 = plain.inverse_blow_up(0), slack.inverse_blow_up(0)
    for x in (0.01, 0.1, 0.5, 0.9, 1.0):
        assert h1(x) == pytest.approx(np.exp(-down) * h0(np.exp(-up) * x), abs=1e-12)
        assert h1(x) < h0(x)
    for k in (0, 32):
        scaled = [(q, s / at.LedgerCurves.scale(k), c) for q, s, c in ledger]
        ref = dominated_epsilon(scaled, DELTA, slack_up=up, slack_down=down)
        assert slack.epsilon(k) == pytest.approx(ref, rel=1e-9)
    assert plain.epsilon(0) == pytest.approx(dominated_epsilon(ledger, DELTA), rel=1e-9)
    with pytest.raises(ValueError, match="slack_up and slack_down"):
        at.LedgerCurves(ledger, DELTA, slack_up=-1e-3)


def test_a_slack_makes_the_test_harder_to_fail():
    """The same guesses against the slackened curve never certify more."""
    inc, s = _null_play(2000, 0, sigma=0.5)
    rows = np.stack([s, -s])
    kw = {"delta": DELTA, "ledger": [(0.064, 1.455, 40)], "planned": [(0, 40, 0)]}
    tight = at.audit_run(rows, inc, **kw)["fdp"]
    loose = at.audit_run(rows, inc, slack=(0.05, 0.05), **kw)["fdp"]
    assert loose.scale <= tight.scale and loose.scale > 1.0
