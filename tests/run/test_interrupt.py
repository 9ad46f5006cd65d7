"""Ctrl-C: a real SIGINT to ``fedsgld simulate`` in a subprocess.

A run interrupted after it released something exits 130 with one line naming the rounds
and the command that resumes it, and that command finishes the run; a run interrupted
before it released anything leaves no directory.
"""

from __future__ import annotations

import json
import os
import pty
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fedsgld

CONFIG = {
    "dataset": "synthetic",
    "model": "cnn",  # tens of ms a round: a loaded machine's poll cannot miss the run
    "sites": 2,
    "rounds": 60,
    "sample_rate": 0.2,
    "lr": 0.1,
    "temperature": 20.0,
    "epsilon": 50.0,
    "eval_every": 0,
    "checkpoint_every": 0,
    "seed": 0,
}


def _default_sigint() -> None:
    """In the child before it runs: Ctrl-C as from a user's shell. A parent that ignores
    SIGINT (a pytest-xdist worker does) would pass that on, and Python, started with
    SIGINT ignored, never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def started():
    """The processes a test starts; each still running at teardown (a failed test) is
    killed by its PID and reaped."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def _start(tmp_path: Path, out: Path, started: list[subprocess.Popen]) -> subprocess.Popen:
    cfg = tmp_path / "long.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in CONFIG.items()))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FLWR_TELEMETRY_ENABLED": "0"}
    cmd = [sys.executable, "-m", "fedsgld", "simulate", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(
        [*cmd, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, preexec_fn=_default_sigint,
    )  # fmt: skip
    started.append(proc)
    return proc


def _steps(out: Path) -> int:
    try:
        state = json.loads((out / "ledger.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(int(c) for _, _, c in state.get("ledger") or [])


def _interrupt(proc: subprocess.Popen, ready, timeout: float = 120.0) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    return out, err


@pytest.mark.slow
def test_interrupted_after_a_release_resumes(tmp_path, started):
    out = tmp_path / "run"
    proc = _start(tmp_path, out, started)
    _, err = _interrupt(proc, lambda: _steps(out) >= 3)
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedsgld simulate: interrupted after ")
    rounds = int(line.split("interrupted after ")[1].split()[0])
    assert rounds >= 2 and _steps(out) >= rounds
    assert (out / "checkpoint.pt").is_file()
    resume = shlex.split(line.split("resume with: ")[1])
    assert resume[-1] == "--resume" and resume[:2] == ["fedsgld", "simulate"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "fedsgld", *resume[1:]],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["privacy"]["steps"] == CONFIG["rounds"]
    assert res["privacy"]["ledger_steps"] >= CONFIG["rounds"]


def test_interrupted_while_loading_leaves_no_directory(tmp_path, started):
    """At a terminal the command says it is loading before the heavy imports; Ctrl-C then
    prints one line and leaves nothing behind."""
    out = tmp_path / "run"
    cfg = tmp_path / "long.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in CONFIG.items()))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FLWR_TELEMETRY_ENABLED": "0"}
    leader, follower = pty.openpty()  # stderr a terminal, as for a user
    cmd = [sys.executable, "-m", "fedsgld", "simulate", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=follower, env=env, preexec_fn=_default_sigint
    )
    started.append(proc)
    os.close(follower)
    seen = b""
    while b"loading" not in seen:
        seen += os.read(leader, 1024)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    while True:
        try:
            chunk = os.read(leader, 1024)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    text = seen.decode()
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1].strip() == "fedsgld simulate: interrupted"
    assert not out.exists()


class _InterruptedNet(nn.Module):
    """A model whose first training forward pass gets a real SIGINT (as from Ctrl-C)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(28 * 28, 3)
        self.fired = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return self.linear(x.flatten(1))


@pytest.fixture
def ctrl_c():
    """Python's own SIGINT handler in this process, as a user's has (a pytest-xdist worker
    ignores SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupted_in_round_one_removes_the_run_directory(tmp_path, ctrl_c):
    """SIGINT inside round 1, after the run directory and its 0-step ledger were written
    and before anything was released: no directory is left."""
    out = tmp_path / "run"
    settings = {k: v for k, v in CONFIG.items() if k != "model"}
    with pytest.raises(fedsgld.RunInterrupted) as err:
        fedsgld.simulate(_InterruptedNet, out_dir=out, progress=False, **settings)
    assert err.value.rounds == 0 and err.value.out is None
    assert not out.exists()
