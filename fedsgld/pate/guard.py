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

from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
from flwr.app import Context, Message

from fedsgld.clients import guard
from fedsgld.clients.guard import Admission
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.release import noisy_votes, vote_sensitivity
from fedsgld.flower import release
from fedsgld.flower.guard import Door, evaluation_admission
from fedsgld.flower.site_files import deployed, read_node_policy
from fedsgld.flower.user_sites import check_site_code
from fedsgld.pate.config import PateConfig
from fedsgld.pate.flower import site_records
from fedsgld.pate.protocol import (
    EVALUATE,
    QUERY,
    TRAIN,
    AtSite,
    PateTask,
    StudentRequest,
    decode_evaluate,
    decode_query,
    decode_train,
    decode_votes,
    encode_votes,
)
from fedsgld.pate.teachers import new_model
from fedsgld.privacy.events import GaussianRelease


def _policy(task: PateTask, context: Context) -> SitePolicy:
    """The node's policy, after the models the task names passed the site's one check of
    code it builds (:func:`~fedsgld.flower.user_sites.check_site_code`), at a deployed
    node before anything is read, imported or called."""
    node_config = dict(context.node_config)
    if deployed(node_config):
        for name in ("teacher_model", "student_model"):
            check_site_code(getattr(task.config, name), node_config, setting=f"pate.{name}")
    return read_node_policy(node_config, run_epsilon=None, run_delta=task.config.delta)


def _site(task: PateTask, context: Context) -> Any:
    """The records of the site ``task`` asks, if this node hosts it, else a refusal."""
    shards = site_records(task.config, dict(context.node_config))
    if task.site_id not in shards:
        raise PolicyRefused(
            f"this node does not host site {task.site_id!r} (it hosts {sorted(shards)})"
        )
    return shards[task.site_id]


def _query_pate(msg: Message, context: Context) -> Admission:
    task = decode_query(msg.content)  # the one decoding of the message
    policy = _policy(task, context)
    return Admission(
        policy,
        release=partial(release.sites_info, label_histogram=None, policy=policy, placements=False),
        request=AtSite(task),
    )


def _train_pate(msg: Message, context: Context) -> Admission:
    req = decode_train(msg.content)  # the one decoding of the message
    policy, s = _policy(req.task, context), _site(req.task, context)
    want = (req.queries.shape[0], *s.x_train.shape[1:])
    if tuple(req.queries.shape) != want:
        raise PolicyRefused(
            f"queries are float32{tuple(req.queries.shape)}, expected float32{want} (the site's records)"
        )
    queries = guard.finite("queries", req.queries)
    _check_teachers(req.task, policy, int(s.y_train.shape[0]))
    adm = _vote_admission(
        req.task.config, policy, int(req.task.site_id), want[0], int(s.num_classes)
    )
    return replace(adm, request=AtSite(replace(req, queries=queries), s))


def _check_teachers(task: PateTask, policy: SitePolicy, exact: int) -> None:
    """A refusal where ``teachers_per_site`` exceeds the training-record count the site
    publishes (its policy's ``public_records``; the exact count only where it says
    "exact"): decided from the request and the policy, never from the records. A site
    that publishes no count trains the teachers asked; one that draws no record votes
    with its initial model (:func:`~fedsgld.pate.teachers.train_site_teachers`)."""
    n, t = policy.published("public_records", exact), task.config.teachers_per_site
    if n is not None and t > n:
        raise PolicyRefused(
            f"pate.teachers_per_site {t} refused: site {task.site_id} publishes {n} training "
            "records (policy public_records), so at most that many teachers"
        )


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
    req = decode_evaluate(msg.content)  # the one decoding of the message
    config, policy, s = req.task.config, _policy(req.task, context), _site(req.task, context)
    run_key = guard.run_key({"run-key": req.task.run_key})
    shape = tuple(s.x_train.shape[1:])
    ref = new_model(config.student_model, shape, int(s.num_classes), config.hidden, 0)
    want = ref.state_dict()
    if sorted(req.student) != sorted(want):
        raise PolicyRefused(
            f"student has parameters {sorted(req.student)}, expected {sorted(want)}"
        )
    student = {}
    for k, t in want.items():
        arr, dtype = req.student[k], str(t.numpy().dtype)
        if str(arr.dtype) != dtype or tuple(arr.shape) != tuple(t.shape):
            raise PolicyRefused(
                f"student parameter {k!r} is {arr.dtype}{tuple(arr.shape)}, expected "
                f"{dtype}{tuple(t.shape)} (the site's model)"
            )
        student[k] = guard.finite(f"student parameter {k!r}", arr)
    adm = evaluation_admission(policy, int(req.task.site_id), run_key, "student", run_secure=False)
    return replace(adm, request=AtSite(StudentRequest(req.task, student), s))


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
    got = decode_votes(reply.content)
    counts = got.counts if noise is None else noisy_votes(got.counts, noise, teachers)
    released = replace(
        got,
        counts=np.ascontiguousarray(counts, dtype=np.int64),
        accuracy=got.accuracy if share_accuracy else (),
        noise_std=noise_std,
    )
    return Message(encode_votes(released), reply_to=msg)


ADMISSIONS: dict[str, Door] = {
    QUERY: _query_pate,
    TRAIN: _train_pate,
    EVALUATE: _evaluate_pate,
}

__all__ = ["ADMISSIONS", "votes"]
