"""Attacks on a deployed site through its one door (issue 25), as a curious or malicious
server would make them: real Flower messages, the real ClientApp and its guard mod, called
as Flower's runtime calls it (:class:`~fedsgld.flower.local_grid.LocalGrid`), nothing mocked.

Each test shows one attack failing. Run with ``FEDSGLD_UNGUARDED=1`` the same tests talk
to the same handlers without the guard (a mod that hands a training handler its decoded
request, unchecked and uncharged, instead of ``site_guard``), and every one of them fails:
the attack then works.
A loopback deployment of the guard: tests/flower/test_site_guard_deploy.py.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsgld.apps import client_app
from fedsgld.apps.client_app import site_guard
from fedsgld.clients.guard import Evaluating, Training
from fedsgld.clients.release import STATS_SENSITIVITY, vote_sensitivity
from fedsgld.config import Config
from fedsgld.core import noise as noise_module
from fedsgld.core.release import charge
from fedsgld.deploy.export_sites import export_sites
from fedsgld.flower.handoff import Admitted, handing
from fedsgld.flower.local_grid import LocalGrid
from fedsgld.flower.protocol import (
    decode_evaluate,
    decode_train,
    pack_vector,
    plan_record,
    run_record,
)
from fedsgld.flower.site_runtime import hosted_site, hosted_sites
from fedsgld.privacy import PrivacyAccountant

UNGUARDED = os.environ.get("FEDSGLD_UNGUARDED") == "1"


def _no_guard(msg: Message, context: Context, call_next) -> Message:
    """The control (``FEDSGLD_UNGUARDED=1``): a training handler gets the decoded request
    with nothing checked and nothing charged (its noise drawn through a receipt that spends
    nothing), and an evaluation handler its decoded request unchecked, as they would with
    no guard in front of them."""
    if msg.metadata.message_type == "evaluate":
        e = decode_evaluate(msg.content)
        site = hosted_site(hosted_sites(context, e.config), e.site_id)
        ((group, idx),) = e.groups.items()
        vectors = [e.thetas[str(i)].numpy() for i in idx]
        with handing(msg, Admitted(Evaluating(site, group, vectors, e.config), None)):
            return call_next(msg, context)
    if msg.metadata.message_type.endswith(".pate"):
        return _pate_unguarded(msg, context, call_next)
    if msg.metadata.message_type != "train":
        return call_next(msg, context)
    p = decode_train(msg.content)
    site = hosted_site(hosted_sites(context, p.config), p.site_id)
    theta = np.frombuffer(p.theta, "<f4").copy()
    at_site = p.config.privacy.noise_placement == "sites"
    request = Training(p, site, theta, p.sample_rate, p.clip, p.prenoise, site.randomness, at_site)
    receipt = charge(PrivacyAccountant(delta=1e-5, epsilon_budget=math.inf), None)
    with handing(msg, Admitted(request, receipt)):
        return call_next(msg, context)


def _pate_unguarded(msg: Message, context: Context, call_next) -> Message:
    """The control for PATE: the handler gets the decoded request, nothing checked."""
    from fedsgld.pate import protocol
    from fedsgld.pate.flower import site_records

    kind = msg.metadata.message_type
    decode = {"query.pate": protocol.decode_query, "train.pate": protocol.decode_train,
              "evaluate.pate": protocol.decode_evaluate}[kind]  # fmt: skip
    req = decode(msg.content)
    task = req if isinstance(req, protocol.PateTask) else req.task
    shards = site_records(task.config, dict(context.node_config))
    records = shards.get(task.site_id) if task.site_id is not None else None
    with handing(msg, Admitted(protocol.AtSite(req, records), None)):
        return call_next(msg, context)


def _app(extra_mods=()) -> ClientApp:
    mods = [_no_guard] if UNGUARDED else [site_guard, *extra_mods]
    return client_app._register(ClientApp(mods=mods))


APP = client_app.app if not UNGUARDED else _app()

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
    "seed": 3,
    "randomness": "os",
}
CONFIG = Config.from_flat(SMALL)
LOCAL = Config.from_flat({**SMALL, "noise_placement": "sites", "local_steps": 2})


@pytest.fixture(autouse=True)
def _own_default_state(tmp_path, monkeypatch):
    """Each test's policy-less sites keep their ledgers in a directory of their own."""
    monkeypatch.setenv("FEDSGLD_STATE_DIR", str(tmp_path / "default-state"))


