"""What a server names cannot reach into a deployed site, and a site's size is its own.

Attacks as a server that runs its own ServerApp would make them: real Flower messages to
the real ClientApp and its guard (:class:`~fedsgld.flower.local_grid.LocalGrid`), the run
record crafted by hand where the server's own config checks would stop an honest one.

1. Code: PATE's ``teacher_model`` / ``student_model`` naming a function of an installed
   module (``tempfile:mkdtemp``, ``this:x``) is refused before anything is imported or
   called, with the same reply for an installed and a missing module.
2. Paths and downloads: a ``backbone`` of ``local-dir:<dir>`` or ``hf-hub:...`` is refused
   for every message type before the site opens a file or a socket (an audit hook sees
   every ``open`` and ``connect`` of the process), with one reply for an existing and a
   missing directory; no refusal carries a path of the site's.
3. Sizes: a site and the same site without one record (D, D') answer ``query`` alike and
   are refused or answered alike at the ``min_expected_batch`` floor when their policy
   publishes a count; the control (``public_records = "exact"``) shows the difference.
4. Absurd settings (sigma, pre-noise, clip = 1e300, ...) are refused in one line naming
   the setting and its range, and the ledger does not change.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from test_site_guard import (
    CONFIG,
    LOCAL,
    SMALL,
    Node,
    _pate,
    answered,
    evaluation,
    pate_node,
    plan,
    policy_file,
    refused,
    site_file,
)

from fedsgld.config import Config
from fedsgld.flower.protocol import plan_record, run_record
from fedsgld.pate.flower import pate_record

# -- an audit hook: every file the process opens or lists, every socket it connects ---------

_SEEN: list[tuple[str, str]] = []
_WATCHING: list[bool] = [False]


def _audit(event: str, args: tuple) -> None:
    if not _WATCHING[0]:
        return
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | Path):
        _SEEN.append((event, str(args[0])))
    elif event in ("socket.connect", "socket.getaddrinfo"):
        _SEEN.append((event, repr(args[:2])))


sys.addaudithook(_audit)


class watch:
    """Records what the process opens and connects to inside the block (``.seen``)."""

    def __enter__(self) -> watch:
        _SEEN.clear()
        _WATCHING[0] = True
        return self

    def __exit__(self, *exc) -> None:
        _WATCHING[0] = False
        self.seen = list(_SEEN)


def message(reason: str) -> str:
    """The refusal's own text: the last line of the reply's reason, one line."""
    last = reason.strip().splitlines()[-1]
    assert "PolicyRefused: " in last, reason[-800:]
    return last.split("PolicyRefused: ", 1)[1]


# -- 1: the models are the site's -------------------------------------------------------------


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """An installed module whose import and whose function each leave a mark."""
    lib = tmp_path / "lib"
    lib.mkdir()
    marks = tmp_path / "marks"
    (lib / "fedsgld_probe54.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marks)!r}).mkdir(exist_ok=True)\n"
        f"(Path({str(marks)!r}) / 'imported').write_text('x')\n"
        "def make():\n"
        f"    (Path({str(marks)!r}) / 'called').write_text('x')\n"
        "    import torch\n"
        "    return torch.nn.Linear(8, 3)\n"
    )
    monkeypatch.syspath_prepend(str(lib))
    yield marks
    sys.modules.pop("fedsgld_probe54", None)


def _student_request(config, split, name: str) -> dict:
    from fedsgld.pate.teachers import new_model

    student = new_model("mlp", split.input_shape, 3, config.hidden, 0)
    return {
        "pate": pate_record(replace(config, student_model=name, teacher_model=name)),
        "task": ConfigRecord({"site-id": 0, "run-key": "attacker"}),
        "student": ArrayRecord(student.state_dict()),
    }


def test_pate_model_names_are_refused_before_anything_is_imported_or_called(
    tmp_path, probe, monkeypatch
):
    config, _, split = _pate()
    node = pate_node(tmp_path, split, "pate")
    bare = Node({"site-id": 0, "site-data": str(tmp_path / "pate-site-pate.npz")})  # no policy
    spawned = tmp_path / "tmp"
    spawned.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spawned))
    had_this = "this" in sys.modules
    texts = {}
    for name in ("fedsgld_probe54:make", "fedsgld_missing54:make", "tempfile:mkdtemp", "this:x"):
        for site in (node, bare):
            for kind in ("query.pate", "evaluate.pate"):
                req = _student_request(config, split, name)
                if kind == "query.pate":
                    req = {"pate": req["pate"]}
                text = message(refused(site.send(kind, **req), "pate.teacher_model", "refused"))
                texts[name, kind] = text.replace(name, "NAME")
                assert "No module" not in text and "install" not in text
    assert not probe.exists()  # the installed module was neither imported nor called
    assert "fedsgld_probe54" not in sys.modules
    assert list(spawned.iterdir()) == []  # tempfile.mkdtemp was not called
    assert had_this or "this" not in sys.modules  # the Zen of Python was not printed
    # one reply whatever is installed: the installed and the missing module read alike
    for kind in ("query.pate", "evaluate.pate"):
        assert len({texts[n, kind] for n in ("fedsgld_probe54:make", "fedsgld_missing54:make",
                                               "tempfile:mkdtemp", "this:x")}) == 1  # fmt: skip
    # the control: a site whose own node config names the factory builds it (and so would
    # have built any factory the server named, without the check)
    own = Node({"site-id": 0, "site-data": str(tmp_path / "pate-site-pate.npz"),
                "privacy-policy": policy_file(tmp_path, "own"), "model": "fedsgld_probe54:make"})  # fmt: skip
    own.send("evaluate.pate", **_student_request(config, split, "fedsgld_probe54:make"))
    assert (probe / "imported").exists() and (probe / "called").exists()


# -- 2: no server-named paths or downloads -----------------------------------------------------


def _timm_run(backbone: str) -> ConfigRecord:
    """The run record of a timm_head run naming ``backbone``, as an attacking server sends
    it (its own config checks skipped)."""
    rec = run_record(Config.from_flat({**SMALL, "model": "timm_head"}))
    rec["backbone"] = backbone
    return rec


def _every_message(run: ConfigRecord) -> dict[str, dict]:
    fields = {"round": 0, "epoch": 0, "run-key": "attacker", "sample-rate": 0.2, "sigma": 1.0,
              "prenoise": 0.01, "clip": 1.0, "theta": b"\0" * 4}  # fmt: skip
    ev = evaluation([np.zeros(4, np.float32)])
    return {
        "query": {"run": run},
        "train": {"plan": plan_record(fields, run)},
        "evaluate": {**ev, "run": run},
    }


def test_a_backbone_naming_a_directory_or_the_hub_is_refused_before_any_file_or_socket(tmp_path):
    import timm

    model_dir = tmp_path / "weights"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architecture": "resnet18"}))
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path)})
    node.send("query", run=run_record(CONFIG))  # the site is up (its own files read once)
    texts = set()
    with watch() as w:
        for backbone in (f"local-dir:{model_dir}", f"local-dir:{tmp_path / 'missing'}",
                         "hf-hub:timm/resnet18.a1_in1k", "hf_hub:timm/resnet18", str(model_dir),
                         "resnet18/../x"):  # fmt: skip
            for kind, content in _every_message(_timm_run(backbone)).items():
                text = message(refused(node.send(kind, **content), "backbone must be a plain"))
                texts.add(text.split(": ", 1)[1])  # after "<message type>: "
                assert str(tmp_path) not in text
    assert len(texts) == 1  # an existing and a missing directory: the same refusal
    touched = [s for s in w.seen if str(model_dir) in s[1] or "missing" in s[1]]
    assert touched == [] and not [s for s in w.seen if s[0].startswith("socket")]
    # the control: timm itself reads the directory's config.json for such a name
    with watch() as w:
        timm.create_model(f"local-dir:{model_dir}", pretrained=False)
    assert ("open", str(model_dir / "config.json")) in w.seen


def test_a_site_process_builds_models_offline():
    import os

    from fedsgld.apps import client_app  # noqa: F401 - importing it makes the process offline

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    from huggingface_hub import constants

    assert constants.is_offline_mode()
    with pytest.raises(ValueError, match="backbone must be a plain timm model name"):
        Config.from_flat({**SMALL, "model": "timm_head", "backbone": "hf-hub:timm/x"})
    from fedsgld.models.backbone import load_backbone

    with watch() as w, pytest.raises(ValueError, match="backbone must be a plain"):
        load_backbone("local-dir:/nonexistent-fedsgld")
    assert w.seen == []


def test_no_refusal_carries_a_path_of_the_sites(tmp_path):
    """A failure whose own text names the site's state directory (its ledger cannot be
    written: ``state_dir`` under a regular file) reaches the server with the path hidden;
    and a key list read from a file is never named in a refusal."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    pol = policy_file(tmp_path, "blocked", state_dir=str(blocker / "state"))
    node = Node({"site-id": 0, "privacy-policy": pol})
    reason = refused(node.send("train", plan=plan(LOCAL)))  # its audit log, first
    assert "<site path>" in reason or "audit log cannot be written" in reason, reason
    assert str(tmp_path) not in reason and "blocker" not in reason
    # the key list: a round naming sites outside it is refused without its file's path
    from fedsgld.secagg import SecAggPlan, check_site_plan, choose_ddg, identity

    _, peers_file = identity.consortium_files(tmp_path / "keys", range(4))
    peers = identity.parse_peers(str(peers_file))
    p = choose_ddg(noise_multiplier=1.0, clip=1.0, dim=64, sites=4, signal_norm=10.0)
    sp = SecAggPlan(round_label=b"x", sites=(0, 7, 8, 9), length=p.dim, bits=p.bits)
    with pytest.raises(ValueError, match="outside the site's key list") as err:
        check_site_plan(sp, p, clip=1.0, noise_multiplier=1.0, sample_rate=0.5, prenoise=0.0,
                        max_dropouts=0, max_colluders=0, peers=peers)  # fmt: skip
    assert str(tmp_path) not in str(err.value)


