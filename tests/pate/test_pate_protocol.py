"""PATE's message codecs: what the server encodes is what a site decodes, a malformed
record is refused naming what is wrong, and a handler reached without the site's guard
computes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsgld.pate import protocol as P
from fedsgld.pate.config import PateConfig

CONFIG = P.pate_config_from_run_config(
    {"pate.dataset": "synthetic", "pate.sites": 2, "pate.mechanisms": "lnmax,gnmax"}
)
TASK = P.PateTask(CONFIG, 1, "run-a")


def test_every_request_round_trips():
    assert P.decode_query(P.encode_query(CONFIG)) == P.PateTask(CONFIG)
    q = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = P.decode_train(P.encode_train(TASK, q))
    assert req.task == TASK and req.queries.dtype == np.float32
    np.testing.assert_array_equal(req.queries, q)
    student = {"w": np.ones((2, 3), np.float32), "b": np.zeros(2, np.float32)}
    record = ArrayRecord({k: Array(v) for k, v in student.items()})
    got = P.decode_evaluate(P.encode_evaluate(TASK, record))
    assert got.task == TASK and sorted(got.student) == ["b", "w"]
    np.testing.assert_array_equal(got.student["w"], student["w"])
    assert isinstance(CONFIG, PateConfig) and CONFIG.mechanisms == ("lnmax", "gnmax")


def test_every_reply_round_trips():
    votes = P.Votes(3, np.array([[1, 0], [0, 1]], np.int64), (0.5, 0.75), 2.5)
    got = P.decode_votes(P.encode_votes(votes))
    assert (got.site_id, got.accuracy, got.noise_std) == (3, (0.5, 0.75), 2.5)
    np.testing.assert_array_equal(got.counts, votes.counts)
    entries = [{"site": 0, "n_train": 5}, {"site": 1, "n_train": 7}]
    assert P.decode_sites(P.encode_sites(entries)) == entries


def _train(**changes) -> RecordDict:
    content = P.encode_train(TASK, np.zeros((2, 4), np.float32))
    for name, rec in changes.items():
        if rec is None:
            del content[name]
        else:
            content[name] = rec
    return content


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"pate": None}, "ConfigRecord 'pate'"),
        ({"task": None}, "ConfigRecord 'task'"),
        ({"task": ConfigRecord({"site-id": True, "run-key": "k"})}, "site-id"),
        ({"task": ConfigRecord({"site-id": 1, "run-key": ""})}, "run key"),
        ({"queries": None}, "ArrayRecord 'queries'"),
        ({"queries": ArrayRecord({"y": Array(np.zeros(2, np.float32))})}, "'x'"),
        ({"queries": ArrayRecord({"x": Array(np.zeros((2, 4), np.float64))})}, "float64"),
        ({"queries": ArrayRecord({"x": Array(np.zeros((0, 4), np.float32))})}, "one public"),
        ({"pate": ConfigRecord({"pate.nonsense": 1})}, "pate.nonsense"),
    ],
)
def test_a_malformed_train_request_is_refused_naming_what_is_wrong(changes, words):
    with pytest.raises(ValueError, match=words):
        P.decode_train(_train(**changes))


def test_a_malformed_votes_reply_is_refused_naming_what_is_wrong():
    good = P.encode_votes(P.Votes(0, np.zeros((1, 2), np.int64), ()))
    for key, value, words in [
        ("accuracy", '"high"', "accuracy"),
        ("accuracy", "[true]", "accuracy"),
        ("site-id", "zero", "site-id"),
        ("vote-noise-std", -1.0, "vote-noise-std"),
    ]:
        bad = RecordDict(dict(good.items()))
        bad["teachers"] = ConfigRecord({**dict(good["teachers"].items()), key: value})
        with pytest.raises(ValueError, match=words):
            P.decode_votes(bad)
    with pytest.raises(ValueError, match="integer 'site'"):
        P.decode_sites(RecordDict({"sites": ConfigRecord({"json": '[{"site": "0"}]'})}))


@pytest.mark.parametrize("kind", [P.QUERY, P.TRAIN, P.EVALUATE])
def test_a_handler_reached_without_the_sites_guard_computes_nothing(kind):
    from fedsgld.apps import client_app
    from fedsgld.flower.local_grid import LocalGrid

    app = client_app._register(ClientApp(mods=[]))  # PATE's handlers, no guard in front
    grid = LocalGrid(app, [{"partition-id": 0, "num-partitions": 2}])
    (node,) = grid.contexts
    (mid,) = grid.push_messages(
        [Message(P.encode_train(TASK, np.zeros((2, 4), np.float32)), node, kind)]
    )
    (reply,) = grid.pull_messages([mid])
    assert reply.has_error() and "guard" in str(reply.error.reason)
