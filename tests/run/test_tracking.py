"""Experiment tracking: short seeded runs logged to MLflow, read back through its client."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import fedsgld
from fedsgld.cli import main

mlflow = pytest.importorskip(
    "mlflow", reason="the tracking extra (pip install 'fedsgld[tracking]')"
)
from mlflow import MlflowClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
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


def _runs(store: Path, experiment: str = "fedsgld"):
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {store}"
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time"])


def test_a_run_is_logged_and_read_back(tmp_path):
    out = tmp_path / "runs" / "a"
    res = fedsgld.simulate(config=SMALL, out_dir=out, progress=False, tracking="mlflow")
    client, runs = _runs(tmp_path / "runs" / "mlflow.db")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "a"
    # the config as parameters
    assert run.data.params["method"] == "dpsgld" and float(run.data.params["lr"]) == 0.2
    assert run.data.params["seed"] == "5"
    # per evaluated round: pooled and per-site test metrics, each accountant's epsilon
    hist = client.get_metric_history(run.info.run_id, "test_accuracy")
    assert [m.step for m in hist] == [4, 8]
    assert hist[-1].value == pytest.approx(res.results["history"][-1]["test_accuracy"])
    for site in range(3):
        assert len(client.get_metric_history(run.info.run_id, f"site{site}/test_nll")) == 2
    eps = {
        a: client.get_metric_history(run.info.run_id, f"epsilon_{a}") for a in ("gdp", "pld", "rdp")
    }
    assert all(len(v) == 2 and v[0].value < v[1].value for v in eps.values())
    assert eps["pld"][-1].value == pytest.approx(res.results["privacy"]["epsilon"]["pld"])
    # the halt reason and the final metrics
    assert run.data.tags["fedsgld.halt_reason"] == res.results["privacy"]["halt_reason"]
    assert run.data.metrics["final/test_accuracy"] == pytest.approx(
        res.results["metrics"]["pooled"]["accuracy"]
    )
    # the files as artifacts, in the store's folder
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "report.md"} <= names
    assert any(n.endswith(".png") for n in names)
    local = Path(client.download_artifacts(run.info.run_id, "results.json", str(tmp_path)))
    assert json.loads(local.read_text())["privacy"]["steps"] == res.results["privacy"]["steps"]
    # a second run in the same folder goes to the same store
    fedsgld.simulate(config={**SMALL, "seed": 6}, out_dir=tmp_path / "runs" / "b",
                     progress=False, tracking="mlflow")  # fmt: skip
    _, runs = _runs(tmp_path / "runs" / "mlflow.db")
    assert [r.info.run_name for r in runs] == ["a", "b"]


def test_tracking_off_writes_no_store(tmp_path):
    fedsgld.simulate(config={**SMALL, "rounds": 2}, out_dir=tmp_path / "r", progress=False)
    assert not (tmp_path / "mlflow.db").exists()


def test_cli_option_and_a_named_store(tmp_path, capsys):
    store = tmp_path / "elsewhere" / "t.db"
    flat = [f"--set={k}={json.dumps(v)}" for k, v in {**SMALL, "rounds": 4}.items()]
    code = main(["simulate", str(ROOT / "simulations" / "demo.toml"), *flat,
                 "--out", str(tmp_path / "r"), "--no-progress", "--tracking", "mlflow",
                 "--tracking-uri", f"sqlite:///{store}", "--set", "tracking_experiment=cli"])  # fmt: skip
    assert code == 0, capsys.readouterr()
    _, runs = _runs(store, "cli")
    assert len(runs) == 1 and runs[0].data.params["rounds"] == "4"
    assert not (tmp_path / "mlflow.db").exists()


def test_missing_extra_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'fedsgld\[tracking\]'"):
        fedsgld.simulate(config=SMALL, out_dir=tmp_path / "r", progress=False, tracking="mlflow")
    assert not (tmp_path / "r").exists()
    flat = [f"--set={k}={json.dumps(v)}" for k, v in SMALL.items()]
    code = main(["simulate", str(ROOT / "simulations" / "demo.toml"), *flat,
                 "--out", str(tmp_path / "c"), "--no-progress", "--tracking", "mlflow"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'fedsgld[tracking]'" in err[0]


def test_unknown_tracker_is_refused():
    with pytest.raises(ValueError, match="tracking"):
        fedsgld.simulate(config=SMALL, progress=False, tracking="wandb")


@pytest.mark.slow  # Flower's in-process grid (about 30 s on a busy 2-core machine)
def test_flower_run_is_logged_by_the_server_only(tmp_path):
    out = tmp_path / "runs" / "f"
    res = fedsgld.simulate(config={**SMALL, "rounds": 4}, out_dir=out, progress=False,
                           tracking="mlflow", transport="flower")  # fmt: skip
    client, runs = _runs(tmp_path / "runs" / "mlflow.db")
    assert len(runs) == 1  # one run: the server's; the sites log nothing
    run = runs[0]
    assert run.data.tags["fedsgld.transport"] == "flower"
    hist = client.get_metric_history(run.info.run_id, "test_accuracy")
    assert [m.step for m in hist] == [4]
    assert hist[0].value == pytest.approx(res.results["history"][-1]["test_accuracy"])


def test_the_site_side_never_imports_the_tracker():
    import subprocess
    import sys

    code = (
        "import sys, fedsgld.apps.client_app, fedsgld.flower.sites\n"
        "assert 'fedsgld.run.tracking' not in sys.modules and 'mlflow' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow  # two trials and a store (about a minute on a busy 2-core machine)
def test_a_sweep_logs_each_trial_as_a_child_run(tmp_path):
    from fedsgld.studies.sweep import run_sweep

    out = tmp_path / "sweeps" / "s"
    sets = ["recal_fraction=0", "rounds=4", "burn_in=2", "thin=1", "eval_every=2",
            "tracking=mlflow"]  # fmt: skip
    res = run_sweep(ROOT / "simulations" / "calibration_breast_cancer.toml",
                    grid_items=["lr=0.02,0.2"], sets=sets, methods=["dpsgld"], seeds=[0],
                    out=out, use_ray=False, progress=False, log=lambda s: None)  # fmt: skip
    assert not res["failed"]
    client, runs = _runs(tmp_path / "sweeps" / "mlflow.db")
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parent) == 1 and parent[0].data.tags["fedsgld.kind"] == "sweep"
    assert len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent[0].info.run_id}
    assert sorted(r.data.params["lr"] for r in children) == ["0.02", "0.2"]
    for child in children:
        summary = next(t["summary"] for t in res["trials"] if t["name"] == child.info.run_name)
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "test_accuracy")]
        assert steps == [2, 4] and child.data.tags["fedsgld.halt_reason"] == summary["halt_reason"]
        assert "results.json" in {a.path for a in client.list_artifacts(child.info.run_id)}
    assert "sweep.md" in {a.path for a in client.list_artifacts(parent[0].info.run_id)}
    assert not list((out / "trials").rglob("mlflow.db"))  # the trials themselves log nothing


def test_a_store_failing_mid_run_costs_the_tracking_not_the_run(tmp_path, monkeypatch, capsys):
    from fedsgld.run import tracking

    def broken(self, run_id, values, step):
        raise ConnectionError("the tracking server went away")

    monkeypatch.setattr(tracking.MlflowStore, "metrics", broken)
    res = fedsgld.simulate(config=SMALL, out_dir=tmp_path / "runs" / "a", tracking="mlflow")
    assert res.results["privacy"]["steps"] == 8 and (tmp_path / "runs" / "a" / "report.md").exists()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tracking:")]
    assert len(lines) == 1 and "ConnectionError" in lines[0] and "untracked" in lines[0]
