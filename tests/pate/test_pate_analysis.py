"""PATE privacy analysis against hand computations and published closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsgld.pate import gnmax_epsilon, lnmax_epsilon
from fedsgld.privacy.pate_analysis import lnmax_log_moments, vote_counts

# ----------------------------------------------------------------------------- LNMax


def _alpha_theorem2(q: float, gamma: float, lam: int) -> float:
    """Theorem 2 of Papernot et al. 2017 written out with plain floats."""
    return math.log(
        (1 - q) * ((1 - q) / (1 - math.exp(2 * gamma) * q)) ** lam + q * math.exp(2 * gamma * lam)
    )


def test_lnmax_tiny_matrix_by_hand():
    # 3 teachers, 2 answered queries, 2 classes. Query 0 votes (3, 0); query 1 votes (1, 2).
    preds = np.array([[0, 1], [0, 1], [0, 0]])
    gamma, delta, moments = 1.0, 0.1, 3
    # Data-independent per query: min(2 g^2 l (l + 1), 2 g l) = 2 l here (pure DP, g = 1).
    # Query 0: Delta = 3, q = (2 + 3) / (4 e^3) = 0.0622 < 1 / (e^2 + 1) = 0.1192 -> Theorem 2.
    q0 = 5 / (4 * math.exp(3))
    assert q0 < (math.exp(2) - 1) / (math.exp(4) - 1)
    # Query 1: Delta = 1, q = 3 / (4 e) = 0.276: too large, data-independent.
    dep = [min(2 * lam, _alpha_theorem2(q0, gamma, lam)) + 2 * lam for lam in (1, 2, 3)]
    ind = [2 * 2 * lam for lam in (1, 2, 3)]  # 4, 8, 12
    eps_dep = min((a + math.log(10)) / lam for a, lam in zip(dep, (1, 2, 3)))
    eps_ind = min((a + math.log(10)) / lam for a, lam in zip(ind, (1, 2, 3)))
    assert eps_ind == pytest.approx(4 + math.log(10) / 3)  # lambda = 3 wins: 4.7675
    out = lnmax_epsilon(preds, num_classes=2, gamma=gamma, delta=delta, moments=moments)
    assert set(out) == {"data_dependent", "data_independent"}
    assert out["data_independent"] == pytest.approx(eps_ind, rel=1e-12)
    assert out["data_dependent"] == pytest.approx(eps_dep, rel=1e-12)
    assert out["data_dependent"] < out["data_independent"]


def test_lnmax_data_independent_closed_form():
    # 100 teachers, gamma 0.2, 9000 queries, delta 1e-5: min_l (9000 * 0.08 l (l+1) + log 1e5) / l
    # is reached at l = 1: 1440 + 11.5129 = 1451.5129.
    preds = np.zeros((100, 9000), dtype=np.int64)
    out = lnmax_epsilon(preds, num_classes=10, gamma=0.2, delta=1e-5, moments=8)
    assert out["data_independent"] == pytest.approx(1440 + math.log(1e5), rel=1e-12)
    rng = np.random.default_rng(1)
    for _ in range(5):
        t, gamma, delta = int(rng.integers(1, 50)), rng.uniform(0.05, 2), 10 ** -rng.uniform(2, 8)
        moments = int(rng.integers(1, 20))
        ref = min(
            (t * min(2 * gamma**2 * lam * (lam + 1), 2 * gamma * lam) + math.log(1 / delta)) / lam
            for lam in range(1, moments + 1)
        )
        got = lnmax_epsilon(
            rng.integers(0, 3, (4, t)), num_classes=3, gamma=gamma, delta=delta, moments=moments
        )
        assert got["data_independent"] == pytest.approx(ref, rel=1e-12)
        assert got["data_dependent"] <= got["data_independent"] * (1 + 1e-12)


def _reference_2017(counts: np.ndarray, gamma: float, delta: float, moments: int, cap=True):
    """The moments accountant of Papernot et al. 2017 as their reference analysis computes
    it, with plain floats: per query the log moment is the smallest of the data-independent
    bound 0.5 eps^2 l (l + 1), Theorem 2's data-dependent bound (when Theorem 3's q allows
    it) and the pure-DP bound eps l, with eps = 2 gamma the mechanism's pure-DP epsilon."""
    eps0 = 2 * gamma
    lams = range(1, moments + 1)
    dep = dict.fromkeys(lams, 0.0)
    ind = dict.fromkeys(lams, 0.0)
    for row in counts:
        top = max(range(len(row)), key=lambda j: (row[j], -j))
        q = sum(
            (2 + gamma * (row[top] - row[j])) / (4 * math.exp(gamma * (row[top] - row[j])))
            for j in range(len(row))
            if j != top
        )
        q = min(q, 1.0)
        for lam in lams:
            data_independent = 0.5 * eps0**2 * lam * (lam + 1)
            if cap:
                data_independent = min(data_independent, eps0 * lam)
            ind[lam] += data_independent
            if q < (math.exp(eps0) - 1) / (math.exp(2 * eps0) - 1):
                theorem2 = math.log(
                    (1 - q) * ((1 - q) / (1 - math.exp(eps0) * q)) ** lam + q * math.exp(eps0 * lam)
                )
                dep[lam] += min(data_independent, theorem2)
            else:
                dep[lam] += data_independent
    eps_dep = min((dep[lam] + math.log(1 / delta)) / lam for lam in lams)
    eps_ind = min((ind[lam] + math.log(1 / delta)) / lam for lam in lams)
    return eps_dep, eps_ind


