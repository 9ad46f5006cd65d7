"""The ServerApp and ClientApp over an in-process Grid: equivalence, reply checks, failures, resume.

These drive the very code Flower runs (``fedsgld.apps.server_app:app`` and
``fedsgld.apps.client_app:app``) through :class:`fedsgld.flower.local_grid.LocalGrid`, so
they take seconds; ``test_flower_simulation.py`` and ``test_flower_deploy.py`` run the
same apps under Flower's simulation and a real deployment.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from flower_support import ROOT, SMALL
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from fedsgld import engine
from fedsgld.apps import APPS
from fedsgld.config import Config, load_config
from fedsgld.deploy.loopback import site_node_configs
from fedsgld.flower.exchange import SitesUnavailable
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.protocol import FLOWER_KEYS, split_run_config
from fedsgld.flower.strategy import AllSitesFailed
from fedsgld.pate.flower import RUN_CONFIG_FIELDS, pate_config_from_run_config
from fedsgld.pate.train import load_pate_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _theta(out):
    return torch.load(out / "checkpoint.pt", weights_only=False)["server"]


def _results(out):
    return json.loads((out / "results.json").read_text())


def _site_reports(block):
    """A metrics block's per-site reports, less the ``release`` field a Flower site adds
    (its reports say whether they are exact or noised; the engine's are exact)."""
    for r in block["sites"].values():
        assert r.pop("release", "exact") == "exact"
    return block


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The in-process engine on SMALL (the reference trajectory)."""
    out = tmp_path_factory.mktemp("engine") / "ref"
    engine.run(load_config(None, SMALL), out_dir=out, progress=False, log=lambda s: None)
    return out


def _local(tmp_path, name, *, fault=None, num_nodes=None, node_configs=None, **over):
    out = tmp_path / name
    run_local(
        {**SMALL, **over, "out": str(out)},
        **APPS,
        num_nodes=num_nodes,
        node_configs=node_configs,
        fault=fault,
        shuffle_seed=7,
    )
    return out


def _site(ins: Message, reply: Message) -> int:
    """The site an instruction went to: its plan names it only where a node hosts several
    sites; otherwise the site's (honest, not yet altered) reply does."""
    plan = ins.content["plan"]
    if "site-id" in plan:
        return int(plan["site-id"])
    return int(reply.content["sum"]["site-id"])


def _round(msg: Message) -> int:
    return int(msg.content["plan"]["round"])


def _sum(reply: Message) -> np.ndarray:
    return np.frombuffer(reply.content["sum"]["sum"], dtype="<f4")


def _replace_sum(ins: Message, reply: Message, value: np.ndarray, **extra) -> Message:
    """``reply`` with S_k replaced by ``value``'s raw bytes (whatever its dtype)."""
    old = reply.content["sum"]
    rec = {"sum": value.tobytes(), "site-id": int(old["site-id"]), "round": int(old["round"])}
    return Message(RecordDict({"sum": ConfigRecord(rec), **extra}), reply_to=ins)


def _fault(rule):
    """A LocalGrid fault hook: ``rule(instruction, reply)`` for train messages only."""

    def hook(ins: Message, reply: Message):
        if ins.metadata.message_type != "train":
            return reply
        return rule(ins, reply)

    return hook


# -- equivalence with the in-process engine ------------------------------------------------


def test_flower_apps_on_local_grid_equal_the_engine_bitwise(tmp_path, reference):
    # 2 nodes host 3 sites (node 0: sites 0 and 2), replies come back shuffled, node ids are
    # random: sorting by site id and (seed, site, round) generators give the same trajectory.
    out = _local(tmp_path, "flower", num_nodes=2)
    ref, got = _theta(reference), _theta(out)
    assert torch.equal(got["theta"], ref["theta"])
    assert got["t"] == ref["t"] == 12
    assert got["posterior"]["steps"] == ref["posterior"]["steps"] == [8, 10, 12]
    for a, b in zip(got["posterior"]["samples"], ref["posterior"]["samples"]):
        assert torch.equal(a, b)
    r, e = _results(out), _results(reference)
    assert r["engine"] == "flower" and e["engine"] == "in-process"
    assert r["privacy"]["ledger"] == e["privacy"]["ledger"]
    assert r["privacy"]["epsilon"] == e["privacy"]["epsilon"]
    assert r["history"] == e["history"]
    assert r["metrics"]["pooled"] == e["metrics"]["pooled"]
    assert _site_reports(r["metrics"])["sites"] == e["metrics"]["sites"]
    assert _site_reports(r["metrics"]["posterior"]) == e["metrics"]["posterior"]
    assert r["sites"] == e["sites"]
    assert r["flower"]["dropped_replies"] == []
    for f in (
        "report.md",
        "history.png",
        "reliability.png",
        "reliability_sites.png",
        "ledger.json",
    ):
        assert (out / f).stat().st_size > 0, f


def test_a_train_plan_names_the_site_only_where_a_node_hosts_several(tmp_path):
    """One site per node: every site of a round gets the same plan record (a deployment
    pushes it once). A node with several sites gets its site named, and refuses a plan
    that names none."""
    from fedsgld.apps.client_app import app as client_app
    from fedsgld.clients.policy import PolicyRefused

    def plans(run):
        out: dict[int, list] = {}
        for ins, _reply in run.pairs:
            if ins.metadata.message_type == "train":
                out.setdefault(int(ins.content["plan"]["round"]), []).append(ins)
        return out

    one, several = _Pairs(), _Pairs()
    run_local({**SMALL, "rounds": 2, "out": str(tmp_path / "one")}, **APPS, fault=one)
    for msgs in plans(one).values():
        assert len(msgs) == SMALL["sites"]
        assert len({m.content["plan"].object_id for m in msgs}) == 1
        assert all("site-id" not in m.content["plan"] for m in msgs)
    grid = run_local(
        {**SMALL, "rounds": 2, "out": str(tmp_path / "several")}, **APPS, num_nodes=2, fault=several
    )
    for msgs in plans(several).values():
        assert sorted(int(m.content["plan"]["site-id"]) for m in msgs) == [0, 1, 2]
    ins = next(m for m in plans(several)[1] if int(m.content["plan"]["site-id"]) == 2)
    del ins.content["plan"]["site-id"]  # node 0 hosts sites 0 and 2
    with pytest.raises(PolicyRefused, match=r"names no site-id, but this node hosts several"):
        client_app(ins, grid.contexts[ins.metadata.dst_node_id])


class _Pairs:
    def __init__(self):
        self.pairs = []

    def __call__(self, ins, reply):
        self.pairs.append((ins, reply))
        return reply


def test_site_data_files_give_the_engine_trajectory(tmp_path, reference):
    """The deployment path: each node reads its own .npz (written by export_sites)."""
    from fedsgld.deploy.export_sites import export_sites

    paths = export_sites(load_config(None, SMALL), tmp_path / "data")
    # a deployed site accepts a shared seed only if its own policy says so (tests only)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        'insecure_seeded_noise = true\nshare_predictions = true\nevaluation = "exact"\n'
        "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n"
    )
    ncs = [
        {"site-id": k, "site-data": str(p), "privacy-policy": str(policy)}
        for k, p in enumerate(paths)
    ]
    out = _local(tmp_path, "npz", node_configs=ncs)
    assert torch.equal(_theta(out)["theta"], _theta(reference)["theta"])
    assert _results(out)["metrics"]["pooled"] == _results(reference)["metrics"]["pooled"]


