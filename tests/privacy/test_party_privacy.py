"""Privacy against each party of a deployment, tested as that party would attack.

Each attack gets exactly what one party receives (the messages of the real ServerApp and
ClientApp over :class:`~fedsgld.flower.local_grid.LocalGrid`) and tries to undo the noise.
With ``randomness = "seeded"`` (simulations) every attack succeeds, which shows the attack
is real; with ``randomness = "os"`` (deployments) each fails by the size of the noise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from fedsgld import engine
from fedsgld.apps import APPS
from fedsgld.clients import site as site_module
from fedsgld.clients.guard import check_training
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.config import load_config
from fedsgld.core.noise import Randomness, seeded_generator
from fedsgld.deploy.loopback import site_node_configs
from fedsgld.flower.local_grid import run_local
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.events import subsampled_steps
from fedsgld.run.resume import ResumeError
from fedsgld.strategies import server as server_module

SMALL = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 3,
    "rounds": 6,
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
    "checkpoint_every": 3,
    "seed": 3,
}


def _vec(rec, key):
    return torch.from_numpy(np.frombuffer(rec[key], dtype="<f4").copy()).double()


class Recorder:
    """A LocalGrid fault hook that keeps every (instruction, reply) pair and passes it on."""

    def __init__(self):
        self.pairs = []

    def __call__(self, ins, reply):
        self.pairs.append((ins, reply))
        return reply

    def train(self):
        return [(i, r) for i, r in self.pairs if i.metadata.message_type == "train"]


def _site_of(ins, reply):
    """The site an instruction went to, as that site knows it: named in the plan where its
    node hosts several sites; otherwise the plan is shared and the site is its node's one."""
    plan = ins.content["plan"]
    if "site-id" in plan:
        return int(plan["site-id"])
    (rec,) = reply.content.values()
    return int(rec["site-id"])


# -- (a) a site against the server's noise (server placement) ---------------------------------


def _site_attack(tmp_path, randomness):
    """Site 0 knows: the run record (with the seed), theta_t of every round, its own sum,
    and the public settings. It estimates the other sites' sum in every round."""
    rec = Recorder()
    out = tmp_path / randomness
    run_local(
        {**SMALL, "randomness": randomness, "out": str(out)}, **APPS, fault=rec, shuffle_seed=1
    )
    cfg = load_config(None, SMALL)
    res = json.loads((out / "results.json").read_text())
    big_l = cfg.privacy.sample_rate * sum(s["n_train"] for s in res["sites"])
    by_round: dict[int, dict[int, tuple]] = {}
    for ins, reply in rec.train():
        plan = ins.content["plan"]
        by_round.setdefault(int(plan["round"]), {})[_site_of(ins, reply)] = (ins, reply)
    errors, noise_norms = [], []
    for t in range(cfg.run.rounds - 1):
        ins0, rep0 = by_round[t][0]
        theta_t = _vec(ins0.content["plan"], "theta")
        theta_next = _vec(by_round[t + 1][0][0].content["plan"], "theta")
        seed = int(ins0.content["plan"]["run.seed"])  # what the site received
        plan = ins0.content["plan"]
        alpha = cfg.privacy.step_size(t)
        noise_std = float(plan["sigma"]) * float(plan["clip"])
        # what the site can regenerate of the server's noise from the seed it received
        guess = torch.randn(theta_t.shape, generator=seeded_generator(seed, 0, t)) * noise_std
        observed = big_l * (theta_t - theta_next) / alpha  # = S_0 + S_1 + S_2 + noise
        estimate = observed - _vec(rep0.content["sum"], "sum") - guess.double()
        truth = sum(_vec(by_round[t][k][1].content["sum"], "sum") for k in (1, 2))
        errors.append(float((estimate - truth).norm()))
        noise_norms.append(noise_std * theta_t.numel() ** 0.5)
    return np.array(errors), np.array(noise_norms)