def test_lnmax_caps_each_query_by_the_pure_dp_bound():
    """100 teachers, 20 queries, gamma 0.2, delta 1e-5, lambda = 1..8: without the cap
    2 gamma lambda the epsilons come out above the 2017 analysis (data-independent 10.24
    instead of 9.44, data-dependent ~13 % higher on these votes)."""
    rng = np.random.default_rng(3)
    preds = np.empty((100, 20), dtype=np.int64)
    for j in range(20):  # contested queries: 20 % .. 60 % of the teachers agree on a label
        label, agree = rng.integers(0, 10), rng.uniform(0.2, 0.6)
        preds[:, j] = np.where(rng.random(100) < agree, label, rng.integers(0, 10, 100))
    counts = vote_counts(preds, num_classes=10)
    want_dep, want_ind = _reference_2017(counts, gamma=0.2, delta=1e-5, moments=8)
    got = lnmax_epsilon(preds, num_classes=10, gamma=0.2, delta=1e-5, moments=8)
    assert got["data_independent"] == pytest.approx(want_ind, rel=1e-12)
    assert got["data_dependent"] == pytest.approx(want_dep, rel=1e-12)
    assert want_ind == pytest.approx((20 * 0.4 * 8 + math.log(1e5)) / 8, rel=1e-12)  # 9.439
    # the uncapped bound 0.08 l (l + 1) per query would give 10.24 at lambda = 3
    uncapped = min((20 * 0.08 * lam * (lam + 1) + math.log(1e5)) / lam for lam in range(1, 9))
    assert uncapped == pytest.approx(10.2376, abs=1e-4)
    assert got["data_independent"] < uncapped * 0.93
    uncapped_dep, _ = _reference_2017(counts, gamma=0.2, delta=1e-5, moments=8, cap=False)
    assert got["data_dependent"] < uncapped_dep * 0.9
    # the per-query log moments are capped too
    for row in counts:
        alpha = lnmax_log_moments(row, gamma=0.2, moments=8)
        assert np.all(alpha <= 0.4 * np.arange(1, 9) + 1e-12)


def test_lnmax_unanimous_far_below_split():
    rng = np.random.default_rng(0)
    unanimous = np.tile(rng.integers(0, 10, 500), (100, 1))
    split = rng.integers(0, 10, (100, 500))
    u = lnmax_epsilon(unanimous, num_classes=10, gamma=0.2, delta=1e-5)
    s = lnmax_epsilon(split, num_classes=10, gamma=0.2, delta=1e-5)
    assert u["data_independent"] == pytest.approx(s["data_independent"])
    assert s["data_dependent"] == pytest.approx(s["data_independent"], rel=1e-9)
    assert u["data_dependent"] < s["data_dependent"] / 20


def test_lnmax_iterates_over_query_columns():
    # 5 queries, 10 classes: one split column among unanimous ones. The epsilon must be the
    # composition over the 5 columns, whatever labels they carry and in any column order.
    preds = np.full((50, 5), 7)
    preds[:, 2] = np.arange(50) % 10
    counts = vote_counts(preds, num_classes=10)
    assert counts.shape == (5, 10) and counts[0, 7] == 50 and counts[2].max() == 5
    total = sum(lnmax_log_moments(c, gamma=0.5, moments=8) for c in counts)
    lam = np.arange(1, 9)
    ref = float(np.min((total + math.log(1e5)) / lam))
    out = lnmax_epsilon(preds, num_classes=10, gamma=0.5, delta=1e-5)
    assert out["data_dependent"] == pytest.approx(ref)
    perm = lnmax_epsilon(preds[:, [4, 2, 0, 1, 3]], num_classes=10, gamma=0.5, delta=1e-5)
    assert perm == pytest.approx(out)
    # The split column costs ~ the data-independent per-query amount; the rest ~ nothing.
    alone = lnmax_epsilon(preds[:, [2]], num_classes=10, gamma=0.5, delta=1e-5)
    assert out["data_dependent"] == pytest.approx(alone["data_dependent"], rel=0.05)


