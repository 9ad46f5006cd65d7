"""The site's audit log: one hash-chained line per message, written before the reply leaves.

Driven through the deployed ClientApp (its guard) as the server reaches it; ``fedsgld site
log --verify`` must find every edited, removed or reordered line, and a site whose log
cannot be written refuses and charges nothing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_site_guard import (
    LOCAL,
    Node,
    answered,
    evaluation,
    ledger_file,
    plan,
    policy_file,
    refused,
)

from fedsgld.cli.commands import main as cli_main
from fedsgld.clients import audit_log
from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy


def _log(state: Path) -> list[dict]:
    return [e for _, _, e in audit_log.read(audit_log.audit_path(state))]


def _site(tmp_path, **keys) -> tuple[Node, Path, str]:
    pol = policy_file(tmp_path, min_noise_multiplier=0.3, max_models_per_evaluation=2, **keys)
    return Node({"site-id": 0, "privacy-policy": pol}), tmp_path / "policy", pol


def _requests(node: Node) -> None:
    """Two answered rounds, a refused replay, an answered and a refused evaluation."""
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    answered(node.send("train", plan=plan(LOCAL, round=1)))
    refused(node.send("train", plan=plan(LOCAL, round=0)), "already answered")
    answered(node.send("evaluate", **evaluation([np.zeros(54595, np.float32)], config=LOCAL)))
    z3 = [np.zeros(54595, np.float32)] * 3
    refused(node.send("evaluate", **evaluation(z3, config=LOCAL)), "max_models_per_evaluation")


@pytest.fixture(scope="module")
def _ran(tmp_path_factory) -> Path:
    """A site's policy directory after :func:`_requests` (run once for the module)."""
    tmp = tmp_path_factory.mktemp("audit")
    node, state, _ = _site(tmp)
    _requests(node)
    return state


@pytest.fixture
def ran(_ran, tmp_path) -> tuple[Path, str]:
    """A copy of it of the test's own: (state directory, policy file)."""
    state = tmp_path / "policy"
    shutil.copytree(_ran, state)
    return state, str(state / "policy.toml")


def test_every_request_has_its_line_and_the_log_agrees_with_the_ledger(ran, capsys):
    state, pol = ran
    lines = _log(state)
    # a request that charges has two lines: the charge (before any noise) and its outcome
    assert [(e["type"], e["decision"]) for e in lines] == [
        ("train", "charged"), ("train", "answered"), ("train", "charged"), ("train", "answered"),
        ("train", "refused"), ("evaluate", "charged"), ("evaluate", "answered"),
        ("evaluate", "refused"),
    ]  # fmt: skip
    assert "already answered" in lines[4]["reason"]
    assert [e.get("releases") for e in lines] == [2, None, 2, None, None, 1, None, None]
    assert [e.get("charge") for e in lines] == [None, 0, None, 2, None, None, 5, None]
    assert lines[0]["request"]["sample-rate"] == 0.2 and lines[0]["request"]["clip"] == 1.0
    assert lines[0]["request"]["noise_placement"] == "sites" and lines[5]["request"]["models"] == 1
    led = ledger_file(state)["ledger"]
    assert lines[5]["ledger_releases"] == led["steps"] == 5
    assert lines[5]["epsilon_total"] > lines[2]["epsilon_total"] > lines[0]["epsilon_total"] > 0
    assert sum(e.get("epsilon_charged", 0) for e in lines) == pytest.approx(
        lines[5]["epsilon_total"]
    )
    text = audit_log.audit_path(state).read_text()
    assert str(state.parent) not in text and "site-data" not in text and "theta" not in text
    assert verify(SitePolicy.from_file(pol)) == (8, None)
    assert cli_main(["site", "log", pol, "--verify"]) == 0
    capsys.readouterr()
    assert cli_main(["site", "log", pol, "--refused", "--json"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["seq"] for e in out] == [4, 7]
    assert cli_main(["site", "log", pol, "--run", "nobody"]) == 0
    assert capsys.readouterr().out == ""
    assert cli_main(["site", "log", pol, "--since", "2999-01-01"]) == 0
    assert capsys.readouterr().out == ""


def test_a_site_killed_after_its_charge_leaves_the_charge_in_log_and_ledger(ran):
    """A site killed while it computes (after the charge, before the reply) leaves the
    ``charged`` line without its outcome: the log still agrees with the ledger."""
    state, pol = ran
    path = audit_log.audit_path(state)
    _rewrite(path, lambda ls: ls[:6])  # killed after the evaluation's charge
    assert _log(state)[-1]["decision"] == "charged"
    assert verify(SitePolicy.from_file(pol)) == (6, None)


def _rewrite(path: Path, change) -> None:
    lines = path.read_text().splitlines()
    path.write_text("".join(x + "\n" for x in change(lines)))


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda ls: (
                ls[:1] + [ls[1].replace('"decision":"answered"', '"decision":"refused"')] + ls[2:]
            ),
            "line 2: its content does not match",
        ),
        (lambda ls: ls[:1] + ls[2:], "line 2: sequence 2, expected 1"),
        (lambda ls: [ls[1], ls[0], *ls[2:]], "line 1: sequence 1, expected 0"),
        (lambda ls: ls[:-3], "the log charged 4 releases, its ledger holds 5"),
        (lambda ls: ls[:2] + [ls[2][:40]] + ls[3:], "line 3: not a JSON object"),
    ],
    ids=["edited", "removed", "reordered", "cut-short", "truncated-line"],
)
def test_verify_finds_the_first_bad_line(ran, capsys, change, words):
    state, pol = ran
    _rewrite(audit_log.audit_path(state), change)
    assert cli_main(["site", "log", pol, "--verify"]) == 1
    assert words in capsys.readouterr().err


