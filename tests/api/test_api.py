"""The Python API: a user's model on a user's tensors, the CLI's numbers, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import fedsgld
from fedsgld.cli import main
from fedsgld.config import load_config
from fedsgld.federation import split_data
from fedsgld.models import build_model

SMALL = {
    "dataset": "synthetic",
    "model": "mlp",
    "hidden": 16,
    "sites": 3,
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
    """Two Gaussian classes in 6 dimensions, separable by the first coordinate."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 6, generator=g)
    x[:, 0] += 3.0 * (2 * y - 1)
    return x, y


class Net(nn.Module):
    """A user's module: Linear layers around a LayerNorm (torch.func path)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_own_model_on_own_tensors_trains(capsys, tmp_path):
    sites = [_blobs(150, k) for k in range(3)]
    rounds = []
    res = fedsgld.simulate(
        Net, sites, progress=False, on_round=rounds.append,
        method="dpsgd", noise_multiplier=1.0, epsilon=8.0, rounds=30, sample_rate=0.2,
        lr=0.5, clip=1.0, eval_every=10, burn_in=10, thin=5, seed=1,
    )  # fmt: skip
    assert capsys.readouterr().out == ""  # progress=False prints nothing
    assert res.grad_path == "func"  # LayerNorm: torch.func's per-record gradients
    assert res.steps == 30 and [r.round for r in rounds] == list(range(1, 31))
    assert rounds[9].test_accuracy is not None and rounds[8].test_accuracy is None
    assert 0 < res.epsilon["pld"] <= 8.0 and set(res.epsilon) >= {"gdp", "pld", "rdp"}
    assert res.metrics["accuracy"] > 0.9  # chance is 0.5
    assert set(res.site_metrics) == {0, 1, 2}
    assert len(res.samples) == 4  # after burn-in 10, every 5th of 30 steps
    probs = res.predict(sites[0][0][:4])
    assert probs.shape == (4, 2) and torch.allclose(probs.sum(1), torch.ones(4))
    assert {"history", "reliability"} <= set(res.plots)
    on_disk = json.loads((res.directory / "results.json").read_text())
    api = on_disk["python_api"]
    assert (api["model"], api["sites"], api["data"]) == ("Net", "python", "user data")
    assert api["parameters"] == sum(p.numel() for p in Net().parameters())
    assert [r["n_train"] + r["n_test"] for r in api["site_records"]] == [150, 150, 150]
    report = (res.directory / "report.md").read_text()
    assert "user data, 3 sites" in report and "model `Net`" in report and "mnist5k" not in report
    kept = res.save(tmp_path / "kept")
    assert {"results.json", "ledger.json", "report.md", "history.png"} <= {
        p.name for p in kept.iterdir()
    }
    with pytest.raises(ValueError, match="already holds a run"):
        res.save(kept)
    # the module holds the last iterate: its predictions are the result's
    with torch.no_grad():
        own = torch.softmax(res.model(sites[0][0][:4]), -1)
    assert torch.allclose(own, res.predict(sites[0][0][:4], posterior=False), atol=1e-6)


def test_same_numbers_as_the_cli_for_a_built_in_model(tmp_path):
    """fedsgld simulate on a built-in dataset and model, and the API given the same
    sites' tensors and a factory for the same model: the same run, number for number."""
    cfg_file = tmp_path / "small.toml"
    cfg_file.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in SMALL.items()))
    assert main(["simulate", str(cfg_file), "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())

    cfg = load_config(None, SMALL)
    split = split_data(cfg, seed=SMALL["seed"], log=lambda _: None)
    shape = tuple(split.site_data[0].x_train.shape[1:])
    res = fedsgld.simulate(
        lambda: build_model("mlp", input_shape=shape, num_classes=split.num_classes, hidden=16),
        [(d.x_train, d.y_train) for d in split.site_data],
        test_sites=[(d.x_test, d.y_test) for d in split.site_data],
        config=cfg,
        progress=False,
    )
    assert res.results["privacy"]["ledger"] == cli["privacy"]["ledger"]
    assert res.epsilon == cli["privacy"]["epsilon"]
    assert res.history == cli["history"]
    assert res.results["metrics"] == cli["metrics"]


def test_batchnorm_is_refused_in_one_line():
    sites = [_blobs(40, k) for k in range(2)]

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    with pytest.raises(ValueError) as err:
        fedsgld.simulate(model, sites, progress=False, epsilon=8.0)
    text = str(err.value)
    assert "\n" not in text and "BatchNorm1d at '1'" in text and ".eval()" in text


def test_linear_model_uses_the_layer_path():
    x, y = _blobs(8, 0)
    assert fedsgld.check_model(lambda: nn.Sequential(nn.Linear(6, 2)), x, y, 2) == "layers"
    with pytest.raises(ValueError, match=r"returns shape \(2, 3\)"):
        fedsgld.check_model(lambda: nn.Linear(6, 3), x, y, 2)


def test_a_plan_that_affords_nothing_is_a_value_error(tmp_path):
    sites = [_blobs(60, k) for k in range(2)]
    out = tmp_path / "never"
    with pytest.raises(fedsgld.NothingToSpend) as err:
        fedsgld.simulate(Net, sites, out_dir=out, progress=False, rounds=5, epsilon=1.0)
    assert isinstance(err.value, ValueError)
    text = str(err.value)
    assert "affords 0 of the 5 rounds" in text and "temperature=" in text and "epsilon=" in text
    assert not out.exists()


def test_import_fedsgld_stays_light():
    code = "import sys, fedsgld; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
