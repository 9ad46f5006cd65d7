"""PATE's models and their (non-private) training: the teachers at a site, the student.

Each site splits its own training records over ``teachers_per_site`` teachers by a keyed
hash of every record (:func:`teacher_assignment`), so one record trains exactly one
teacher, as the PATE analysis assumes; each teacher trains with plain Adam
(:func:`train_classifier`) and votes on the public queries (:func:`train_site_teachers`).
Only the histogram of the votes (:func:`fedsgld.pate.aggregation.site_histogram`) should
leave the site. Every model starts from its own seed (:func:`new_model`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn

from fedsgld.core import streams
from fedsgld.core.finite import finite_probs
from fedsgld.core.noise import seeded_generator
from fedsgld.models import build_model
from fedsgld.pate.config import PateConfig


def new_model(name: str, shape: tuple[int, ...], num_classes: int, hidden: int, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(name, input_shape=shape, num_classes=num_classes, hidden=hidden)


def train_classifier(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> nn.Module:
    """Plain (non-private) Adam on cross-entropy; shuffling from ``generator``."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    n = int(y.shape[0])
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    return model


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Softmax of ``model`` on ``x``; a record whose softmax is not finite gets the uniform
    distribution (:func:`fedsgld.core.finite.finite_probs`), so its vote is class 0 and
    its metrics are defined, whatever the other records are."""
    model.eval()
    return torch.cat(
        [
            finite_probs(torch.softmax(model(x[i : i + chunk]), dim=1))
            for i in range(0, len(x), chunk)
        ]
    )


def train_site_teachers(
    config: PateConfig,
    *,
    site_id: int,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    x_query: torch.Tensor,
    num_classes: int,
) -> tuple[np.ndarray, list[float]]:
    """One site's teachers on disjoint subsets of its own training records.

    Returns the teachers' predicted labels for the queries, shape
    (teachers_per_site, n_queries), and each teacher's accuracy on the site's test split.
    Only the histogram of the predictions (:func:`site_histogram`) should leave the site.
    Fewer records than teachers is no failure (a failure there would depend on the exact
    count): a teacher that draws no record votes with its initial model. A deployed site
    refuses ``teachers_per_site`` above the count it publishes, before any record is read
    (:mod:`fedsgld.pate.guard`).
    """
    shape = tuple(x_train.shape[1:])
    owner = teacher_assignment(
        x_train, y_train, config.teachers_per_site, key=(config.seed, site_id)
    )
    preds, acc = [], []
    for j in range(config.teachers_per_site):
        tid = site_id * config.teachers_per_site + j
        model = new_model(
            config.teacher_model, shape, num_classes, config.hidden, config.seed * 10007 + tid
        )
        ix = torch.from_numpy(np.flatnonzero(owner == j))
        if len(ix):  # a teacher that drew no record votes with its initial (data-free) model
            train_classifier(
                model, x_train[ix], y_train[ix], epochs=config.teacher_epochs, lr=config.lr,
                batch_size=config.batch_size, generator=seeded_generator(config.seed, streams.PATE_TEACHER, tid),
            )  # fmt: skip
        preds.append(predict_proba(model, x_query).argmax(dim=1).numpy())
        acc.append(float((predict_proba(model, x_test).argmax(1) == y_test).float().mean()))
    return np.stack(preds), acc


def teacher_assignment(
    x: torch.Tensor, y: torch.Tensor, teachers: int, *, key: tuple[int, ...]
) -> np.ndarray:
    """The teacher of every record: a keyed hash of the record itself, modulo ``teachers``.

    A record's teacher depends on that record (and the key) only, so adding or removing one
    record changes exactly one teacher's training set, as the PATE analysis assumes (one
    record changes at most one vote per query). A permutation of the whole site would
    re-deal every teacher's records instead.
    """
    salt = repr(tuple(int(k) for k in key)).encode()
    xs = x.detach().cpu().contiguous().numpy()
    ys = y.detach().cpu().numpy()
    out = np.empty(len(ys), dtype=np.int64)
    for i in range(len(ys)):
        h = hashlib.blake2b(xs[i].tobytes(), digest_size=8, key=salt[:64])
        h.update(int(ys[i]).to_bytes(8, "little", signed=True))
        out[i] = int.from_bytes(h.digest(), "little") % teachers
    return out


# evaluate_student(student) -> (pooled calibration_report, [per-site reports with "site"])


__all__ = [
    "new_model",
    "predict_proba",
    "teacher_assignment",
    "train_classifier",
    "train_site_teachers",
]