_SITE_FILES: dict[int, str] = {}


def site_file(site: int) -> str:
    """The site's own records file (what a deployed node's config names: ``site-data``)."""
    if not _SITE_FILES:
        out = Path(tempfile.mkdtemp(prefix="fedsgld-guard-sites-"))
        _SITE_FILES.update({k: str(f) for k, f in enumerate(export_sites(CONFIG, out))})
    return _SITE_FILES[site]


class Node:
    """One deployed SuperNode as a server reaches it: a message in, the reply out. A
    deployed node reads its own records file (``site-data``, added where not given)."""

    def __init__(
        self, node_config: dict, app: ClientApp | None = None, *, records: bool = True
    ) -> None:
        if records and "site-id" in node_config and "site-data" not in node_config:
            node_config = {**node_config, "site-data": site_file(node_config["site-id"])}
        SITE_PATHS.update(paths_of(node_config))
        self.grid = LocalGrid(app or APP, [node_config])
        (self.id,) = self.grid.contexts

    @property
    def context(self) -> Context:
        return self.grid.contexts[self.id]

    def send(self, kind: str, **records) -> Message:
        msg = Message(RecordDict(records), self.id, kind, group_id="attack")
        (mid,) = self.grid.push_messages([msg])
        (reply,) = self.grid.pull_messages([mid])
        return reply


# every path of a site's that an attack here started a node with: its files, their folders,
# and the default state directory; no refusal any attack receives may name one
SITE_PATHS: set[str] = set()


def paths_of(node_config: dict) -> set[str]:
    found = {os.environ.get("FEDSGLD_STATE_DIR", "")}
    for k in ("site-data", "privacy-policy", "state-dir", "backbone-weights"):
        if k in node_config:
            p = Path(str(node_config[k])).resolve()
            found |= {str(node_config[k]), str(p), str(p.parent)}
    return {f for f in found if len(f) > 1}


def refused(reply: Message, *words: str) -> str:
    """The reason of a refusal holding ``words``; it names no path of any site's."""
    assert reply.has_error(), f"the site answered: {sorted(reply.content.keys())}"
    reason = str(reply.error.reason)
    named = [p for p in SITE_PATHS | paths_of({}) if p in reason]
    assert not named, f"a refusal names the site's path(s) {named}: {reason[-600:]}"
    for w in words:
        assert w in reason, reason[-600:]
    return reason


def answered(reply: Message) -> Message:
    assert not reply.has_error(), str(reply.error.reason)[-1500:]
    return reply


ALL_PLACEMENTS = ["secure", "sites", "server"]


def policy_file(tmp_path, name="policy", **keys) -> str:
    """A site's policy file: ``keys``, with a budget, every placement and its exact record
    counts published unless given (the attacks here are on the request's numbers; the
    placement, budget and size tests set them)."""
    keys = {
        "epsilon": 50.0,
        "placements": ALL_PLACEMENTS,
        "public_records": "exact",
        "public_test_records": "exact",
        **keys,
    }
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "policy.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return str(d / "policy.toml")


def spy_on_noise(monkeypatch) -> list[tuple[tuple[int, ...], float, bool, torch.Tensor]]:
    """Every Gaussian draw from now on, as (shape, std, secure, the values drawn)."""
    draws = []
    real = noise_module.gaussian_noise

    def spy(shape, **kw):
        z = real(shape, **kw)
        draws.append((tuple(shape), kw["std"], kw["secure"], z.clone()))
        return z

    monkeypatch.setattr(noise_module, "gaussian_noise", spy)
    return draws


