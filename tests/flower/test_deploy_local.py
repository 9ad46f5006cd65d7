"""``fedsgld deploy local``: a Flower simulation on a SuperLink of its own, on a free port,
stopped by its PID when the run ends (nothing left running)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.simulation, pytest.mark.slow]

RUN_CONFIG = (
    "dataset='synthetic' model='mlp' sites=2 rounds=2 eval_every=0 epsilon=30.0 lr=0.2 "
    "temperature=2.0 burn_in=0 thin=1 max_samples=2"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_deploy_local_runs_on_its_own_superlink_and_stops_it(flower_tmp):
    # flower_tmp's teardown stops whatever names its directory: the SuperLink too, should
    # the command be killed (timeout) before it stops it
    root, _ = flower_tmp
    out, home = root / "out", root / "home"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "fedsgld", "deploy", "local", "--home", str(home)]
    cmd += ["--run-config", f"{RUN_CONFIG} out='{out}'"]
    cmd += ["--federation-config", "num-supernodes=2 client-resources-num-cpus=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    line = next(x for x in res.stderr.splitlines() if x.startswith("fedsgld deploy local:"))
    pid, port = map(int, re.search(r"pid (\d+) on 127\.0\.0\.1:(\d+)", line).groups())
    assert port != 39091 and str(home) in line
    assert not _alive(pid)  # stopped by its PID when the run ended
    results = json.loads((out / "results.json").read_text())
    assert results["engine"] == "flower" and results["privacy"]["steps"] == 2