def test_a_site_cannot_subtract_the_servers_noise(tmp_path):
    err, noise = _site_attack(tmp_path, "os")
    # the estimate is off by (true noise - guess): sqrt(2) x the noise norm, never small
    assert np.all(err > 0.8 * noise), (err, noise)
    assert np.all(err < 2.0 * noise), (err, noise)
    # the same attack on a seeded simulation recovers the other sites' sum: the attack is real
    err_s, noise_s = _site_attack(tmp_path, "seeded")
    assert np.all(err_s < 1e-3 * noise_s), (err_s, noise_s)


# -- (b) the server against a site's own noise (sites placement) -------------------------------


def _server_attack(tmp_path, monkeypatch, randomness):
    """The server knows: theta it sent, theta_k the site returned, the seed, the settings.
    With one local step, L_k (theta - theta_k) / alpha = S_k + noise_k; it subtracts the
    noise it can regenerate and compares with the site's true clipped sum S_k."""
    true_sums: list[torch.Tensor] = []
    real = site_module.site_step

    def recording(*a, **kw):
        s = real(*a, **kw)
        true_sums.append(s.detach().clone().double())
        return s

    monkeypatch.setattr(site_module, "site_step", recording)
    rec = Recorder()
    over = {**SMALL, "noise_placement": "sites", "local_steps": 1, "rounds": 3}
    run_local(
        {**over, "randomness": randomness, "out": str(tmp_path / randomness)}, **APPS, fault=rec
    )
    cfg = load_config(None, over)
    errors, noise_norms = [], []
    for i, (ins, reply) in enumerate(rec.train()):
        plan = ins.content["plan"]
        k, t = _site_of(ins, reply), int(plan["round"])
        seed = int(ins.content["plan"]["run.seed"])
        theta = _vec(ins.content["plan"], "theta")
        theta_k = _vec(reply.content["theta"], "theta")
        sites = json.loads((tmp_path / randomness / "results.json").read_text())["sites"]
        big_lk = cfg.privacy.sample_rate * sites[k]["n_train"]
        noise_std = cfg.privacy.sigma(t) * cfg.privacy.clip
        guess = (
            torch.randn(
                theta.shape,
                generator=seeded_generator(seed, 1 + k, t, site_module.LOCAL_NOISE_STREAM),
            )
            * noise_std
        )
        estimate = big_lk * (theta - theta_k) / cfg.privacy.step_size(t) - guess.double()
        errors.append(float((estimate - true_sums[i]).norm()))
        noise_norms.append(noise_std * theta.numel() ** 0.5)
    return np.array(errors), np.array(noise_norms)


@pytest.mark.slow  # 7-16 s
def test_the_server_cannot_subtract_a_sites_noise(tmp_path, monkeypatch):
    err, noise = _server_attack(tmp_path, monkeypatch, "os")
    assert len(err) == 9
    assert np.all(err > 0.8 * noise) and np.all(err < 2.0 * noise), (err, noise)
    err_s, noise_s = _server_attack(tmp_path, monkeypatch, "seeded")
    assert np.all(err_s < 1e-3 * noise_s), (err_s, noise_s)


# -- (c) crash and resume: never the same noise twice, every release counted ------------------