def test_shards_are_rebuilt_from_node_state_in_a_fresh_process(tmp_path, monkeypatch):
    """Deployment starts a new process per message: the node's shards come from context.state."""
    from fedsgld.flower import site_runtime as site_side
    from fedsgld.flower.local_grid import LocalGrid
    from fedsgld.flower.protocol import run_record

    config = Config.from_flat(SMALL)
    grid = LocalGrid.partitions(__import__("fedsgld.apps.client_app", fromlist=["app"]).app, 2)
    ctx = next(iter(grid.contexts.values()))
    site_side._CACHE.clear()  # an earlier test's run of these sites: built here, into ctx.state
    hosted = site_side.hosted_sites(ctx, config)
    assert sorted(hosted.sites) == [0, 2]
    theta = torch.randn(hosted.sites[0].fm.size)
    before = hosted.sites[2].clipped_sum(theta, round=3, sample_rate=0.5, clip=1.0, prenoise=0.01)
    site_side._CACHE.clear()  # a new process: no Python-level cache

    def no_rebuild(*a, **k):
        raise AssertionError("the shard was rebuilt instead of read from context.state")

    monkeypatch.setattr(site_side, "_build", no_rebuild)
    again = site_side.hosted_sites(ctx, config)
    assert sorted(again.sites) == [0, 2]
    after = again.sites[2].clipped_sum(theta, round=3, sample_rate=0.5, clip=1.0, prenoise=0.01)
    assert torch.equal(before, after)
    assert run_record(config)["seed"] == 3