# -- 3: sizes --------------------------------------------------------------------------------


def _neighbour(tmp_path, drop: str) -> str:
    """Site 0's records file without its first ``drop`` record (``x_train`` or ``x_test``)."""
    with np.load(site_file(0)) as z:
        arrays = {k: z[k] for k in z.files}
    split = drop.split("_")[1]
    for k in (f"x_{split}", f"y_{split}"):
        arrays[k] = arrays[k][1:]
    out = tmp_path / f"without-one-{split}.npz"
    np.savez(out, **arrays)
    return str(out)


def _sites_reply(node: Node) -> list[dict]:
    return json.loads(answered(node.send("query", run=run_record(CONFIG))).content["sites"]["json"])


@pytest.mark.parametrize("published", [{"public_records": 160}, {}])
def test_a_site_and_the_same_site_without_one_record_answer_query_alike(tmp_path, published):
    keys = {"public_test_records": None, **published}
    keys = {k: v for k, v in keys.items() if v is not None}
    d = Node({"site-id": 0, "privacy-policy": _policy(tmp_path, "d", **keys)})
    replies = [_sites_reply(d)]
    for drop in ("x_train", "x_test"):
        node = Node({"site-id": 0, "site-data": _neighbour(tmp_path, drop),
                     "privacy-policy": _policy(tmp_path, drop, **keys)})  # fmt: skip
        replies.append(_sites_reply(node))
    assert replies[0] == replies[1] == replies[2]
    (entry,) = replies[0]
    assert entry["n_train"] == published.get("public_records") and entry["n_test"] is None
    if not published:  # nothing published: the site says why and answers no training
        assert entry["placements"] == [] and "public_records" in entry["refuses"]
        refused(d.send("train", plan=plan()), "publishes no record count")
    # the control: a policy that publishes its exact counts tells D from D'
    exact = {"public_records": "exact", "public_test_records": "exact"}
    ctrl = [
        _sites_reply(Node({"site-id": 0, "privacy-policy": _policy(tmp_path, "ce", **exact)})),
        _sites_reply(
            Node(
                {
                    "site-id": 0,
                    "site-data": _neighbour(tmp_path, "x_train"),
                    "privacy-policy": _policy(tmp_path, "ce2", **exact),
                }
            )
        ),  # fmt: skip
    ]
    assert ctrl[0][0]["n_train"] == ctrl[1][0]["n_train"] + 1


