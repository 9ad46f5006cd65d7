"""Pre-noise from sub-streams: exactly N(0, rho^2) per value, independent across records and
sub-streams, the same numbers for a seed whatever the thread count, fresh every draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld.core.noise import Randomness, seeded_generator
from fedsgld.core.prenoise import SUBSTREAMS, PrenoiseRows, prenoise_values, substreams

STD = 0.3
N = 8 * 40_000  # 40,000 values from each sub-stream


def _blocks(z: torch.Tensor) -> list[np.ndarray]:
    n = z.numel()
    edges = [n * j // SUBSTREAMS for j in range(SUBSTREAMS + 1)]
    return [z[edges[j] : edges[j + 1]].double().numpy() for j in range(SUBSTREAMS)]


def test_every_substream_is_the_claimed_normal_and_not_a_wrong_one():
    z = prenoise_values(N, std=STD, generator=seeded_generator(7, 1))
    assert z.dtype == torch.float32 and z.shape == (N,)
    for block in _blocks(z):
        assert stats.kstest(block, "norm", args=(0.0, STD)).pvalue > 1e-4
        for wrong in (STD * 2 / 3, STD * 3 / 2):  # a test that can fail
            assert stats.kstest(block, "norm", args=(0.0, wrong)).pvalue < 1e-8
    assert stats.kstest(z.double().numpy(), "norm", args=(0.0, STD)).pvalue > 1e-4


def test_records_and_substreams_are_uncorrelated():
    B, P = 64, 5_000  # a chunk: B records of P parameters, record-major like param_blocks
    z = prenoise_values(B * P, std=1.0, generator=seeded_generator(2, 9)).double()
    rows = z.view(B, P).numpy()
    r = np.corrcoef(rows)[np.triu_indices(B, 1)]  # under independence each ~ N(0, 1/P)
    assert np.abs(r).max() < 5.5 / np.sqrt(P)
    assert abs(r.mean()) < 4 / np.sqrt(P * len(r))
    # the records' squared norms: chi^2_P each
    assert stats.kstest((rows**2).sum(1), "chi2", args=(P,)).pvalue > 1e-4
    blocks = _blocks(z)
    m = min(len(b) for b in blocks)
    c = np.corrcoef(np.stack([b[:m] for b in blocks]))[np.triu_indices(SUBSTREAMS, 1)]
    assert np.abs(c).max() < 5 / np.sqrt(m)
    # lagged: the start of each sub-stream against the next one's, shifted by one
    for a, b in zip(blocks, blocks[1:], strict=False):
        assert abs(np.corrcoef(a[: m - 1], b[1:m])[0, 1]) < 5 / np.sqrt(m)


def test_a_seed_gives_the_same_numbers_at_any_thread_count():
    ref = prenoise_values(10_010, std=STD, generator=seeded_generator(4, 4), threads=1)
    for threads in (2, 3, 8, 64):
        again = prenoise_values(10_010, std=STD, generator=seeded_generator(4, 4), threads=threads)
        assert torch.equal(ref, again)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # the background draw on two threads
        rows = PrenoiseRows(7, 1_430, std=STD, generator=seeded_generator(4, 4), background=True)
        assert torch.equal(rows.result(), ref)
    finally:
        torch.set_num_threads(n)


def test_every_draw_has_fresh_streams():
    g = seeded_generator(5, 0)
    a, b = (prenoise_values(4_000, std=1.0, generator=g) for _ in range(2))
    assert not torch.equal(a, b)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 5 / np.sqrt(4_000)
    # the party's generator moved on by the key's draw only: the next key differs
    g1, g2 = seeded_generator(5, 0), seeded_generator(5, 0)
    s1, s2 = substreams(g1), substreams(g2)
    assert all(torch.equal(x.get_state(), y.get_state()) for x, y in zip(s1, s2, strict=True))
    assert not any(
        torch.equal(x.get_state(), y.get_state()) for x, y in zip(s1, substreams(g1), strict=True)
    )
    states = {bytes(s.get_state().numpy()) for s in s1}
    assert len(states) == SUBSTREAMS  # no two sub-streams alike


def test_os_randomness_gives_unrelated_substreams():
    r = Randomness.system(secure=False)
    a = prenoise_values(2_000, std=1.0, generator=r.generator(1, 0))
    b = prenoise_values(2_000, std=1.0, generator=r.generator(1, 0))  # the same key: fresh
    assert not torch.equal(a, b)


def test_small_draws_and_refusals():
    z = prenoise_values(3, std=STD, generator=seeded_generator(1))  # fewer values than streams
    assert z.shape == (3,) and torch.isfinite(z).all()
    assert torch.equal(prenoise_values(5, std=0.0, generator=seeded_generator(1)), torch.zeros(5))
    with pytest.raises(ValueError, match="std"):
        prenoise_values(5, std=float("nan"), generator=seeded_generator(1))
