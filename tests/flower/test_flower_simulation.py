"""``flwr run .``: Flower's own local SuperLink and its Ray simulation runtime.

Each test gets its own FLWR_HOME and local-SuperLink port; the detached SuperLink that
``flwr run`` leaves behind (and Ray's processes) are stopped at teardown. A seeded
simulation gives the in-process result: the DP-SGLD trajectory's ledger, epsilon and
metrics, and PATE's labels and epsilons.
"""

from __future__ import annotations

import json

import pytest
from flower_support import SMALL, flower_env, flwr, free_port, run_config_arg
from test_pate_flower import PATE_RC

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.pate.flower import pate_config_from_run_config
from fedsgld.pate.train import run_pate

# about a minute each (a Ray cluster per run): slow
pytestmark = [pytest.mark.simulation, pytest.mark.slow]


def _simulate(root, run_config: dict, nodes: int) -> None:
    env = flower_env(root / "home", FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()))
    res = flwr(
        [
            "run", ".", "--stream",
            "--run-config", run_config_arg(run_config),
            "--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1",
        ],
        env,
        timeout=900,
    )  # fmt: skip
    log = res.stdout + res.stderr
    (root / "flwr-run.log").write_text(log)
    assert res.returncode == 0, log[-3000:]
    # `flwr run --stream` can exit 0 for a failed run: the result file is the proof
    out = run_config["out"]
    assert (root / "out" / "results.json").is_file(), f"no results in {out}:\n{log[-3000:]}"


def test_ray_simulation_of_dpsgld_equals_the_engine(flower_tmp, tmp_path):
    root, _procs = flower_tmp
    ref_out = tmp_path / "engine"
    engine.run(load_config(None, SMALL), out_dir=ref_out, progress=False, log=lambda s: None)
    # `flwr run .` defaults to OS randomness; a seeded simulation reproduces the engine
    _simulate(
        root, {**SMALL, "randomness": "seeded", "threads": 1, "out": str(root / "out")}, nodes=2
    )
    got = json.loads((root / "out" / "results.json").read_text())
    ref = json.loads((ref_out / "results.json").read_text())
    assert got["engine"] == "flower" and got["flower"]["dropped_replies"] == []
    assert len(set(got["flower"]["nodes"].values())) == 2  # 3 sites on 2 SuperNodes
    assert got["privacy"]["ledger"] == ref["privacy"]["ledger"]
    assert got["privacy"]["epsilon"] == ref["privacy"]["epsilon"]
    assert got["metrics"]["pooled"] == ref["metrics"]["pooled"]
    # each simulated site's report says it released exact metrics; the engine's are exact
    for r in got["metrics"]["posterior"]["sites"].values():
        assert r.pop("release") == "exact"
    assert got["metrics"]["posterior"] == ref["metrics"]["posterior"]


def test_ray_simulation_of_pate_equals_in_process(flower_tmp, tmp_path):
    root, _procs = flower_tmp
    ref = run_pate(pate_config_from_run_config(PATE_RC), log=lambda s: None)
    _simulate(root, {**PATE_RC, "out": str(root / "out")}, nodes=2)
    got = json.loads((root / "out" / "results.json").read_text())
    assert got["engine"] == "flower" and got["flower"]["dropped_replies"] == []
    assert got["teachers"]["test_accuracy"] == ref["teachers"]["test_accuracy"]
    for mech, e in ref["mechanisms"].items():
        assert got["mechanisms"][mech]["epsilon"] == e["epsilon"]
        assert got["mechanisms"][mech]["noisy_label_accuracy"] == e["noisy_label_accuracy"]


def test_ray_simulation_of_secure_aggregation_charges_as_the_engine(flower_tmp, tmp_path):
    """``secure_aggregation = true`` over Flower's simulation: 3 sites on 2 SuperNodes (one
    node keeps two sites' protocol state between the steps), every round a secure sum
    whose accounting is the engine's (the shares are the operating system's, so only the
    ledger and epsilon, not the metrics, are compared)."""
    root, _procs = flower_tmp
    secure = {**SMALL, "rounds": 2, "secure_aggregation": True, "noise_placement": "sites",
              "local_steps": 1, "max_dropouts": 1, "hidden": 16, "eval_every": 0,
              "burn_in": 1, "thin": 1, "max_samples": 1, "checkpoint_every": 0}  # fmt: skip
    ref_out = tmp_path / "engine"
    engine.run(load_config(None, secure), out_dir=ref_out, progress=False, log=lambda s: None)
    _simulate(root, {**secure, "threads": 1, "out": str(root / "out")}, nodes=2)
    got = json.loads((root / "out" / "results.json").read_text())
    ref = json.loads((ref_out / "results.json").read_text())
    assert got["flower"]["dropped_replies"] == []
    assert got["flower"]["secure_aggregation"]["rounds"] == 2
    assert got["privacy"]["steps"] == ref["privacy"]["steps"] == 2
    assert got["privacy"]["epsilon"] == ref["privacy"]["epsilon"]
    assert (
        got["privacy"]["secure_aggregation"]["last_round"]
        == (ref["privacy"]["secure_aggregation"]["last_round"])
    )