def _policy(tmp_path, name: str, **keys) -> str:
    """A policy publishing only what ``keys`` say (the default helper publishes exactly)."""
    base = {"public_records": None, "public_test_records": None, **keys}
    path = policy_file(tmp_path, name, **{k: v for k, v in base.items() if v is not None})
    text = Path(path).read_text()
    for k in ("public_records", "public_test_records"):
        if base[k] is None:
            text = "\n".join(line for line in text.splitlines() if not line.startswith(k))
    Path(path).write_text(text + "\n")
    return path


def test_the_batch_floor_is_decided_by_the_published_count(tmp_path):
    """The attack: a sample rate at which q N_D >= min_expected_batch > q N_D' (D' = D
    without one record). With the exact counts the floor answers D and refuses D'; with a
    published count both are answered (or both refused) alike."""
    n = 160  # site 0's training records (the control below checks it)
    q = 16.0 / (n - 0.5)
    rnd = plan(**{"sample-rate": q})
    for name, keys, alike in (("pub", {"public_records": n}, True),
                              ("exact", {"public_records": "exact"}, False)):  # fmt: skip
        d = Node({"site-id": 0, "privacy-policy": _policy(tmp_path, name + "d", **keys)})
        d2 = Node({"site-id": 0, "site-data": _neighbour(tmp_path, "x_train"),
                   "privacy-policy": _policy(tmp_path, name + "d2", **keys)})  # fmt: skip
        outcome = [d.send("train", plan=rnd).has_error(), d2.send("train", plan=rnd).has_error()]
        assert (outcome[0] == outcome[1]) is alike, (name, outcome)


