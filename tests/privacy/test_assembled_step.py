"""The assembled private step: what a round really releases, tested against the documented
distribution rather than through a noise std the test computes from the code.

Every test runs the real round (``LangevinServer.plan`` / ``mode.finish``,
``Site.clipped_sum``, ``Site.local_round``, ``mode.begin`` / ``mode.finish``)
and checks the released values against the formulas of the README and
:mod:`fedsgld.core.mechanism`, written out here independently of the code:

    alpha_t = lr (1 + t / t0)^(-gamma)          (DP-SGD: alpha_t = lr)
    sigma_t = sqrt(2 alpha_t tau)                (DP-SGD: sigma_t = noise_multiplier)
    theta'  = theta - alpha_t ((sum_k S_k + N(0, (sigma_t C)^2 I)) / L + lambda theta),
    L       = q sum_k N_k                        (sites placement: L_k = q N_k per site)
    S_k     = sum over a Poisson(q) sample of the site's records of clip_C(g_i + rho z_i).

Noise tests are Kolmogorov-Smirnov tests that accept the claimed std and reject 2/3 and 3/2
of it; sampling tests are exact binomial and chi-square tests. Records with an exactly
zero gradient come from a saturated logistic regression (inputs 0, bias +-500: the softmax
is exactly one-hot in float32, so every per-record gradient is exactly 0); records whose
sampling can be read off the released sum come from one-hot inputs (record i moves only
weight column i).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld.clients.site import Site
from fedsgld.config import PrivacySettings
from fedsgld.core.release import Charged, charge
from fedsgld.models import LogisticRegression
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.events import subsampled_steps
from fedsgld.strategies import LangevinServer

LR, GAMMA, T0, TAU, NOISE_MULT = 0.1, 0.5, 10.0, 2.0, 1.3


def _privacy(**kw) -> PrivacySettings:
    base = dict(
        method="dpsgld", epsilon=1e4, delta=1e-5, sample_rate=0.05, clip=0.7, prenoise=0.0,
        lr=LR, temperature=TAU, decay_gamma=GAMMA, decay_t0=T0, noise_multiplier=NOISE_MULT,
    )  # fmt: skip
    base.update(kw)
    return PrivacySettings(**base)


def _paid(priv: PrivacySettings, first_step: int, local_steps: int) -> Charged:
    """The receipt of a real ledger's charge for ``local_steps`` local steps from
    ``first_step`` (what the server's or the site's ledger gives a local round)."""
    acc = PrivacyAccountant(delta=1e-5, epsilon_budget=math.inf, accountant="rdp")
    steps = [(priv.sample_rate, priv.sigma(first_step + i)) for i in range(local_steps)]
    return charge(acc, subsampled_steps(steps))


def claimed_alpha(method: str, t: int) -> float:
    """The documented step size of step t (DP-SGD keeps it constant)."""
    return LR * (1.0 + t / T0) ** (-GAMMA) if method == "dpsgld" else LR


def claimed_sigma(method: str, t: int) -> float:
    """The documented noise multiplier of step t."""
    if method == "dpsgld":
        return math.sqrt(2.0 * claimed_alpha(method, t) * TAU)
    return NOISE_MULT


def _ks_accepts_only_the_claimed_std(z: np.ndarray) -> None:
    """z should be N(0, 1); N(0, (2/3)^2) and N(0, (3/2)^2) must be rejected."""
    assert stats.kstest(z, "norm").pvalue > 1e-4
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < 1e-10, wrong


# -- sites whose records' contributions are known --------------------------------------
def _saturated_site(site_id: int, n: int, d: int, *, seed: int) -> Site:
    """n records with an exactly zero loss gradient at :func:`_saturated_theta`."""
    x, y = torch.zeros(n, d), torch.zeros(n, dtype=torch.long)
    return Site(site_id, x, y, x[:1], y[:1], LogisticRegression(d, 2), seed=seed)


def _saturated_theta(d: int) -> torch.Tensor:
    theta = torch.zeros(2 * d + 2)  # linear.weight (2 x d), then linear.bias (2)
    theta[-2:] = torch.tensor([500.0, -500.0])
    return theta


def _one_hot_site(site_id: int, n: int, *, seed: int) -> Site:
    """Record i has input e_i and label 0: at theta = 0 its gradient is -0.5 in weight
    W[0, i], +0.5 in W[1, i] and (-0.5, 0.5) in the bias (L2 norm 1), so entry i of the
    released sum is -0.5 exactly when record i was sampled."""
    x, y = torch.eye(n), torch.zeros(n, dtype=torch.long)
    return Site(site_id, x, y, x[:1], y[:1], LogisticRegression(n, 2), seed=seed)


def _sampled(summed: torch.Tensor, n: int) -> np.ndarray:
    w0 = summed[:n].numpy()
    assert np.all(np.isclose(w0, 0.0, atol=1e-6) | np.isclose(w0, -0.5, atol=1e-6))
    return w0 < -0.25


def test_the_helper_sites_have_the_gradients_they_claim():
    site = _saturated_site(0, 3, 4, seed=0)
    g = site.fm.per_record_grads(_saturated_theta(4), site.x_train, site.y_train)
    assert g.shape == (3, 10) and torch.count_nonzero(g) == 0
    site = _one_hot_site(0, 5, seed=0)
    g = site.fm.per_record_grads(torch.zeros(12), site.x_train, site.y_train)
    torch.testing.assert_close(g.norm(dim=1), torch.ones(5))
    assert torch.equal(g[:, :5] != 0, torch.eye(5, dtype=torch.bool))


# -- server placement: ServerNoise.finish -----------------------------------------------
@pytest.mark.parametrize("method", ["dpsgld", "dpsgd"])
def test_server_step_releases_the_documented_gaussian(method):
    """apply() with known site sums: theta' - E[theta'] is N(0, (alpha_t sigma_t C / L)^2 I),
    fresh every round, and its mean uses L = q sum_k N_k and the prior term lambda theta."""
    P, sizes, q, C, wd = 20_000, [300, 500, 200], 0.05, 0.7, 0.01
    L = q * sum(sizes)
    theta0 = torch.randn(P, generator=torch.Generator().manual_seed(0))
    server = LangevinServer(
        _privacy(method=method, sample_rate=q, clip=C), theta=theta0, site_sizes=sizes,
        seed=11, rounds=4, weight_decay=wd,
    )  # fmt: skip
    sums_gen = torch.Generator().manual_seed(1)
    zs = []
    for t in range(4):
        plan = server.plan()
        assert plan is not None and plan.round == t
        before = server.theta.clone()
        site_sums = [3.0 * torch.randn(P, generator=sums_gen) for _ in sizes]
        after = server.mode.finish(plan, site_sums).clone()
        alpha, sigma = claimed_alpha(method, t), claimed_sigma(method, t)
        mean = before - alpha * (sum(site_sums) / L + wd * before)
        z = ((after - mean) / (alpha * sigma * C / L)).double().numpy()
        _ks_accepts_only_the_claimed_std(z)
        zs.append(z)
    # fresh noise every round: successive rounds' noise is uncorrelated
    for a, b in zip(zs, zs[1:]):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(P)
    assert server.t == 4 and server.accountant.steps == 4


def test_a_full_round_through_real_sites_releases_only_the_server_noise():
    """plan -> Site.clipped_sum at three sites -> apply. The sites' records have zero
    gradients and there is no pre-noise, so the released change is the server's noise
    alone: N(0, (alpha_t sigma_t C / L)^2) with L = q (N_1 + N_2 + N_3)."""
    d, sizes, q, C = 2000, [40, 70, 90], 0.2, 0.9
    sites = [_saturated_site(k, n, d, seed=21) for k, n in enumerate(sizes)]
    server = LangevinServer(
        _privacy(sample_rate=q, clip=C), theta=_saturated_theta(d), site_sizes=sizes,
        seed=21, rounds=3,
    )  # fmt: skip
    L = q * sum(sizes)
    for t in range(3):
        plan = server.plan()
        before = server.theta.clone()
        sums = [
            s.clipped_sum(
                before, round=plan.round, sample_rate=plan.sample_rate, clip=plan.clip,
                prenoise=plan.prenoise,
            )
            for s in sites
        ]  # fmt: skip
        assert all(torch.count_nonzero(s) == 0 for s in sums)
        after = server.mode.finish(plan, sums)
        std = claimed_alpha("dpsgld", t) * claimed_sigma("dpsgld", t) * C / L
        _ks_accepts_only_the_claimed_std(((after - before)[:-2] / std).double().numpy())


# -- the site: clipping, pre-noise, Poisson sampling -------------------------------------
def test_a_record_with_a_huge_gradient_moves_the_site_sum_by_exactly_C():
    """Neighbouring sites D and D + {huge record}, everything sampled (q = 1), no
    pre-noise: the released sums differ by the huge record's clipped gradient, of L2 norm
    exactly C, although its raw gradient has norm ~1e4; every ordinary record is clipped too."""
    torch.manual_seed(0)
    model = LogisticRegression(5, 3)
    x, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    x_big = torch.cat([x, torch.full((1, 5), 1e4)])
    y_big = torch.cat([y, torch.tensor([2])])
    C = 0.05
    server = LangevinServer(
        _privacy(sample_rate=1.0, clip=C), theta=torch.zeros(18), site_sizes=[31], seed=0,
        rounds=1,
    )  # fmt: skip
    plan = server.plan()
    theta = 0.1 * torch.randn(18)

    def released(xs, ys, clip):
        site = Site(0, xs, ys, xs, ys, model, seed=4)
        return site.clipped_sum(
            theta, round=0, sample_rate=plan.sample_rate, clip=clip, prenoise=plan.prenoise
        )

    raw = Site(0, x_big, y_big, x, y, model, seed=4).fm.per_record_grads(theta, x_big, y_big)
    assert raw[-1].norm() > 1e3 and raw[:-1].norm(dim=1).min() > C  # clipping bites everywhere
    a, b = released(x, y, plan.clip), released(x_big, y_big, plan.clip)
    assert (b - a).norm().item() == pytest.approx(C, rel=1e-4)
    assert a.norm() <= 30 * C * (1 + 1e-5)
    # the check can fail: without the clip the same record moves the sum by ~1e4
    assert (released(x_big, y_big, None) - released(x, y, None)).norm() > 1e3


def test_prenoise_is_added_to_each_record_before_its_clip():
    """One record with a zero gradient, always sampled: the site releases clip_C(rho z),
    z ~ N(0, I_P). Its norm is min(C, rho chi_P): equal to C with probability
    P[chi2_P > (C / rho)^2], and below C distributed as rho^2 chi2_P truncated there.
    Without pre-noise the sum is 0; pre-noise after the clip (or no clip) is never
    truncated; a pre-noise std off by 2/3 or 3/2 moves P[clipped] from 0.45 to 0.02 or 0.90."""
    d, rho, C, R = 3, 0.5, 1.4, 600
    P = 2 * d + 2
    server = LangevinServer(
        _privacy(sample_rate=1.0, clip=C, prenoise=rho), theta=_saturated_theta(d),
        site_sizes=[1], seed=0, rounds=1,
    )  # fmt: skip
    plan = server.plan()
    assert plan.prenoise == rho  # DP-SGLD applies the configured pre-noise
    site = _saturated_site(0, 1, d, seed=8)
    norms = np.array(
        [
            site.clipped_sum(
                _saturated_theta(d), round=r, sample_rate=plan.sample_rate, clip=plan.clip,
                prenoise=plan.prenoise,
            ).norm().item()
            for r in range(R)
        ]
    )  # fmt: skip
    assert norms.max() <= C * (1 + 1e-5)
    clipped = norms >= C * (1 - 1e-5)
    p_clip = stats.chi2.sf((C / rho) ** 2, P)
    assert 0.3 < p_clip < 0.6
    assert stats.binomtest(int(clipped.sum()), R, p_clip).pvalue > 1e-4
    below = (norms[~clipped] / rho) ** 2
    cap = stats.chi2.cdf((C / rho) ** 2, P)
    assert stats.kstest(below, lambda v: stats.chi2.cdf(v, P) / cap).pvalue > 1e-4
    # the other methods add no pre-noise: the same record then releases exactly 0
    dpsgd = _privacy(method="dpsgd", sample_rate=1.0, clip=C, prenoise=rho)
    assert dpsgd.applied_prenoise == 0.0


def test_site_sampling_is_poisson_at_rate_q_and_fresh_every_round():
    """Which records a site sampled can be read off its released sum (one-hot records).
    Over R rounds: the number of (record, round) selections is Binomial(n R, q); the
    realised batch size varies like Binomial(n, q) (not a fixed-size sample); every
    record's count is Binomial(R, q) (fresh draws, not the same batch every round); two
    successive rounds share Binomial(n, q^2) records; two sites draw independently."""
    n, R, q = 600, 30, 0.05
    server = LangevinServer(
        _privacy(method="dpsgd", sample_rate=q, clip=10.0), theta=torch.zeros(2 * n + 2),
        site_sizes=[n, n], seed=0, rounds=1,
    )  # fmt: skip
    plan = server.plan()
    sites = [_one_hot_site(k, n, seed=13) for k in (0, 1)]  # same records, same seed
    picks = np.array(
        [
            [
                _sampled(
                    s.clipped_sum(
                        torch.zeros(2 * n + 2),
                        round=r,
                        sample_rate=plan.sample_rate,
                        clip=plan.clip,
                        prenoise=plan.prenoise,
                    ),
                    n,
                )
                for r in range(R)
            ]
            for s in sites
        ]
    )  # fmt: skip  (site, round, record)
    _check_poisson(picks[0], q)
    # the two sites' samples are independent
    both = int((picks[0] & picks[1]).sum())
    assert stats.binomtest(both, n * R, q * q).pvalue > 1e-4


def _check_poisson(picks: np.ndarray, q: float) -> None:
    """picks: (rounds, records) bool matrix of the records selected in each round."""
    R, n = picks.shape
    total = int(picks.sum())
    assert stats.binomtest(total, n * R, q).pvalue > 1e-4
    assert stats.binomtest(total, n * R, 2 * q).pvalue < 1e-10  # the test tells 2q from q
    sizes = picks.sum(axis=1)
    chi = float(((sizes - n * q) ** 2).sum() / (n * q * (1 - q)))  # ~ chi2_R
    assert 1e-4 < stats.chi2.sf(chi, R) < 1 - 1e-4
    counts = picks.sum(axis=0)  # per record: Binomial(R, q)
    k = np.arange(4)
    expected = np.append(stats.binom.pmf(k, R, q), stats.binom.sf(3, R, q)) * n
    observed = np.append([(counts == i).sum() for i in k], (counts > 3).sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-4
    overlap = int((picks[1:] & picks[:-1]).sum())
    assert stats.binomtest(overlap, n * (R - 1), q * q).pvalue > 1e-4


def test_local_round_sampling_is_poisson_and_fresh_every_step():
    """noise_placement "sites": the sample of local step t is read off the released
    parameters of a non-private (sgd) local round: theta' = theta - alpha S / (q N_k)."""
    n, R, q, alpha = 800, 40, 0.05, 0.5
    priv = PrivacySettings(
        method="sgd", sample_rate=q, lr=alpha, decay_gamma=0.0, noise_placement="sites",
        local_steps=1,
    )  # fmt: skip
    site = _one_hot_site(2, n, seed=17)
    theta = torch.zeros(2 * n + 2)
    picks = []
    for t in range(R):
        new = site.local_round(theta, first_step=t, local_steps=1, privacy=priv)
        picks.append(_sampled(-(new - theta) * (q * n) / alpha, n))
    _check_poisson(np.array(picks), q)


