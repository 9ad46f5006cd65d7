"""The site's one door in Flower: the ClientApp mod every message passes first.

The ClientApp (``fedsgld.apps.client_app``) is ``ClientApp(mods=[site_guard])``, its
guard built by :func:`make_site_guard` from a table of admissions, one per message type
it answers (:data:`DOORS`: ``query``, ``train``, ``evaluate``; the app adds PATE's from
:mod:`fedsgld.pate.guard`). Flower calls the guard with every message before the handler
of its type; the guard

1. finds the type's admission (a type it does not know is refused), which decodes the
   message, finds the hosted site and checks the request against the site's policy
   (:mod:`fedsgld.clients.guard`); a malformed message is refused as such,
2. charges the site's ledger (:func:`fedsgld.clients.guard.charge`; a simulated node keeps
   it in ``context.state``),
3. draws the release's noise (:func:`fedsgld.clients.guard.draw`),
4. calls the handler (``call_next``), handing it what was admitted: the decoded, checked
   request and the charge's receipt (:mod:`fedsgld.flower.handoff`), and
5. lets out only the admission's release of the reply (:mod:`fedsgld.flower.release`),
6. and only after its line is in the site's audit log (:mod:`fedsgld.flower.audit`: the
   log must be writable before the charge, every refusal has its line too).

A refusal raises :class:`~fedsgld.clients.policy.PolicyRefused`; Flower turns it into the
error reply the server logs; no error leaves with a path of the site's in it
(:mod:`fedsgld.flower.redact`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedsgld.clients import guard
from fedsgld.clients.audit_log import AuditUnwritable
from fedsgld.clients.guard import Admission, Evaluating
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import standardization_key
from fedsgld.config.checks import MAX_CLIP, MAX_NOISE_MULTIPLIER
from fedsgld.data.standardize import public_scale, sensitivity
from fedsgld.flower import release
from fedsgld.flower.audit import MessageAudit
from fedsgld.flower.handoff import Admitted, handing
from fedsgld.flower.protocol import (
    EVALUATE,
    QUERY,
    STANDARDIZE,
    TRAIN,
    config_from_record,
    decode_evaluate,
    decode_standardize,
    decode_train,
)
from fedsgld.flower.redact import redacted
from fedsgld.flower.site_runtime import site_runtime
from fedsgld.privacy.events import GaussianRelease

Handler = Callable[[Message, Context], Message]
Mod = Callable[[Message, Context, Handler], Message]
Door = Callable[[Message, Context], Admission]  # a message type's admission
LEDGER_STATE = "fedsgld.ledger-{}"  # a site's ledger in context.state (policy without state_dir)


def make_site_guard(doors: Mapping[str, Door]) -> Mod:
    """The guard mod of a ClientApp that answers the message types of ``doors`` (in that
    order in its refusals) and no other."""
    table = dict(doors)

    def site_guard(msg: Message, context: Context, call_next: Handler) -> Message:
        """The ClientApp mod every message passes: validate, charge, draw, compute, release."""
        audit = MessageAudit(msg, context)  # its line is written before the reply leaves
        try:
            return _admit(msg, context, call_next, audit)
        except Exception as err:  # noqa: BLE001 - the reason leaves the site: no path in it
            out = redacted(err, dict(context.node_config))
            audit.refused(str(out))
            if out is err:
                raise
            raise out from None

    def _admit(msg: Message, context: Context, call_next: Handler, audit: MessageAudit) -> Message:
        kind = msg.metadata.message_type
        door = table.get(kind)
        if door is None:
            raise PolicyRefused(
                f"the site refuses message type {kind!r}: its guard answers only {', '.join(table)}"
            )
        try:
            adm = door(msg, context)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise PolicyRefused(f"{kind}: malformed request: {err}") from None
        _logged(audit.admitted, adm)  # no log, no charge: refused here
        try:
            with audit.charging(adm):
                receipt = guard.charge(adm, _ContextLedgers(context))
        except AuditUnwritable as err:  # charged, not logged: nothing is drawn or released
            raise PolicyRefused(f"{err}: the site releases nothing it has not logged") from None
        noise = guard.draw(adm, receipt)
        with handing(msg, Admitted(adm.request, receipt)):
            reply = call_next(msg, context)
        if not reply.has_error():
            if adm.after is not None:
                adm.after()
            reply = adm.release(msg, reply, noise)
        _logged(audit.answered, reply)  # the reply leaves only once its line is written
        return reply

    return site_guard


def _logged(step: Callable[[Any], None], arg: Any) -> None:
    """``step(arg)`` of the message's audit; a log that cannot be written refuses."""
    try:
        step(arg)
    except AuditUnwritable as err:
        raise PolicyRefused(f"{err}: the site releases nothing it has not logged") from None


