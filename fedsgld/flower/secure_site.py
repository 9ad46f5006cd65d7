"""A site's part in a secure-aggregation round over Flower: its handler (its door, which
every step passes first: :mod:`fedsgld.flower.secure_door`).

The handler (:func:`handle_secagg`) computes from what the guard admitted (the decoded
:class:`~fedsgld.flower.secure_protocol.SecureStep`, the site, and at ``masked_input`` the
checked request and the charge's receipt: :mod:`fedsgld.flower.handoff`). It plays the
site's :class:`~fedsgld.secagg.SiteParty`, which signs its round keys and the survivor set
it is shown with the site's long-term key, refuses a roster with an unauthenticated entry
at ``share_keys`` (before any share leaves), and unmasks only a survivor set that t
survivors signed. At ``masked_input`` it computes the site's clipped, pre-noised sum on
theta_t (Poisson sample and pre-noise from the policy's sampler), or in a round of kind
``standardize`` its clipped moment sums (:func:`fedsgld.data.standardize.moment_sum`),
norm-clipped to C times the count the site publishes (so the sum stays within the signal
norm the bits are chosen for, whatever its true count:
:func:`fedsgld.core.finite.clip_to_norm`), and encodes it with its share, drawn from the
operating system through the receipt of that charge, then masks it. Between the steps of
a round the site's :class:`~fedsgld.secagg.SiteParty` (its secrets included) is kept in
the node's ``context.state``, on the site's machine; it is deleted after ``unmask``, and a
new ``advertise_keys`` replaces it. In pipelined rounds the party of round t + 1 is made
at round t's ``consistency`` (its keys advertised) and kept beside round t's; at round
t's ``unmask`` it becomes the site's round in progress, after playing round t + 1's
``share_keys`` on the roster the request carries. The ledger refuses a second
``masked_input`` for a round (replay numbering), so no round draws two shares.

In a one-shot round (:attr:`fedsgld.secagg.SecAggPlan.one_shot`: no dropouts planned) the
``masked_input`` request carries the roster (checked by the door before the charge); the
party checks its own keys in it before the clipped sum is computed or the share drawn,
and the party is deleted with the reply. A ``next_round`` in that request makes the site's
party for round t + 1 (its keys in the reply: ``next``), kept as the site's round in
progress."""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsgld.clients import guard
from fedsgld.core.finite import clip_to_norm
from fedsgld.core.release import Charged
from fedsgld.data.standardize import moment_sum
from fedsgld.flower.handoff import admitted
from fedsgld.flower.secure_door import (  # noqa: F401 - secagg_door, site_mechanism: re-exported
    STATE,
    SecureRequest,
    secagg_door,
    site_credentials,
    site_mechanism,
)
from fedsgld.flower.secure_protocol import secagg_label
from fedsgld.flower.secure_requests import next_plan, step_message  # noqa: F401 - re-exported
from fedsgld.privacy.events import DistributedDiscreteGaussianStep
from fedsgld.secagg import RoundAborted, SecAggPlan, SiteParty, encode
from fedsgld.secagg.identity import Credentials
from fedsgld.secagg.wire import flatten, unflatten

STATE_NEXT = "fedsgld.secagg-next-{}"  # its party for the next round, from consistency to unmask


def _next_plan(r: SecureRequest) -> SecAggPlan:
    """Round t + 1's plan as a pipelined request of round t implies it: round t's, with
    round t + 1's label and sigma (:func:`~fedsgld.flower.secure_requests.next_plan`;
    keys signed for it are refused by any other plan)."""
    run_key, epoch, rnd = r.round_of
    return next_plan(
        r.secagg, secagg_label(run_key, epoch, rnd + 1), r.config.privacy.sigma(rnd + 1)
    )


def _ahead(
    r: SecureRequest, creds: Credentials, context: Context, out: dict[str, Any], next_keys: Any
) -> dict[str, Any]:
    """The next round's part of a pipelined request, after this round's step answered
    ``out``. At ``consistency`` with ``next_round``: the site's party for round t + 1,
    its fresh keys signed for round t + 1's plan, kept beside this round's party
    (``next``). At ``unmask``: that party becomes the site's round in progress, and with
    ``next_keys`` it plays round t + 1's ``share_keys`` on that roster first (every entry
    checked against the site's key list before any share leaves: ``next_shares``)."""
    site = r.site.site_id
    later = STATE_NEXT.format(site)
    if r.standardize:  # one round: nothing of a next one is made or kept
        return out
    if r.step == ("masked_input" if r.secagg.one_shot else "consistency"):
        if "next_round" in r.secure.message:  # the next round's party, its keys advertised
            party = SiteParty(site, _next_plan(r), creds)
            out = {**out, "next": party.advertise_keys()}
            # a one-shot round is over: the next one becomes the round in progress
            _keep(context, (STATE if r.secagg.one_shot else STATE_NEXT).format(site), party)
        return out
    if r.step != "unmask":
        return out
    kept = context.state.get(later)
    if kept is None:
        if next_keys is not None:
            raise RoundAborted(f"site {site}: a roster for round {r.round_of[2] + 1} without "
                               "its keys advertised")  # fmt: skip
        return out
    del context.state[later]
    party = SiteParty.restore(_next_plan(r), unflatten(kept, ""), creds)
    if next_keys is not None:
        out = {**out, "next_shares": party.share_keys({"keys": next_keys})}
    _keep(context, STATE.format(site), party)
    return out


