"""Ctrl-C at every durable write of a run: the ledger counts what was released, no more.

A seeded in-process run is interrupted (``KeyboardInterrupt``) at the n-th call of
``os.fsync`` or ``os.replace`` (every write point of ``ledger.json``, ``ledger.chain``,
``checkpoint.pt`` and the result files), for every n, in a first run and in a resumed
one; then resumed to the end. The server's noise draws are counted and kept: the ledger
holds every step whose noise was drawn plus at most one per interrupt (the step charged
but not drawn when the write was cut), no draw repeats an earlier one, and the budget
halts where an uninterrupted run halts, within those in-flight steps.
"""

from __future__ import annotations

import json
import os

import pytest

from fedsgld import engine
from fedsgld.calibration import plots
from fedsgld.config import load_config
from fedsgld.core import release
from fedsgld.run.resume import ResumeError

CFG = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 2,
    "rounds": 30,
    "max_records": 400,
    "sample_rate": 0.2,
    "lr": 0.1,
    "temperature": 20.0,
    "epsilon": 1.6,
    "eval_every": 0,
    "checkpoint_every": 3,
    "swag_samples": 0,
    "seed": 5,
}
QUIET = {"progress": False, "log": lambda s: None}


def _no_png(fig, path, **kw):
    """The figure closed without rendering it (its PNG is not a write point)."""
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


class Draws:
    """Every server noise draw (its first values), and the n-th durable write that raises."""

    def __init__(self, monkeypatch) -> None:
        self.values: list[tuple[float, ...]] = []
        self.calls = 0
        self.fail_at = 0
        real_noise = release.Charged.noise
        real_fsync, real_replace = os.fsync, os.replace

        def noise(receipt, *args, **kwargs):
            out = real_noise(receipt, *args, **kwargs)
            self.values.append(tuple(out.flatten()[:4].tolist()))
            return out

        def hit() -> None:
            self.calls += 1
            if self.calls == self.fail_at:
                raise KeyboardInterrupt

        def fsync(fd):
            hit()
            return real_fsync(fd)

        def replace(src, dst):
            hit()
            return real_replace(src, dst)

        monkeypatch.setattr(release.Charged, "noise", noise)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        # the result PNGs are written in place (no fsync, no rename: not write points) and
        # rendering them is most of each run's time; the sweeps start a run ~170 times
        monkeypatch.setattr(plots, "_save", _no_png)

    def run(self, out, *, resume: bool, fail_at: int = 0) -> dict | None:
        """One start of the run; None when it was interrupted."""
        self.calls, self.fail_at = 0, fail_at
        cfg = load_config(None, CFG)
        try:
            return engine.run(cfg, out_dir=out, resume=resume, **QUIET)
        except KeyboardInterrupt:
            return None


def _ledger_steps(out) -> int:
    return sum(int(c) for _, _, c in json.loads((out / "ledger.json").read_text())["ledger"])


def _finish(draws: Draws, out) -> dict:
    """Resume until the run ends (a directory that holds no run starts anew)."""
    try:
        res = draws.run(out, resume=True)
    except ResumeError as err:
        assert "holds no" in str(err) and not draws.values, err
        res = draws.run(out, resume=False)
    assert res is not None
    return res


def _check(draws: Draws, res: dict, base: dict, interrupts: int) -> None:
    drawn = len(draws.values)
    steps = res["privacy"]["ledger_steps"]
    assert drawn <= steps <= drawn + interrupts, (drawn, steps)
    assert len(set(draws.values)) == drawn, "a noise draw was replayed"
    want = base["privacy"]["ledger_steps"]
    assert want - interrupts <= drawn <= want, (drawn, want)
    assert res["privacy"]["epsilon"]["pld"] <= CFG["epsilon"] + 1e-9


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        draws = Draws(mp)
        res = draws.run(tmp_path_factory.mktemp("base") / "run", resume=False)
        assert res is not None and res["privacy"]["ledger_steps"] == len(draws.values)
        assert res["privacy"]["ledger_steps"] < CFG["rounds"]  # the budget halts it
        return res, draws.calls


def test_a_resumed_run_cut_while_writing_its_ledger_counts_one_step_more(
    tmp_path, monkeypatch, uninterrupted
):
    """The reported case: ``ledger.json.tmp`` written, the rename cut; the checkpoint
    taken at the interrupt holds that step. The next resume counts it, and only it."""
    base, _ = uninterrupted
    draws = Draws(monkeypatch)
    out = tmp_path / "run"
    assert draws.run(out, resume=False, fail_at=23) is None  # a first interrupt
    seen = len(draws.values)
    real_replace = os.replace

    renames = []

    def cut(src, dst):  # the resumed run's third rename of ledger.json.tmp is interrupted
        if str(src).endswith("ledger.json.tmp"):
            renames.append(src)
            if len(renames) == 3:
                raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", cut)
    assert draws.run(out, resume=True) is None
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (out / "ledger.json.tmp").exists()
    assert len(draws.values) > seen  # each interrupt leaves at most its charged step undrawn
    assert len(draws.values) <= _ledger_steps(out) <= len(draws.values) + 2
    res = _finish(draws, out)
    _check(draws, res, base, interrupts=2)
    assert res["privacy"]["epsilon"]["pld"] <= base["privacy"]["epsilon"]["pld"] + 1e-9


def _sweep(tmp_path, uninterrupted, *, resumed: bool) -> None:
    base, total = uninterrupted
    for n in range(1, total + 1):
        with pytest.MonkeyPatch.context() as mp:  # each point's own patches, none stacked
            _sweep_point(tmp_path / f"run-{n}", Draws(mp), base, total, n, resumed=resumed)


def _sweep_point(out, draws: Draws, base: dict, total: int, n: int, *, resumed: bool) -> None:
    interrupts = 1
    if resumed:  # a first interrupt, then the n-th write of the resumed run
        assert draws.run(out, resume=False, fail_at=total // 3) is None
        if draws.run(out, resume=True, fail_at=n) is not None:
            return  # the resumed run has fewer writes than n
        interrupts = 2
    elif draws.run(out, resume=False, fail_at=n) is not None:
        return
    res = _finish(draws, out)
    print(f"interrupt at write {n} of {total}: {len(draws.values)} drawn", flush=True)
    try:
        _check(draws, res, base, interrupts)
    except AssertionError as err:
        raise AssertionError(f"interrupt at write {n}: {err}") from None


@pytest.mark.slow
def test_an_interrupt_at_every_write_of_a_run(tmp_path, uninterrupted):
    _sweep(tmp_path, uninterrupted, resumed=False)


@pytest.mark.slow
def test_an_interrupt_at_every_write_of_a_resumed_run(tmp_path, uninterrupted):
    _sweep(tmp_path, uninterrupted, resumed=True)
