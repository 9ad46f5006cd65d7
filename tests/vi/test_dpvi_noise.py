"""DPVI's released update against its documented distribution (not a noise std the test
takes from the code).

The server's DPVI step (README, :meth:`fedsgld.strategies.LangevinServer._vi_update`) with
the SGD optimiser is

    phi' = phi - alpha ((sum_k S_k + N(0, (sigma C)^2 I)) / L + grad KL(q || prior) / N),

L = q N, N = sum_k N_k, sigma = noise_multiplier, and for phi = [mu, rho], s = softplus(rho):

    dKL/dmu = mu / prior_std^2,   dKL/drho = (s / prior_std^2 - 1 / s) sigmoid(rho),

written out below without fedsgld's kl_gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld.clients.site import Site
from fedsgld.config import PrivacySettings
from fedsgld.models import LogisticRegression
from fedsgld.strategies import LangevinServer
from fedsgld.vi import VariationalModel


def _kl_grad_reference(phi: torch.Tensor, prior_std: float) -> torch.Tensor:
    phi = phi.double()
    p = phi.shape[0] // 2
    mu, rho = phi[:p], phi[p:]
    s = torch.log1p(torch.exp(rho))
    return torch.cat([mu / prior_std**2, (s / prior_std**2 - 1 / s) / (1 + torch.exp(-rho))])


def _dpvi(**kw) -> PrivacySettings:
    base = dict(
        method="dpvi", epsilon=1e4, delta=1e-5, sample_rate=0.05, clip=0.8, lr=0.02,
        noise_multiplier=1.3,
    )  # fmt: skip
    base.update(kw)
    return PrivacySettings(**base)


def test_dpvi_server_update_releases_the_documented_gaussian():
    P, sizes, q, C, sigma, alpha, prior = 10_000, [400, 600], 0.05, 0.8, 1.3, 0.02, 2.0
    g = torch.Generator().manual_seed(0)
    phi0 = torch.cat([0.5 * torch.randn(P, generator=g), 0.5 * torch.randn(P, generator=g) - 2])
    server = LangevinServer(
        _dpvi(), theta=phi0, site_sizes=sizes, seed=5, rounds=3, prior_std=prior,
        optimizer="sgd",
    )  # fmt: skip
    L, N = q * sum(sizes), sum(sizes)
    zs = []
    for _ in range(3):
        plan = server.plan()
        assert plan.sigma == sigma and plan.clip == C and plan.prenoise == 0.0
        before = server.theta.clone()
        after = server.mode.finish(plan, [torch.zeros(2 * P), torch.zeros(2 * P)])
        mean = before.double() - alpha * _kl_grad_reference(before, prior) / N
        z = ((after.double() - mean) / (alpha * sigma * C / L)).numpy()
        assert stats.kstest(z, "norm").pvalue > 1e-4
        for wrong in (2 / 3, 3 / 2):
            assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < 1e-10
        zs.append(z)
    for a, b in zip(zs, zs[1:]):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(2 * P)


def test_non_private_vi_adds_no_noise():
    server = LangevinServer(
        PrivacySettings(method="vi", lr=0.02), theta=torch.zeros(8), site_sizes=[10], seed=0,
        rounds=1, prior_std=1.0,
    )  # fmt: skip
    plan = server.plan()
    after = server.mode.finish(plan, [torch.ones(8)])
    expected = -0.02 * (torch.ones(8) / (0.05 * 10) + _kl_grad_reference(torch.zeros(8), 1.0) / 10)
    torch.testing.assert_close(after, expected.float())


def test_a_huge_record_moves_the_dpvi_site_sum_by_exactly_C():
    """Per-record ELBO gradients (with respect to [mu, rho]) are clipped at the site like
    DP-SGLD's: a record with a gradient of norm > 1e3 moves the released sum by exactly C."""
    torch.manual_seed(1)
    vm = VariationalModel(LogisticRegression(4, 3), init_std=0.3)
    x, y = torch.randn(25, 4), torch.randint(0, 3, (25,))
    x_big, y_big = torch.cat([x, torch.full((1, 4), 1e4)]), torch.cat([y, torch.tensor([1])])
    C = 0.1
    server = LangevinServer(
        _dpvi(sample_rate=1.0, clip=C), theta=vm.flatten(), site_sizes=[26], seed=0, rounds=1
    )
    plan = server.plan()
    phi = vm.flatten() + 0.05 * torch.randn(vm.size)

    def released(xs, ys, clip):
        site = Site(0, xs, ys, xs, ys, vm.module, seed=9, flat_model=vm)
        return site.clipped_sum(
            phi, round=0, sample_rate=plan.sample_rate, clip=clip, prenoise=plan.prenoise
        )

    a, b = released(x, y, plan.clip), released(x_big, y_big, plan.clip)
    assert (b - a).norm().item() == pytest.approx(C, rel=1e-4)
    assert (released(x_big, y_big, None) - released(x, y, None)).norm() > 1e3


def test_dpvi_noise_depends_on_the_runs_seed_and_adam_normalises_the_noisy_gradient():
    P = 2000
    steps = {}
    for seed, opt in ((1, "sgd"), (2, "sgd"), (1, "adam")):
        server = LangevinServer(
            _dpvi(), theta=torch.zeros(2 * P), site_sizes=[100], seed=seed, rounds=1,
            prior_std=1e6, optimizer=opt,
        )  # fmt: skip
        steps[seed, opt] = server.mode.finish(server.plan(), [torch.zeros(2 * P)]).clone()
    a, b = steps[1, "sgd"].numpy(), steps[2, "sgd"].numpy()
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(2 * P)
    # Adam's first step is alpha * g / (|g| + 1e-8): every coordinate moves by ~alpha,
    # in the direction of the same noisy gradient as SGD's (post-processing of it)
    adam = steps[1, "adam"].numpy()
    assert np.allclose(np.abs(adam), 0.02, rtol=1e-3)
    assert np.array_equal(np.sign(adam), np.sign(a))


def test_dpvi_site_draws_a_fresh_reparameterisation_every_round():
    """A DPVI site's sum has a data gradient in rho (through theta = mu + s * eps, eps drawn
    from the site's generator of the round), and a different one every round."""
    torch.manual_seed(2)
    vm = VariationalModel(LogisticRegression(4, 3), init_std=0.3)
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    site = Site(0, x, y, x, y, vm.module, seed=3, flat_model=vm)
    phi = vm.flatten()
    sums = [
        site.clipped_sum(phi, round=r, sample_rate=1.0, clip=100.0, prenoise=0.0) for r in (0, 1)
    ]
    assert all(s[vm.P :].abs().max() > 1e-4 for s in sums)
    assert not torch.allclose(sums[0][vm.P :], sums[1][vm.P :])