def test_a_node_builds_only_its_own_sites_once_per_process_and_run(tmp_path, monkeypatch):
    """Of a 6-site federation, the node with partition 1 of 4 builds sites 1 and 5 (the
    engine's records, model and generators) and nothing of the other sites; nodes whose
    messages interleave in one process (Ray's actors) each build once for the run."""
    from fedsgld.federation import Federation
    from fedsgld.flower import site_runtime as site_side
    from fedsgld.flower.local_grid import LocalGrid

    config = Config.from_flat({**SMALL, "sites": 6})
    grid = LocalGrid.partitions(__import__("fedsgld.apps.client_app", fromlist=["app"]).app, 4)
    ctxs = list(grid.contexts.values())
    built: list[int] = []
    real_build_site = site_side.build_site

    def counted(config, data, *a, **k):
        built.append(data.site_id)
        return real_build_site(config, data, *a, **k)

    monkeypatch.setattr(site_side, "build_site", counted)
    site_side._CACHE.clear()
    for _ in range(3):  # the nodes' messages, interleaved, three times
        hosted = [site_side.hosted_sites(c, config) for c in ctxs]
    assert sorted(built) == [0, 1, 2, 3, 4, 5]  # each site once, by its node alone
    assert sorted(hosted[1].sites) == [1, 5]
    fed = Federation(config, log=lambda s: None)
    theta = fed.sites[0].fm.flatten() + 0.01
    for k in (1, 5):
        mine, ref = hosted[1].sites[k], fed.sites[k]
        for name in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(mine, name), getattr(ref, name))
        assert torch.equal(mine.fm.flatten(), ref.fm.flatten())
        got = mine.clipped_sum(theta, round=2, sample_rate=0.5, clip=1.0, prenoise=0.01)
        want = ref.clipped_sum(theta, round=2, sample_rate=0.5, clip=1.0, prenoise=0.01)
        assert torch.equal(got, want)


