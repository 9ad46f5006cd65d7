"""DPVI: per-record ELBO gradients, the KL term, agreement with a reference, the budget."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.models import LogisticRegression
from fedsgld.strategies import LangevinServer
from fedsgld.vi import VariationalModel, kl_divergence, kl_gradient
from fedsgld.vi.model import inverse_softplus


def _logreg_data(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    w = torch.tensor([1.5, -1.0])
    y = (torch.rand(n, generator=g) < torch.sigmoid(x @ w + 0.3)).long()
    return x, y


def test_per_record_elbo_grads_match_a_loop():
    torch.manual_seed(0)
    vm = VariationalModel(LogisticRegression(4, 3), init_std=0.3)
    phi = vm.flatten() + 0.1 * torch.randn(vm.size)
    vm.begin_step(torch.Generator().manual_seed(1))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    vec = vm.per_record_grads(phi, x, y)
    rows = []
    for i in range(6):
        p = phi.clone().requires_grad_(True)
        theta = p[: vm.P] + F.softplus(p[vm.P :]) * vm._eps
        loss = F.cross_entropy(vm.logits(theta, x[i : i + 1]), y[i : i + 1])
        rows.append(torch.autograd.grad(loss, p)[0])
    torch.testing.assert_close(vec, torch.stack(rows), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        vm.summed_grad(phi, x, y), torch.stack(rows).sum(0), rtol=1e-5, atol=1e-6
    )
    assert vec[:, vm.P :].abs().max() > 0  # rho gets a data gradient through the draw


def test_kl_gradient_matches_autograd():
    phi = torch.randn(10, dtype=torch.float64)
    p = phi.clone().requires_grad_(True)
    P = 5
    s = F.softplus(p[P:])
    kl = torch.sum(math.log(2.0) - torch.log(s) + (s**2 + p[:P] ** 2) / (2 * 4.0) - 0.5)
    (g,) = torch.autograd.grad(kl, p)
    torch.testing.assert_close(kl_gradient(phi, prior_std=2.0), g)
    assert kl_divergence(phi, prior_std=2.0) == pytest.approx(kl.item())


def _vi_run(x, y, *, steps, lr, method="vi", clip=1.0, noise=1.0, epsilon=10.0, seed=0):
    cfg = load_config(
        None,
        {
            "method": method,
            "lr": lr,
            "sample_rate": 1.0,
            "clip": clip,
            "noise_multiplier": noise,
            "epsilon": epsilon,
            "optimizer": "adam",
            "prior_std": 3.0,
            "vi_init_std": 0.1,
            "rounds": steps,
        },
    )
    vm = VariationalModel(LogisticRegression(2, 2), init_std=0.1)
    from fedsgld.clients.site import Site

    site = Site(0, x, y, x[:5], y[:5], vm.module, seed=seed, flat_model=vm)
    phi0 = torch.cat(
        [torch.zeros(vm.P), torch.full((vm.P,), inverse_softplus(0.1))]
    )  # mu = 0, std 0.1
    server = LangevinServer(
        cfg.privacy,
        theta=phi0,
        site_sizes=[len(y)],
        seed=seed,
        rounds=steps,
        prior_std=3.0,
        optimizer="adam",
    )
    trace = []
    while (plan := server.plan()) is not None:
        s = site.clipped_sum(
            server.theta,
            round=plan.round,
            sample_rate=plan.sample_rate,
            clip=plan.clip,
            prenoise=plan.prenoise,
        )
        server.mode.finish(plan, [s])
        trace.append(server.theta.clone())
    return vm, server, trace


def _elbo(vm, phi, x, y, draws=200):
    gen = torch.Generator().manual_seed(7)
    mu, rho = vm.split(phi)
    s = F.softplus(rho)
    ll = 0.0
    for _ in range(draws):
        theta = mu + s * torch.randn(vm.P, generator=gen)
        ll += -F.cross_entropy(vm.logits(theta, x), y, reduction="sum").item()
    return ll / draws - kl_divergence(phi, prior_std=3.0)


def test_non_private_vi_agrees_with_the_mean_field_laplace_reference():
    """Reference: MAP by L-BFGS and the Hessian H of the negative log posterior there. For a
    near-Gaussian posterior the mean-field optimum has mean ~ MAP and std 1/sqrt(diag H).
    Tolerances: |mean - MAP| < 0.25 reference std; std within 25 % (one MC draw per step,
    Adam at a constant step, iterates averaged over the last 500 of 2,500 steps)."""
    x, y = _logreg_data()
    vm, server, trace = _vi_run(x, y, steps=2500, lr=0.01)
    phi = torch.stack(trace[-500:]).mean(0)
    mu, rho = vm.split(phi)
    std = F.softplus(rho)

    def neg_log_post(theta):
        return F.cross_entropy(vm.logits(theta, x), y, reduction="sum") + (theta**2).sum() / (
            2 * 9.0
        )

    theta = torch.zeros(vm.P, requires_grad=True)
    opt = torch.optim.LBFGS(
        [theta], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        loss = neg_log_post(theta)
        loss.backward()
        return loss

    opt.step(closure)
    H = torch.autograd.functional.hessian(neg_log_post, theta.detach())
    ref_std = 1.0 / torch.sqrt(torch.diag(H))
    assert torch.all((mu - theta.detach()).abs() < 0.25 * ref_std), (mu, theta, ref_std)
    rel = (std / ref_std - 1).abs()
    assert torch.all(rel < 0.25), (std, ref_std)
    # and the ELBO went up
    assert _elbo(vm, phi, x, y) > _elbo(vm, trace[0], x, y) + 10


def test_kl_is_added_after_the_noise_and_unclipped():
    cfg = load_config(None, {"method": "vi", "lr": 0.5, "sample_rate": 0.5, "rounds": 1})
    vm = VariationalModel(LogisticRegression(2, 2))
    phi = torch.randn(vm.size)
    server = LangevinServer(
        cfg.privacy, theta=phi, site_sizes=[40, 60], seed=0, rounds=1, prior_std=2.0
    )
    plan = server.plan()
    server.mode.finish(plan, [torch.zeros(vm.size)])
    expected = phi - 0.5 * kl_gradient(phi, prior_std=2.0) / 100
    torch.testing.assert_close(server.theta, expected)


def test_dpvi_run_stays_within_budget(tmp_path):
    cfg = load_config(
        None,
        {
            "dataset": "breast_cancer",
            "model": "logreg",
            "sites": 3,
            "method": "dpvi",
            "epsilon": 1.0,
            "delta": 1e-5,
            "sample_rate": 0.1,
            "clip": 1.0,
            "noise_multiplier": 1.5,
            "lr": 0.05,
            "optimizer": "adam",
            "rounds": 400,
            "eval_every": 0,
            "max_samples": 0,
            "checkpoint_every": 0,
            "vi_samples": 10,
            "seed": 1,
        },
    )
    res = engine.run(cfg, out_dir=tmp_path / "dpvi", progress=False, log=lambda s: None)
    pr = res["privacy"]
    assert pr["halted"] and pr["epsilon"]["pld"] <= 1.0
    assert res["metrics"]["pooled"]["accuracy"] > 0.85  # breast cancer is easy even privately
    assert set(res["metrics"]["sites"]) == {"0", "1", "2"}
    assert np.isfinite(res["metrics"]["pooled"]["ece"])
