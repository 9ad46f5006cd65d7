"""What a Flower site task imports when it starts: each deployed message may start a new
process, so the ClientApp's import must not pull in modules that only some tasks need."""

from __future__ import annotations

import subprocess
import sys

from flower_support import ROOT


def test_the_clientapp_starts_without_scipy_stats_or_the_engine():
    """scipy.stats (which only fedsgld.calibration's AUC loads) is about a second of a task's start and
    only evaluation and held-out splits need it; the engine and the run lifecycle are the
    server's."""
    code = (
        "import sys\n"
        "import fedsgld.apps.client_app\n"
        "late = ('scipy.stats', 'fedsgld.engine', 'fedsgld.run')\n"
        "print('LOADED', sorted(m for m in late if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "LOADED []"