# ----------------------------------------------------------------------------- GNMax


def _smooth_bound_by_hand(q: float, sigma: float, lam: float) -> float:
    """Theorem 6 of Papernot et al. 2018 with mu_2 = sigma sqrt(log 1/q), plain floats."""
    mu2 = sigma * math.sqrt(math.log(1 / q))
    mu1 = mu2 + 1
    e1, e2 = mu1 / sigma**2, mu2 / sigma**2
    assert mu2 > 1 and lam < mu1 and q * math.exp(e2) < 1
    assert q <= math.exp((mu2 - 1) * e2) / (mu1 / (mu1 - 1) * mu2 / (mu2 - 1)) ** mu2
    a = (1 - q) / (1 - (q * math.exp(e2)) ** ((mu2 - 1) / mu2))
    b = math.exp(e1) / q ** (1 / (mu1 - 1))
    return math.log((1 - q) * a ** (lam - 1) + q * b ** (lam - 1)) / (lam - 1)


def test_gnmax_tiny_matrix_by_hand():
    # 20 unanimous teachers, 1 query, 2 classes, sigma 2: q = 1/2 erfc(20 / 4) = 7.7e-12.
    preds = np.zeros((20, 1), dtype=np.int64)
    sigma, delta = 2.0, 1e-3
    q = 0.5 * math.erfc(20 / (2 * sigma))
    orders = [2.0, 5.0, 50.0]  # mu_1 = 11.1: order 50 falls back to lambda / sigma^2 = 12.5
    rdp = [min(lam / sigma**2, _smooth_bound_by_hand(q, sigma, lam)) for lam in orders[:2]]
    rdp.append(orders[2] / sigma**2)
    ref_dep = min(r + math.log(1 / delta) / (lam - 1) for r, lam in zip(rdp, orders))
    ref_ind = min(lam / sigma**2 + math.log(1 / delta) / (lam - 1) for lam in orders)
    out = gnmax_epsilon(preds, num_classes=2, sigma=sigma, delta=delta, orders=orders)
    assert out["data_independent"] == pytest.approx(ref_ind, rel=1e-12)
    assert out["data_dependent"] == pytest.approx(ref_dep, rel=1e-9)
    assert out["data_dependent"] < out["data_independent"]
    assert rdp[1] < 0.01 * orders[1] / sigma**2  # a unanimous query costs ~ nothing


def test_gnmax_data_independent_closed_form():
    # Gaussian RDP T lambda / sigma^2: over a continuum of orders the optimum is
    # eps = T / sigma^2 + 2 sqrt(T log(1/delta)) / sigma (Mironov 2017).
    for t, sigma, delta in [(2000, 40.0, 1e-5), (300, 10.0, 1e-6), (5, 3.0, 1e-3)]:
        preds = np.zeros((5, t), dtype=np.int64)
        ref = t / sigma**2 + 2 * math.sqrt(t * math.log(1 / delta)) / sigma
        orders = np.linspace(1.001, 400, 400_000)
        got = gnmax_epsilon(preds, num_classes=3, sigma=sigma, delta=delta, orders=orders)
        assert got["data_independent"] >= ref * (1 - 1e-12)
        assert got["data_independent"] == pytest.approx(ref, rel=1e-6)


def test_gnmax_unanimous_far_below_split():
    rng = np.random.default_rng(0)
    unanimous = np.tile(rng.integers(0, 10, 300), (100, 1))
    split = rng.integers(0, 10, (100, 300))
    u = gnmax_epsilon(unanimous, num_classes=10, sigma=10.0, delta=1e-5)
    s = gnmax_epsilon(split, num_classes=10, sigma=10.0, delta=1e-5)
    assert s["data_dependent"] == pytest.approx(s["data_independent"], rel=1e-9)
    assert u["data_dependent"] < s["data_dependent"] / 10