# -- noise placement "sites": every site adds the noise itself ------------------------------
def test_sites_placement_each_site_releases_the_documented_gaussian():
    """mode.begin -> Site.local_round (E noisy steps, zero gradients) ->
    mode.finish. Site k's released parameters move by the sum of E independent
    N(0, (alpha_t sigma_t C / (q N_k))^2) draws; the server's new parameters are the
    N_k-weighted average; both sites' noise is independent and every round is fresh."""
    d, sizes, q, C, E = 2000, [50, 80], 0.1, 0.7, 3
    priv = _privacy(sample_rate=q, clip=C, noise_placement="sites", local_steps=E)
    sites = [_saturated_site(k, n, d, seed=31) for k, n in enumerate(sizes)]
    server = LangevinServer(priv, theta=_saturated_theta(d), site_sizes=sizes, seed=31, rounds=2)
    previous = None
    for r in range(2):
        plan = server.plan()
        assert (plan.first_step, plan.local_steps) == (r * E, E)
        paid = server.mode.begin(plan)
        assert server.accountant.steps == (r + 1) * E
        before = server.theta.clone()
        released, zs = [], []
        for s, n_k in zip(sites, sizes):
            th = s.local_round(
                before,
                first_step=plan.first_step,
                local_steps=plan.local_steps,
                privacy=priv,
                charged=paid,
            )
            var = sum(
                (claimed_alpha("dpsgld", t) * claimed_sigma("dpsgld", t) * C / (q * n_k)) ** 2
                for t in range(r * E, r * E + E)
            )
            z = ((th - before)[:-2] / math.sqrt(var)).double().numpy()
            _ks_accepts_only_the_claimed_std(z)
            released.append((n_k, th))
            zs.append(z)
        assert abs(np.corrcoef(zs[0], zs[1])[0, 1]) < 5 / math.sqrt(2 * d)
        if previous is not None:
            assert abs(np.corrcoef(zs[0], previous)[0, 1]) < 5 / math.sqrt(2 * d)
        previous = zs[0]
        after = server.mode.finish(plan, released)
        expected = sum(n_k * th for n_k, th in released) / sum(sizes)
        torch.testing.assert_close(after, expected)