def test_a_noised_evaluation_carries_the_published_test_count_not_the_exact_one(tmp_path):
    z = [np.zeros(54595, np.float32)]
    for keys, expect in (({"public_test_records": 30}, 30), ({}, None)):
        pol = _policy(tmp_path, f"ev{len(keys)}", public_records=160, **keys)
        d2 = Node(
            {"site-id": 0, "site-data": _neighbour(tmp_path, "x_test"), "privacy-policy": pol}
        )
        stats = json.loads(answered(d2.send("evaluate", **evaluation(z))).content["stats"]["json"])
        n = stats["model"]["n"]
        assert n == expect if expect is not None else n >= 1


# -- 4: absurd settings are refused in one line, before any charge -----------------------------

ABSURD = [
    ({"sigma": 1e300}, "noise multiplier 1e+300 refused: must be in [policy min_noise_multiplier"),
    ({"sigma": 1e7}, "1e+06]"),
    ({"prenoise": 1e300}, "prenoise 1e+300 refused: must be in [0, 1e+06]"),
    ({"clip": 1e300}, "clip 1e+300 refused: must be in (0, 1e+06]"),
    ({"sample-rate": 1e-300}, "sample rate 1e-300 refused: must be in [1e-09"),
    ({"sigma": 1e-300}, "budget"),  # an infinite epsilon: the ledger's refusal
]


def test_absurd_settings_are_refused_in_one_line_and_the_ledger_does_not_change(tmp_path):
    node = Node({"site-id": 0, "privacy-policy": policy_file(tmp_path)})
    answered(node.send("train", plan=plan(**{"run-key": "honest"})))
    ledger = tmp_path / "policy" / "fedsgld-site-0.json"
    before = ledger.read_bytes()
    for i, (fields, words) in enumerate(ABSURD):
        text = message(refused(node.send("train", plan=plan(**fields, **{"run-key": f"a{i}"}))))
        assert words in text, text
    hot = run_record(LOCAL)
    hot["temperature"] = 1e300  # a DP-SGLD noise multiplier sqrt(2 lr temperature) = inf
    text = message(refused(node.send("train", plan=plan_record({}, hot))))
    assert "sigma_0" in text and "(0, 1e+06]" in text
    assert ledger.read_bytes() == before