def site0(node: Node, config: Config = CONFIG):
    """Site 0 as the test (not the server) sees it: its model layout and true labels."""
    return hosted_sites(node.context, config).sites[0]


def plan(config: Config = CONFIG, size: int | None = None, **fields) -> ConfigRecord:
    """A training instruction as the server sends it; ``None`` drops a field."""
    size = size if size is not None else 54595  # the synthetic MLP's parameter count
    rec = {
        "round": 0,
        "epoch": 0,
        "run-key": "attacker",
        "sample-rate": 0.2,
        "sigma": 1.0,
        "prenoise": 0.01,
        "clip": 1.0,
        "theta": pack_vector(np.zeros(size, np.float32)),
    }
    if config.privacy.noise_placement == "sites":
        rnd = fields.get("round", 0)
        rec |= {"local-steps": config.privacy.local_steps, "first-step": rnd * 2}
    rec |= fields
    return plan_record({k: v for k, v in rec.items() if v is not None}, run_record(config))


def evaluation(thetas, *, run_key="attacker", groups=None, config: Config = CONFIG) -> dict:
    arrays = ArrayRecord({str(i): Array(np.asarray(t)) for i, t in enumerate(thetas)})
    groups = groups if groups is not None else {"model": list(range(len(thetas)))}
    ev = ConfigRecord({"site-id": 0, "groups": json.dumps(groups), "run-key": run_key})
    return {"thetas": arrays, "eval": ev, "run": run_record(config)}


def ledger_file(d) -> dict:
    return json.loads((d / "fedsgld-site-0.json").read_text())


# -- one door -------------------------------------------------------------------------------


def test_a_message_type_the_guard_does_not_know_is_refused_even_with_a_handler(tmp_path):
    app = _app()

    @app.query("debug")  # a handler someone added behind the guard, unknown to it
    def leak(msg: Message, context: Context) -> Message:
        labels = hosted_sites(context, CONFIG).sites[0].y_test.tolist()
        return Message(RecordDict({"labels": ConfigRecord({"y": labels})}), reply_to=msg)

    node = Node({"site-id": 0}, app=app)
    refused(node.send("query.debug", run=run_record(CONFIG)), "guard answers only")
    # a type with no handler at all never gets that far: Flower's router refuses it
    refused(Node({"site-id": 0}).send("train.anything", plan=plan()), "No train function")


# -- 4: every setting finite and inside the policy's range; malformed parameters refused --------

LIMITS = dict(max_clip=10.0, min_noise_multiplier=0.5, max_sample_rate=0.5)
BAD_TRAINING = [
    ("sigma", math.nan, "noise multiplier nan refused"),
    ("sigma", math.inf, "noise multiplier inf refused"),
    ("sigma", -1.0, "policy min_noise_multiplier 0.5"),
    ("sigma", 0.1, "policy min_noise_multiplier 0.5"),
    ("clip", math.nan, "clip nan refused"),
    ("clip", 0.0, "clip 0.0 refused"),
    ("clip", -1e6, "policy max_clip 10"),
    ("clip", math.inf, "policy max_clip 10"),
    ("clip", 100.0, "policy max_clip 10"),
    ("sample-rate", math.nan, "sample rate nan refused"),
    ("sample-rate", 0.0, "policy max_sample_rate 0.5"),
    ("sample-rate", -0.1, "policy max_sample_rate 0.5"),
    ("sample-rate", 0.9, "policy max_sample_rate 0.5"),
    ("prenoise", math.nan, "prenoise nan refused"),
    ("prenoise", -1.0, "prenoise -1.0 refused: must be in [0, 1e+06]"),
    ("round", -1, "round is -1"),
    ("epoch", 0.5, "epoch is 0.5"),
    ("theta", pack_vector(np.full(54595, np.nan, np.float32)), "theta holds non-finite"),
    ("theta", pack_vector(np.zeros(100, np.float32)), "malformed request: theta has 400 bytes"),
    ("theta", np.zeros(54595).tobytes(), "malformed request: theta has"),  # float64
    ("theta", None, "malformed request: theta is a NoneType"),
    ("clip", None, "non-private request"),
]


