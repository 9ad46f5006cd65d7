"""The ``train.secagg`` message's one codec (:mod:`fedsgld.flower.protocol` describes every
message type): a :class:`SecureStep` is one step of a secure-aggregation round for one
site, its record the train plan's fields (:func:`fedsgld.flower.protocol.train_fields`)
plus the round's public plan and the step's protocol message. The server encodes
(:func:`encode_secure`); the site's door decodes once (:func:`decode_secure`), refusing a
malformed record, and checks the rest against its policy (:mod:`fedsgld.flower.secure_door`).
A round's kind is ``train`` (a training round's clipped gradient sums) or ``standardize``
(the pooled standardisation's one release at the ``secure`` placement, its own label).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import RecordDict

from fedsgld.clients.site_ledger import standardization_key
from fedsgld.core.plan import TrainPlan
from fedsgld.flower.protocol import (
    SECAGG_PREFIX,
    plan_record,
    plan_record_in,
    read_train_plan,
    real_field,
    run_record,
    train_fields,
)
from fedsgld.flower.secure_requests import bound_plan
from fedsgld.secagg import SecAggPlan
from fedsgld.secagg.driver import STEPS as SECAGG_STEPS
from fedsgld.secagg.wire import flatten, unflatten
from fedsgld.strategies.secure_sum import round_label

SECAGG_FIELDS = ("signal-norm", "secagg-step", "secagg-sites", "secagg-length", "secagg-bits",
                 "secagg-dropouts", "secagg-colluders", "secagg-neighbours",
                 "secagg-one-shot", "secagg-kind")  # fmt: skip
# what a secure round sums: a training round's clipped gradient sums, or (once, before round
# 1, ``standardize = "pooled"``) the sites' clipped moment sums of the pooled standardisation
SECAGG_KINDS = ("train", "standardize")


@dataclass(frozen=True)
class SecureStep:
    """One step of a secure-aggregation round for one site (a ``train.secagg`` message):
    the round's :class:`TrainPlan` (theta_t only at ``masked_input``), the step, the round's
    public :class:`~fedsgld.secagg.SecAggPlan`, the norm bound of the sum the mechanism is
    chosen for (``signal_norm``: C times the sites' records) and the step's protocol message
    (:mod:`fedsgld.secagg.wire`, its shape checked by the site's admission)."""

    plan: TrainPlan
    step: str
    secagg: SecAggPlan
    signal_norm: float | None
    message: dict[str, Any]
    kind: str = "train"  # or "standardize": :data:`SECAGG_KINDS`

    @property
    def round_of(self) -> tuple[str, int, int]:
        """(key, epoch, round): what the site's ledger numbers the round by; the pooled
        standardisation's is the run's standardisation key (one release per epoch)."""
        if self.kind == "standardize":
            return (standardization_key(self.plan.run_key), self.plan.epoch, 0)
        return self.plan.round_of


def secagg_label(run_key: str, epoch: int, rnd: int) -> bytes:
    """The round label of a Flower secure-aggregation round: a resumed run (new epoch)
    never repeats one."""
    return round_label(f"{run_key}/{epoch}", rnd)


def standardize_label(run_key: str, epoch: int) -> bytes:
    """The label of the pooled standardisation's secure round: never a training round's."""
    return secagg_label(standardization_key(run_key), epoch, 0)


def secagg_fields(sp: SecAggPlan, step: str) -> dict[str, Any]:
    """A step's public secure-aggregation plan, as ``plan`` record fields."""
    return {
        "secagg-step": step,
        "secagg-sites": list(sp.sites),
        "secagg-length": sp.length,
        "secagg-bits": sp.bits,
        "secagg-dropouts": sp.max_dropouts,
        "secagg-colluders": sp.max_colluders,
        "secagg-neighbours": sp.neighbours,
        "secagg-one-shot": sp.one_shot,
    }


def secagg_plan(
    rec: Any, *, run_key: str, epoch: int, rnd: int, label: bytes | None = None
) -> SecAggPlan:
    """The round's :class:`SecAggPlan` from a ``train.secagg`` plan record (``ValueError``,
    ``TypeError`` or ``KeyError`` for a malformed one); its label ``label``, else training
    round ``rnd``'s."""
    sites = rec["secagg-sites"]
    names = ("secagg-length", "secagg-bits", "secagg-dropouts", "secagg-colluders",
             "secagg-neighbours")  # fmt: skip
    ints = [rec[k] for k in names]
    if not isinstance(sites, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in [*sites, *ints]
    ):
        raise TypeError(
            "secagg-sites, -length, -bits, -dropouts, -colluders, -neighbours must be integers"
        )
    length, bits, dropouts, colluders, neighbours = ints
    one_shot = rec["secagg-one-shot"]
    if not isinstance(one_shot, bool):
        raise TypeError("secagg-one-shot must be true or false")
    return SecAggPlan(
        round_label=label or secagg_label(run_key, epoch, rnd), sites=tuple(sites), length=length,
        bits=bits, max_dropouts=dropouts, max_colluders=colluders, neighbours=neighbours,
        one_shot=one_shot,
    )  # fmt: skip


def encode_secure(step: SecureStep) -> RecordDict:
    """A ``train.secagg`` message's content: one ``plan`` record (module docstring)."""
    p = step.plan
    rec = train_fields(p)
    rec |= {"signal-norm": step.signal_norm, **secagg_fields(step.secagg, step.step)}
    rec["secagg-kind"] = step.kind
    if step.signal_norm is None:
        del rec["signal-norm"]
    if p.theta is not None:
        rec["theta"] = p.theta
    rec |= flatten(step.message, SECAGG_PREFIX)
    return RecordDict({"plan": plan_record(rec, run_record(p.config))})


def decode_secure(content: RecordDict) -> SecureStep:
    """The :class:`SecureStep` a ``train.secagg`` message carries (:func:`encode_secure`);
    ``ValueError``, ``TypeError`` or ``KeyError`` for a malformed one. The step's name is
    one of the protocol's; its message's shape is the step's admission's to check."""
    rec = plan_record_in(content)
    plan = read_train_plan(rec, extra=SECAGG_FIELDS, prefix=SECAGG_PREFIX)
    step = rec.get("secagg-step")
    if step not in SECAGG_STEPS:
        raise ValueError(f"secagg-step {step!r} refused: must be one of {', '.join(SECAGG_STEPS)}")
    kind = rec.get("secagg-kind", "train")
    if kind not in SECAGG_KINDS:
        raise ValueError(f"secagg-kind {kind!r} refused: must be one of {', '.join(SECAGG_KINDS)}")
    label = None
    if kind == "standardize":  # one round, no parameters: its own label
        if plan.round != 0 or plan.theta is not None:
            raise ValueError("a standardisation round is round 0 and carries no theta")
        label = standardize_label(plan.run_key, plan.epoch)
    sp = secagg_plan(rec, run_key=plan.run_key, epoch=plan.epoch, rnd=plan.round, label=label)
    norm = real_field(dict(rec.items()), "signal-norm", optional=True)
    return SecureStep(
        plan=plan,
        step=step,
        secagg=bound_plan(sp, plan, norm),  # the mechanism the request's numbers make
        signal_norm=norm,
        message=unflatten(rec, SECAGG_PREFIX),
        kind=kind,
    )


__all__ = [
    "SECAGG_FIELDS",
    "SECAGG_KINDS",
    "SecureStep",
    "decode_secure",
    "encode_secure",
    "secagg_fields",
    "secagg_label",
    "secagg_plan",
    "standardize_label",
]