def test_confident_gnmax_threshold_composes():
    rng = np.random.default_rng(0)
    n = 200
    preds = np.tile(rng.integers(0, 10, n), (100, 1))
    preds[:, : n // 2] = rng.integers(0, 10, (100, n // 2))  # half the queries split
    answered = np.zeros(n, dtype=bool)
    answered[n // 2 :] = True  # the unanimous ones passed the check
    kw = dict(num_classes=10, sigma=10.0, delta=1e-5)
    conf = gnmax_epsilon(preds, threshold=60.0, sigma1=8.0, answered=answered, **kw)
    plain = gnmax_epsilon(preds[:, answered], **kw)
    # Data-independent: every posed query pays lambda/(2 sigma1^2) + lambda/sigma^2.
    o = np.linspace(1.01, 300, 100_000)
    ref = np.min(n * (o / 128 + o / 100) + math.log(1e5) / (o - 1))
    conf_fine = gnmax_epsilon(preds, threshold=60.0, sigma1=8.0, answered=answered, orders=o, **kw)
    assert conf_fine["data_independent"] == pytest.approx(ref, rel=1e-9)
    # The threshold check adds a cost on top of GNMax on the answered queries.
    assert conf["data_dependent"] > plain["data_dependent"]
    assert conf["data_dependent"] < conf["data_independent"] / 3
    # A threshold far above every count: unanswered, and the check costs almost nothing.
    far = gnmax_epsilon(preds, threshold=1000.0, sigma1=8.0, answered=np.zeros(n, bool), **kw)
    assert far["data_dependent"] < 0.05 * far["data_independent"]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("fn", ["lnmax", "gnmax"])
def test_bad_inputs_raise_naming_the_setting(fn):
    good = np.array([[0, 1], [1, 1]])

    def call(preds=good, **kw):
        base = dict(num_classes=2, delta=1e-5)
        base.update({"gamma": 0.2} if fn == "lnmax" else {"sigma": 2.0})
        base.update(kw)
        return (lnmax_epsilon if fn == "lnmax" else gnmax_epsilon)(preds, **base)

    with pytest.raises(ValueError, match="teacher_preds.*\\[0, 2\\)"):
        call(np.array([[0, 2], [1, 1]]))
    with pytest.raises(ValueError, match="teacher_preds"):
        call(np.array([[0, -1], [1, 1]]))
    with pytest.raises(ValueError, match="teacher_preds"):
        call(np.array([0, 1]))
    with pytest.raises(ValueError, match="teacher_preds"):
        call(np.array([[0.5, 1.0]]))
    with pytest.raises(ValueError, match="num_classes"):
        call(num_classes=1)
    for bad in (0.0, 1.0, -1e-5, 2.0):
        with pytest.raises(ValueError, match="delta"):
            call(delta=bad)
    name = "gamma" if fn == "lnmax" else "sigma"
    for bad in (0.0, -0.2, math.nan, math.inf):
        with pytest.raises(ValueError, match=name):
            call(**{name: bad})
    if fn == "lnmax":
        with pytest.raises(ValueError, match="moments"):
            call(moments=0)
    else:
        with pytest.raises(ValueError, match="orders"):
            call(orders=[1.0, 2.0])
        with pytest.raises(ValueError, match="sigma1"):
            call(threshold=3.0, answered=np.ones(2, bool))
        with pytest.raises(ValueError, match="answered"):
            call(threshold=3.0, sigma1=1.0, answered=np.ones(3, bool))


def test_the_analysis_needs_only_the_vote_histogram():
    """A server that sees summed per-site histograms gets the same epsilons as one that
    sees every teacher's vote; bad histograms are refused."""
    from fedsgld.privacy.pate_analysis import (
        gnmax_epsilon_from_counts,
        lnmax_epsilon_from_counts,
        vote_counts,
    )

    rng = np.random.default_rng(0)
    preds = rng.integers(0, 4, size=(20, 30))
    counts = vote_counts(preds, num_classes=4)
    assert lnmax_epsilon_from_counts(counts, gamma=0.2, delta=1e-5) == lnmax_epsilon(
        preds, num_classes=4, gamma=0.2, delta=1e-5
    )
    assert gnmax_epsilon_from_counts(counts, sigma=5.0, delta=1e-5) == gnmax_epsilon(
        preds, num_classes=4, sigma=5.0, delta=1e-5
    )
    with pytest.raises(ValueError, match="counts must be >= 0"):
        lnmax_epsilon_from_counts(-counts, gamma=0.2, delta=1e-5)
    with pytest.raises(ValueError, match="2-D array"):
        gnmax_epsilon_from_counts(counts[0], sigma=5.0, delta=1e-5)
    with pytest.raises(ValueError, match="integer vote counts"):
        gnmax_epsilon_from_counts(counts + 0.5, sigma=5.0, delta=1e-5)