def _keep(context: Context, slot: str, party: SiteParty) -> None:
    """``party`` (its round secrets included) in the node's ``context.state``, on the site's
    machine: never sent."""
    context.state[slot] = ConfigRecord(flatten(party.state(), ""))


def _masked_input(
    r: SecureRequest, receipt: Charged | None, party: SiteParty, inbox: dict[str, Any]
) -> dict[str, Any]:
    """The site's clipped sum of the round, encoded with its share drawn through the
    receipt of its guard's charge, then masked."""
    if receipt is None or (r.training is None and r.standardizing is None):
        raise RuntimeError("masked_input without the guard's charge: no share is drawn")
    params = receipt.event.params  # the mechanism the guard built, checked and charged

    def encoded():
        # within C x the count the site publishes, which the plan's signal norm sums
        total = clip_to_norm(
            _site_sum(r, receipt.event), params.clip * guard.public_records(r.policy, r.site)
        )
        return receipt.draw(encode, total.double().numpy(), params, r.secagg.round_label)

    if r.secagg.one_shot:  # ``inbox`` is the roster: checked before anything is drawn
        return party.one_shot_input(inbox, encoded)
    return party.masked_input(inbox, encoded())


def _site_sum(r: SecureRequest, event: DistributedDiscreteGaussianStep) -> torch.Tensor:
    """What the site sums: its clipped moment sums (a standardisation round), or its
    clipped, pre-noised gradient sum on theta_t."""
    s, t = r.standardizing, r.training
    if s is not None:
        return moment_sum(s.site.x_train, s.centre, s.scale, s.clip)
    return t.site.clipped_sum(
        torch.from_numpy(t.theta),
        round=t.plan.round,
        sample_rate=event.sample_rate,
        clip=event.params.clip,
        prenoise=t.prenoise,
        randomness=t.randomness,
    )


def _play(
    r: SecureRequest, receipt: Charged | None, party: SiteParty, m: dict[str, Any]
) -> dict[str, Any]:
    """The party's answer to step ``r.step`` (after ``advertise_keys``)."""
    if r.step == "share_keys":
        return party.share_keys(m)
    if r.step == "masked_input":
        return _masked_input(r, receipt, party, m)
    if r.step == "consistency":
        return party.consistency(m)
    return party.unmask(m)


def handle_secagg(msg: Message, context: Context) -> Message:
    """One step of the site's side of the round (behind its guard, from what it admitted)."""
    got = admitted(msg)
    r: SecureRequest = got.request
    slot, later = STATE.format(r.site.site_id), STATE_NEXT.format(r.site.site_id)
    creds = site_credentials(r)
    m = dict(r.secure.message)
    m.pop("next_round", None)
    next_keys = m.pop("next_keys", None)
    if r.step == "advertise_keys":  # a fresh round: any party kept for it is replaced
        context.state.pop(later, None)
        party = SiteParty(r.site.site_id, r.secagg, creds)
        out = party.advertise_keys()
    else:
        kept = context.state.get(slot)
        if not isinstance(kept, ConfigRecord):
            raise RoundAborted(f"site {r.site.site_id}: no secure-aggregation round in progress")
        party = SiteParty.restore(r.secagg, unflatten(kept, ""), creds)
        try:
            out = _play(r, got.receipt, party, m)
        except RoundAborted:  # a refused roster or survivor set ends the site's round
            del context.state[slot]
            context.state.pop(later, None)
            raise
    if r.step == "unmask" or (r.secagg.one_shot and r.step == "masked_input"):
        del context.state[slot]  # the round's last step: no secret of it is kept
    else:
        _keep(context, slot, party)
    try:
        out = _ahead(r, creds, context, out, next_keys)
    except RoundAborted:  # a refused next roster: the site answers neither round
        context.state.pop(slot, None)
        raise
    return Message(RecordDict({"secagg": ConfigRecord(flatten(out, ""))}), reply_to=msg)


__all__ = [
    "STATE",
    "STATE_NEXT",
    "handle_secagg",
    "secagg_door",
    "site_credentials",
    "site_mechanism",
    "step_message",
]