@pytest.mark.parametrize(("key", "value", "words"), BAD_TRAINING)
def test_out_of_range_or_malformed_training_settings_are_refused_and_cost_nothing(
    tmp_path, key, value, words
):
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, **LIMITS)})
    refused(node.send("train", plan=plan(**{key: value})), words)
    # nothing was recorded (not even the round): the same round, well formed, is answered,
    # and its sum keeps the clip bound ||S|| <= N C
    reply = answered(node.send("train", plan=plan()))
    s = np.frombuffer(reply.content["sum"]["sum"], dtype="<f4")
    assert np.isfinite(s).all() and np.linalg.norm(s) <= 160 * 1.0 * (1 + 1e-3)


def test_a_seeded_run_is_refused_unless_the_sites_policy_accepts_it(tmp_path):
    """A shared seed lets whoever knows it regenerate the site's noise: a deployed site
    refuses it (a policy that does not say otherwise)."""
    seeded = Config.from_flat({**SMALL, "randomness": "seeded"})
    for node_config in (
        {"site-id": 0, "privacy-policy": policy_file(tmp_path, "bare")},
        {"site-id": 0, "privacy-policy": policy_file(tmp_path, "plain", **LIMITS)},
    ):
        refused(Node(node_config).send("train", plan=plan(seeded)), "shared-seed randomness")
    tests_only = policy_file(tmp_path, "tests", insecure_seeded_noise=True)
    answered(Node({"site-id": 0, "privacy-policy": tests_only}).send("train", plan=plan(seeded)))


def test_a_site_answers_up_to_max_local_steps_and_no_more(tmp_path):
    pol = policy_file(tmp_path, epsilon=50.0, max_local_steps=2)
    node = Node({"site-id": 0, "privacy-policy": pol})
    three = Config.from_flat({**SMALL, "noise_placement": "sites", "local_steps": 3})
    refused(node.send("train", plan=plan(three)), "3 local steps; policy max_local_steps is 2")
    answered(node.send("train", plan=plan(LOCAL)))  # 2 local steps: at the limit


# -- 5: validate, then charge; a refused request costs nothing -------------------------------------


def test_a_refused_request_leaves_the_sites_ledger_file_unchanged(tmp_path):
    state = tmp_path / "policy"
    pol = policy_file(tmp_path, epsilon=50.0, min_noise_multiplier=0.3, max_models_per_evaluation=2)
    node = Node({"site-id": 0, "privacy-policy": pol})
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    before = (state / "fedsgld-site-0.json").read_bytes()
    assert ledger_file(state)["ledger"]["steps"] == 2  # the two local steps of round 0
    attacks = [
        # fails after the checks of the old guard: the plan's steps disagree with the run's
        ("train", {"plan": plan(LOCAL, round=1, **{"local-steps": 5})}, "local-steps=5"),
        ("train", {"plan": plan(LOCAL, round=1, theta=b"\0" * 8)}, "theta has 8 bytes"),
        ("train", {"plan": plan(LOCAL, round=0)}, "already answered"),
        ("evaluate", evaluation([np.zeros(54595, np.float32)] * 3), "max_models_per_evaluation"),
        ("evaluate", evaluation([np.zeros(54595, np.float64)]), "expected float32(54595,)"),
    ]
    for kind, records, words in attacks:
        refused(node.send(kind, **records), words)
        assert (state / "fedsgld-site-0.json").read_bytes() == before, words
    answered(node.send("train", plan=plan(LOCAL, round=1)))
    assert ledger_file(state)["ledger"]["steps"] == 4


# -- 1: evaluation is a query: one model, a few per run, noised and charged ------------------------