def test_resumes_draw_fresh_noise_and_the_ledger_counts_every_release(tmp_path, monkeypatch):
    drawn: list[tuple[int, tuple, torch.Tensor]] = []
    real_gaussian = Randomness.gaussian

    def recording(self, shape, *, std, key, dtype=torch.float32):
        x = real_gaussian(self, shape, std=std, key=key, dtype=dtype)
        if key[0] == server_module.SERVER_STREAM:
            drawn.append((self.epoch, key, x.clone()))
        return x

    monkeypatch.setattr(Randomness, "gaussian", recording)
    real_sum = site_module.Site.clipped_sum
    crash = {"at": 4}

    def crashing(self, theta, *, round, **kw):
        if round == crash["at"]:
            raise RuntimeError("simulated crash")
        return real_sum(self, theta, round=round, **kw)

    monkeypatch.setattr(site_module.Site, "clipped_sum", crashing)
    cfg = load_config(None, SMALL)
    out = tmp_path / "run"

    def go(resume):
        return engine.run(cfg, out_dir=out, resume=resume, progress=False, log=lambda s: None)

    with pytest.raises(RuntimeError):
        go(False)  # rounds 0..3 released; checkpoint at round 3
    with pytest.raises(RuntimeError):
        go(True)  # epoch 1 from round 3: round 3 again, crash at 4 (no new checkpoint)
    crash["at"] = None
    res = go(True)  # epoch 2 from round 3 again, to the end
    # round 3 was released three times, each with different noise
    r3 = [(e, x) for e, k, x in drawn if k[1] == 3]
    assert [e for e, _ in r3] == [0, 1, 2]
    assert not torch.equal(r3[0][1], r3[1][1]) and not torch.equal(r3[1][1], r3[2][1])
    assert not torch.equal(r3[0][1], r3[2][1])
    # no two draws of the whole history are equal
    flat = [x for _, _, x in drawn]
    assert all(not torch.equal(a, b) for i, a in enumerate(flat) for b in flat[i + 1 :])
    pr = res["privacy"]
    assert pr["steps"] == 6
    assert pr["ledger_steps"] == 4 + 1 + 3  # every release counted, the replays too
    assert pr["randomness"]["epoch"] == 2


# -- (d) the ledger never resets --------------------------------------------------------------


def _crashed_run(tmp_path, monkeypatch, name):
    real_sum = site_module.Site.clipped_sum

    def crashing(self, theta, *, round, **kw):
        if round == 4:
            raise RuntimeError("simulated crash")
        return real_sum(self, theta, round=round, **kw)

    monkeypatch.setattr(site_module.Site, "clipped_sum", crashing)
    cfg = load_config(None, SMALL)
    with pytest.raises(RuntimeError):
        engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)
    monkeypatch.setattr(site_module.Site, "clipped_sum", real_sum)
    return cfg, tmp_path / name


def test_resume_without_ledger_json_never_restarts_at_zero(tmp_path, monkeypatch):
    cfg, out = _crashed_run(tmp_path, monkeypatch, "noledger")
    assert json.loads((out / "ledger.json").read_text())["steps"] == 4
    (out / "ledger.json").unlink()
    logs: list[str] = []
    res = engine.run(cfg, out_dir=out, resume=True, progress=False, log=logs.append)
    # the checkpoint (round 3) held 3 steps; the rounds that may have run after it (up to
    # checkpoint_every) are counted as spent, so the ledger is never below the truth (4)
    assert res["privacy"]["ledger_steps"] >= 4 + 3
    assert any("ledger.json" in m for m in logs)


def test_resume_refuses_when_no_ledger_can_be_read(tmp_path, monkeypatch):
    cfg, out = _crashed_run(tmp_path, monkeypatch, "noledgers")
    (out / "ledger.json").unlink()
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    ck["ledger"] = None
    torch.save(ck, out / "checkpoint.pt")
    with pytest.raises(ResumeError, match="ledger.json.*checkpoint.pt"):
        engine.run(cfg, out_dir=out, resume=True, progress=False, log=lambda s: None)


def test_resume_takes_the_larger_ledger(tmp_path, monkeypatch):
    cfg, out = _crashed_run(tmp_path, monkeypatch, "larger")
    bigger = json.loads((out / "ledger.json").read_text())
    # a stale ledger.json (say, restored from a backup) must not win over the checkpoint
    stale = dict(bigger, ledger=[[bigger["ledger"][0][0], bigger["ledger"][0][1], 1]], steps=1)
    (out / "ledger.json").write_text(json.dumps(stale))
    # ... nor resume at all: ledger.chain says 4 steps were taken; the operator who
    # removes the damaged file gets the checkpoint's ledger plus what may have run after it
    with pytest.raises(ResumeError, match="ledger.json .write 5, 1 steps. is not the last"):
        engine.run(cfg, out_dir=out, resume=True, progress=False, log=lambda s: None)
    (out / "ledger.json").unlink()
    res = engine.run(cfg, out_dir=out, resume=True, progress=False, log=lambda s: None)
    # checkpoint 3 + 3 that may have run after it (counted) + rounds 3..5 run again
    assert res["privacy"]["ledger_steps"] == 3 + 3 + 3