def test_a_later_task_of_the_run_skips_the_layer_path_check_its_first_task_passed(
    tmp_path, monkeypatch
):
    """Each deployed round runs in a new process; the layer path's check against torch.func
    runs in the run's first train task, and later tasks read that it passed from
    context.state (for the same sites' data key only)."""
    from fedsgld.core.per_record import RecordGradients
    from fedsgld.flower import site_runtime as site_side

    checks = []
    real = RecordGradients.ready

    def counting(self, theta, x, y):
        if self.layers is not None and not self.checked and x.shape[0] >= 2:
            checks.append(1)
        return real(self, theta, x, y)

    monkeypatch.setattr(RecordGradients, "ready", counting)
    config = Config.from_flat({**SMALL, "rounds": 3})
    grid = run_local({**SMALL, "rounds": 3, "out": str(tmp_path / "r")}, **APPS)  # a node per site
    assert len(checks) == 3  # one per site: this process keeps its sites between rounds
    ctx = next(c for c in grid.contexts.values() if c.node_config["partition-id"] == 0)
    hosted = site_side.hosted_sites(ctx, config)
    assert ctx.state[site_side.LAYERS_STATE]["key"] == hosted.key
    site_side._CACHE.clear()  # a new process: the sites are built again
    fresh = site_side.hosted_sites(ctx, config).sites[0]
    assert fresh.fm.grad_path == "layers" and not fresh.fm.layers_checked
    site_side.layers_check_from_state(ctx, site_side.hosted_sites(ctx, config), fresh)
    assert fresh.fm.layers_checked
    # another data key (another run config) is checked again
    site_side._CACHE.clear()
    other = site_side.hosted_sites(ctx, Config.from_flat({**SMALL, "hidden": 16}))
    site_side.layers_check_from_state(ctx, other, other.sites[0])
    assert not other.sites[0].fm.layers_checked


def test_a_site_data_node_reads_its_file_and_keeps_no_records_in_node_state(tmp_path):
    """A deployed site's records never travel in context.state (which Flower sends to and
    from the SuperNode with every message): a fresh process reads the file again and
    computes the same sum."""
    from flwr.app import Context, RecordDict

    from fedsgld.deploy.export_sites import export_sites
    from fedsgld.flower import site_runtime as site_side

    config = Config.from_flat(SMALL)
    paths = export_sites(load_config(None, SMALL), tmp_path / "data")
    node = {"site-id": 1, "site-data": str(paths[1])}
    ctx = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})
    site_side._CACHE.clear()
    hosted = site_side.hosted_sites(ctx, config)
    assert sorted(hosted.sites) == [1]
    assert not [k for k in ctx.state if k.startswith("fedsgld.shard") or k == "fedsgld.sites"]
    theta = torch.randn(hosted.sites[1].fm.size)
    before = hosted.sites[1].clipped_sum(theta, round=3, sample_rate=0.5, clip=1.0, prenoise=0.01)
    site_side._CACHE.clear()  # a new process
    again = site_side.hosted_sites(ctx, config)
    assert again is not hosted
    after = again.sites[1].clipped_sum(theta, round=3, sample_rate=0.5, clip=1.0, prenoise=0.01)
    assert torch.equal(before, after)