def test_an_evaluation_message_evaluates_one_model_of_the_sites_own_shape(tmp_path):
    node = Node(
        {"site-id": 0, "privacy-policy": policy_file(tmp_path, max_models_per_evaluation=2)}
    )
    z = np.zeros(54595, np.float32)
    two_groups = evaluation([z, z], groups={"a": [0], "b": [1]})
    refused(node.send("evaluate", **two_groups), "exactly one model")
    refused(node.send("evaluate", **evaluation([z] * 3)), "policy max_models_per_evaluation is 2")
    refused(node.send("evaluate", **evaluation([z[:-1]])), "expected float32(54595,)")
    refused(node.send("evaluate", **evaluation([z * np.nan])), "non-finite")
    refused(node.send("evaluate", **evaluation([z], run_key="")), "no run key")
    answered(node.send("evaluate", **evaluation([z, z])))  # a posterior of two samples


def test_a_site_answers_at_most_max_evaluations_per_run(tmp_path):
    state = tmp_path / "policy"
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, max_evaluations=3)})
    z = [np.zeros(54595, np.float32)]
    for _ in range(3):
        answered(node.send("evaluate", **evaluation(z)))
    refused(node.send("evaluate", **evaluation(z)), "policy max_evaluations is 3")
    assert ledger_file(state)["evaluations"] == {"attacker": 3}
    answered(node.send("evaluate", **evaluation(z, run_key="another run")))


def _predict_class(fm, c: int) -> np.ndarray:
    """Parameters of a model that predicts class ``c`` for every record: zero weights, a
    large bias of the last layer on class ``c`` (the server knows the architecture)."""
    theta = np.zeros(fm.size, np.float32)
    theta[-fm.numels[-1] + c] = 20.0
    return theta


def test_the_release_noise_is_fresh_entropy_the_server_cannot_predict(tmp_path, monkeypatch):
    """The same evaluation asked of two fresh sites (nothing differs but the sites' own
    entropy) is released with different noise: nothing the server sends, and no fixed
    seed, decides it."""
    draws = spy_on_noise(monkeypatch)
    z = np.zeros(54595, np.float32)
    for k in range(2):
        pol = policy_file(tmp_path, f"site-{k}")
        answered(Node({"site-id": 0, "privacy-policy": pol}).send("evaluate", **evaluation([z])))
    # even where the policy accepts a seeded run (tests only), a release is never seeded
    for k in range(2):
        pol = policy_file(tmp_path, f"seeded-{k}", insecure_seeded_noise=True)
        answered(Node({"site-id": 0, "privacy-policy": pol}).send("evaluate", **evaluation([z])))
    drawn = [d[3] for d in draws]
    assert len(drawn) == 4
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[2], drawn[3])


def test_crafted_models_no_longer_read_out_the_test_label_histogram(tmp_path, monkeypatch):
    """The attack of issue 25: for each class c, a model that predicts c everywhere; its
    accuracy is the number of test records of class c. Against a site that releases exact
    metrics it recovers the histogram exactly; against a deployed site's default it is off
    by the noise the site draws (hardened, std 5 sqrt(5)), and every answer is charged."""
    draws = spy_on_noise(monkeypatch)
    exact = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, evaluation="exact")})
    default = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path, "default")})
    site = site0(default)
    truth = torch.bincount(site.y_test, minlength=3).numpy()
    models = [_predict_class(site.fm, c) for c in range(3)]

    def read_out(node: Node, c: int) -> tuple[int, Message]:
        reply = answered(node.send("evaluate", **evaluation([models[c]])))
        return json.loads(reply.content["stats"]["json"])["model"]["correct"], reply

    assert [read_out(exact, c)[0] for c in range(3)] == truth.tolist()  # the attack is real
    errors = []
    for _ in range(6):  # 18 evaluations: within the default max_evaluations (20)
        for c in range(3):
            got, reply = read_out(default, c)
            assert sorted(reply.content.keys()) == ["meta", "reports", "stats"]  # no labels
            assert json.loads(reply.content["reports"]["json"])["model"]["release"] == "dp"
            errors.append(got - truth[c])
    std = 5.0 * STATS_SENSITIVITY
    assert draws and all(d[:3] == ((47,), pytest.approx(std), True) for d in draws)
    assert len(draws) == 18
    # the released count carries noise of about that size (clipped into [0, n_test]: less)
    assert 0.3 * std <= float(np.std(errors)) <= 1.6 * std
    assert np.mean(np.abs(errors)) > 2.0
    ledger = ledger_file(tmp_path / "default")
    assert ledger["ledger"]["ledger"] == [[1.0, 5.0, 18]]  # one Gaussian release each


