"""Faults on a real deployment lose nothing (docs/deployment.md, "What a fault costs").

Each test starts a loopback deployment (one SuperLink, four SuperNodes on the fast path,
each site with its own data file, policy, ledger and audit log), injects a fault by PID
(:class:`fedsgld.deploy.loopback.Processes`: ``signal``, ``restart``, ``descendants``)
and then checks the run's outcome, every site's ledger and its audit log
(``fedsgld site log --verify``'s check: chain intact, the log agrees with the ledger):

* a SuperNode killed (SIGKILL) while it computes a train reply, then started again, and
  (once the first is back) a SuperNode stopped (SIGSTOP) past the round timeout, then
  continued, in one run;
* the ServerApp killed mid-run, and the run resumed from its checkpoint;
* a SuperNode killed during a secure round: with ``max_dropouts = 1`` the round recovers,
  with none planned the run fails naming the site and the round;
* two runs (two ServerApps, two run keys) on the same four SuperNodes at once.

A site is killed or stopped the moment its audit log shows the round's ``charged`` line
(written after the ledger's charge, before any noise is drawn): the site is then computing
its reply (a CNN's per-record gradients of every record: about a second). Every process is
stopped by its PID at the end, also when the test fails (the Loopback context manager).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from flower_support import SMALL

from fedsgld.clients import audit_log
from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy
from fedsgld.config import load_config
from fedsgld.deploy.export_sites import export_sites
from fedsgld.deploy.loopback import LOOPBACK_POLICY, Loopback, approved_policy
from fedsgld.secagg import identity

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

TIMEOUT = 20.0  # the round timeout: a site that has not answered by then is dropped
RUN: dict[str, Any] = {
    **SMALL,
    "dataset": "mnist5k",
    "model": "cnn",
    "sites": 4,
    "rounds": 6,
    "sample_rate": 1.0,  # every record's gradient: the site computes for about a second
    "min_sites": 3,
    "epsilon": 500.0,  # no budget stop: every round runs
    "eval_every": 0,
    "checkpoint_every": 2,
    "burn_in": 1,
    "thin": 1,
    "max_samples": 2,
    "threads": 1,
    "randomness": "os",
    "poll-interval": 0.1,
    "wait-for-sites": 180.0,
    "round-timeout": TIMEOUT,
}


class Sites:
    """Four deployed sites under ``root``: data files, approved policies, ledgers, logs."""

    def __init__(self, root: Path, run: dict[str, Any], *, secure: bool = False) -> None:
        self.root = root
        cfg = load_config(None, {k: v for k, v in run.items() if "-" not in k})
        files = export_sites(cfg, root / "data")
        keys = ""
        if secure:  # every site's long-term key and the consortium's key list
            public = {k: identity.generate(root / f"site{k}" / "site.key") for k in range(4)}
            (root / "peers.toml").write_text("".join(f'{k} = "{h}"\n' for k, h in public.items()))
            keys = f'signing_key = "site.key"\npeers = "{root / "peers.toml"}"\n'
            keys += f"max_dropouts = {run['max_dropouts']}\n"
        self.policies = [
            approved_policy(root / f"site{k}" / "policy.toml", LOOPBACK_POLICY + keys)
            for k in range(len(files))
        ]
        self.nodes = [
            f"site-id={k} site-data='{f}' privacy-policy='{p}'"
            for k, (f, p) in enumerate(zip(files, self.policies))
        ]

    def ledger(self, k: int) -> dict[str, Any]:
        return json.loads((self.root / f"site{k}" / f"fedsgld-site-{k}.json").read_text())

    def log(self, k: int) -> list[dict[str, Any]]:
        path = audit_log.audit_path(self.root / f"site{k}")
        return [e for _, _, e in audit_log.read(path) if e is not None]

    def charged(self, k: int, rnd: int, kind: str = "train") -> bool:
        return any(
            e["decision"] == "charged" and e["type"] == kind and e.get("round") == rnd
            for e in self.log(k)
        )

    def rounds(self, k: int, decision: str, run: str | None = None) -> list[int]:
        """The train rounds of site ``k`` whose line has ``decision`` (of ``run``)."""
        return sorted(
            e["round"]
            for e in self.log(k)
            if e["type"] == "train" and e["decision"] == decision and run in (None, e["run"])
        )

    def verified(self) -> None:
        """Every site's log: chain intact and in agreement with its ledger."""
        for pol in self.policies:
            n, problem = verify(SitePolicy.from_file(pol))
            assert problem is None and n > 0, (pol, problem)


