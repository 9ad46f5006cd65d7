"""PATE over the Flower apps (LocalGrid): sites train teachers and send only histograms.

A seeded Flower run equals the in-process ``run_pate`` (same split, teachers, noise); a
tampered histogram is dropped with its reason and the analysis covers the rest; if no site
answers usefully the run stops with a clear error; bad PATE run-config keys are named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedsgld.apps import APPS
from fedsgld.flower.local_grid import run_local
from fedsgld.pate.flower import pate_config_from_run_config
from fedsgld.pate.server import PateSitesFailed
from fedsgld.pate.train import analyse_vote_file, run_pate

PATE_RC = {
    "task": "pate",
    "pate.dataset": "synthetic",
    "pate.dataset_options": json.dumps(
        {"n": 400, "num_classes": 3, "shape": [8], "separation": 1.5}
    ),
    "pate.sites": 2,
    "pate.teachers_per_site": 3,
    "pate.queries": 60,
    "pate.public_fraction": 0.25,
    "pate.teacher_epochs": 5,
    "pate.student_epochs": 10,
    "pate.threads": 1,
    "pate.mechanisms": "lnmax,gnmax,confident_gnmax",
    "pate.gnmax_sigma": 1.0,
    "pate.threshold": 4.0,
    "pate.sigma1": 1.0,
    "pate.sigma2": 1.0,
    "pate.randomness": "seeded",  # a simulation: equal to the in-process run
}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("pate") / "inproc"
    return run_pate(pate_config_from_run_config(PATE_RC), out_dir=out, log=lambda s: None), out


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())


def test_pate_over_flower_equals_in_process(tmp_path, in_process):
    ref, ref_out = in_process
    out = tmp_path / "flower"
    run_local({**PATE_RC, "out": str(out)}, **APPS, num_nodes=2, shuffle_seed=3)
    got = _results(out)
    assert got["engine"] == "flower" and got["flower"]["dropped_replies"] == []
    assert got["teachers"]["test_accuracy"] == ref["teachers"]["test_accuracy"]
    for mech, e in ref["mechanisms"].items():
        g = got["mechanisms"][mech]
        assert g["epsilon"] == e["epsilon"] and g["answered"] == e["answered"]
        assert g["noisy_label_accuracy"] == e["noisy_label_accuracy"]
        for key in ("accuracy", "nll", "ece"):
            assert g["student"]["pooled"][key] == pytest.approx(
                e["student"]["pooled"][key], abs=1e-6
            )
        with np.load(out / f"votes_{mech}.npz") as a, np.load(ref_out / f"votes_{mech}.npz") as b:
            assert "teacher_preds" not in a.files  # single teachers' votes never left the sites
            assert np.array_equal(a["counts"], b["counts"]) and np.array_equal(
                a["labels"], b["labels"]
            )
        # the analysis command reproduces the server's epsilons from the histogram alone
        assert analyse_vote_file(out / f"votes_{mech}.npz")["epsilon"] == e["epsilon"]


def _tamper_site_1(ins: Message, reply: Message) -> Message:
    """Site 1 tries to outvote the others: 10 votes for class 0 on every query."""
    if ins.metadata.message_type != "train.pate" or ins.content["task"]["site-id"] != 1:
        return reply
    counts = reply.content["histogram"]["counts"].numpy().copy()
    counts[:, 0] += 10
    content = RecordDict(
        {"histogram": ArrayRecord({"counts": Array(counts)}), "teachers": reply.content["teachers"]}
    )
    return Message(content, reply_to=ins)


def test_a_tampered_histogram_is_dropped_and_the_rest_is_analysed(tmp_path, in_process):
    out = tmp_path / "tampered"
    run_local({**PATE_RC, "out": str(out)}, **APPS, num_nodes=2, fault=_tamper_site_1)
    got = _results(out)
    (drop,) = got["flower"]["dropped_replies"]
    assert drop["site"] == 1 and "3 non-negative votes" in drop["reason"]
    assert got["flower"]["voting_sites"] == [0] and got["teachers"]["count"] == 3
    with np.load(out / "votes_lnmax.npz") as z:
        assert np.all(z["counts"].sum(axis=1) == 3)
    # the student is still evaluated at both sites
    assert [s["site"] for s in got["mechanisms"]["gnmax"]["student"]["per_site"]] == [0, 1]


def test_no_usable_histogram_stops_the_run(tmp_path):
    def drop_all(ins: Message, reply: Message):
        return None if ins.metadata.message_type == "train.pate" else reply

    with pytest.raises(PateSitesFailed, match="no site returned a usable vote histogram"):
        run_local(
            {**PATE_RC, "out": str(tmp_path / "x"), "round-timeout": 1.0},
            **APPS,
            num_nodes=2,
            fault=drop_all,
        )


def test_bad_pate_run_config_is_named():
    with pytest.raises(ValueError, match="pate.no_such_key"):
        pate_config_from_run_config({"pate.no_such_key": 1})
    with pytest.raises(ValueError, match="pate.mechanisms"):
        pate_config_from_run_config({"pate.mechanisms": ["lnmax"]})
    with pytest.raises(ValueError, match="lnmax_gamma must be a finite number > 0"):
        pate_config_from_run_config({"pate.lnmax_gamma": 0.0})
    with pytest.raises(ValueError, match="pate.dataset_options"):
        pate_config_from_run_config({"pate.dataset_options": "[1, 2]"})
    with pytest.raises(ValueError, match="task must be one of"):
        run_local({"task": "nonsense"}, **APPS, num_nodes=1)


def test_deployed_sites_reading_their_own_files_give_the_same_run(tmp_path, in_process):
    """A deployment: each node hosts one site (site-id) and reads only its own .npz; their
    policies let exact votes out (allow_non_private), so the run equals the in-process one."""
    from fedsgld.pate.train import pate_split

    ref, _ = in_process
    split = pate_split(pate_config_from_run_config(PATE_RC))
    # sites that trust the server's aggregator with their exact votes and evaluations (a
    # deployed site's default noises both: tests/privacy/test_site_guard.py)
    policy = tmp_path / "policy.toml"
    policy.write_text('epsilon = 1000.0\nallow_non_private = true\nevaluation = "exact"\n')
    nodes = []
    for s in split.sites:
        f = tmp_path / f"site{s.site_id}.npz"
        np.savez(
            f, x_train=s.x_train.numpy(), y_train=s.y_train.numpy(), x_test=s.x_test.numpy(),
            y_test=s.y_test.numpy(), num_classes=split.num_classes,
        )  # fmt: skip
        nodes.append({"site-id": s.site_id, "site-data": str(f), "privacy-policy": str(policy)})
    out = tmp_path / "deployed"
    run_local({**PATE_RC, "out": str(out)}, **APPS, node_configs=nodes)
    got = _results(out)
    assert got["teachers"]["test_accuracy"] == ref["teachers"]["test_accuracy"]
    for mech, e in ref["mechanisms"].items():
        assert got["mechanisms"][mech]["epsilon"] == e["epsilon"]
