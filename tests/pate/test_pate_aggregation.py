"""Noisy vote aggregation: histograms, and noise of the claimed distribution (KS tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld.core.noise import seeded_generator
from fedsgld.pate.aggregation import (
    combine_histograms,
    confident_gnmax,
    gnmax,
    gnmax_noisy_counts,
    laplace_noise,
    lnmax,
    lnmax_noisy_counts,
    site_histogram,
)


def test_site_histograms_sum_one_hot_votes():
    a = np.array([[0, 2, 1], [0, 1, 1]])  # site A: 2 teachers, 3 queries
    b = np.array([[2, 2, 1]])  # site B: 1 teacher
    ha, hb = site_histogram(a, num_classes=3), site_histogram(b, num_classes=3)
    assert ha.tolist() == [[2, 0, 0], [0, 1, 1], [0, 2, 0]]
    total = combine_histograms([ha, hb])
    assert total.tolist() == [[2, 0, 1], [0, 1, 2], [0, 3, 0]]
    assert total.sum(dim=1).tolist() == [3, 3, 3]  # one vote per teacher per query
    with pytest.raises(ValueError, match="num_classes"):
        site_histogram(np.array([[3]]), num_classes=3)


N = 20_000


@pytest.mark.parametrize("mechanism", ["lnmax", "gnmax"])
def test_aggregation_noise_has_claimed_scale(mechanism):
    counts = torch.tensor([[7, 3, 0, 0]] * (N // 4))
    g = seeded_generator(11, 0 if mechanism == "lnmax" else 1)
    if mechanism == "lnmax":
        gamma = 0.2
        noise = (lnmax_noisy_counts(counts, gamma=gamma, generator=g) - counts).ravel().numpy()
        dist = stats.laplace
        scale = 1 / gamma
    else:
        sigma = 3.0
        noise = (gnmax_noisy_counts(counts, sigma=sigma, generator=g) - counts).ravel().numpy()
        dist = stats.norm
        scale = sigma
    assert noise.shape == (N,)
    assert stats.kstest(noise, dist(scale=scale).cdf).pvalue > 1e-3
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(noise, dist(scale=wrong * scale).cdf).pvalue < 1e-6
    # Laplace is not Gaussian of the same variance (and vice versa): the test can tell.
    other = (
        stats.norm(scale=np.sqrt(2) * scale)
        if mechanism == "lnmax"
        else stats.laplace(scale=scale / np.sqrt(2))
    )
    assert stats.kstest(noise, other.cdf).pvalue < 1e-6


def test_laplace_noise_explicit_generator_and_reproducible():
    a = laplace_noise((1000,), scale=2.0, generator=seeded_generator(3))
    b = laplace_noise((1000,), scale=2.0, generator=seeded_generator(3))
    assert torch.equal(a, b) and torch.isfinite(a).all()
    with pytest.raises(TypeError):
        laplace_noise((3,), scale=1.0, generator=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        laplace_noise((3,), scale=-1.0, generator=seeded_generator(0))


def test_argmax_mechanisms():
    counts = torch.tensor([[100, 0, 0], [0, 0, 100], [3, 3, 3]])
    g = seeded_generator(5)
    assert lnmax(counts, gamma=1.0, generator=g)[:2].tolist() == [0, 2]
    assert gnmax(counts, sigma=1.0, generator=g)[:2].tolist() == [0, 2]
    # A near-tie is answered uniformly-ish by heavy noise: class frequencies near 1/3.
    many = torch.tensor([[3, 3, 3]] * 3000)
    freq = torch.bincount(lnmax(many, gamma=0.2, generator=g), minlength=3) / 3000
    assert torch.all((freq - 1 / 3).abs() < 0.05)
    with pytest.raises(ValueError, match="gamma"):
        lnmax(counts, gamma=0.0, generator=g)
    with pytest.raises(ValueError, match="sigma"):
        gnmax(counts, sigma=-1.0, generator=g)


def test_confident_gnmax_threshold():
    counts = torch.tensor([[50, 0, 0]] * 500 + [[10, 20, 20]] * 500)
    labels, answered = confident_gnmax(
        counts, threshold=35.0, sigma1=3.0, sigma2=2.0, generator=seeded_generator(9)
    )
    assert answered[:500].all() and not answered[500:].any()
    assert (labels[:500] == 0).all() and (labels[500:] == -1).all()
    # At max count == threshold the check passes with probability 1/2.
    _, half = confident_gnmax(
        torch.tensor([[20, 0]] * 4000), threshold=20.0, sigma1=5.0, sigma2=1.0,
        generator=seeded_generator(10),
    )  # fmt: skip
    assert abs(half.double().mean().item() - 0.5) < 0.03