# -- the randomness belongs to the run, and the budget guard holds inside apply ----------------
def test_server_noise_depends_on_the_runs_seed():
    """Two runs with different seeds draw different server noise (a deployment draws its
    seed from the operating system; noise that ignored it would be predictable)."""
    steps = []
    for seed in (1, 2, 1):
        server = LangevinServer(
            _privacy(), theta=torch.zeros(500), site_sizes=[100], seed=seed, rounds=1
        )
        steps.append(server.mode.finish(server.plan(), [torch.zeros(500)]).clone())
    assert torch.equal(steps[0], steps[2])
    assert abs(np.corrcoef(steps[0].numpy(), steps[1].numpy())[0, 1]) < 5 / math.sqrt(500)


def test_site_sample_comes_from_the_sites_generator_only():
    """The sample of (seed, site, round) does not depend on torch's global random state,
    and differs between rounds and seeds."""
    n = 300

    def sample(seed, round_):
        site = _one_hot_site(0, n, seed=seed)
        s = site.clipped_sum(torch.zeros(2 * n + 2), round=round_, sample_rate=0.2, clip=10.0,
                             prenoise=0.0)  # fmt: skip
        return _sampled(s, n)

    torch.manual_seed(0)
    a = sample(5, 3)
    torch.manual_seed(12345)
    torch.rand(1000)
    assert np.array_equal(a, sample(5, 3))
    assert not np.array_equal(a, sample(5, 4)) and not np.array_equal(a, sample(6, 3))