class _ContextLedgers:
    """A simulated node's ledgers, in its ``context.state`` for the run."""

    def __init__(self, context: Context) -> None:
        self.state = context.state

    def get(self, site_id: int) -> dict[str, Any] | None:
        rec = self.state.get(LEDGER_STATE.format(site_id))
        return json.loads(str(rec["json"])) if isinstance(rec, ConfigRecord) else None

    def put(self, site_id: int, state: dict[str, Any]) -> None:
        self.state[LEDGER_STATE.format(site_id)] = ConfigRecord({"json": json.dumps(state)})


# -- reading a message ------------------------------------------------------------------------


def request_record(msg: Message, name: str, kind: type) -> Any:
    """The record ``name`` of type ``kind`` in ``msg``, else a refusal."""
    rec = msg.content.get(name) if msg.has_content() else None
    if not isinstance(rec, kind):
        raise PolicyRefused(f"request has no {kind.__name__} {name!r}")
    return rec


def checked_array(
    rec: ArrayRecord, key: str, *, dtype: str, shape: tuple[int, ...], name: str
) -> np.ndarray:
    """``rec[key]`` as a finite numpy array of ``dtype`` and ``shape``, else a refusal."""
    arr = rec[key]
    if arr.stype != "numpy.ndarray" or arr.dtype != dtype or tuple(arr.shape) != shape:
        raise PolicyRefused(
            f"{name} is {arr.dtype}{tuple(arr.shape)}, expected {dtype}{shape} (the site's model)"
        )
    return guard.finite(name, arr.numpy())


# -- the admissions of the training protocol, one per message type -----------------------------


def _query(msg: Message, context: Context) -> Admission:
    config = config_from_record(request_record(msg, "run", ConfigRecord))
    runtime = site_runtime(context, config)
    policy = runtime.policy
    hist = policy.share_label_histogram
    return Admission(
        policy,
        release=partial(release.sites_info, label_histogram=hist, policy=policy),
        request=runtime,
    )


def _train(msg: Message, context: Context) -> Admission:
    request_record(msg, "plan", ConfigRecord)
    plan = decode_train(msg.content)  # the one decoding of the message
    runtime = site_runtime(context, plan.config)
    adm = guard.training_admission(runtime.policy, runtime.site(plan.site_id), plan)
    return replace(adm, after=partial(runtime.remember_checks, context))


def evaluation_admission(
    policy: SitePolicy, site_id: int, run_key: str, group: str, *, run_secure: bool
) -> Admission:
    """One released evaluation of the model ``group`` (its release: :func:`release.evaluation`)."""
    return guard.evaluation_admission(
        policy,
        site_id,
        run_key,
        run_secure=run_secure,
        release=partial(release.evaluation, policy=policy, group=group),
    )


def _evaluate(msg: Message, context: Context) -> Admission:
    for name, kind in (("eval", ConfigRecord), ("thetas", ArrayRecord), ("run", ConfigRecord)):
        request_record(msg, name, kind)
    req = decode_evaluate(msg.content)  # the one decoding of the message
    config = req.config
    runtime = site_runtime(context, config)
    policy, site = runtime.policy, runtime.site(req.site_id, required=True)
    run_key = guard.run_key({"run-key": req.run_key})
    thetas, n = req.thetas, len(req.thetas)
    if len(req.groups) != 1:
        raise PolicyRefused("an evaluation message evaluates exactly one model (one group)")
    ((group, idx),) = req.groups.items()
    if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", group):
        raise PolicyRefused(f"group name {group!r} refused: letters, digits and _ only")
    if idx != list(range(n)) or sorted(thetas.keys()) != sorted(str(i) for i in range(n)):
        raise PolicyRefused(f"group {group!r} must average every parameter vector 0..{n - 1}")
    guard.number(
        "parameter vectors", n, lo=1, hi=policy.max_models_per_evaluation,
        limit=f"policy max_models_per_evaluation is {policy.max_models_per_evaluation}",
    )  # fmt: skip
    vectors = [
        checked_array(
            thetas, str(i), dtype="float32", shape=(site.fm.size,), name=f"parameter vector {i}"
        )
        for i in range(n)
    ]
    adm = evaluation_admission(policy, site.site_id, run_key, group, run_secure=config.run.secure)
    return replace(adm, request=Evaluating(site, group, vectors, config))


@dataclass(frozen=True)
class Standardizing:
    """A ``query.standardize`` request as the guard admitted it: the hosted ``site``, what
    it computes (``exact``: its exact sums of x and x^2, a non-private run; else its sum of
    clipped (u, u^2), :func:`fedsgld.data.standardize.moment_sum`, with the run's public
    centre and scale and clip ``clip``)."""

    site: Any
    exact: bool
    centre: Any = None
    scale: Any = None
    clip: float = 0.0


