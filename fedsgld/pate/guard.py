"""What a site admits of PATE: the admissions of ``query.pate``, ``train.pate`` and
``evaluate.pate`` for the site's guard, and the release of its vote counts.

The ClientApp (``fedsgld.apps.client_app``) adds :data:`ADMISSIONS` to the guard's table
(:func:`fedsgld.flower.guard.make_site_guard`), so every PATE message passes the same
steps as a training one: validate, charge, draw, compute, release. A ``train.pate``
request is checked (public queries of the site's input shape, finite), charged as one
Gaussian release of the site's vote histogram (unless its policy allows non-private
answers) and answered with :func:`votes`; ``evaluate.pate`` checks the student against
the site's model layout and is released as one evaluation (:mod:`fedsgld.flower.release`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsgld.clients import guard
from fedsgld.clients.guard import Admission
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.release import noisy_votes, vote_sensitivity
from fedsgld.flower import release
from fedsgld.flower.guard import Door, checked_array, evaluation_admission, request_record
from fedsgld.flower.site_files import read_node_policy
from fedsgld.pate.config import PateConfig
from fedsgld.pate.flower import EVALUATE, QUERY, TRAIN, pate_config_from_run_config, site_records
from fedsgld.pate.teachers import new_model
from fedsgld.privacy.events import GaussianRelease


def _pate(msg: Message, context: Context, *, shard: bool = True):
    """(config, policy, site id, the site's records) of a PATE message."""
    config = pate_config_from_run_config(dict(request_record(msg, "pate", ConfigRecord).items()))
    policy = read_node_policy(dict(context.node_config), run_epsilon=None, run_delta=config.delta)
    if not shard:
        return config, policy, None, None
    sid = request_record(msg, "task", ConfigRecord).get("site-id")
    shards = site_records(config, dict(context.node_config))
    if isinstance(sid, bool) or not isinstance(sid, int) or sid not in shards:
        raise PolicyRefused(f"this node does not host site {sid!r} (it hosts {sorted(shards)})")
    return config, policy, sid, shards[sid]


def _query_pate(msg: Message, context: Context) -> Admission:
    _, policy, _, _ = _pate(msg, context, shard=False)
    return Admission(policy, release=partial(release.sites_info, label_histogram=None))


def _train_pate(msg: Message, context: Context) -> Admission:
    config, policy, sid, s = _pate(msg, context)
    x = request_record(msg, "queries", ArrayRecord)
    shape = tuple(x["x"].shape) if "x" in x else ()
    n_queries = shape[0] if shape else 0
    if n_queries < 1:
        raise PolicyRefused("train.pate needs at least one public query")
    checked_array(x, "x", dtype="float32", shape=(n_queries, *s.x_train.shape[1:]), name="queries")
    return _vote_admission(config, policy, sid, n_queries, int(s.num_classes))


def _vote_admission(
    config: PateConfig, policy: SitePolicy, sid: int, n_queries: int, num_classes: int
) -> Admission:
    """The site's vote histogram on ``n_queries`` queries: one Gaussian release of
    sensitivity :func:`vote_sensitivity`, unless the policy allows non-private answers."""
    noised = not policy.allow_non_private
    m = policy.vote_noise_multiplier
    event = GaussianRelease(m, vote_sensitivity(n_queries)) if noised else None
    std = event.std if event is not None else 0.0
    return Admission(
        policy,
        sid,
        event=event,
        noise_shape=(n_queries, num_classes) if noised else None,
        noise_std=std,
        release=partial(
            votes,
            teachers=config.teachers_per_site,
            noise_std=std,
            share_accuracy=policy.evaluation == "exact",
        ),
    )


def _evaluate_pate(msg: Message, context: Context) -> Admission:
    config, policy, sid, s = _pate(msg, context)
    run_key = guard.run_key(request_record(msg, "task", ConfigRecord))
    student = request_record(msg, "student", ArrayRecord)
    shape = tuple(s.x_train.shape[1:])
    ref = new_model(config.student_model, shape, int(s.num_classes), config.hidden, 0)
    want = ref.state_dict()
    if sorted(student.keys()) != sorted(want):
        raise PolicyRefused(
            f"student has parameters {sorted(student.keys())}, expected {sorted(want)}"
        )
    for k, t in want.items():
        dtype = str(t.numpy().dtype)
        checked_array(
            student, k, dtype=dtype, shape=tuple(t.shape), name=f"student parameter {k!r}"
        )
    return evaluation_admission(policy, sid, run_key, "student", run_secure=False)


def votes(
    msg: Message,
    reply: Message,
    noise: np.ndarray | None,
    *,
    teachers: int,
    noise_std: float,
    share_accuracy: bool,
) -> Message:
    """A PATE site's vote histogram (noised unless ``noise`` is None) and, where the policy
    releases exact evaluations, its teachers' test accuracies (else an empty list)."""
    c = reply.content
    counts = c["histogram"]["counts"].numpy()
    if noise is not None:
        counts = noisy_votes(counts, noise, teachers)
    acc = str(c["teachers"]["accuracy"]) if share_accuracy else "[]"
    rec: dict[str, Any] = {
        "site-id": c["teachers"]["site-id"],
        "accuracy": acc,
        "vote-noise-std": noise_std,
    }
    out = {
        "histogram": ArrayRecord({"counts": Array(np.ascontiguousarray(counts, dtype=np.int64))}),
        "teachers": ConfigRecord(rec),
    }
    return Message(RecordDict(out), reply_to=msg)


ADMISSIONS: dict[str, Door] = {
    QUERY: _query_pate,
    TRAIN: _train_pate,
    EVALUATE: _evaluate_pate,
}

__all__ = ["ADMISSIONS", "votes"]
