"""``progress=False`` logs nothing per round; a server's ``"log"`` progress does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedsgld.run.progress import Progress


@pytest.mark.parametrize(("enabled", "lines"), [(False, 0), ("log", 3)])
def test_progress_false_logs_no_round_line(enabled, lines):
    said: list[str] = []
    bar = Progress(enabled=enabled, total=3, initial=0, desc="x", log=said.append)
    server = SimpleNamespace(accountant=None, t=0)
    for t in (1, 2, 3):
        server.t = t
        bar.update(server, evaluated=0.5, force_log=True)  # as if every round took long
    bar.close()
    assert len(said) == lines
    assert all(s.startswith("round ") for s in said)
