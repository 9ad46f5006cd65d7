"""Many sites' clipped sums in one per-record pass against each site's own pass.

Each site keeps its own Poisson sample, pre-noise and sum (its own generator, same
streams), so the batched sums must equal the per-site sums to float rounding, for the MLP
and the paper CNN, with and without pre-noise, with canaries, and with sites whose sample
spans several chunks or is empty; a variational model falls back to the per-site path.
"""

from __future__ import annotations

import pytest
import torch

from fedsgld.clients.site import Site, can_batch, clipped_sums
from fedsgld.config import PerfSettings
from fedsgld.core.noise import Randomness
from fedsgld.models import build_model
from fedsgld.vi.model import VariationalModel

SHAPE = (1, 28, 28)


class Canaries:
    """Records given by their gradients: fixed rows of norm 3 (clipped to C)."""

    def __init__(self, count: int, size: int) -> None:
        gen = torch.Generator().manual_seed(11)
        rows = torch.randn(count, size, generator=gen)
        self.rows = 3.0 * rows / rows.norm(dim=1, keepdim=True)
        self.count = count

    def gradients(self, index: torch.Tensor, clip: float | None) -> torch.Tensor:
        return self.rows[index]


def _sites(model_name: str, sizes: list[int], *, chunk_size: int = 256, vi: bool = False):
    torch.manual_seed(0)
    model = build_model(model_name, input_shape=SHAPE, num_classes=10, hidden=32)
    rnd = Randomness.seeded(5)
    out = []
    for k, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(100 + k)
        x = torch.rand(n, *SHAPE, generator=gen)
        y = torch.randint(0, 10, (n,), generator=gen)
        fm = VariationalModel(model) if vi else None
        out.append(
            Site(
                k, x, y, x[:2], y[:2], model, chunk_size=chunk_size, flat_model=fm, randomness=rnd
            )  # fmt: skip
        )
    return out


def _compare(sites, *, clip=1.0, prenoise=0.01, sample_rate=0.3, round_=2) -> list[torch.Tensor]:
    theta = sites[0].fm.flatten() * 1.5
    kw = dict(round=round_, sample_rate=sample_rate, clip=clip, prenoise=prenoise)
    ref = clipped_sums(sites, theta, batched=False, **kw)
    got = clipped_sums(sites, theta, batched=True, **kw)
    assert len(got) == len(ref)
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape and g.device == r.device
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * max(float(r.norm()), 1e-3))
    return ref


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_batched_sums_equal_each_sites_own_pass(model_name):
    sites = _sites(model_name, [12, 0, 30, 5, 21, 1])
    assert can_batch(sites)
    ref = _compare(sites)
    assert float(ref[1].abs().max()) == 0.0  # the site without records sends zeros
    assert sum(float(r.norm()) > 0 for r in ref) >= 4  # the sums are not trivially zero


def test_batched_sums_span_chunks_and_batches_and_clip_without_prenoise():
    """Samples larger than a chunk (several pre-noise draws per site) and batches that
    cut between sites; then the norm-first case (no pre-noise)."""
    sites = _sites("mlp", [40, 3, 55, 17], chunk_size=4)
    _compare(sites, sample_rate=0.6)
    _compare(sites, sample_rate=0.6, prenoise=0.0)


def test_batched_sums_keep_each_sites_canaries():
    sites = _sites("cnn", [10, 14, 8])
    canaries = Canaries(6, sites[0].fm.size)
    sites[1].extra_records = canaries
    with_canaries = _compare(sites, sample_rate=0.5)
    sites[1].extra_records = None
    without = clipped_sums(sites, sites[0].fm.flatten() * 1.5, round=2, sample_rate=0.5,
                           clip=1.0, prenoise=0.01, batched=True)  # fmt: skip
    # the canaries move site 1's sum only
    assert not torch.equal(with_canaries[1], without[1])
    torch.testing.assert_close(with_canaries[0], without[0], rtol=1e-5, atol=1e-6)


def test_a_sites_batched_sum_depends_on_its_own_stream_only():
    """Site 0's sum is the same whether it is batched with others or alone."""
    sites = _sites("mlp", [25, 30, 12])
    theta = sites[0].fm.flatten()
    kw = dict(round=4, sample_rate=0.4, clip=1.0, prenoise=0.01, batched=True)
    together = clipped_sums(sites, theta, **kw)
    alone = clipped_sums(sites[:1], theta, **kw)  # one site: its own pass
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(together[0], together[1])


def test_variational_sites_fall_back_to_their_own_pass():
    sites = _sites("mlp", [10, 12], vi=True)
    assert not can_batch(sites)
    theta = sites[0].fm.flatten()
    kw = dict(round=1, sample_rate=0.5, clip=1.0, prenoise=0.01)
    got = clipped_sums(sites, theta, batched=True, **kw)
    ref = clipped_sums(sites, theta, batched=False, **kw)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)


def test_site_pass_setting():
    assert not PerfSettings().batched_sites(4)
    assert PerfSettings().batched_sites(8)
    assert PerfSettings(site_pass="batched").batched_sites(2)
    assert not PerfSettings(site_pass="per_site").batched_sites(1024)
    with pytest.raises(ValueError, match="site_pass"):
        PerfSettings(site_pass="vector")