@pytest.mark.parametrize(("key", "value", "words"), [
    ("noise_multiplier", 1e300, r"noise_multiplier must be a number in \(0.0, 1000000.0\]"),
    ("prenoise", 1e300, r"prenoise must be a number in \[0.0, 1000000.0\]"),
    ("clip", 1e300, r"clip must be a number in \(0.0, 1000000.0\]"),
    ("sample_rate", 1e-300, r"sample_rate must be a number in \[1e-09, 1.0\]"),
    ("temperature", 1e300, r"sigma_0 = sqrt\(2 lr temperature\) = [^;]+; it must be in \(0, 1e\+06\]"),
])  # fmt: skip
def test_the_run_config_refuses_absurd_settings_with_one_line(key, value, words):
    method = {"noise_multiplier": "dpsgd"}.get(key, "dpsgld")
    with pytest.raises(ValueError, match=words) as err:
        Config.from_flat({**SMALL, "method": method, key: value})
    assert "\n" not in str(err.value) and re.search(key.split("_")[0], str(err.value))


def test_a_sites_own_steps_divide_by_the_count_it_publishes(tmp_path):
    """L_k = q N_k of the site's own update is the published N_k: a site that publishes
    twice the count moves half as far (one noiseless local step over every record)."""
    own = Config.from_flat({**SMALL, "method": "sgd", "noise_placement": "sites",
                            "local_steps": 1, "sample_rate": 1.0})  # fmt: skip
    theta0 = np.zeros(54595, np.float32)
    moved = {}
    for n in (160, 320):
        pol = _policy(tmp_path, f"n{n}", public_records=n, allow_non_private=True)
        node = Node({"site-id": 0, "privacy-policy": pol})
        reply = answered(node.send("train", plan=plan(own, clip=None, sigma=0.0)))
        theta = np.frombuffer(reply.content["theta"]["theta"], "<f4")
        moved[n] = theta - theta0
    assert np.abs(moved[160]).max() > 0
    np.testing.assert_allclose(moved[160], 2 * moved[320], rtol=1e-4, atol=1e-7)


def test_pate_teachers_beyond_the_published_count_are_refused_and_never_fail_on_records(
    tmp_path,
):
    """Before, a site holding fewer training records than ``teachers_per_site`` failed
    ("exceeds site 0's N training records"), after the charge, at D' = D without one
    record and not at D. Now the count it publishes decides: above it a refusal before
    any charge; at it D and D' both answer; a site publishing no count answers too (a
    teacher that draws no record votes with its initial model)."""
    from flwr.app import Array

    from fedsgld.pate.flower import pate_record as record

    config, _, split = _pate()
    s, n = split.sites[0], 6
    task = ConfigRecord({"site-id": 0, "run-key": "attacker"})
    queries = ArrayRecord({"x": Array(split.x_query.numpy().astype(np.float32)[:8])})
    files = []
    for name, rows in (("d", n), ("d-prime", n - 1)):
        f = tmp_path / f"pate-{name}.npz"
        np.savez(f, x_train=s.x_train.numpy()[:rows], y_train=s.y_train.numpy()[:rows],
                 x_test=s.x_test.numpy(), y_test=s.y_test.numpy(),
                 num_classes=np.int64(s.num_classes))  # fmt: skip
        files.append(str(f))

    def ask(data: str, name: str, teachers: int, **keys):
        node = Node({"site-id": 0, "site-data": data,
                     "privacy-policy": _policy(tmp_path, name, **keys)})  # fmt: skip
        rec = record(replace(config, teachers_per_site=teachers))
        return node.send("train.pate", pate=rec, task=task, queries=queries)

    pub = {"public_records": n, "allow_non_private": True}
    reply = ask(files[0], "over", n + 1, **pub)
    assert "publishes 6 training records" in message(refused(reply, "pate.teachers_per_site"))
    assert not (tmp_path / "over" / "fedsgld-site-0.json").exists()  # nothing charged
    for data, name in zip(files, ("d", "dp"), strict=True):  # D and D': both answered
        counts = answered(ask(data, name, n, **pub)).content["histogram"]["counts"].numpy()
        assert (counts.sum(axis=1) == n).all()
    # nothing published: more teachers than records is answered, not an error
    answered(ask(files[1], "none", n + 3, allow_non_private=True))
