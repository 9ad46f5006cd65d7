"""fedsgld.privacy and the ``fedsgld privacy`` command never import torch.

The accountant is the bottom layer: it must start fast and stay usable where torch is not
installed. Every module of the package is imported in a fresh interpreter, the command is
run once, and torch must not be among the loaded modules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import argparse, importlib, pkgutil, sys
import fedsgld.privacy as p
for m in pkgutil.iter_modules(p.__path__):
    importlib.import_module(f"fedsgld.privacy.{m.name}")
from fedsgld.cli import privacy as cli
parser = argparse.ArgumentParser()
cli.add_arguments(parser)
args = parser.parse_args(["--sample-rate", "0.01", "--steps", "20", "--delta", "1e-5",
                          "--lr", "0.1", "--temperature", "1", "--json"])
assert cli.run(args) == 0
print("TORCH", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_privacy_and_its_command_import_no_torch():
    r = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "TORCH []"