def test_a_crash_inside_the_noise_draw_leaves_the_step_in_the_ledger(tmp_path, monkeypatch):
    cfg = load_config(None, SMALL)
    out = tmp_path / "noisecrash"
    real = Randomness.gaussian

    def crash_on_round_2(self, shape, *, std, key, dtype=torch.float32):
        if key == (server_module.SERVER_STREAM, 2):
            on_disk = json.loads((out / "ledger.json").read_text())
            assert on_disk["steps"] == 3  # round 2 is on disk before its noise exists
            raise RuntimeError("crash while drawing the noise")
        return real(self, shape, std=std, key=key, dtype=dtype)

    monkeypatch.setattr(Randomness, "gaussian", crash_on_round_2)
    with pytest.raises(RuntimeError, match="drawing the noise"):
        engine.run(cfg, out_dir=out, progress=False, log=lambda s: None)
    assert json.loads((out / "ledger.json").read_text())["steps"] == 3


# -- (e) sites enforce their own policy ----------------------------------------------------------


def _guard(tmp_path, **policy):
    pol = SitePolicy(epsilon=4.0, delta=1e-5, state_dir=str(tmp_path), **policy)
    return SiteLedger(0, pol, state_path=tmp_path / "site-0.json")


def _authorize(ledger, *, round, steps, run_key="r", epoch=0, seeded=False, clip=1.0):
    """What the guard does with a sites-placement training request: check, then charge."""
    steps, clip = check_training(ledger.policy, steps=steps, clip=clip, prenoise=0.0, seeded=seeded)
    ledger.admit(event=subsampled_steps(steps), round_of=(run_key, epoch, round))


def test_a_site_refuses_requests_outside_its_policy(tmp_path):
    g = _guard(tmp_path, max_sample_rate=0.1, min_noise_multiplier=0.8, max_clip=2.0)
    _authorize(g, round=0, steps=[(0.05, 1.0)])
    with pytest.raises(PolicyRefused, match="min_noise_multiplier"):
        _authorize(g, round=1, steps=[(0.05, 1e-4)])  # temperature 1e-9 -> sigma ~ 0
    with pytest.raises(PolicyRefused, match="max_sample_rate"):
        _authorize(g, round=1, steps=[(0.5, 1.0)])
    with pytest.raises(PolicyRefused, match="max_clip"):
        _authorize(g, round=1, steps=[(0.05, 1.0)], clip=5.0)
    with pytest.raises(PolicyRefused, match="shared-seed"):
        _authorize(g, round=1, steps=[(0.05, 1.0)], seeded=True)
    with pytest.raises(PolicyRefused, match="non-private"):
        _authorize(g, round=1, steps=[(0.05, 1.0)], clip=None)
    with pytest.raises(PolicyRefused, match="already answered"):
        _authorize(g, round=0, steps=[(0.05, 1.0)])  # a replayed round
    # refusals spent nothing; the one accepted step is on disk, and survives a restart
    assert g.spent_steps == 1
    again = SiteLedger(0, g.policy, state_path=tmp_path / "site-0.json")
    assert again.spent_steps == 1
    with pytest.raises(PolicyRefused, match="already answered"):
        _authorize(again, round=0, steps=[(0.05, 1.0)])
    _authorize(again, round=1, steps=[(0.05, 1.0)])
    _authorize(again, round=0, steps=[(0.05, 1.0)], epoch=1)  # a resumed server


