"""The layer path's first use in a fresh process: checked against autograd on one record
at a time, without ``torch.func`` (whose first call imports ``torch._dynamo``: about as
long as importing torch, in every Ray actor and engine process that trains)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, torch
from fedsgld.core.mechanism import FlatModel
from fedsgld.models import build_model
fm = FlatModel(build_model("cnn", input_shape=(1, 28, 28), num_classes=10))
theta, x, y = fm.flatten(), torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
rows = fm.per_record_grads(theta, x, y)
print(fm.grad_path, tuple(rows.shape), "torch._dynamo" in sys.modules)
"""


def test_the_layer_paths_check_imports_no_torch_dynamo():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    path, *rest = res.stdout.split()
    assert path == "layers" and rest[-1] == "False", res.stdout
