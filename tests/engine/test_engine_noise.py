"""End to end: one engine round releases the documented amount of noise.

The accuracy checks of the end-to-end tests would also pass with no noise and no clipping;
this one would not. After one DP-SGLD round from theta_0 (README, "The algorithm"):

    V := (theta_0 - theta_1) L / (alpha_0 C) = sum_k S_k / C + sigma_0 * xi,

with L = q N, sigma_0 = sqrt(2 alpha_0 tau) and xi ~ N(0, I_P) at the server (placement
"server") or a sum of K independent such draws, one per site (placement "sites", one
local step, parameters averaged with weights N_k / N). DPVI (SGD optimiser) releases
phi_1 = phi_0 - alpha ((sum_k S_k + sigma C xi) / L + grad KL(phi_0) / N) with the constant
sigma = noise_multiplier; the KL term is subtracted first (its formula written out below). Every record's clipped
contribution has norm <= C, so | ||V|| - sigma_0 ||xi|| | <= |B|, the number of sampled
records, and ||xi|| concentrates at sqrt(P) (its sd is about 1/sqrt(2)). The model is
large (P = 54,595) and tau high, so sigma_0 sqrt(P) ~ 1,000 dwarfs |B| (~24): the norm
tells the documented noise apart from none, 2/3 or 3/2 of it.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.federation import Federation

ONE_ROUND = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 3,
    "rounds": 1,
    "method": "dpsgld",
    "sample_rate": 0.05,
    "clip": 1.0,
    "prenoise": 0.01,
    "lr": 0.2,
    "temperature": 50.0,
    "epsilon": 1.0,
    "eval_every": 0,
    "checkpoint_every": 1,
    "max_samples": 0,
    "seed": 2,
}


def _kl_grad(phi: torch.Tensor, prior_std: float) -> torch.Tensor:
    """d KL(N(mu, softplus(rho)^2) || N(0, prior_std^2)) / d[mu, rho]."""
    phi = phi.double()
    mu, rho = phi[: phi.numel() // 2], phi[phi.numel() // 2 :]
    s = torch.log1p(torch.exp(rho))
    return torch.cat([mu / prior_std**2, (s / prior_std**2 - 1 / s) * torch.sigmoid(rho)])


@pytest.mark.parametrize(
    ("method", "placement"), [("dpsgld", "server"), ("dpsgld", "sites"), ("dpvi", "server")]
)
def test_one_round_releases_the_documented_noise(tmp_path, method, placement):
    over = {"method": method, "noise_placement": placement}
    if method == "dpvi":
        over.update(noise_multiplier=4.0, optimizer="sgd", prior_std=1.0)
    cfg = load_config(None, {**ONE_ROUND, **over})
    fed = Federation(cfg, log=lambda s: None)
    theta0 = fed.make_server().theta.clone()
    sizes = [s.num_train for s in fed.sites]
    engine.run(cfg, out_dir=tmp_path / "run", progress=False, log=lambda s: None)
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    theta1 = ckpt["server"]["theta"]
    assert ckpt["server"]["t"] == 1

    q, C, alpha0, N = 0.05, 1.0, 0.2, sum(sizes)
    sigma0 = math.sqrt(2 * alpha0 * 50.0) if method == "dpsgld" else 4.0
    P = theta0.numel()
    draws = 1 if placement == "server" else len(sizes)
    step = (theta0 - theta1).double()
    if method == "dpvi":
        step -= alpha0 * _kl_grad(theta0, 1.0) / N
    v = (step * q * N / (alpha0 * C)).norm().item()
    batch_max = q * N + 8 * math.sqrt(q * N) + 8  # |B| ~ Binomial(N, q): never above this
    noise = sigma0 * math.sqrt(draws * P)
    slack = 5 * sigma0 * math.sqrt(draws) + batch_max
    assert batch_max < 0.1 * noise  # the data term cannot hide a wrong noise scale
    assert noise - slack <= v <= noise + slack
    for wrong in (0.0, 2 / 3, 3 / 2):
        assert not (wrong * noise - slack <= v <= wrong * noise + slack)