def _when(cond, what: str, timeout: float = 600.0, every: float = 0.005, run=None, logs=()):
    """Wait for ``cond``; an AssertionError after ``timeout`` s, or at once when ``run``
    (a :class:`Submitted`) has ended, with the run's own log lines and the tails of
    ``logs`` (what the next reader needs to see why)."""
    end = time.monotonic() + timeout
    while not cond():
        ended = run is not None and run.proc.poll() is not None
        if ended or time.monotonic() > end:
            why = "the run ended" if ended else f"{timeout:g} s"
            shown = [] if run is None else [run.log, *logs]
            raise AssertionError(f"no {what} ({why})\n" + "\n".join(map(_tail, shown)))
        time.sleep(every)


def _tail(path: Path, lines: int = 40) -> str:
    """The run's ``[fedsgld]`` lines, or the last ``lines`` lines, of the log ``path``."""
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    own = [t for t in text if "[fedsgld]" in t]
    return f"--- {path.name}\n" + "\n".join((own or text)[-lines:])


def _contributors(r: dict[str, Any]) -> dict[int, list[int]]:
    """Round -> the sites whose answers it used (results.json's round_contributors)."""
    out = {}
    for block in r["round_contributors"]:
        for t in range(block["rounds"][0], block["rounds"][1] + 1):
            out[t] = block["sites"]
    return out


def test_a_killed_and_a_stopped_site_are_charged_once_and_the_run_goes_on(tmp_path):
    """Site 3 is killed while it computes round 1 and started again; once it answers from
    its new node, site 1 is stopped while it computes the next round, past the round
    timeout, then continued. The run finishes (``min_sites = 3``) without their replies of
    those rounds. Site 3's ledger and log hold the charge of the reply it never sent, and
    site 3 answers later rounds from its new node; site 1's late reply is discarded and it
    is charged once for that round. (How many rounds pass before the restarted node
    registers depends on the machine: site 1 is stopped only when site 3 is back, so that
    the round keeps ``min_sites``.)"""
    run_cfg = {**RUN, "rounds": 8}
    sites = Sites(tmp_path, run_cfg)
    with Loopback(tmp_path / "flwr") as lo:
        lo.start(sites.nodes, fast=True)
        run = lo.submit({**run_cfg, "out": str(tmp_path / "out")})
        _when(lambda: sites.charged(3, 1), "charge of site 3 in round 1")
        lo.procs.signal("supernode-3", signal.SIGKILL)
        lo.procs.restart("supernode-3")
        _when(
            lambda: any(t > 1 for t in sites.rounds(3, "charged")),
            "site 3 on its new node",
            run=run,
            logs=[lo.root / "supernode-3.log"],
        )
        stop = min(t for t in sites.rounds(3, "charged") if t > 1) + 1
        # rounds are numbered from 0: a round after the stopped one must be left
        assert stop < run_cfg["rounds"] - 1, f"site 3 came back only in round {stop - 1}"
        _when(lambda: sites.charged(1, stop), f"charge of site 1 in round {stop}", run=run)
        lo.procs.signal("supernode-1", signal.SIGSTOP)
        time.sleep(TIMEOUT + 5.0)
        lo.procs.signal("supernode-1", signal.SIGCONT)
        r = run.result(900.0)
    used = _contributors(r)
    assert r["privacy"]["steps"] == run_cfg["rounds"] and len(used) == run_cfg["rounds"]
    assert 3 not in used[1] and 1 not in used[stop]
    drops = {(d["site"], d["round"]) for d in r["flower"]["dropped_replies"]}
    assert {(3, 1), (1, stop)} <= drops
    # every drop names the node it asked: never the SuperLink (node 1), which makes the
    # error replies of a node that stopped sending heartbeats
    nodes = {d["node_id"] for d in r["flower"]["dropped_replies"]}
    assert 1 not in nodes, r["flower"]["dropped_replies"]
    # site 3: charged for round 1 (its reply never left), then answers from its new node
    assert [j["site"] for j in r["flower"]["rejoined"]] == [3]
    assert 3 in used[stop]
    charged3, answered3 = sites.rounds(3, "charged"), sites.rounds(3, "answered")
    assert 1 in charged3 and 1 not in answered3
    assert set(charged3) - set(answered3) == {1}
    # site 1: one charge for the stopped round (its late reply discarded), and it goes on
    charged1 = sites.rounds(1, "charged")
    assert charged1.count(stop) == 1 and len(charged1) == len(set(charged1))
    assert any(1 in used[t] for t in range(stop + 1, run_cfg["rounds"]))
    sites.verified()