def test_apply_refuses_a_step_over_the_budget_and_releases_nothing():
    """Called directly with a plan the budget cannot pay for, apply raises, records why,
    and leaves the parameters and the step counter as they were."""
    from fedsgld.privacy import BudgetExhausted
    from fedsgld.strategies import RoundPlan

    server = LangevinServer(
        _privacy(epsilon=0.5), theta=torch.ones(10), site_sizes=[100], seed=0, rounds=5
    )
    plan = RoundPlan(round=0, step_size=0.1, sigma=0.2, sample_rate=1.0, clip=1.0, prenoise=0.0)
    with pytest.raises(BudgetExhausted):
        server.mode.finish(plan, [torch.zeros(10)])
    assert server.halt_reason.startswith("privacy budget:")
    assert torch.equal(server.theta, torch.ones(10)) and server.t == 0
    assert server.accountant.steps == 0


def test_apply_refuses_misuse_by_name():
    server = LangevinServer(_privacy(), theta=torch.zeros(4), site_sizes=[10], seed=0, rounds=2)
    plan = server.plan()
    with pytest.raises(ValueError, match=r"^site sum has shape \(3,\), expected \(4,\)$"):
        server.mode.finish(plan, [torch.zeros(3)])
    server.mode.finish(plan, [torch.zeros(4)])
    with pytest.raises(ValueError, match=r"^plan is for round 0, server is at round 1$"):
        server.mode.finish(plan, [torch.zeros(4)])
    local = LangevinServer(
        _privacy(noise_placement="sites", local_steps=2), theta=torch.zeros(4),
        site_sizes=[10], seed=0, rounds=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^the round needs at least one site's parameters$"):
        local.mode.finish(local.plan(), [])


def test_posterior_samples_are_the_released_iterates():
    """Kept samples (post-processing) are exactly the iterates apply released."""
    from fedsgld.strategies import PosteriorSamples

    server = LangevinServer(
        _privacy(), theta=torch.zeros(6), site_sizes=[20], seed=0, rounds=4,
        posterior=PosteriorSamples(burn_in=1, thin=1, max_samples=2),
    )  # fmt: skip
    released = [server.mode.finish(server.plan(), [torch.zeros(6)]).clone() for _ in range(4)]
    assert list(server.posterior.steps) == [3, 4]
    for kept, theta in zip(server.posterior.samples, released[2:]):
        assert torch.equal(kept, theta)


def test_local_round_clips_every_record():
    """Sites placement: a record with a huge gradient moves a site's local step by its
    clipped gradient only (norm C), at a temperature so low that the noise is negligible:
    theta' = theta - alpha (S + sigma C xi) / (q N_k) with sigma ~ 4.5e-7."""
    torch.manual_seed(3)
    model = LogisticRegression(5, 3)
    x, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    x_big, y_big = torch.cat([x, torch.full((1, 5), 1e4)]), torch.cat([y, torch.tensor([2])])
    C, alpha = 0.05, 0.1
    priv = _privacy(
        sample_rate=1.0, clip=C, temperature=1e-12, decay_gamma=0.0, noise_placement="sites",
        local_steps=1,
    )  # fmt: skip
    theta = 0.1 * torch.randn(18)

    def site_sum(xs, ys):
        new = Site(0, xs, ys, xs, ys, model, seed=4).local_round(
            theta, first_step=0, local_steps=1, privacy=priv, charged=_paid(priv, 0, 1)
        )
        return -(new - theta).double() * len(ys) / alpha  # q = 1: L_k = N_k

    assert (site_sum(x_big, y_big) - site_sum(x, y)).norm().item() == pytest.approx(C, rel=1e-3)


def test_local_round_randomness_weight_decay_and_empty_sites():
    """The local sample comes from the site's generator only; the prior term lambda theta
    is applied; a site without records returns the parameters unchanged."""
    n, q, alpha, wd = 300, 0.2, 0.5, 0.1
    priv = PrivacySettings(
        method="sgd", sample_rate=q, lr=alpha, decay_gamma=0.0, noise_placement="sites",
        local_steps=1,
    )  # fmt: skip
    site = _one_hot_site(0, n, seed=5)
    theta = torch.zeros(2 * n + 2)
    torch.manual_seed(0)
    a = site.local_round(theta, first_step=3, local_steps=1, privacy=priv)
    torch.manual_seed(999)
    torch.rand(100)
    assert torch.equal(a, site.local_round(theta, first_step=3, local_steps=1, privacy=priv))
    sat = _saturated_site(1, 4, 3, seed=5)  # zero gradients: only the prior term moves theta
    th = _saturated_theta(3) + 1.0
    new = sat.local_round(th, first_step=0, local_steps=1, privacy=priv, weight_decay=wd)
    torch.testing.assert_close(new, th - alpha * wd * th)
    empty = _saturated_site(2, 0, 3, seed=5)
    assert torch.equal(empty.local_round(th, first_step=0, local_steps=2, privacy=priv), th)
    one = _saturated_site(3, 1, 3, seed=5)
    moved = one.local_round(th, first_step=0, local_steps=1, privacy=priv, weight_decay=wd)
    assert not torch.equal(moved, th)


def test_local_noise_belongs_to_the_run_and_is_not_the_sampling_stream():
    """Sites placement: a site's noise depends on the run's seed, and it is not a replay of
    the site's own sampling / pre-noise generator of the same step."""
    d = 1000
    priv = _privacy(sample_rate=0.5, clip=0.7, noise_placement="sites", local_steps=1)
    theta = _saturated_theta(d)
    noise = {}
    for seed in (1, 2):
        site = _saturated_site(0, 20, d, seed=seed)
        paid = _paid(priv, 0, 1)
        new = site.local_round(theta, first_step=0, local_steps=1, privacy=priv, charged=paid)
        noise[seed] = (new - theta)[:-2].numpy()
    bound = 5 / math.sqrt(2 * d)
    assert abs(np.corrcoef(noise[1], noise[2])[0, 1]) < bound
    replay = torch.randn(2 * d + 2, generator=_saturated_site(0, 20, d, seed=1).generator(0))
    assert abs(np.corrcoef(noise[1], replay[:-2].numpy())[0, 1]) < bound
