"""Secure aggregation with distributed discrete Gaussian noise (docs/secure_aggregation.md):
its settings, its accounting."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedsgld import engine
from fedsgld.config import Config, load_config
from fedsgld.federation import Federation
from fedsgld.privacy.audit_tradeoff import LedgerCurves
from fedsgld.privacy.distributed import ddg_epsilon
from fedsgld.secagg import RoundAborted, run_round
from fedsgld.studies.audit import accountant_curve

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy"))
from test_secagg import servers_residual  # noqa: E402  (the primitives' attacker)

SECAGG = {
    "secure_aggregation": True,
    "noise_placement": "sites",
    "method": "dpsgld",
    "local_steps": 1,
}


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"noise_placement": "server"}, "noise_placement"),
        ({"method": "sgd"}, "method dpsgd or dpsgld"),
        ({"method": "dpvi", "noise_placement": "server"}, "noise_placement"),
        ({"local_steps": 2}, "local_steps = 1"),
        ({"max_dropouts": -1}, "max_dropouts must be an integer"),
        ({"max_colluders": 1.5}, "max_colluders must be an integer"),
        ({"secure_aggregation": "yes"}, "secure_aggregation must be true or false"),
        ({"max_dropouts": 2, "max_colluders": 2}, r"sites - 1 = 3"),
        (
            {"secagg_neighbours": 1},
            r"secagg_neighbours must be 0 .* or even in \[2, sites - 2 = 2\]",
        ),
        ({"sites": 8, "max_dropouts": 1, "secagg_neighbours": 2}, r"even in \[4, sites - 2 = 6\]"),
        ({"secagg_neighbours": 4}, r"sites - 2 = 2\] .*got 4"),
        ({"secagg_neighbours": -2}, "secagg_neighbours must be an integer"),
    ],
)
def test_secure_aggregation_settings_are_checked(change, names):
    with pytest.raises(ValueError, match=names):
        Config.from_flat({**SECAGG, "sites": 4, **change})


def test_secure_aggregation_settings_accepted_within_range():
    assert Config.from_flat({**SECAGG, "sites": 8, "max_dropouts": 1,
                             "secagg_neighbours": 4}).privacy.secagg_neighbours == 4  # fmt: skip
    cfg = Config.from_flat({**SECAGG, "sites": 4, "max_dropouts": 2, "max_colluders": 1})
    assert cfg.privacy.secure_aggregation and cfg.privacy.max_dropouts == 2
    # off, the plan bounds are not checked against the sites (they do not apply)
    assert Config.from_flat({"sites": 2, "max_dropouts": 5}).privacy.max_dropouts == 5


# -- the in-process engine -----------------------------------------------------------------

SMALL = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 4,
    "rounds": 6,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 2.0,
    "prenoise": 0.01,
    "epsilon": 30.0,
    "eval_every": 3,
    "checkpoint_every": 3,
    "seed": 5,
    **SECAGG,
}


def _run(tmp_path, name="secagg", **over):
    cfg = load_config(None, {**SMALL, **over})
    return engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)


def test_engine_run_names_the_mechanism_and_its_epsilon(tmp_path):
    res = _run(tmp_path, max_dropouts=1)
    on_disk = json.loads((tmp_path / "secagg" / "results.json").read_text())
    block = on_disk["privacy"]["secure_aggregation"]
    assert block["mechanism"] == "distributed discrete Gaussian"
    assert block["accounting"].startswith("PLD of a dominating Poisson-subsampled Gaussian")
    assert on_disk["privacy"]["steps"] == 6 and res["privacy"]["steps"] == 6
    # the run's epsilon is ddg_epsilon of its rounds (dpsgld, constant step size here)
    cfg = load_config(None, {**SMALL, "max_dropouts": 1})
    server = Federation(cfg, log=lambda s: None).make_server()
    rounds = [(cfg.privacy.sample_rate, server.mode.parameters(t), 1) for t in range(6)]
    ref = ddg_epsilon(rounds, cfg.privacy.delta)[0]
    assert block["epsilon"] == pytest.approx(ref, rel=1e-9)
    assert on_disk["privacy"]["epsilon"]["pld"] == pytest.approx(ref, rel=1e-9)
    assert on_disk["privacy"]["rigorous_accountant"] == "pld"
    assert all(np.isfinite(v) for v in on_disk["privacy"]["epsilon"].values())
    # the audit's curve is the PLD of the same dominating ledger: at the claimed noise its
    # epsilon is the accountant's
    ledger, slack = accountant_curve(on_disk["privacy"])
    assert ledger and len(ledger) == len(block["dominating_ledger"])
    curves = LedgerCurves(ledger, cfg.privacy.delta, slack_up=slack[0], slack_down=slack[1])
    assert curves.epsilon(0) == pytest.approx(ref, rel=1e-9)


def _federation(**over):
    cfg = load_config(None, {**SMALL, **over})
    fed = Federation(cfg, log=lambda s: None)
    server = fed.make_server()
    server.run_key = "test"
    return fed, server


def test_budget_stops_the_run_before_a_round_past_it(tmp_path):
    fed, server = _federation()
    one = ddg_epsilon([(0.2, server.mode.parameters(0), 1)], 1e-5)[0]
    three = ddg_epsilon([(0.2, server.mode.parameters(0), 3)], 1e-5)[0]
    res = _run(tmp_path, epsilon=(three + one) / 2 if three > one else three)
    assert res["privacy"]["halted"] and res["privacy"]["steps"] < 6
    assert res["privacy"]["secure_aggregation"]["epsilon"] <= (three + one) / 2


def test_a_planned_dropout_completes_the_round_and_one_more_aborts_it():
    fed, server = _federation(max_dropouts=1)
    theta0 = server.theta.clone()
    plan = server.plan()
    engine.secure_round(fed, server, plan, drop={2: "masked_input"})
    assert server.t == 1 and not torch.equal(server.theta, theta0)
    assert server.mode.last_round.survivors == (0, 1, 3)
    # the dropped site drew nothing and charged nothing; the others charged their ledgers
    ledgers = [g.ledger.accountant.steps for g in fed.secure_sites()]
    assert ledgers == [1, 1, 0, 1]
    theta1 = server.theta.clone()
    plan = server.plan()
    with pytest.raises(RoundAborted):
        engine.secure_round(fed, server, plan, drop={0: "masked_input", 3: "masked_input"})
    assert server.t == 1 and torch.equal(server.theta, theta1)  # nothing released


def test_the_server_sees_only_masked_inputs_and_the_sum():
    """Site 0's contribution is its clipped sum plus its share, masked: from everything the
    server party received in an engine round (the transcript), rebuilding and removing
    site 0's self mask leaves a residual that is uniform modulo 2^bits, unrelated to site
    0's encoded input. Fails when the pairwise masks are left out."""
    fed, server = _federation(secagg_one_shot=False)
    plan = server.plan()
    engine.secure_round(fed, server, plan)
    party = server.mode.last_round.server
    residual = servers_residual(party, 0)
    bits = party.plan.bits
    u = residual.astype(np.float64) / 2.0**bits
    assert stats.kstest(u, "uniform").pvalue > 1e-6
    names = [name for name, _ in party.transcript]
    assert names == ["advertise_keys", "share_keys", "masked_input", "consistency", "unmask"]