def _secure_step(e: dict[str, Any], step: str, rnd: int) -> bool:
    return (
        e["type"] == "train.secagg"
        and e["request"].get("secagg-step") == step
        and (e.get("round") == rnd)
    )


# the ServerApp and two-run tests kill no site mid-computation: a small MLP, quick rounds
LIGHT: dict[str, Any] = {
    **{k: v for k, v in RUN.items() if k not in ("dataset", "model", "sample_rate")},
    "dataset": "synthetic",
    "model": "mlp",
    "sample_rate": 0.2,
}

SECURE = {
    **RUN,
    "noise_placement": "sites",
    "local_steps": 1,
    "secure_aggregation": True,
    "rounds": 3,
}


def _kill_site_3_in_round_1(
    tmp_path: Path, run: dict[str, Any]
) -> tuple[Sites, dict[str, Any] | RuntimeError]:
    """A secure run whose site 3 is killed once it has charged round 1 (it computes its
    masked input); the run's results.json, or the error of a failed run."""
    sites = Sites(tmp_path, run, secure=True)
    with Loopback(tmp_path / "flwr") as lo:
        lo.start(sites.nodes, fast=True)
        job = lo.submit({**run, "out": str(tmp_path / "out")})
        _when(lambda: sites.charged(3, 1, "train.secagg"), "charge of site 3 in round 1")
        lo.procs.signal("supernode-3", signal.SIGKILL)
        try:
            return sites, job.result(900.0)
        except RuntimeError as err:
            return sites, err


def test_a_site_killed_in_a_secure_round_is_recovered_within_max_dropouts(tmp_path):
    """``max_dropouts = 1``: site 3 is killed while it computes its masked input of round 1
    (its shares of round 1 went out with round 0's unmask step). The round completes from
    the survivors' shares, the run finishes on three sites, and every log agrees with its
    ledger (site 3's holds its round-1 charge)."""
    run = {**SECURE, "max_dropouts": 1}
    sites, r = _kill_site_3_in_round_1(tmp_path, run)
    assert isinstance(r, dict), r
    used = _contributors(r)
    assert r["privacy"]["steps"] == run["rounds"] and not r["privacy"]["halted"]
    assert used[0] == [0, 1, 2, 3] and all(used[t] == [0, 1, 2] for t in range(1, 3)), used
    assert {d["site"] for d in r["flower"]["dropped_replies"]} == {3}
    last = sites.log(3)[-1]  # its charge of round 1, and no outcome
    assert _secure_step(last, "masked_input", 1) and last["decision"] == "charged"
    for k in range(3):  # the survivors unmasked round 1 (site 3's mask rebuilt from shares)
        assert any(_secure_step(e, "unmask", 1) and e["decision"] == "answered"
                   for e in sites.log(k))  # fmt: skip
    sites.verified()


