"""The noise function's and the clip's contracts at the edge values the statistical tests
do not visit (these tests kill mutants that survived `make mutation`; see the README)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld.core.clipping import clip_and_sum
from fedsgld.core.mechanism import langevin_update
from fedsgld.core.noise import gaussian_noise, os_seed, seeded_generator


@pytest.mark.parametrize("std", [1.0, 0.5, 3.0])
def test_noise_of_every_std_has_that_std(std):
    """std = 1 is a common noise multiplier; it must not be special-cased."""
    z = gaussian_noise((20_000,), std=std, generator=seeded_generator(3)).double().numpy()
    assert stats.kstest(z / std, "norm").pvalue > 1e-4
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(z / std, "norm", args=(0.0, wrong)).pvalue < 1e-10


@pytest.mark.parametrize("std", [math.inf, math.nan, -1e-9, -math.inf])
def test_non_finite_or_negative_std_is_refused(std):
    with pytest.raises(ValueError, match=r"^noise std must be finite and >= 0, got "):
        gaussian_noise((3,), std=std, generator=seeded_generator(0))


def test_zero_std_gives_zeros_of_the_requested_dtype():
    z = gaussian_noise((4,), std=0.0, generator=seeded_generator(0), dtype=torch.float64)
    assert z.dtype == torch.float64 and torch.count_nonzero(z) == 0
    z = gaussian_noise((4,), std=0.5, generator=seeded_generator(0), dtype=torch.float64)
    assert z.dtype == torch.float64 and torch.count_nonzero(z) == 4


def test_noise_without_a_generator_is_refused_by_name():
    with pytest.raises(
        TypeError, match=r"^gaussian_noise needs an explicit torch\.Generator \(generator=\.\.\.\)$"
    ):
        gaussian_noise((3,), std=1.0, generator=np.random.default_rng(0))  # type: ignore[arg-type]


def test_seeded_streams_are_distinct_for_distinct_keys():
    """(seed, stream, round) keys, as the server and the sites use them: every key gets its
    own stream, the order of the parts matters, negative parts are refused."""
    keys = [(s, k, r) for s in range(3) for k in range(5) for r in range(40)]
    keys += [(s, k, r, 1) for s in range(2) for k in range(1, 4) for r in range(20)]
    first = {torch.randn(4, generator=seeded_generator(*key)).numpy().tobytes() for key in keys}
    assert len(first) == len(keys)
    a = torch.randn(4, generator=seeded_generator(1, 2, 3))
    assert torch.equal(a, torch.randn(4, generator=seeded_generator(1, 2, 3)))
    with pytest.raises(ValueError, match=r"^generator key parts must be >= 0, got \(0, -1\)$"):
        seeded_generator(0, -1)


def test_os_seed_is_a_fresh_63_bit_integer():
    seeds = [os_seed() for _ in range(8)]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 8
    assert max(seeds) >= 2**56  # 63 random bits, not a small range


def test_clip_refuses_a_non_matrix_and_prenoise_without_a_generator():
    with pytest.raises(
        ValueError, match=r"^per_record must be \(records, params\), got shape \(3,\)$"
    ):
        clip_and_sum(torch.zeros(3), clip=1.0)
    with pytest.raises(ValueError, match=r"^prenoise > 0 needs an explicit torch\.Generator$"):
        clip_and_sum(torch.zeros(2, 3), clip=1.0, prenoise=0.1)


def test_clip_leaves_short_rows_alone_and_scales_long_rows_to_exactly_C():
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    out = clip_and_sum(rows, clip=1.0)
    torch.testing.assert_close(
        out, torch.tensor([0.6 + 0.3 + 0.6, 0.8 + 0.4 + 0.8], dtype=torch.float64)
    )
    assert torch.isfinite(clip_and_sum(torch.zeros(2, 3), clip=1.0)).all()


def test_langevin_update_validates_the_batch_size_and_step_size():
    def step(L, alpha):
        return langevin_update(
            torch.zeros(3), torch.ones(3), step_size=alpha, expected_batch=L, weight_decay=0.0,
        )  # fmt: skip

    torch.testing.assert_close(step(0.5, 0.1), torch.full((3,), -0.2))  # L < 1 is valid
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"^expected batch size must be > 0, got "):
            step(bad, 0.1)
    for bad in (0.0, -0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^step size must be finite and > 0, got "):
            step(1.0, bad)


def test_clip_of_tiny_rows_never_exceeds_C():
    """Rows with norms near the 1e-12 guard of the division are left as they are."""
    norms = torch.tensor([1e-13, 5e-13, 9e-13, 1e-12, 2e-12], dtype=torch.float64)
    rows = torch.stack([torch.tensor([n, 0.0], dtype=torch.float64) for n in norms])
    for i in range(len(rows)):
        out = clip_and_sum(rows[i : i + 1], clip=0.5)
        assert out.norm() <= 0.5
        torch.testing.assert_close(out, rows[i], rtol=1e-6, atol=0.0)


def test_clip_none_is_the_plain_sum_and_prenoise_keeps_the_dtype():
    rows = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    torch.testing.assert_close(clip_and_sum(rows, clip=None), rows.sum(0))
    out = clip_and_sum(rows, clip=1.0, prenoise=0.1, generator=seeded_generator(0))
    assert out.dtype == torch.float64 and out.shape == (3,)


def test_unclipped_sum_over_several_chunks_is_the_whole_sum():
    from fedsgld.core.mechanism import FlatModel, clipped_gradient_sum
    from fedsgld.models import LogisticRegression

    torch.manual_seed(0)
    fm = FlatModel(LogisticRegression(4, 3))
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    theta = fm.flatten()
    whole = fm.per_record_grads(theta, x, y).sum(0)
    for chunk in (2, 3, 7):
        torch.testing.assert_close(
            clipped_gradient_sum(fm, theta, x, y, clip=None, chunk_size=chunk), whole,
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip


def test_seeded_generators_use_the_full_63_bit_seed_space():
    """The key derivation does not hash a seed down to a small range (what the generator
    then keeps of it is torch's: 32 bits on the CPU; deployments do not use seeds, see
    tests/privacy/test_os_streams.py)."""
    seeds = [seeded_generator(os_seed(), 0, t).initial_seed() for t in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert sum(s >= 2**62 for s in seeds) >= 16  # about half of them, if uniform
