"""benchmarks/gpu_check.py: its CPU dry run (every code path, tiny), its one line without a
GPU, and, marked ``gpu``, its parts on CUDA (skipped with the reason where none is present)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.slow  # about 30 s of CPU (two tiny demo runs with their result files)
def test_cpu_dry_run_writes_both_reports(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["dry_run"] and rep["passed"]
    assert rep["command"].startswith("python benchmarks/gpu_check.py --cpu-dry-run")
    assert len(rep["machine"]["commit"]) == 40 and rep["machine"]["device"] == "cpu"
    assert set(rep["step"]["ratio_to_sgd"]) == {"sgd", "dpsgld", "dpsgd", "opacus"}
    assert rep["math"]["max_relative_difference"] == 0.0  # the CPU against itself
    d = rep["demo"]
    assert d["steps"]["cpu"] == d["steps"]["device"] == 2
    assert d["accuracy"]["cpu"] == d["accuracy"]["device"]  # same device: the same numbers
    assert rep["sites"]["sites"] == 8 and rep["sites"]["batched_s_per_round"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: passed") and rep["machine"]["commit"][:12] in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--cpu-dry-run" in lines[0]
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.gpu
@no_gpu
def test_step_benchmark_on_cuda():
    st = _module().step_benchmark(torch.device("cuda"), 32, 3)
    assert all(v > 0 for v in st["samples_per_s"].values())


@pytest.mark.gpu
@no_gpu
def test_clipped_sum_on_cuda_matches_the_cpu():
    mc = _module().math_check(torch.device("cuda"), 64)
    assert mc["passed"], mc


@pytest.mark.gpu
@no_gpu
def test_short_demo_on_cuda_spends_the_cpu_runs_privacy():
    d = _module().demo_runs(torch.device("cuda"), 3, {"max_records": 400, "sites": 2})
    assert d["steps"]["cpu"] == d["steps"]["device"] == 3
    assert d["epsilon"]["cpu"] == d["epsilon"]["device"]


@pytest.mark.gpu
@no_gpu
def test_engine_at_many_sites_on_cuda():
    row = _module().many_sites(torch.device("cuda"), 16, 2, {"sample_rate": 0.01})
    assert row["per_site_s_per_round"] > 0 and row["batched_s_per_round"] > 0