def test_a_site_refuses_what_would_pass_its_own_budget(tmp_path):
    g = _guard(tmp_path)
    answered = 0
    with pytest.raises(PolicyRefused, match="budget"):
        for r in range(10_000):
            _authorize(g, round=r, steps=[(0.1, 1.0)] * 4)  # 26 steps fit
            answered += 1
    assert answered == 6  # 24 of the 26 affordable steps; the 7th round (28) is refused
    assert g.accountant.rigorous_epsilon() <= 4.0
    assert g.spent_steps == 4 * answered


def _policy_file(tmp_path, k, **keys):
    d = tmp_path / f"site{k}"
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{a} = {json.dumps(b)}" for a, b in keys.items()]
    (d / "policy.toml").write_text("\n".join(lines) + "\n")
    return d / "policy.toml"


def test_sites_ledgers_agree_with_the_servers_and_refuse_a_low_noise_server(tmp_path):
    over = {**SMALL, "noise_placement": "sites", "local_steps": 2, "rounds": 3}
    # exact evaluations: the sites' ledgers then hold the training steps alone (noised
    # evaluations compose into them too: tests/privacy/test_site_guard.py)
    keys = dict(epsilon=50.0, delta=1e-5, min_noise_multiplier=0.3, evaluation="exact",
                public_records="exact")  # fmt: skip
    ncs = site_node_configs(SMALL, tmp_path, policy=None)
    for k, nc in enumerate(ncs):
        nc["privacy-policy"] = str(_policy_file(tmp_path, k, **keys))
    out = tmp_path / "sites"
    run_local({**over, "randomness": "os", "out": str(out)}, **APPS, node_configs=ncs)
    server_ledger = json.loads((out / "ledger.json").read_text())
    for k in range(3):
        site_state = json.loads((tmp_path / f"site{k}" / f"fedsgld-site-{k}.json").read_text())
        # the same steps; the site keeps exact sigmas, the server rounds them down onto its
        # sigma_grid (conservative; 0 = exact), so on the server's grid the ledgers are equal
        assert site_state["ledger"]["steps"] == server_ledger["steps"] == 6
        grid = PrivacyAccountant(
            delta=1e-5, sigma_rel_grid=load_config(None, over).privacy.sigma_grid
        )
        site_on_grid = [[q, grid.bucket(sg), c] for q, sg, c in site_state["ledger"]["ledger"]]
        assert site_on_grid == server_ledger["ledger"]
    # a server that asks for less noise (temperature 0.1: sigma_0 = 0.2 < 0.3) is refused by
    # every site before it computes anything
    from fedsgld.flower.strategy import AllSitesFailed

    with pytest.raises(AllSitesFailed, match="min_noise_multiplier"):
        run_local(
            {**over, "temperature": 0.1, "randomness": "os", "out": str(tmp_path / "low")},
            **APPS,
            node_configs=ncs,
        )
    for k in range(3):
        st = json.loads((tmp_path / f"site{k}" / f"fedsgld-site-{k}.json").read_text())
        assert st["ledger"]["steps"] == 6  # unchanged


def test_a_deployed_site_refuses_a_seeded_run_and_a_replayed_round(tmp_path):
    from fedsgld.apps.client_app import app as client_app
    from fedsgld.flower.strategy import AllSitesFailed

    over = {**SMALL, "rounds": 2}
    ncs = site_node_configs(
        SMALL,
        tmp_path,
        policy="epsilon = 50.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n",
    )
    with pytest.raises(AllSitesFailed, match="shared-seed"):
        run_local(
            {**over, "randomness": "seeded", "out": str(tmp_path / "s")}, **APPS, node_configs=ncs
        )

    kept: list = []

    def keep(ins, reply):
        if ins.metadata.message_type == "train" and _site_of(ins, reply) == 0:
            kept.append((ins, reply))
        return reply

    grid = run_local(
        {**over, "randomness": "os", "out": str(tmp_path / "r")},
        **APPS,
        node_configs=ncs,
        fault=keep,
    )
    ins, reply = kept[1]  # round 1, answered
    assert not reply.has_error()
    # the same instruction delivered again (a replaying server or network) is refused; the
    # Flower runtimes turn the exception into an error reply the server logs
    with pytest.raises(PolicyRefused, match="already answered"):
        client_app(ins, grid.contexts[ins.metadata.dst_node_id])


