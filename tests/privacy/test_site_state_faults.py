"""A site whose state directory fails: full, read-only, or its ledger file corrupted.

Driven through the site's real ClientApp and guard (as in test_site_guard.py). A write
of the site's ledger that fails (``ENOSPC``: the disk is full; ``EROFS``: the directory
is read-only; injected at the write, as the kernel would report it) must end in a
refusal (one line after the traceback Flower adds), with no noise drawn, and the ledger file as it was and still readable;
the site answers again once the directory can be written. A corrupted ledger file is
refused and never reset.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
from test_site_guard import LOCAL, Node, answered, plan, policy_file, refused, spy_on_noise

from fedsgld import files

FAULTS = {
    "disk full": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "read-only": OSError(errno.EROFS, os.strerror(errno.EROFS)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_site_that_cannot_write_its_ledger_refuses_and_releases_nothing(
    tmp_path, monkeypatch, fault, where
):
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path)})
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    path = tmp_path / "policy" / "fedsgld-site-0.json"
    before = path.read_bytes()
    draws = spy_on_noise(monkeypatch)
    real = getattr(os, where)

    def failing(*args):
        raise FAULTS[fault]

    monkeypatch.setattr(files.os, where, failing)
    reply = node.send("train", plan=plan(LOCAL, round=1))
    last = refused(reply).strip().splitlines()[-1]  # the refusal, after Flower's traceback
    assert last.endswith("the ledger file left as it was"), last
    assert "PolicyRefused: site 0 cannot write its ledger" in last, last
    assert os.strerror(FAULTS[fault].errno) in last and "nothing released" in last
    assert not draws, "noise was drawn for a round whose charge was not written"
    assert path.read_bytes() == before
    assert json.loads(path.read_text())["ledger"]["steps"] == 2
    assert not path.with_name(path.name + ".tmp").exists()
    monkeypatch.setattr(files.os, where, real)
    answered(node.send("train", plan=plan(LOCAL, round=1)))  # the round it never answered
    assert json.loads(path.read_text())["ledger"]["steps"] == 4


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # cut short
        lambda b: b"\0" * len(b),  # zeroed
        lambda b: b"[]",  # not an object
        lambda b: b"",  # emptied
    ],
    ids=["cut", "zeroed", "not-an-object", "empty"],
)
def test_a_corrupted_ledger_file_is_refused_and_never_reset(tmp_path, monkeypatch, damage):
    nc = {"site-id": 0, "privacy-policy": policy_file(tmp_path)}
    answered(Node(nc).send("train", plan=plan(LOCAL, round=0)))
    path = tmp_path / "policy" / "fedsgld-site-0.json"
    path.write_bytes(damage(path.read_bytes()))
    broken = path.read_bytes()
    draws = spy_on_noise(monkeypatch)
    for rnd in (1, 2):  # a new node process each time: nothing carried over in memory
        reason = refused(Node(nc).send("train", plan=plan(LOCAL, round=rnd)))
        assert "fedsgld-site-0.json" in reason.strip().splitlines()[-1], reason[-400:]
    assert not draws
    assert path.read_bytes() == broken