def test_a_line_recomputed_after_an_edit_still_disagrees_with_the_ledger(ran):
    state, pol = ran
    path = audit_log.audit_path(state)
    entries = _log(state)
    path.write_text("")
    for e in entries:  # a forger drops the evaluation's charge and re-chains every line
        if e["type"] == "evaluate" and e["decision"] in ("charged", "answered"):
            continue
        audit_log.append(path, {k: v for k, v in e.items() if k not in ("seq", "prev", "hash")})
    assert "its ledger holds 5" in str(verify(SitePolicy.from_file(pol))[1])


def test_a_site_whose_log_cannot_be_written_refuses_and_charges_nothing(tmp_path):
    node, state, pol = _site(tmp_path)
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    before = (state / "fedsgld-site-0.json").read_bytes()
    path = audit_log.audit_path(state)
    path.unlink()
    path.mkdir()  # the log's place is taken: nothing can be appended (root or not)
    refused(node.send("train", plan=plan(LOCAL, round=1)), "audit log cannot be written")
    assert (state / "fedsgld-site-0.json").read_bytes() == before
    path.rmdir()
    answered(node.send("train", plan=plan(LOCAL, round=1)))  # writable again: it answers


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_log_directory_refuses_and_charges_nothing(tmp_path):
    node, state, _ = _site(tmp_path)
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    before = (state / "fedsgld-site-0.json").read_bytes()
    path = audit_log.audit_path(state)
    path.chmod(0o444)
    path.parent.chmod(0o555)
    try:
        refused(node.send("train", plan=plan(LOCAL, round=1)), "audit log cannot be written")
    finally:
        path.parent.chmod(0o755)
    assert (state / "fedsgld-site-0.json").read_bytes() == before


def _append_many(path: str, who: int, n: int) -> None:
    for i in range(n):
        audit_log.append(Path(path), {"time": audit_log.now(), "type": "query", "who": who, "i": i})


def test_concurrent_appends_from_two_processes_keep_the_chain(tmp_path):
    path = audit_log.audit_path(tmp_path)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), w, 60)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = audit_log.read(path)
    assert len(lines) == 120
    assert audit_log.chain_problem(lines) is None
    assert {e["who"] for _, _, e in lines} == {1, 2}


def test_a_pate_vote_has_its_line_and_verifies(tmp_path):
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from test_site_guard import _pate, pate_node

    config, rec, split = _pate()
    node = pate_node(tmp_path, split, "default")
    task = ConfigRecord({"site-id": 0, "run-key": "pate-run"})
    queries = ArrayRecord({"x": Array(split.x_query.numpy().astype(np.float32))})
    answered(node.send("train.pate", pate=rec, task=task, queries=queries))
    line, outcome = _log(tmp_path / "default")
    assert (line["type"], line["decision"], line["run"], line["releases"]) == (
        "train.pate", "charged", "pate-run", 1,
    )  # fmt: skip
    assert (outcome["decision"], outcome["charge"]) == ("answered", 0)
    assert "x" not in line["request"]  # the queries' array name and values stay out
    assert verify(SitePolicy.from_file(tmp_path / "default" / "policy.toml")) == (2, None)
