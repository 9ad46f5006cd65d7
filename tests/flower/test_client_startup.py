"""The ClientApp starts light: every task of a deployment is a new process that imports
``fedsgld.apps.client_app``, so what only some messages need is imported at the first of
them (PATE's side, at the first PATE message; scipy.stats, which only the calibration
metrics' AUC loads, at the first AUC), never at start-up."""

from __future__ import annotations

import subprocess
import sys

from flower_support import ROOT

# imported only when a message needs them (see the comments at their imports)
LATER = ("fedsgld.pate", "scipy.stats")


def test_importing_the_client_app_leaves_pate_and_scipy_stats_for_later():
    code = (
        "import sys\n"
        "import fedsgld.apps.client_app\n"
        f"print([m for m in {LATER!r} if m in sys.modules])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