def test_evaluations_and_local_training_compose_in_one_ledger_under_one_budget(tmp_path):
    state = tmp_path / "policy"
    pol = policy_file(tmp_path, epsilon=13.0, min_noise_multiplier=0.3, max_evaluations=100)
    node = Node({"site-id": 0, "privacy-policy": pol})
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    z = [np.zeros(54595, np.float32)]
    n = 0
    while not (reply := node.send("evaluate", **evaluation(z, config=LOCAL))).has_error():
        n += 1
        assert n < 100
    refused(reply, "budget epsilon=13")
    assert n >= 1
    led = ledger_file(state)["ledger"]
    assert {q for q, _, _ in led["ledger"]} == {0.2, 1.0}  # training steps and evaluations
    assert led["steps"] == 2 + n
    assert PrivacyAccountant.from_state_dict(led).rigorous_epsilon() <= 13.0


# -- 2: PATE honours the policy -----------------------------------------------------------------

PATE = {
    "pate.dataset": "synthetic",
    "pate.dataset_options": json.dumps(
        {"n": 400, "num_classes": 3, "shape": [8], "separation": 1.5}
    ),
    "pate.sites": 2,
    "pate.teachers_per_site": 1,  # a site with a single teacher
    "pate.queries": 60,
    "pate.public_fraction": 0.25,
    "pate.teacher_epochs": 5,
    "pate.student_epochs": 2,
    "pate.threads": 1,
}


def _pate():
    from fedsgld.pate.flower import pate_config_from_run_config, pate_record
    from fedsgld.pate.train import pate_split

    config = pate_config_from_run_config(PATE)
    return config, pate_record(config), pate_split(config)


def pate_node(tmp_path, split, name: str, **keys) -> Node:
    """A deployed PATE site 0: its own records file and its policy (``keys``)."""
    s = split.sites[0]
    data = tmp_path / f"pate-site-{name}.npz"
    if not data.is_file():
        arrays = {k: getattr(s, k).numpy() for k in ("x_train", "y_train", "x_test", "y_test")}
        np.savez(data, **arrays, num_classes=np.int64(s.num_classes))
    pol = policy_file(tmp_path, name, **keys)
    return Node({"site-id": 0, "site-data": str(data), "privacy-policy": pol})


def test_a_single_teacher_site_sends_only_noised_votes(tmp_path, monkeypatch):
    config, rec, split = _pate()
    draws = spy_on_noise(monkeypatch)
    task = ConfigRecord({"site-id": 0, "run-key": "attacker"})
    queries = ArrayRecord({"x": Array(split.x_query.numpy().astype(np.float32))})
    exact = answered(
        pate_node(tmp_path, split, "trusting", allow_non_private=True, evaluation="exact").send(
            "train.pate", pate=rec, task=task, queries=queries
        )
    )
    teacher = exact.content["histogram"]["counts"].numpy().argmax(axis=1)  # its predictions
    default = pate_node(tmp_path, split, "default")
    reply = answered(default.send("train.pate", pate=rec, task=task, queries=queries))
    counts = reply.content["histogram"]["counts"].numpy()
    assert counts.dtype == np.int64 and (counts >= 0).all() and (counts.sum(axis=1) == 1).all()
    agree = float(np.mean(counts.argmax(axis=1) == teacher))
    assert agree < 0.7  # chance is 1/3; the exact votes agree on every query
    teachers = reply.content["teachers"]
    assert json.loads(teachers["accuracy"]) == []  # an exact test statistic: not released
    assert teachers["vote-noise-std"] == pytest.approx(vote_sensitivity(60))
    # the deployed default's votes: one hardened draw at that std over the whole histogram
    assert [d[:3] for d in draws] == [(counts.shape, pytest.approx(vote_sensitivity(60)), True)]
    led = ledger_file(tmp_path / "default")["ledger"]
    assert [1.0, 1.0, 1] in led["ledger"]


