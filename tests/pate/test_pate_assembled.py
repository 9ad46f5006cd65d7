"""PATE as assembled: teachers on disjoint records, the noise scales of the released labels
at vote gaps where the scale changes the outcome, and the Confident-GNMax threshold cost
against an independent computation of the paper's bound.

The analysis (:mod:`fedsgld.privacy.pate_analysis`) assumes that one record changes at most one
teacher, hence one vote per query; the label mechanisms are (Papernot et al. 2017, 2018):

    LNMax:           argmax_j (n_j + Lap(1 / gamma))
    GNMax:           argmax_j (n_j + N(0, sigma^2))
    Confident-GNMax: answered iff max_j n_j + N(0, sigma_1^2) >= T, then GNMax(sigma_2).

With two competing classes and a gap d = n_top - n_other the label is the top class with
probability Phi(d / (sqrt(2) sigma)) (GNMax) and 1 - (2 + gamma d) e^(-gamma d) / 4 (LNMax:
the difference of two Laplace(1/gamma) variables); the threshold check passes with
probability Phi((max_j n_j - T) / sigma_1). The tests pick gaps at which 2/3 and 3/2 of the
claimed scale give clearly different probabilities, and check the test can tell.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import fedsgld.pate.teachers as pate_train
from fedsgld.core.noise import seeded_generator
from fedsgld.pate.aggregation import confident_gnmax, gnmax, lnmax, site_histogram
from fedsgld.pate.config import PateConfig
from fedsgld.pate.teachers import train_site_teachers
from fedsgld.privacy.pate_analysis import gnmax_epsilon_from_counts

# -- teachers on disjoint records -------------------------------------------------------


def _site(n=40, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)  # rows are distinct: they identify the records
    y = torch.randint(0, 3, (n,), generator=g)
    xq = torch.randn(30, d, generator=g)
    return x, y, xq


def _train_and_spy(monkeypatch, config, x, y, xq):
    """Run the real train_site_teachers; record which rows every teacher trained on."""
    seen: list[torch.Tensor] = []
    real = pate_train.train_classifier

    def spy(model, xs, ys, **kw):
        seen.append(xs.clone())
        return real(model, xs, ys, **kw)

    monkeypatch.setattr(pate_train, "train_classifier", spy)
    preds, _ = train_site_teachers(
        config, site_id=1, x_train=x, y_train=y, x_test=x[:5], y_test=y[:5], x_query=xq,
        num_classes=3,
    )  # fmt: skip
    monkeypatch.setattr(pate_train, "train_classifier", real)
    return preds, seen


def _record_ids(rows: torch.Tensor, x: torch.Tensor) -> set[int]:
    index = {tuple(r.tolist()): i for i, r in enumerate(x)}
    return {index[tuple(r.tolist())] for r in rows}


CONFIG = PateConfig(
    dataset="synthetic", teachers_per_site=4, teacher_epochs=2, hidden=8, batch_size=8
)


def test_each_teacher_trains_on_its_own_disjoint_records(monkeypatch):
    x, y, xq = _site()
    preds, seen = _train_and_spy(monkeypatch, CONFIG, x, y, xq)
    assert preds.shape == (4, 30) and len(seen) == 4
    parts = [_record_ids(rows, x) for rows in seen]
    assert [len(p) for p in parts] == [len(rows) for rows in seen]  # no record twice
    assert all(len(p) > 0 for p in parts)  # sizes vary: each record's teacher is its hash's
    assert set().union(*parts) == set(range(40))
    assert sum(len(p) for p in parts) == 40  # pairwise disjoint


def test_replacing_one_record_changes_at_most_one_teachers_votes(monkeypatch):
    """Substitution of one record: only the teacher holding it may vote differently, so
    every query's site histogram moves by at most 2 in L1 (the analysis' sensitivity)."""
    x, y, xq = _site()
    preds, seen = _train_and_spy(monkeypatch, CONFIG, x, y, xq)
    owner = next(j for j, rows in enumerate(seen) if 7 in _record_ids(rows, x))
    x2, y2 = x.clone(), y.clone()
    x2[7], y2[7] = 25.0, (int(y[7]) + 1) % 3
    preds2, _ = _train_and_spy(monkeypatch, CONFIG, x2, y2, xq)
    changed = {j for j in range(4) if not np.array_equal(preds[j], preds2[j])}
    assert changed <= {owner}
    h, h2 = site_histogram(preds, num_classes=3), site_histogram(preds2, num_classes=3)
    assert int((h - h2).abs().sum(dim=1).max()) <= 2


def test_removing_one_record_changes_at_most_one_teachers_records(monkeypatch):
    x, y, xq = _site()
    _, seen = _train_and_spy(monkeypatch, CONFIG, x, y, xq)
    _, seen_minus = _train_and_spy(monkeypatch, CONFIG, x[1:], y[1:], xq)
    before = [_record_ids(rows, x) - {0} for rows in seen]
    after = [_record_ids(rows, x) for rows in seen_minus]
    assert sum(a != b for a, b in zip(before, after)) <= 1


# -- the released labels' noise at gaps where the scale matters ---------------------------

N = 8000


def _phi(v: float) -> float:
    return float(stats.norm.cdf(v))


def _assert_rate(hits: int, n: int, p: float, wrong: list[float]) -> None:
    assert stats.binomtest(hits, n, p).pvalue > 1e-4, (hits / n, p)
    for w in wrong:  # the same data must reject the probability of a wrong scale
        assert stats.binomtest(hits, n, w).pvalue < 1e-8, (hits / n, w)


def test_confident_gnmax_threshold_noise_has_scale_sigma1():
    T, s1 = 50, 4.0
    gaps = [-4, 2, 4, 8]
    counts = torch.tensor([[T + g, 0, 0] for g in gaps for _ in range(N)])
    _, answered = confident_gnmax(
        counts, threshold=float(T), sigma1=s1, sigma2=1.0, generator=seeded_generator(41)
    )
    for i, g in enumerate(gaps):
        hits = int(answered[i * N : (i + 1) * N].sum())
        _assert_rate(hits, N, _phi(g / s1), [_phi(g / (f * s1)) for f in (2 / 3, 3 / 2)])


def test_confident_gnmax_answer_noise_has_scale_sigma2():
    s2 = 3.0
    gaps = [2, 4, 6]
    counts = torch.tensor([[100 + d, 100, 0] for d in gaps for _ in range(N)])
    labels, answered = confident_gnmax(
        counts, threshold=-1e6, sigma1=1.0, sigma2=s2, generator=seeded_generator(42)
    )
    assert bool(answered.all())
    for i, d in enumerate(gaps):
        top = int((labels[i * N : (i + 1) * N] == 0).sum())
        p = _phi(d / (math.sqrt(2) * s2))
        _assert_rate(top, N, p, [_phi(d / (math.sqrt(2) * f * s2)) for f in (2 / 3, 3 / 2)])


def test_confident_gnmax_joint_outcome_distribution():
    """Unanswered / top class / other class, with the check on the MAXIMUM count (54, not
    the total 104) and independent threshold and answer noise."""
    T, s1, s2 = 50.0, 4.0, 3.0
    counts = torch.tensor([[54, 50, 0]] * (3 * N))
    labels, _ = confident_gnmax(
        counts, threshold=T, sigma1=s1, sigma2=s2, generator=seeded_generator(43)
    )
    p_ans, p_top = _phi(4 / s1), _phi(4 / (math.sqrt(2) * s2))
    expected = np.array([1 - p_ans, p_ans * p_top, p_ans * (1 - p_top)]) * 3 * N
    observed = np.array([(labels == v).sum().item() for v in (-1, 0, 1)])
    assert observed.sum() == 3 * N
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_gnmax_and_lnmax_labels_at_scale_sensitive_gaps():
    sigma, gamma, d = 3.0, 0.2, 5
    counts = torch.tensor([[100 + d, 100, 0]] * N)
    top = int((gnmax(counts, sigma=sigma, generator=seeded_generator(44)) == 0).sum())
    _assert_rate(
        top, N, _phi(d / (math.sqrt(2) * sigma)),
        [_phi(d / (math.sqrt(2) * f * sigma)) for f in (2 / 3, 3 / 2)],
    )  # fmt: skip

    def lnmax_top(g):  # 1 - P[Lap - Lap > d] for two Laplace(1/g) variables
        return 1 - (2 + g * d) * math.exp(-g * d) / 4

    two = torch.tensor([[d, 0]] * N)
    top = int((lnmax(two, gamma=gamma, generator=seeded_generator(45)) == 0).sum())
    _assert_rate(top, N, lnmax_top(gamma), [lnmax_top(gamma / f) for f in (2 / 3, 3 / 2)])


# -- the data-dependent threshold cost, computed independently ----------------------------


def _theorem6_rdp(log_q: float, sigma: float, order: float) -> float:
    """Papernot et al. 2018, Theorem 6 with mu_2 = sigma sqrt(log 1/q), mu_1 = mu_2 + 1,
    for a mechanism whose data-independent RDP is order / sigma^2; capped by that bound."""
    indep = order / sigma**2
    q = math.exp(log_q)
    mu2 = sigma * math.sqrt(-log_q)
    mu1 = mu2 + 1.0
    e1, e2 = mu1 / sigma**2, mu2 / sigma**2
    ok = (
        mu2 > 1.0
        and order < mu1
        and log_q + e2 < 0.0
        and log_q <= (mu2 - 1.0) * e2 - mu2 * math.log(mu1 / (mu1 - 1.0) * mu2 / (mu2 - 1.0))
    )
    if not ok:
        return indep
    a = (1.0 - q) / (1.0 - math.exp((log_q + e2) * (mu2 - 1.0) / mu2))
    log_b = e1 - log_q / (mu1 - 1.0)
    # log((1 - q) A^(l-1) + q B^(l-1)) / (l - 1), the second term in log space
    first = math.log1p(-q) + (order - 1.0) * math.log(a)
    second = log_q + (order - 1.0) * log_b
    hi = max(first, second)
    dep = (hi + math.log(math.exp(first - hi) + math.exp(second - hi))) / (order - 1.0)
    return min(indep, dep)


def test_threshold_cost_matches_an_independent_computation():
    """Confident-GNMax, data-dependent epsilon = min over orders of
    sum_posed RDP_threshold + sum_answered RDP_GNMax + log(1/delta) / (order - 1), where the
    threshold check of a query with maximum count m is analysed as GNMax with sigma =
    sqrt(2) sigma_1 at q = Phi(-|m - T| / sigma_1) (the less likely of answer / no answer),
    and an answered query's GNMax at q = sum_{j != top} 1/2 erfc((n_top - n_j) / (2 sigma_2)).
    """
    T, s1, s2, delta = 100.0, 5.0, 6.0, 1e-5
    counts = np.array([[130, 20, 0], [60, 50, 40], [155, 0, 45], [70, 70, 10]])
    answered = np.array([True, False, True, False])
    orders = [1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 55.0, 89.0]
    ref_dep, ref_ind = [], []
    for o in orders:
        rdp = 0.0
        for row, ans in zip(counts, answered):
            log_q = float(stats.norm.logcdf(-abs(row.max() - T) / s1))
            rdp += _theorem6_rdp(log_q, math.sqrt(2.0) * s1, o)
            if ans:
                top = int(np.argmax(row))
                q = sum(
                    0.5 * math.erfc((row[top] - row[j]) / (2 * s2)) for j in range(3) if j != top
                )
                rdp += _theorem6_rdp(math.log(min(q, 1.0)), s2, o)
        ind = len(counts) * (o / (2 * s1**2) + o / s2**2)
        ref_dep.append(min(rdp, ind) + math.log(1 / delta) / (o - 1))
        ref_ind.append(ind + math.log(1 / delta) / (o - 1))
    got = gnmax_epsilon_from_counts(
        counts, sigma=s2, delta=delta, threshold=T, sigma1=s1, answered=answered, orders=orders
    )
    assert got["data_dependent"] == pytest.approx(min(ref_dep), rel=1e-9)
    assert got["data_independent"] == pytest.approx(min(ref_ind), rel=1e-12)
    # the data-dependent bound is in force here (not just the data-independent fallback)
    assert got["data_dependent"] < 0.5 * got["data_independent"]
    # and the threshold cost is charged: without the check (plain GNMax on the answered
    # queries) the same answered queries cost less
    plain = gnmax_epsilon_from_counts(counts[answered], sigma=s2, delta=delta, orders=orders)
    assert plain["data_dependent"] < got["data_dependent"]


# -- edge values of the samplers (tests for mutants that survived `make mutation`) ---------


def test_laplace_noise_is_the_documented_construction_draw_for_draw():
    """scale (E_1 - E_2), E_i = -log(1 - U_i), U_i uniform on [0, 1) in float64, drawn
    as one (2, *shape) block from the generator: the tails reach about 36.7 scale (float64
    uniforms) rather than 16.6 scale (float32 uniforms)."""
    from fedsgld.pate.aggregation import laplace_noise

    u = torch.rand((2, 5, 3), generator=seeded_generator(8), dtype=torch.float64)
    expected = 2.5 * (-torch.log1p(-u[0]) + torch.log1p(-u[1]))
    got = laplace_noise((5, 3), scale=2.5, generator=seeded_generator(8))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)
    f32 = laplace_noise((5, 3), scale=2.5, generator=seeded_generator(8), dtype=torch.float32)
    assert f32.dtype == torch.float32


@pytest.mark.parametrize("scale", [1.0, 0.5, 4.0])
def test_laplace_noise_of_every_scale_has_that_scale(scale):
    from fedsgld.pate.aggregation import laplace_noise

    z = laplace_noise((20_000,), scale=scale, generator=seeded_generator(9)).numpy()
    assert stats.kstest(z, stats.laplace(scale=scale).cdf).pvalue > 1e-4
    for f in (2 / 3, 3 / 2):
        assert stats.kstest(z, stats.laplace(scale=f * scale).cdf).pvalue < 1e-10


def test_sampler_arguments_are_checked_by_name():
    from fedsgld.pate.aggregation import laplace_noise

    z = laplace_noise((2, 3), scale=0.0, generator=seeded_generator(0), dtype=torch.float32)
    assert z.shape == (2, 3) and z.dtype == torch.float32 and torch.count_nonzero(z) == 0
    z = laplace_noise((4,), scale=0.0, generator=seeded_generator(0))
    assert z.shape == (4,) and z.dtype == torch.float64 and torch.count_nonzero(z) == 0
    with pytest.raises(TypeError, match=r"^laplace_noise needs an explicit torch\.Generator"):
        laplace_noise((3,), scale=1.0, generator=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^Laplace scale must be finite and >= 0, got "):
        laplace_noise((3,), scale=math.inf, generator=seeded_generator(0))
    counts, g = torch.tensor([[3, 1]]), seeded_generator(0)
    with pytest.raises(ValueError, match=r"^gamma must be a finite number > 0, got 0\.0$"):
        lnmax(counts, gamma=0.0, generator=g)
    with pytest.raises(ValueError, match=r"^sigma must be a finite number > 0, got -1\.0$"):
        gnmax(counts, sigma=-1.0, generator=g)
    with pytest.raises(ValueError, match=r"^sigma1 must be a finite number > 0, got 0\.0$"):
        confident_gnmax(counts, threshold=1.0, sigma1=0.0, sigma2=1.0, generator=g)
    with pytest.raises(ValueError, match=r"^threshold must be a finite number, got nan$"):
        confident_gnmax(counts, threshold=math.nan, sigma1=1.0, sigma2=1.0, generator=g)