# -- what leaves a site ----------------------------------------------------------------------


def test_every_site_message_holds_exactly_the_documented_records(tmp_path):
    rec = Recorder()
    over = {**SMALL, "rounds": 2, "eval_every": 1}
    ncs = site_node_configs(
        SMALL,
        tmp_path,
        policy="epsilon = 50.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n",
    )
    grid = run_local(
        {**over, "randomness": "os", "out": str(tmp_path / "m")},
        **APPS,
        node_configs=ncs,
        fault=rec,
    )
    kinds = set()
    plans: dict[int, set[str]] = {}  # round -> object ids of the plans the sites received
    ins_run = None  # the run config the discovery query sent (the first message)
    for ins, reply in rec.pairs:
        kind = ins.metadata.message_type
        kinds.add(kind)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        c = reply.content
        if kind == "query":
            assert sorted(c.keys()) == ["sites"]
            info = json.loads(c["sites"]["json"])
            for e in info:
                assert sorted(e) == sorted(
                    ["site", "n_train", "n_test", "num_classes", "input_shape", "label_histogram"]
                    + ["placements", "refuses"]
                )
                assert e["label_histogram"] is None  # not shared by default
                assert e["placements"] == ["server"] and e["refuses"] is None  # its policy's
        elif kind == "train":
            assert list(c.keys()) == ["sum"]
            assert sorted(c["sum"].keys()) == ["round", "site-id", "sum"]
            assert len(c["sum"]["sum"]) == len(ins.content["plan"]["theta"])  # float32 (P,)
            assert (
                c["sum"]["site-id"]
                == grid.contexts[ins.metadata.dst_node_id].node_config["site-id"]
            )
            assert c["sum"]["round"] == int(ins.content["plan"]["round"])
            # never the realised batch size
        elif kind == "evaluate":
            assert sorted(c.keys()) == ["meta", "reports", "stats"]  # no labels, no predictions
            assert dict(c["meta"]) == {"site-id": int(ins.content["eval"]["site-id"])}
            # a deployed site's default: the metrics carry the site's own noise
            assert {r["release"] for r in json.loads(c["reports"]["json"]).values()} == {"dp"}
        else:
            raise AssertionError(f"unexpected message type {kind}")
        if kind == "train":  # one record: the round's fields and the run config (run.*)
            assert list(ins.content.keys()) == ["plan"]
            plan = ins.content["plan"]
            fields = sorted(k for k in plan.keys() if not k.startswith("run."))
            # no site-id: each node hosts one site, so every site gets the same plan
            assert fields == sorted(
                ["round", "epoch", "run-key", "sample-rate", "sigma", "prenoise", "clip", "theta"]
            )
            plans.setdefault(int(plan["round"]), set()).add(plan.object_id)
            run = {k[4:]: v for k, v in plan.items() if k.startswith("run.")}
            assert ins_run is not None and run == ins_run
        elif kind == "query":
            ins_run = dict(ins.content["run"].items())  # the run config as the query sent it
        # nothing the server sends determines its noise: no generator state, no noise key
        for name in ins.content.keys():
            assert "generator" not in name and "noise" not in name
        for name, value in ins.content.items():
            if isinstance(value, ConfigRecord):
                assert not any("generator" in k or "state" in k for k in value.keys()), name
    assert kinds == {"query", "train", "evaluate"}
    assert plans and all(len(ids) == 1 for ids in plans.values())  # one plan object per round
    res = json.loads((tmp_path / "m" / "results.json").read_text())
    assert res["flower"]["pooled_metrics_from"] == "site statistics"
    assert res["metrics"]["pooled"]["ace"] is None and res["metrics"]["pooled"]["ece"] >= 0
    assert all(s["label_histogram"] is None for s in res["sites"])
