"""SWAG fitted to a chain's kept iterates: moments, sampler, and a Gaussian target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsgld.posteriors.swag import SwagMoments
from fedsgld.strategies import PosteriorSamples

# target N(m, S) with correlated coordinates
M = np.array([1.0, -2.0, 0.5, 3.0])
S = np.array(
    [
        [1.0, 0.6, 0.0, 0.2],
        [0.6, 2.0, -0.3, 0.0],
        [0.0, -0.3, 0.5, 0.1],
        [0.2, 0.0, 0.1, 1.5],
    ]
)
H = 0.2  # Langevin step size


def _ula_stationary_cov() -> np.ndarray:
    """Exact stationary covariance of the unadjusted Langevin chain below (an AR(1)):
    C = B C B^T + 2 H I with B = I - H S^-1, solved by iterating to convergence."""
    b = np.eye(4) - H * np.linalg.inv(S)
    c = np.eye(4)
    for _ in range(2000):
        c = b @ c @ b.T + 2 * H * np.eye(4)
    return c


def _chain(collector: PosteriorSamples, steps: int, seed: int) -> list[np.ndarray]:
    """Langevin on the Gaussian target; every iterate offered to ``collector``; returns
    the iterates the collector's rule keeps (after burn_in, every thin-th)."""
    rng = np.random.default_rng(seed)
    a = np.linalg.inv(S)
    x = np.zeros(4)
    kept = []
    noise = rng.standard_normal((steps, 4)) * np.sqrt(2 * H)
    for t in range(1, steps + 1):
        x = x - H * a @ (x - M) + noise[t - 1]
        collector.offer(t, torch.from_numpy(x))
        if t > collector.burn_in and (t - collector.burn_in) % collector.thin == 0:
            kept.append(x.copy())
    return kept


@pytest.fixture(scope="module")
def fitted():
    post = PosteriorSamples(burn_in=200, thin=10, max_samples=5, swag_rank=300)
    kept = _chain(post, 40_200, seed=0)
    return post, np.array(kept)


def test_swag_mean_and_variance_are_the_kept_iterates(fitted):
    post, kept = fitted
    swag = post.swag
    assert len(swag) == len(kept) == 4000
    assert len(post) == 5  # max_samples keeps the latest 5; SWAG saw all 4000
    np.testing.assert_allclose(swag.mean.numpy(), kept.mean(axis=0), rtol=0, atol=1e-10)
    np.testing.assert_allclose(swag.variance.numpy(), kept.var(axis=0), rtol=1e-9)
    # the deviations are those of the last 300 iterates from the running mean after each
    assert swag.used_rank == 300
    running = np.cumsum(kept, axis=0) / np.arange(1, len(kept) + 1)[:, None]
    dev = (kept - running)[-300:]
    np.testing.assert_allclose(torch.stack(list(swag.deviations)).numpy(), dev, rtol=0, atol=1e-5)


def test_swag_matches_the_gaussian_target(fitted):
    post, _ = fitted
    swag = post.swag
    c = _ula_stationary_cov()  # the chain's exact stationary law is N(M, c)
    # tolerances: about twice the largest error over seeds 0, 1, 2
    np.testing.assert_allclose(swag.mean.numpy(), M, atol=0.1)
    np.testing.assert_allclose(swag.variance.numpy(), np.diag(c), rtol=0.15)
    # SWAG's covariance: (diag + low rank) / 2, i.e. the full covariance's diagonal and
    # half its off-diagonal entries
    expected = 0.5 * (np.diag(np.diag(c)) + c)
    np.testing.assert_allclose(swag.covariance().numpy(), expected, atol=0.2)


def test_swag_draws_have_the_fitted_mean_and_covariance(fitted):
    post, _ = fitted
    swag = post.swag
    g = torch.Generator().manual_seed(5)
    draws = torch.stack(swag.sample(20_000, generator=g)).double().numpy()
    cov = swag.covariance().numpy()
    se = np.sqrt(np.diag(cov) / len(draws))
    assert np.all(np.abs(draws.mean(axis=0) - swag.mean.numpy()) < 5 * se)
    np.testing.assert_allclose(np.cov(draws.T), cov, atol=0.06 * np.abs(cov).max())
    # the same generator state gives the same draws; another seed different ones
    again = swag.sample(3, generator=torch.Generator().manual_seed(5))
    other = swag.sample(3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(again[0], torch.from_numpy(draws[0]).float())
    assert not torch.equal(again[0], other[0])


def test_diagonal_swag_samples_the_iterates_variance():
    swag = SwagMoments(0)
    rng = np.random.default_rng(1)
    xs = rng.normal([0.0, 5.0], [1.0, 0.1], size=(500, 2))
    for x in xs:
        swag.update(torch.from_numpy(x))
    assert swag.used_rank == 0 and len(swag.deviations) == 0
    draws = torch.stack(swag.sample(20_000, generator=torch.Generator().manual_seed(0)))
    np.testing.assert_allclose(draws.double().var(dim=0).numpy(), xs.var(axis=0), rtol=0.05)


def test_variance_keeps_its_digits_around_a_large_mean():
    # float32 E[x^2] - E[x]^2 would lose everything here; Welford in float64 does not
    swag = SwagMoments(2)
    xs = 1e4 + 1e-3 * np.array([-1.0, 1.0, -1.0, 1.0])
    for x in xs:
        swag.update(torch.tensor([x], dtype=torch.float64))
    np.testing.assert_allclose(swag.variance.numpy(), [1e-6], rtol=1e-6)


def test_state_round_trip_and_errors():
    a = SwagMoments(3)
    for i in range(5):
        a.update(torch.tensor([float(i), float(i * i)]))
    b = SwagMoments(3)
    b.load_state_dict(a.state_dict())
    assert b.n == 5 and torch.equal(b.mean, a.mean) and torch.equal(b.variance, a.variance)
    assert [d.tolist() for d in b.deviations] == [d.tolist() for d in a.deviations]
    with pytest.raises(ValueError, match="rank"):
        SwagMoments(2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="swag_rank"):
        SwagMoments(-1)
    with pytest.raises(ValueError, match="no iterates"):
        SwagMoments(1).sample(1, generator=torch.Generator())
    with pytest.raises(TypeError, match="Generator"):
        a.sample(1, generator=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        a.update(torch.zeros(3))


def test_collector_without_swag_and_with_max_samples_zero():
    post = PosteriorSamples(burn_in=1, thin=2, max_samples=0, swag_rank=2)
    for t in range(1, 8):
        post.offer(t, torch.tensor([float(t)]))
    assert len(post) == 0 and len(post.swag) == 3  # steps 3, 5, 7
    assert post.swag.mean.item() == pytest.approx(5.0)
    plain = PosteriorSamples(burn_in=1, thin=2, max_samples=2)
    assert plain.swag is None and plain.state_dict()["swag"] is None
    with pytest.raises(ValueError, match="SWAG"):
        post.load_state_dict(plain.state_dict())