def test_a_one_shot_round_shows_the_server_masked_inputs_and_the_sum_only():
    """The default with no dropouts planned (secagg_one_shot): the server receives the keys
    and one masked input per site, nothing else, and site 0's input as the server holds it
    is uniform modulo 2^bits (no secret of any site is ever released to remove a mask);
    the sum carries the central noise as in the full protocol's round."""
    fed, server = _federation()
    plan = server.plan()
    theta0 = server.theta.clone()
    engine.secure_round(fed, server, plan)
    party = server.mode.last_round.server
    assert party.plan.one_shot
    assert [name for name, _ in party.transcript] == ["advertise_keys", "masked_input"]
    y = dict(party.transcript)["masked_input"][0]["y"]
    u = np.frombuffer(y, dtype="<u4").astype(np.float64) / 2.0**party.plan.bits
    assert stats.kstest(u, "uniform").pvalue > 1e-6
    assert server.t == 1 and torch.isfinite(server.theta).all()
    assert not torch.equal(server.theta, theta0)


def test_the_engine_sum_carries_the_central_noise():
    """The decoded sum of an engine round minus the sites' clipped sums has variance
    sigma_t^2 C^2 (tolerance 5 standard errors; statistical): shares of 1/K of it each."""
    fed, server = _federation(model="mlp", clip=1.0)
    plan = server.plan()
    sums = [
        s.clipped_sum(server.theta, round=0, sample_rate=plan.sample_rate, clip=plan.clip,
                      prenoise=plan.prenoise).double()
        for s in fed.sites
    ]  # fmt: skip
    # the same clipped sums the round computes (the sites' generators are keyed by round)
    params = server.mode.begin(plan)
    guards = fed.secure_sites()
    res = run_round(
        [x.numpy() for x in sums], params, round_label=b"noise",
        mechanism=server.mode.mechanism(plan, params),
        encoder=lambda i, v, p: guards[i].contribution(
            v, plan=p, params=params, noise_multiplier=plan.sigma,
            sample_rate=plan.sample_rate, prenoise=plan.prenoise, round_of=("noise", 0, 0)),
    )  # fmt: skip
    noise = res.total - sum(sums).numpy()
    target = (plan.sigma * plan.clip) ** 2
    dim = noise.shape[0]
    assert dim > 2000
    assert abs(noise.var() / target - 1.0) < 5 * math.sqrt(2.0 / dim) + 0.02


