"""The command line's "loading ..." line: on stderr, once, only when stderr is a terminal
(someone is waiting); never on stdout, never in a pipe or a log file."""

from __future__ import annotations

import io
import sys

import pytest

from fedsgld.cli import main

LINE = "fedsgld simulate: loading torch and the federation code ...\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_loading_line_only_on_a_terminal(terminal, monkeypatch, capsys, tmp_path):
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    # a missing config: refused (exit 2) right after the line would be written
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2
    text = err.getvalue()
    assert text.count(LINE) == (1 if terminal else 0)
    assert "loading" not in capsys.readouterr().out
