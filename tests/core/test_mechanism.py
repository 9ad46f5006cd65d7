"""Per-record gradients, clipping, Poisson sampling and noise: checks that can fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.linalg import solve_discrete_lyapunov

from fedsgld.core.clipping import clip_and_sum
from fedsgld.core.mechanism import (
    FlatModel,
    clipped_gradient_sum,
    langevin_update,
    poisson_sample,
)
from fedsgld.core.noise import gaussian_noise, seeded_generator
from fedsgld.models import MLP, PaperCNN


@pytest.fixture(scope="module")
def cnn_batch():
    torch.manual_seed(0)
    model = PaperCNN(num_classes=10)
    x = torch.randn(9, 1, 28, 28)
    y = torch.randint(0, 10, (9,))
    return FlatModel(model), x, y


def _loop_grads(fm: FlatModel, theta, x, y):
    rows = []
    for i in range(x.shape[0]):
        t = theta.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(fm.logits(t, x[i : i + 1]), y[i : i + 1])
        (g,) = torch.autograd.grad(loss, t)
        rows.append(g)
    return torch.stack(rows)


def test_per_record_grads_match_a_loop(cnn_batch):
    fm, x, y = cnn_batch
    theta = fm.flatten()
    vec = fm.per_record_grads(theta, x, y)
    loop = _loop_grads(fm, theta, x, y)
    assert vec.shape == (9, fm.size) == loop.shape
    torch.testing.assert_close(vec, loop, rtol=1e-4, atol=1e-6)
    # and the records are really different (a broadcast bug would make rows equal)
    assert (vec[0] - vec[1]).abs().max() > 1e-4


def test_flat_model_round_trip(cnn_batch):
    fm, x, _ = cnn_batch
    theta = fm.flatten()
    with torch.no_grad():
        ref = fm.module(x)
    torch.testing.assert_close(fm.logits(theta, x), ref)
    assert fm.size == 26010


def test_clipped_sum_matches_loop_and_chunking(cnn_batch):
    fm, x, y = cnn_batch
    theta = fm.flatten()
    loop = _loop_grads(fm, theta, x, y)
    norms = loop.norm(dim=1)
    clip = float(norms.median())  # some rows clipped, some not
    expected = sum(g * min(1.0, clip / n) for g, n in zip(loop, norms, strict=False))
    for chunk in (2, 4, 256):
        got = clipped_gradient_sum(fm, theta, x, y, clip=clip, chunk_size=chunk)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # no clipping, no pre-noise: plain summed gradient
    plain = clipped_gradient_sum(fm, theta, x, y, clip=None)
    torch.testing.assert_close(plain, loop.sum(0), rtol=1e-4, atol=1e-5)


def test_one_record_moves_the_sum_by_at_most_C(cnn_batch):
    fm, x, y = cnn_batch
    theta = fm.flatten()
    for clip in (0.01, 0.5, 3.0):
        full = clipped_gradient_sum(fm, theta, x, y, clip=clip)
        for i in range(x.shape[0]):
            keep = torch.arange(x.shape[0]) != i
            part = clipped_gradient_sum(fm, theta, x[keep], y[keep], clip=clip)
            assert (full - part).norm() <= clip * (1 + 1e-5)


def test_prenoise_is_added_before_clipping():
    g = torch.zeros(4000, 3)  # zero gradients: clipped rows are pure pre-noise
    gen = torch.Generator().manual_seed(1)
    rho = 0.5
    raw = clip_and_sum(g, clip=1e9, prenoise=rho, generator=gen)
    rows = gaussian_noise((4000, 3), std=rho, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        raw, rows.sum(0), rtol=1e-4, atol=1e-3
    )  # unclipped: sum of the pre-noise
    assert stats.kstest(rows.flatten().numpy(), "norm", args=(0, rho)).pvalue > 1e-3
    gen = torch.Generator().manual_seed(1)
    clipped = clip_and_sum(g, clip=0.1, prenoise=rho, generator=gen)
    # every pre-noised row had norm ~0.87 > 0.1, so each is scaled to norm 0.1 exactly
    gen = torch.Generator().manual_seed(1)
    rows = gaussian_noise((4000, 3), std=rho, generator=gen)
    expected = (rows * (0.1 / rows.norm(dim=1, keepdim=True)).clamp(max=1)).sum(0)
    torch.testing.assert_close(clipped, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Generator"):
        clip_and_sum(g, clip=1.0, prenoise=0.1)


def test_poisson_sampling_rate():
    gen = torch.Generator().manual_seed(3)
    n, q = 20000, 0.07
    counts = [len(poisson_sample(n, sample_rate=q, generator=gen)) for _ in range(20)]
    # each count ~ Binomial(n, q); the mean of 20 is within 5 standard errors
    se = math.sqrt(n * q * (1 - q) / 20)
    assert abs(np.mean(counts) - n * q) < 5 * se
    assert len(set(counts)) > 1  # realised batch sizes vary
    with pytest.raises(ValueError, match="sample_rate"):
        poisson_sample(10, sample_rate=0.0, generator=gen)
    with pytest.raises(ValueError, match="sample_rate"):
        poisson_sample(10, sample_rate=1.5, generator=gen)


def test_gaussian_noise_ks_accepts_claimed_std_and_rejects_wrong_ones():
    std = 1.7
    z = gaussian_noise((50_000,), std=std, generator=torch.Generator().manual_seed(11)).numpy()
    assert stats.kstest(z, "norm", args=(0, std)).pvalue > 1e-3
    for wrong in (2 / 3 * std, 3 / 2 * std):
        assert stats.kstest(z, "norm", args=(0, wrong)).pvalue < 1e-10


def test_noise_needs_explicit_generator_and_valid_std():
    with pytest.raises(TypeError):
        gaussian_noise((3,), std=1.0, generator=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="std"):
        gaussian_noise((3,), std=-1.0, generator=torch.Generator())
    assert torch.equal(gaussian_noise((3,), std=0.0, generator=torch.Generator()), torch.zeros(3))


def test_seeded_generators_are_reproducible_and_distinct():
    a = torch.randn(5, generator=seeded_generator(1, 2, 3))
    b = torch.randn(5, generator=seeded_generator(1, 2, 3))
    c = torch.randn(5, generator=seeded_generator(1, 3, 2))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_zero_gradient_drift_matches_promised_noise():
    """With zero gradients, T DP-SGLD steps move theta by sum_t alpha_t sigma_t C / L xi_t."""
    P, C, L, tau = 20_000, 0.8, 64.0, 0.5
    alphas = [0.3 * (1 + t / 10) ** -0.5 for t in range(15)]
    theta = torch.zeros(P)
    gen = torch.Generator().manual_seed(5)
    var = 0.0
    for a in alphas:
        sigma = math.sqrt(2 * a * tau)
        noisy = gaussian_noise((P,), std=sigma * C, generator=gen)  # the release's noise
        theta = langevin_update(
            theta, torch.zeros(P) + noisy, step_size=a, expected_batch=L, weight_decay=0.0
        )
        var += (a * sigma * C / L) ** 2
    sd = math.sqrt(var)
    d = theta.numpy()
    assert stats.kstest(d, "norm", args=(0, sd)).pvalue > 1e-3
    assert stats.kstest(d, "norm", args=(0, sd * 2 / 3)).pvalue < 1e-10
    assert stats.kstest(d, "norm", args=(0, sd * 3 / 2)).pvalue < 1e-10


def test_weight_decay_is_the_gaussian_prior_gradient():
    theta = torch.tensor([1.0, -2.0])
    out = langevin_update(
        theta,
        torch.tensor([0.5, 0.5]),
        step_size=0.1,
        expected_batch=2.0,
        weight_decay=0.3,
    )
    torch.testing.assert_close(out, theta - 0.1 * (torch.tensor([0.25, 0.25]) + 0.3 * theta))


def test_mlp_per_record_grads_match_loop():
    torch.manual_seed(2)
    fm = FlatModel(MLP(12, 3, hidden=8))
    x, y = torch.randn(5, 12), torch.randint(0, 3, (5,))
    theta = fm.flatten()
    torch.testing.assert_close(
        fm.per_record_grads(theta, x, y), _loop_grads(fm, theta, x, y), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("tau", [1.0])
def test_langevin_on_gaussian_target_recovers_mean_and_covariance(tau):
    """Per-record loss 1/2 (theta - x_i)^T A (theta - x_i), q = 1, no clipping bites.

    theta' = (I - alpha A) theta + alpha A xbar - alpha sigma C / N xi, sigma = sqrt(2 alpha tau):
    a Gaussian AR(1) chain whose stationary law is N(xbar, Sigma) with Sigma the solution of
    Sigma = M Sigma M^T + s^2 I, M = I - alpha A, s = alpha sigma C / N. 4,000 independent
    chains, 400 steps each (over 10 relaxation times), compared with Sigma within 10 %
    (sampling error of a covariance from 4,000 draws is about 2-3 %).
    """
    A = np.array([[2.0, 0.6], [0.6, 1.0]])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 2)) + np.array([1.0, -2.0])
    N, chains, alpha, C = x.shape[0], 4000, 0.05, 4.0
    sigma = math.sqrt(2 * alpha * tau)
    At = torch.tensor(A, dtype=torch.float64)
    xbar = torch.tensor(x.mean(0))
    theta = torch.zeros(chains * 2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    for _ in range(400):
        th = theta.view(chains, 2)
        summed = (N * (th - xbar) @ At.T).reshape(-1)  # sum_i A (theta - x_i)
        noisy = summed + gaussian_noise(
            summed.shape, std=sigma * C, generator=gen, dtype=summed.dtype
        )
        theta = langevin_update(
            theta, noisy, step_size=alpha, expected_batch=float(N), weight_decay=0.0
        )
    samples = theta.view(chains, 2).numpy()
    M = np.eye(2) - alpha * A
    s = alpha * sigma * C / N
    Sigma = solve_discrete_lyapunov(M, s**2 * np.eye(2))
    emp = np.cov(samples.T)
    se_mean = np.sqrt(np.diag(Sigma) / chains)
    assert np.all(np.abs(samples.mean(0) - x.mean(0)) < 5 * se_mean)
    rel = np.abs(emp - Sigma) / np.sqrt(np.outer(np.diag(Sigma), np.diag(Sigma)))
    assert rel.max() < 0.1, (emp, Sigma)
    # the test can tell a wrong temperature: 1.5 tau gives a covariance 50 % larger
    assert (
        np.abs(emp - 1.5 * Sigma) / np.sqrt(np.outer(np.diag(Sigma), np.diag(Sigma)))
    ).max() > 0.2