def test_a_site_killed_in_a_one_shot_round_fails_the_run_naming_it(tmp_path):
    """No dropouts planned (one-shot rounds): site 3 is killed while it computes its masked
    input of round 1. The round cannot be unmasked without it: the run fails with one line
    naming the round and the site, keeps its checkpoint, and no site is asked anything of
    round 1 after its masked input (nothing of any site is rebuilt)."""
    run = {**SECURE, "max_dropouts": 0, "min_sites": 0}
    sites, err = _kill_site_3_in_round_1(tmp_path, run)
    assert isinstance(err, RuntimeError), err
    text = str(err)
    assert "round 1" in text and "site 3" in text, text[-2000:]
    assert not (tmp_path / "out" / "results.json").exists()
    assert (tmp_path / "out" / "checkpoint.pt").is_file()
    for k in range(3):
        late = [e for e in sites.log(k) if (e.get("round") or 0) >= 1]
        assert {e["request"].get("secagg-step") for e in late} <= {"masked_input"}, late
    sites.verified()


def test_a_killed_serverapp_resumes_with_fresh_noise_and_ledgers_only_grow(tmp_path):
    """The ServerApp is killed (SIGKILL) after round 6's checkpoint; the run is resumed
    (``resume = true``). The resumed epoch redoes the rounds after the checkpoint with
    fresh requests (no site answers one (epoch, round) twice), every site's ledger only
    grows, and the resumed run's epsilon is its ledger's."""
    run = {**LIGHT, "rounds": 12, "checkpoint_every": 3}
    sites = Sites(tmp_path, run)
    out = tmp_path / "out"
    with Loopback(tmp_path / "flwr") as lo:
        lo.start(sites.nodes, fast=True)
        job = lo.submit({**run, "out": str(out)})
        _when(lambda: any(sites.charged(k, 7) for k in range(4)), "a charge of round 7")
        victims = lo.procs.descendants("superlink", "flwr-serverapp")
        assert victims, "no ServerApp process below the SuperLink"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        job.proc.kill()  # the stream of a dead run: ours, by PID
        job.wait(30.0)
        before = [sites.ledger(k)["ledger"]["steps"] for k in range(4)]
        saved = json.loads((out / "ledger.json").read_text())
        r = lo.submit({**run, "out": str(out), "resume": True}, name="resumed").result(900.0)
    p = r["privacy"]
    assert p["steps"] == run["rounds"] and p["randomness"]["epoch"] == 1
    # the rounds redone after the checkpoint are charged again (fresh noise): the result's
    # epsilon is that of the run's ledger, which holds both
    ledger = json.loads((out / "ledger.json").read_text())
    assert p["ledger_steps"] == ledger["steps"] > p["steps"] and ledger["steps"] > saved["steps"]
    assert p["ledger"] == ledger["ledger"]
    for k in range(4):
        assert sites.ledger(k)["ledger"]["steps"] > before[k]
        pairs = [
            (e["request"].get("epoch"), e["round"])
            for e in sites.log(k)
            if e["type"] == "train" and e["decision"] == "charged"
        ]
        assert len(pairs) == len(set(pairs)), k  # no (epoch, round) answered twice
        assert {p[0] for p in pairs} == {0, 1}
    sites.verified()


def test_two_runs_on_the_same_sites_at_once_are_each_charged_to_every_ledger(tmp_path):
    """Two studies (two ServerApps, two run keys) use the four SuperNodes at the same time.
    Both finish; each site answered every round of both, and its ledger holds exactly what
    its log says it answered to both."""
    run = {**LIGHT, "rounds": 6, "min_sites": 0}
    sites = Sites(tmp_path, run)
    with Loopback(tmp_path / "flwr") as lo:
        lo.start(sites.nodes, fast=True)
        jobs = [lo.submit({**run, "out": str(tmp_path / n)}, name=n) for n in ("a", "b")]
        results = [j.result(900.0) for j in jobs]
    for r in results:
        assert r["privacy"]["steps"] == run["rounds"]
    for k in range(4):
        keys = {e["run"] for e in sites.log(k) if e["type"] == "train"}
        assert len(keys) == 2
        for key in keys:
            assert sites.rounds(k, "charged", key) == list(range(run["rounds"]))
        assert set(sites.ledger(k)["answered"]) == keys
    sites.verified()
