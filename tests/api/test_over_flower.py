"""The same objects over Flower: a user's model factory and tensors drive the project's
ServerApp and ClientApp (Flower's Grid in this process), with the engine's numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedsgld

SETTINGS = {
    "rounds": 8,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 2.0,
    "epsilon": 30.0,
    "eval_every": 4,
    "burn_in": 4,
    "thin": 2,
    "max_samples": 3,
    "seed": 5,
}


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 5, generator=g)
    x[:, 0] += 2.5 * y
    return x, y


class Net(nn.Module):
    """A user's module: a LayerNorm between Linear layers (the torch.func path)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _same(a: fedsgld.Result, b: fedsgld.Result) -> None:
    assert torch.equal(a.theta, b.theta)
    assert len(a.samples) == len(b.samples) > 0
    for s, t in zip(a.samples, b.samples):
        assert torch.equal(s, t)
    ra, rb = a.results, b.results
    assert ra["privacy"]["ledger"] == rb["privacy"]["ledger"]
    assert a.epsilon == b.epsilon and a.steps == b.steps
    assert a.history == b.history
    assert a.metrics == b.metrics
    for k, m in a.site_metrics.items():
        got = dict(b.site_metrics[k])
        assert got.pop("release", "exact") == "exact"
        assert got == m
    assert a.grad_path == b.grad_path


@pytest.mark.parametrize("nodes", [2])
def test_own_model_on_own_tensors_over_flower_equals_the_engine(nodes):
    sites = [_blobs(60, k) for k in range(3)]
    ref = fedsgld.simulate(Net, sites, progress=False, **SETTINGS)
    seen: list[int] = []
    got = fedsgld.simulate(
        Net, sites, progress=False, transport="flower", nodes=nodes,
        on_round=lambda info: seen.append(info.round), **SETTINGS,
    )  # fmt: skip
    assert got.results["engine"] == "flower" and ref.results["engine"] == "in-process"
    assert seen == list(range(1, got.steps + 1))
    _same(ref, got)
    assert isinstance(got.model, Net)
    api = got.results["python_api"]
    assert (api["model"], api["sites"], api["data"]) == ("Net", "python", "user data")
    assert api["site_records"] == ref.results["python_api"]["site_records"]
    assert "user data, 3 sites" in (got.directory / "report.md").read_text()
    # nodes = 2: node 0 hosts sites 0 and 2 (Flower's partition-id rule)
    want = 3 if nodes is None else 2
    assert len(set(got.results["flower"]["nodes"].values())) == want
    x = sites[0][0][:7]
    assert torch.equal(got.predict(x), ref.predict(x))


def test_two_runs_with_other_records_in_one_process_do_not_share_sites():
    """A node's cache is keyed by the user's objects: other records, other sites."""
    a = [_blobs(40, k) for k in range(2)]
    b = [_blobs(40, k + 10) for k in range(2)]
    small = {**SETTINGS, "rounds": 4, "eval_every": 0}
    over_a = fedsgld.simulate(Net, a, progress=False, transport="flower", **small)
    over_b = fedsgld.simulate(Net, b, progress=False, transport="flower", **small)
    ref_b = fedsgld.simulate(Net, b, progress=False, **small)
    assert not torch.equal(over_a.theta, over_b.theta)
    assert torch.equal(over_b.theta, ref_b.theta)


def test_an_unknown_transport_is_refused_in_one_line():
    with pytest.raises(ValueError, match="transport must be one of in-process, flower, ray"):
        fedsgld.simulate(Net, [_blobs(20, 0)], transport="flwr", rounds=1)


def test_an_unpicklable_factory_is_refused_before_ray_starts():
    import threading

    lock = threading.Lock()  # cannot be pickled

    def factory() -> nn.Module:
        with lock:
            return Net()

    with pytest.raises(
        ValueError, match='cannot be sent to Flower.s Ray actors.*transport="flower"'
    ):
        fedsgld.simulate(factory, [_blobs(40, k) for k in range(2)], transport="ray", **SETTINGS)


@pytest.mark.slow
@pytest.mark.simulation
def test_own_model_on_own_tensors_in_flowers_ray_simulation_equals_the_engine(monkeypatch):
    """Flower's Ray simulation (run_simulation): the ClientApp, with the user's factory
    (a class of this test module) and tensors, is pickled to Ray's actor processes."""
    for var in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):
        monkeypatch.setenv(var, "0" if var == "FLWR_TELEMETRY_ENABLED" else "1")
    sites = [_blobs(60, k) for k in range(3)]
    small = {**SETTINGS, "rounds": 4, "eval_every": 0}
    ref = fedsgld.simulate(Net, sites, progress=False, **small)
    got = fedsgld.simulate(Net, sites, progress=False, transport="ray", nodes=2, **small)
    assert len(set(got.results["flower"]["nodes"].values())) == 2
    assert torch.equal(ref.theta, got.theta)
    assert ref.epsilon == got.epsilon and ref.metrics == got.metrics
