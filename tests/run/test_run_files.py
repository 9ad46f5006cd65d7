"""The run layer's files and imports: strict durable JSON, and no plotting library in the
processes that never draw."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsgld.files import json_default, strict_json, write_json

ROOT = Path(__file__).resolve().parents[2]


def test_json_default_turns_arrays_tensors_scalars_and_paths_into_json():
    assert json_default(np.float32(1.5)) == 1.5 and json_default(np.int64(3)) == 3
    assert json_default(np.arange(3)) == [0, 1, 2]
    assert json_default(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
    assert json_default(Path("a") / "b") == str(Path("a") / "b")
    with pytest.raises(TypeError, match="not JSON serialisable: object"):
        json_default(object())


def test_write_json_is_strict_and_leaves_no_temporary_file(tmp_path):
    obj = {"eps": math.inf, "auc": float("nan"), "x": np.float64(0.25), "t": torch.ones(2)}
    write_json(tmp_path / "r.json", obj)
    assert json.loads((tmp_path / "r.json").read_text()) == {
        "eps": None,
        "auc": None,
        "x": 0.25,
        "t": [1.0, 1.0],
    }
    assert strict_json(obj) == json.loads((tmp_path / "r.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize("module", ["fedsgld.engine", "fedsgld.run.lifecycle", "fedsgld.files"])
def test_the_run_imports_no_plotting_library(module):
    """matplotlib costs about a second to import; a site's process imports the engine (and
    so the lifecycle) and never draws, so only writing the result files may import it."""
    code = f"import sys, {module}; print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    plots, torch_loaded = r.stdout.split()
    assert plots == "False"
    if module == "fedsgld.files":  # the bottom layer: no torch either
        assert torch_loaded == "False"
