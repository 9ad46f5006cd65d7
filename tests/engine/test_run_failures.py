"""A run directory whose ledger was shortened cannot be resumed from the shorter ledger.

The attacks: ``ledger.json`` replaced by an older copy of itself (9 steps counted, 13
taken), cut short, edited; ``ledger.chain`` deleted or cut; a checkpoint that rebuilds
less than the chain recorded. Each must be refused with :class:`ResumeError` naming the
file, never resumed with fewer steps than were taken.
"""

from __future__ import annotations

import json
import shutil

import pytest

from fedsgld import engine
from fedsgld.clients import site as site_module
from fedsgld.config import load_config
from fedsgld.privacy.ledger_chain import CHAIN
from fedsgld.run.resume import ResumeError

CFG = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 3,
    "rounds": 16,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 0.5,
    "decay_gamma": 0.5,
    "decay_t0": 5.0,
    "prenoise": 0.01,
    "epsilon": 50.0,
    "eval_every": 0,
    "burn_in": 2,
    "thin": 1,
    "max_samples": 2,
    "swag_samples": 0,
    "seed": 3,
}
QUIET = {"progress": False, "log": lambda s: None}


def _steps(path):
    return sum(e[2] for e in json.loads(path.read_text())["ledger"])


def _crash_at(monkeypatch, out, crash_round, *, keep_round=None, **over):
    """Run until ``crash_round`` crashes the sites; keep ``ledger.json`` as it was when
    round ``keep_round`` began (an older copy of it). Returns the config and the copy."""
    real = site_module.Site.clipped_sum
    kept = out.parent / f"{out.name}-ledger-at-{keep_round}.json"

    def crashing(self, theta, *, round, **kw):
        if round == keep_round and not kept.exists():
            shutil.copy(out / "ledger.json", kept)
        if round == crash_round:
            raise RuntimeError("simulated crash")
        return real(self, theta, round=round, **kw)

    monkeypatch.setattr(site_module.Site, "clipped_sum", crashing)
    cfg = load_config(None, {**CFG, **over})
    with pytest.raises(RuntimeError, match="simulated crash"):
        engine.run(cfg, out_dir=out, **QUIET)
    monkeypatch.setattr(site_module.Site, "clipped_sum", real)
    return cfg, kept


def test_an_older_ledger_json_without_a_checkpoint_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg, older = _crash_at(monkeypatch, out, 13, keep_round=9, checkpoint_every=0)
    assert not (out / "checkpoint.pt").exists() and _steps(out / "ledger.json") == 13
    shutil.copy(older, out / "ledger.json")  # 9 steps counted, 13 taken
    assert _steps(out / "ledger.json") == 9
    with pytest.raises(ResumeError, match=r"ledger.json \(write \d+, 9 steps\).*13 steps"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)


def test_an_older_or_cut_ledger_json_with_a_checkpoint_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg, older = _crash_at(monkeypatch, out, 13, keep_round=9, checkpoint_every=5)
    assert (out / "checkpoint.pt").exists()
    good = (out / "ledger.json").read_bytes()
    shutil.copy(older, out / "ledger.json")
    with pytest.raises(ResumeError, match="ledger.json .*not the last write.*remove ledger.json"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    (out / "ledger.json").write_bytes(good[: len(good) // 2])  # cut mid-file: unreadable
    with pytest.raises(ResumeError, match="ledger.json is unreadable"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    edited = json.loads(good)
    edited["ledger"][-1][2] -= 2  # two steps fewer, everything else as written
    (out / "ledger.json").write_text(json.dumps(edited))
    with pytest.raises(ResumeError, match="not the last write"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    # the intact file resumes, counting every step taken
    (out / "ledger.json").write_bytes(good)
    res = engine.run(cfg, out_dir=out, resume=True, **QUIET)
    assert res["privacy"]["ledger_steps"] == 13 + (16 - 10)  # resumed at checkpoint 10
    line = json.loads((out / CHAIN).read_text().splitlines()[-1])
    assert res["privacy"]["ledger_record"]["chain"] == line["chain"]
    assert res["privacy"]["ledger_record"]["steps"] == line["steps"] == 19


def test_a_missing_or_cut_chain_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg, _ = _crash_at(monkeypatch, out, 7, checkpoint_every=0)
    lines = (out / CHAIN).read_text().splitlines(keepends=True)
    saved = {p.name: p.read_bytes() for p in out.iterdir()}
    # two lines short: ledger.json is ahead of what the chain can vouch for
    (out / CHAIN).write_text("".join(lines[:-2]))
    with pytest.raises(ResumeError, match="not the last write"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    (out / CHAIN).unlink()
    with pytest.raises(ResumeError, match="ledger.chain is missing"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    # one line short and a partial line: a crash between the ledger.json write and its
    # line, which the resume completes (ledger.json is the larger record)
    (out / CHAIN).write_text("".join(lines[:-1]) + lines[-1][:10])
    res = engine.run(cfg, out_dir=out, resume=True, **QUIET)
    assert res["privacy"]["ledger_steps"] == 7 + 16
    seqs = [json.loads(x)["sequence"] for x in (out / CHAIN).read_text().splitlines()]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > len(lines)
    assert (out / CHAIN).read_bytes().splitlines()[: len(lines)] == saved[CHAIN].splitlines()


def test_a_checkpoint_that_rebuilds_less_than_the_chain_is_refused(tmp_path, monkeypatch):
    """Without ledger.json the checkpoint's ledger plus checkpoint_every rounds is counted;
    after repeated crashes past the checkpoint that is less than was taken: refused."""
    out = tmp_path / "run"
    over = {"checkpoint_every": 5}
    cfg, _ = _crash_at(monkeypatch, out, 7, **over)  # 7 steps, checkpoint at round 5
    for _ in range(3):  # each resume replays rounds 5 and 6: 2 steps more
        _crash_at_resume(monkeypatch, out, cfg, 7)
    assert _steps(out / "ledger.json") == 7 + 3 * 2
    (out / "ledger.json").unlink()
    with pytest.raises(ResumeError, match=r"checkpoint.pt: 10 steps.*below the 13 steps"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)


def _crash_at_resume(monkeypatch, out, cfg, crash_round):
    real = site_module.Site.clipped_sum

    def crashing(self, theta, *, round, **kw):
        if round == crash_round:
            raise RuntimeError("simulated crash")
        return real(self, theta, round=round, **kw)

    monkeypatch.setattr(site_module.Site, "clipped_sum", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        engine.run(cfg, out_dir=out, resume=True, **QUIET)
    monkeypatch.setattr(site_module.Site, "clipped_sum", real)


def test_a_new_run_refuses_a_directory_that_holds_only_a_chain(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg, _ = _crash_at(monkeypatch, out, 3, checkpoint_every=0)
    (out / "ledger.json").unlink()
    with pytest.raises(ValueError, match="already holds a run"):
        engine.run(cfg, out_dir=out, **QUIET)