# -- bad replies, failures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def zero_reply_run(tmp_path_factory):
    """The run in which site 1 sends an all-zero sum in round 5 (no record sampled)."""

    def zero(ins, reply):
        if _site(ins, reply) == 1 and _round(ins) == 5:
            return _replace_sum(ins, reply, np.zeros_like(_sum(reply)))
        return reply

    return _local(tmp_path_factory.mktemp("zero"), "zero", fault=_fault(zero))


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("nan", "non-finite"),
        ("shape", "expected float32 ("),
        ("float64", "expected float32 ("),
        ("norm", "exceeds N_k C"),
        ("extra-record", "reply records"),
        ("wrong-site", "was asked for site 1"),
        ("error", "error reply"),
        ("unavailable", "Node Unavailable"),
        ("lost", "no reply"),
    ],
)
def test_a_bad_reply_is_dropped_as_if_the_site_sampled_nothing(
    tmp_path, zero_reply_run, kind, reason
):
    """Site 1's reply in round 5 is bad: it is dropped with a logged reason, the run goes
    on, and the step equals one where site 1 sent an all-zero sum (no record sampled)."""
    size, asked = {}, {}

    def bad(ins, reply):
        if _site(ins, reply) != 1 or _round(ins) != 5:
            return reply
        s = _sum(reply)
        size["p"] = s.size
        asked["node"] = ins.metadata.dst_node_id
        if kind == "nan":
            return _replace_sum(ins, reply, np.full_like(s, np.nan))
        if kind == "shape":
            return _replace_sum(ins, reply, s[:-1].copy())
        if kind == "float64":
            return _replace_sum(ins, reply, s.astype(np.float64))
        if kind == "norm":
            return _replace_sum(ins, reply, np.full_like(s, 1e6))
        if kind == "extra-record":
            return _replace_sum(ins, reply, s, n=MetricRecord({"batch-size": 17}))
        if kind == "wrong-site":
            m = _replace_sum(ins, reply, s)
            m.content["sum"]["site-id"] = 0
            return m
        if kind == "error":
            return Message(Error(2, "Traceback: RuntimeError: disk full"), reply_to=ins)
        if kind == "unavailable":  # as the SuperLink answers for a node without heartbeats:
            m = Message(Error(5, "Node Unavailable"), reply_to=ins)
            m.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # it is the source
            return m
        return None  # lost

    # a lost reply is waited for until round-timeout, then dropped; min_sites 2 lets the
    # run go on without it (the default, every site, fails it: test_run_failures.py)
    out = _local(tmp_path, "bad", fault=_fault(bad), min_sites=2, **{"round-timeout": 1.0})
    ref = zero_reply_run
    r = _results(out)
    drops = r["flower"]["dropped_replies"]
    assert len(drops) == 1 and drops[0]["round"] == 5 and drops[0]["kind"] == "train"
    assert reason in drops[0]["reason"]
    assert drops[0]["site"] == 1 and drops[0]["node_id"] == asked["node"]  # the node asked
    assert r["privacy"]["steps"] == 12 and r["privacy"]["ledger_steps"] == 12
    assert r["privacy"]["ledger"] == _results(ref)["privacy"]["ledger"]
    assert torch.equal(_theta(out)["theta"], _theta(ref)["theta"])


def test_every_site_failing_stops_the_run_with_a_clear_error(tmp_path):
    def all_fail(ins, reply):
        if _round(ins) == 4:
            return Message(Error(2, "ClientApp crashed"), reply_to=ins)
        return reply

    with pytest.raises(AllSitesFailed, match="round 4: every site failed.*no step was taken"):
        _local(tmp_path, "fail", fault=_fault(all_fail))
    out = tmp_path / "fail"
    ledger = json.loads((out / "ledger.json").read_text())
    assert sum(e[2] for e in ledger["ledger"]) == 4  # rounds 0..3 spent, round 4 not
    assert _theta(out)["t"] == 4  # checkpointed where it stopped
    assert not (out / "results.json").exists()


def test_missing_sites_are_reported_after_the_wait(tmp_path):
    with pytest.raises(SitesUnavailable, match=r"sites \[1, 2\] had no working node"):
        ncs = site_node_configs(SMALL, tmp_path, sites=[0])  # site 0 alone is deployed
        _local(tmp_path, "few", node_configs=ncs, **{"wait-for-sites": 0.5})


def test_a_misconfigured_node_is_named_in_the_error(tmp_path):
    ncs = [{"site-id": 0}, {"site-id": 1}, {"nothing": 1}]
    with pytest.raises(SitesUnavailable, match="node config must name the site"):
        _local(tmp_path, "bad-node", node_configs=ncs, **{"wait-for-sites": 0.5})


# -- crash and resume ------------------------------------------------------------------------