def check_pooled_request(policy: SitePolicy, site: Any, config: Any) -> None:
    """The checks of every request for the pooled standardisation's release, whichever
    message carries it (``query.standardize``, or a standardisation round of
    ``train.secagg`` at the ``secure`` placement): pooled, no statistics released yet,
    tabular records, a published count, no seeded noise without the policy's leave."""
    p = config.privacy
    if p.standardize != "pooled" or p.standardize_stats:
        raise PolicyRefused(
            "a pooled standardisation request needs standardize = 'pooled' and no released "
            "statistics yet (standardize_stats empty)"
        )
    if site.x_train.ndim != 2:
        raise PolicyRefused("standardize = 'pooled' needs tabular records; this site's are not")
    guard.public_records(policy, site)  # the server divides by the published counts
    guard.check_seeded(policy, config.run.randomness == "seeded")


def private_standardizing(
    policy: SitePolicy, site: Any, config: Any
) -> tuple[Standardizing, float]:
    """What a private release computes (the clipped moment sums) and its noise multiplier,
    ``standardize_noise_multiplier`` and ``standardize_clip`` checked against the policy."""
    p = config.privacy
    sigma = guard.number(
        "standardize_noise_multiplier", p.standardize_noise_multiplier,
        lo=policy.min_noise_multiplier, hi=MAX_NOISE_MULTIPLIER, lo_open=True,
        limit=f"must be in [policy min_noise_multiplier {policy.min_noise_multiplier:g}, "
        f"{MAX_NOISE_MULTIPLIER:g}] and > 0",
    )  # fmt: skip
    clip = guard.number("standardize_clip", p.standardize_clip, lo=0.0, hi=MAX_CLIP,
                        lo_open=True, limit=f"must be in (0, {MAX_CLIP:g}]")  # fmt: skip
    centre, scale = public_scale(config.run.dataset, int(site.x_train.shape[1]))
    return Standardizing(site, False, centre, scale, clip), sigma


def _standardize(msg: Message, context: Context) -> Admission:
    """The pooled standardisation's one release of a site (:mod:`fedsgld.flower.standardize`):
    a Gaussian mechanism on the site's clipped moment sums, noise multiplier
    ``standardize_noise_multiplier`` at sensitivity sqrt(2 d), charged to the site's ledger
    as one release of a run key and epoch (a second is a replay), noised here at the
    ``sites`` placement; a non-private run's exact sums only where the policy allows them.
    (At the ``secure`` placement the release is a secure round instead:
    :mod:`fedsgld.flower.secure_door`.)"""
    req = decode_standardize(msg.content)  # the one decoding of the message
    config = req.config
    runtime = site_runtime(context, config)
    policy, site = runtime.policy, runtime.site(req.site_id, required=True)
    key = guard.run_key({"run-key": req.run_key})
    epoch = guard.whole_number({"epoch": req.epoch}, "epoch")
    check_pooled_request(policy, site, config)
    round_of = (standardization_key(key), epoch, 0)
    if config.privacy.private:
        return _private_release(policy, site, config, round_of)
    if not policy.allow_non_private:
        raise PolicyRefused(
            "the site refuses a non-private request (exact sums of its records for the "
            "pooled standardisation); its policy would need allow_non_private = true"
        )
    return Admission(policy, site.site_id, round_of=round_of, request=Standardizing(site, True))


def _private_release(
    policy: SitePolicy, site: Any, config: Any, round_of: tuple[str, int, int]
) -> Admission:
    """The checked, charged and (at ``sites``) noised release of a private run."""
    p = config.privacy
    if p.placement == "secure":
        raise PolicyRefused(
            "standardize = 'pooled' at the secure placement releases through a secure "
            "round (train.secagg), never as a query.standardize answer"
        )
    guard.check_placement(policy, site.site_id, p.placement)
    request, sigma = private_standardizing(policy, site, config)
    d = int(site.x_train.shape[1])
    delta = sensitivity(d)
    at_site = p.placement == "sites"
    return Admission(
        policy,
        site.site_id,
        # the noise the site adds, or (server placement, deployed) the noise it is promised
        event=GaussianRelease(sigma, delta) if at_site or not policy.simulated else None,
        round_of=round_of,
        noise_shape=(2 * d,) if at_site else None,
        noise_std=sigma * delta,
        run_secure=config.run.secure,
        release=release.moments,
        request=request,
    )


DOORS: dict[str, Door] = {
    QUERY: _query,
    TRAIN: _train,
    EVALUATE: _evaluate,
    STANDARDIZE: _standardize,
}

__all__ = [
    "DOORS",
    "Door",
    "LEDGER_STATE",
    "Standardizing",
    "check_pooled_request",
    "checked_array",
    "evaluation_admission",
    "make_site_guard",
    "private_standardizing",
    "request_record",
]