def test_every_share_is_drawn_through_the_receipt_of_its_sites_charge(monkeypatch):
    """Each site's discrete Gaussian share is drawn by the receipt its own ledger returned
    for this round's event: no share exists without its site's charge."""
    from fedsgld.core.release import Charged

    fed, server = _federation()
    drawn = []
    real = Charged.draw

    def spy(self, sampler, *args, **kwargs):
        drawn.append(self.event)
        return real(self, sampler, *args, **kwargs)

    monkeypatch.setattr(Charged, "draw", spy)
    engine.secure_round(fed, server, server.plan())
    assert len(drawn) == len(fed.sites)
    assert all(type(e).__name__ == "DistributedDiscreteGaussianStep" for e in drawn)
    assert [g.ledger.accountant.steps for g in fed.secure_sites()] == [1] * len(fed.sites)


def test_sparse_neighbourhoods_mask_with_k_sites_and_charge_the_same(tmp_path):
    """secagg_neighbours = 2 on 5 sites: every site sends its shares to its two ring
    neighbours only, the run trains to a finite model, and the epsilon is the complete
    graph's (the released sum, and so the mechanism, is the same)."""
    sparse = _run(tmp_path, "sparse", sites=5, rounds=2, secagg_neighbours=2,
                  secagg_one_shot=False)  # fmt: skip
    full = _run(tmp_path, "full", sites=5, rounds=2, secagg_one_shot=False)
    assert sparse["privacy"]["epsilon"]["pld"] == pytest.approx(full["privacy"]["epsilon"]["pld"])
    on_disk = json.loads((tmp_path / "sparse" / "results.json").read_text())
    assert on_disk["privacy"]["secure_aggregation"]["neighbours"] == 2
    assert np.isfinite(on_disk["metrics"]["pooled"]["accuracy"])
    fed, server = _federation(sites=5, secagg_neighbours=2, secagg_one_shot=False)
    plan = server.plan()
    engine.secure_round(fed, server, plan)
    party = server.mode.last_round.server
    shares = dict(party.transcript)["share_keys"]
    assert sorted(len(m["shares"]) for m in shares) == [2] * 5


def test_encoding_processes_release_the_same_mechanism_and_stop_with_the_run(tmp_path):
    """secagg_encoders = processes: the sites' encodings run in the run's child processes
    (their CPU time counts encodings), every site's ledger is charged once a round as
    with the round's threads, the epsilon is the threads run's, and no child outlives
    the run."""
    seen: dict = {}
    built: dict = {}

    def during(info) -> None:
        w = built["federation"].encode_workers
        seen.update(pids=w.pids, procs=[x.proc for x in w._workers], cpu=w.cpu_seconds,
                    encodings=w.encodings)  # fmt: skip

    cfg = load_config(None, {**SMALL, "rounds": 2, "eval_every": 0, "threads": 2,
                             "secagg_encoders": "processes"})  # fmt: skip
    res = engine.run(cfg, out_dir=tmp_path / "procs", progress=False, log=lambda s: None,
                     on_round=during, built=built)  # fmt: skip
    assert len(seen["pids"]) == 2 and seen["cpu"] > 0.0
    assert seen["encodings"] == 2 * 4  # every site's share of both rounds, in a child
    assert all(p.poll() is not None for p in seen["procs"])  # stopped with the run
    fed = built["federation"]
    assert fed.encode_workers is None
    assert [g.ledger.accountant.steps for g in fed.secure_sites()] == [2] * 4
    threads = _run(tmp_path, "threads", rounds=2, eval_every=0, threads=2,
                   secagg_encoders="threads")  # fmt: skip
    assert res["privacy"]["epsilon"]["pld"] == pytest.approx(threads["privacy"]["epsilon"]["pld"])
    assert res["privacy"]["steps"] == threads["privacy"]["steps"] == 2
    assert np.isfinite(res["metrics"]["pooled"]["accuracy"])


def test_with_encoding_processes_the_server_still_sees_uniform_inputs_and_the_sum():
    """The server's view of a round whose encodings ran in the children: site 0's masked
    input is uniform modulo 2^bits and the round steps; every site's share was drawn by
    the receipt of its own charge (the ledgers), in a child (its CPU time)."""
    from fedsgld.secagg.workers import EncodeWorkers

    fed, server = _federation()
    with EncodeWorkers(2) as workers:
        fed.encode_workers = workers
        engine.secure_round(fed, server, server.plan())
        assert workers.encodings == len(fed.sites) and workers.cpu_seconds > 0.0
    party = server.mode.last_round.server
    y = dict(party.transcript)["masked_input"][0]["y"]
    u = np.frombuffer(y, dtype="<u4").astype(np.float64) / 2.0**party.plan.bits
    assert stats.kstest(u, "uniform").pvalue > 1e-6
    assert server.t == 1 and torch.isfinite(server.theta).all()
    assert [g.ledger.accountant.steps for g in fed.secure_sites()] == [1] * len(fed.sites)
    fed.encode_workers = None
    assert all(g.workers is None for g in fed.secure_sites())