def test_resume_after_a_server_crash_keeps_the_spent_budget(tmp_path, reference):
    def crash(ins, reply):
        if _round(ins) == 7:
            raise RuntimeError("server crashed")
        return reply

    with pytest.raises(RuntimeError, match="server crashed"):
        _local(tmp_path, "crash", fault=_fault(crash))
    out = tmp_path / "crash"
    assert sum(e[2] for e in json.loads((out / "ledger.json").read_text())["ledger"]) == 7
    with pytest.raises(ValueError, match="resume"):  # a fresh run into the same directory
        _local(tmp_path, "crash")
    _local(tmp_path, "crash", resume=True)
    r = _results(out)
    assert r["privacy"]["steps"] == 12
    assert r["privacy"]["ledger_steps"] == 14  # rounds 5 and 6 were released twice: both counted
    assert r["privacy"]["epsilon"]["pld"] > _results(reference)["privacy"]["epsilon"]["pld"]
    # epoch 1 replays rounds 5 and 6 with fresh noise (server and sites): a new trajectory
    assert r["privacy"]["randomness"]["epoch"] == 1
    assert not torch.equal(_theta(out)["theta"], _theta(reference)["theta"])
    with pytest.raises(ValueError, match="config differs"):
        _local(tmp_path, "crash", resume=True, lr=0.3)


# -- configuration ---------------------------------------------------------------------------


def test_pyproject_run_config_has_every_setting_and_works():
    with (ROOT / "pyproject.toml").open("rb") as fh:
        py = tomllib.load(fh)
    app = py["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedsgld.apps.server_app:app",
        "clientapp": "fedsgld.apps.client_app:app",
    }
    defaults = dict(app["config"])
    pate = {f"pate.{k}": v for k, v in defaults.pop("pate").items()}
    assert set(defaults) == set(Config().flat()) | set(FLOWER_KEYS)
    assert set(pate) == {f"pate.{k}" for k in RUN_CONFIG_FIELDS}
    # `flwr run .` defaults to deployment randomness (each party's own OS entropy)
    assert defaults["randomness"] == "os" and pate["pate.randomness"] == "os"
    assert pate_config_from_run_config(pate) == load_pate_config(
        ROOT / "simulations" / "pate_mnist.toml", {"randomness": "os"}
    )
    config, opts = split_run_config({**defaults, **pate})
    assert config.privacy.method == "dpsgld" and opts["out"] == "" and opts["resume"] is False
    demo = load_config(ROOT / "simulations" / "demo.toml")
    for k, v in demo.flat().items():
        if k not in (
            "rounds",
            "burn_in",
            "thin",
            "max_samples",
            "eval_every",
            "checkpoint_every",
            "randomness",
            "secure_noise",
        ):
            assert config.flat()[k] == v, k
    assert config.run.rounds <= 100


def test_unknown_run_config_keys_are_named():
    with pytest.raises(ValueError, match="no_such_key"):
        split_run_config({"no_such_key": 1})
    with pytest.raises(ValueError, match="round-timeout"):
        split_run_config({"round-timeout": 0})


# -- the other methods and the other noise placement over the same apps -----------------------


@pytest.mark.parametrize(
    "over",
    [
        {"noise_placement": "sites", "local_steps": 2, "rounds": 6},
        {"method": "dpvi", "noise_multiplier": 1.5, "lr": 0.05, "optimizer": "adam", "rounds": 6},
    ],
    ids=["sites-placement", "dpvi"],
)
def test_other_placements_and_methods_equal_the_engine(tmp_path, over):
    cfg = {**SMALL, **over}
    ref = tmp_path / "engine"
    engine.run(load_config(None, cfg), out_dir=ref, progress=False, log=lambda s: None)
    out = _local(tmp_path, "flower", num_nodes=2, **over)
    assert torch.equal(_theta(out)["theta"], _theta(ref)["theta"])
    r, e = _results(out), _results(ref)
    assert r["privacy"]["ledger"] == e["privacy"]["ledger"]
    assert r["privacy"]["epsilon"]["pld"] <= cfg["epsilon"]
    assert r["metrics"]["pooled"] == e["metrics"]["pooled"]
    if "local_steps" in over:
        assert r["privacy"]["ledger_steps"] == 2 * r["privacy"]["steps"] == 12