def test_evaluate_pate_sends_no_labels_or_predictions_unless_shared(tmp_path):
    import torch.nn

    from fedsgld.pate.teachers import new_model as _new_model

    config, rec, split = _pate()
    student = _new_model(config.student_model, split.input_shape, 3, config.hidden, 0)
    content = {
        "pate": rec,
        "task": ConfigRecord({"site-id": 0, "run-key": "attacker"}),
        "student": ArrayRecord(student.state_dict()),
    }
    default = pate_node(tmp_path, split, "default")
    reply = answered(default.send("evaluate.pate", **content))
    assert sorted(reply.content.keys()) == ["meta", "reports", "stats"]
    assert json.loads(reply.content["reports"]["json"])["student"]["release"] == "dp"
    shares = pate_node(tmp_path, split, "shares", share_predictions=True, evaluation="exact")
    reply = answered(shares.send("evaluate.pate", **content))
    assert "labels" in reply.content and "pred-student" in reply.content
    wrong = ArrayRecord(torch.nn.Linear(8, 3).state_dict())
    refused(default.send("evaluate.pate", **{**content, "student": wrong}), "student")


# -- 3: the site's policy decides how it draws its noise ------------------------------------------


@pytest.mark.parametrize(("site_secure", "run_secure", "hardened"), [
    (True, "off", True),  # the server cannot switch the site to the plain sampler
    (False, "on", True),  # it may ask for more
    (False, "off", False),  # the site's own choice
])  # fmt: skip
def test_the_server_cannot_weaken_the_sites_sampler(
    tmp_path, monkeypatch, site_secure, run_secure, hardened
):
    draws = []
    real = noise_module.gaussian_noise

    def spy(shape, **kw):
        if kw["std"] > 0.0 and len(tuple(shape)) == 1 and tuple(shape)[0] == 54595:
            draws.append(kw["secure"])  # the site's local Gaussian noise
        return real(shape, **kw)

    monkeypatch.setattr(noise_module, "gaussian_noise", spy)
    pol = policy_file(tmp_path, epsilon=50.0, secure_noise=site_secure)
    config = Config.from_flat({**LOCAL.flat(), "secure_noise": run_secure})
    answered(Node({"site-id": 0, "privacy-policy": pol}).send("train", plan=plan(config)))
    assert draws == [hardened] * 2  # two local steps


def test_the_server_cannot_shrink_the_sites_own_noise(tmp_path):
    pol = policy_file(tmp_path, epsilon=50.0, min_noise_multiplier=0.3)
    cold = Config.from_flat({**LOCAL.flat(), "temperature": 1e-9})  # sigma_t ~ 1e-5
    reply = Node({"site-id": 0, "privacy-policy": pol}).send("train", plan=plan(cold))
    refused(reply, "policy min_noise_multiplier 0.3")


# -- 6 (site side): replay protection and the ledger outlive runs, with or without a policy ------


def test_a_site_refuses_a_round_it_answered_in_an_earlier_run(tmp_path):
    nc = {"site-id": 0, "privacy-policy": policy_file(tmp_path)}
    msg = plan(round=3, **{"run-key": "run-1"})
    answered(Node(nc).send("train", plan=msg))
    # a new SuperNode process of a new run: nothing carried over in Flower's node state
    refused(Node(nc).send("train", plan=msg), "already answered round 3")
    assert "run-1" in ledger_file(tmp_path / "policy")["answered"]


def test_a_truncated_ledger_is_an_error_never_an_empty_ledger(tmp_path):
    nc = {"site-id": 0, "privacy-policy": policy_file(tmp_path)}
    answered(Node(nc).send("train", plan=plan(round=1)))
    f = tmp_path / "policy" / "fedsgld-site-0.json"
    f.write_text(f.read_text()[:40])
    refused(Node(nc).send("train", plan=plan(round=2)), "does not parse")
