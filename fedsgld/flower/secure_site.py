"""A site's part in a secure-aggregation round over Flower: its door and its handler.

``train.secagg`` messages (:mod:`fedsgld.flower.protocol`) carry the five steps of a round
(:mod:`fedsgld.secagg.protocol`: ``advertise_keys``, ``share_keys``, ``masked_input``,
``consistency``, ``unmask``). Every one passes the site's guard like any other message;
its admission (:func:`secagg_door`) checks, in order:

1. the request: the run asks for secure aggregation, the site is hosted here and is one of
   the round's sites, the plan is for the run's number of sites and this model's
   (padded) dimension, and it plans for at least the dropouts and colluders the site's
   POLICY assumes (``max_dropouts``, ``max_colluders``: never the run's values); the
   site's credentials (:func:`site_credentials`: its policy's ``signing_key``, ``peers``
   and ``min_peers``) exist, and the round names only sites of its key list, at least
   ``min_peers`` of them; the step's protocol message has the step's shape
   (:func:`step_message`);
2. at ``masked_input``, where the site's noise share is drawn, the training request as
   everywhere (:func:`fedsgld.clients.guard.check_training`: sample rate, noise
   multiplier, clip against the policy), then the mechanism: the site builds the round's
   distributed discrete Gaussian ITSELF from the public numbers
   (:func:`fedsgld.privacy.distributed.choose_ddg`) and checks that the plan matches it
   (:func:`fedsgld.secagg.check_site_plan`), and the admission carries the round's
   :class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep`, which the guard
   charges to the site's ledger before the handler runs.

The handler (:func:`handle_secagg`) computes from what the guard admitted (the decoded
:class:`~fedsgld.flower.secure_protocol.SecureStep`, the site, and at ``masked_input`` the checked
training request and the charge's receipt: :mod:`fedsgld.flower.handoff`). It plays the
site's :class:`~fedsgld.secagg.SiteParty`, which signs its round keys and the survivor set
it is shown with the site's long-term key, refuses a roster with an unauthenticated entry
at ``share_keys`` (before any share leaves), and unmasks only a survivor set that t
survivors signed. At ``masked_input`` it computes the site's clipped, pre-noised sum on
theta_t (Poisson sample and pre-noise from the policy's sampler), norm-clipped to C times
the count the site publishes (so the sum stays within the signal norm the bits are chosen
for, whatever its true count: :func:`fedsgld.core.finite.clip_to_norm`), and encodes it with its
share, drawn from the operating system through the receipt of that charge, then masks it. Between the steps of a round the site's
:class:`~fedsgld.secagg.SiteParty` (its secrets included) is kept in the node's
``context.state``, on the site's machine; it is deleted after ``unmask``, and a new
``advertise_keys`` replaces it. In pipelined rounds the party of round t + 1 is made at
round t's ``consistency`` (its keys advertised) and kept beside round t's; at round t's
``unmask`` it becomes the site's round in progress, after playing round t + 1's
``share_keys`` on the roster the request carries. The ledger refuses a second
``masked_input`` for a round (replay numbering), so no round draws two shares.

A round of kind ``standardize`` (:attr:`fedsgld.flower.secure_protocol.SecureStep.kind`: the
pooled standardisation's one release at the ``secure`` placement, before round 1) passes
the same door, with the request checked at EVERY step (the site signs keys for no other
release): no next round, the checks of every pooled request
(:func:`fedsgld.flower.guard.check_pooled_request`), ``standardize_noise_multiplier`` and
``standardize_clip`` against the policy, and sigma, clip, q and pre-noise exactly the run
config's (sigma, sqrt(2 d), 1, 0), the length the padded 2 d. At ``masked_input`` the
site builds the mechanism for its 2 d sums, the guard charges it (numbered by the run's
standardisation key and epoch: no replay), and the handler encodes the site's clipped
moment sums (:func:`fedsgld.data.standardize.moment_sum`, clipped to sqrt(2 d) times its
published count) with its share.

In a one-shot round (:attr:`fedsgld.secagg.SecAggPlan.one_shot`: no dropouts planned) the
``masked_input`` request carries the roster: the door checks every entry against the key
list and that it holds every site of the round BEFORE the charge, the party checks its
own keys in it before the clipped sum is computed or the share drawn, and the party is
deleted with the reply. A ``next_round`` in that request makes the site's party for
round t + 1 (its keys in the reply: ``next``), kept as the site's round in progress.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsgld.clients import guard
from fedsgld.clients.guard import Admission, Training
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site import Site
from fedsgld.config import Config
from fedsgld.core.finite import clip_to_norm
from fedsgld.core.release import Charged
from fedsgld.data.standardize import moment_sum, sensitivity
from fedsgld.flower.guard import (
    Standardizing,
    check_pooled_request,
    private_standardizing,
    request_record,
)
from fedsgld.flower.handoff import admitted
from fedsgld.flower.secure_protocol import SecureStep, decode_secure, secagg_label
from fedsgld.flower.secure_requests import next_plan, step_message
from fedsgld.flower.site_runtime import SiteRuntime, site_runtime
from fedsgld.privacy.distributed import DDGParameters, choose_ddg, padded_dimension
from fedsgld.privacy.events import DistributedDiscreteGaussianStep
from fedsgld.secagg import (
    RoundAborted,
    SecAggPlan,
    SiteParty,
    check_site_plan,
    encode,
    identity,
    roster,
)
from fedsgld.secagg.identity import Credentials
from fedsgld.secagg.wire import flatten, unflatten

STATE = "fedsgld.secagg-{}"  # a site's SiteParty between the steps of a round
STATE_NEXT = "fedsgld.secagg-next-{}"  # its party for the next round, from consistency to unmask


@dataclass(frozen=True)
class _Request:
    """One step's request as the site's admission decoded and checked it (handed to the
    handler by the guard: :mod:`fedsgld.flower.handoff`)."""

    secure: SecureStep
    policy: SitePolicy
    site: Site
    training: Training | None = None  # masked_input: the training request, as admitted
    runtime: SiteRuntime | None = None  # the node's sites (those of its layer path check)
    # masked_input of a standardisation round: what the site sums, as admitted
    standardizing: Standardizing | None = None

    @property
    def config(self) -> Config:
        return self.secure.plan.config

    @property
    def round_of(self) -> tuple[str, int, int]:
        return self.secure.round_of

    @property
    def standardize(self) -> bool:
        """A round of the pooled standardisation (its moment sums), not a training round."""
        return self.secure.kind == "standardize"

    def dimension(self) -> int:
        """The length of what the site sums: its model's parameters, or 2 d moment sums of
        its d features (a refusal where its records are not tabular)."""
        if not self.standardize:
            return self.site.fm.size
        if self.site.x_train.ndim != 2:
            raise PolicyRefused("standardize = 'pooled' needs tabular records; this site's are not")
        return 2 * int(self.site.x_train.shape[1])

    @property
    def step(self) -> str:
        return self.secure.step

    @property
    def secagg(self) -> SecAggPlan:
        return self.secure.secagg


def _request(msg: Message, context: Context) -> _Request:
    request_record(msg, "plan", ConfigRecord)
    secure = decode_secure(msg.content)  # the one decoding of the message
    config = secure.plan.config
    if not config.privacy.secure_aggregation:
        raise PolicyRefused("train.secagg refused: the run config has secure_aggregation = false")
    runtime = site_runtime(context, config)
    site = runtime.site(secure.plan.site_id, required=True)
    return _Request(secure, runtime.policy, site, runtime=runtime)


def site_credentials(r: _Request) -> Credentials:
    """The site's long-term key and key list, from its policy (:class:`PolicyRefused`
    without them). A simulation node's policy has no list: its keys are derived from the
    run key (:func:`fedsgld.secagg.identity.simulated_credentials`, public: a simulation is
    one party and authenticates nobody)."""
    pol, site = r.policy, r.site.site_id
    if pol.peers is not None and pol.peers.simulated:
        if site not in r.secagg.sites:
            raise PolicyRefused(f"secure aggregation plan refused: site {site} is not one of "
                                "the round's sites")  # fmt: skip
        return identity.simulated_credentials(r.round_of[0], r.secagg.sites, site,
                                              min_peers=pol.min_peers)  # fmt: skip
    if pol.peers is None or pol.signing_key is None:
        raise PolicyRefused(
            f"site {site} takes part in secure aggregation only with a long-term key and the "
            "consortium's key list: its privacy policy needs signing_key and peers"
        )
    try:
        creds = Credentials(identity.load(pol.signing_key), pol.peers, pol.min_peers)
        creds.check_site(site)
    except ValueError as err:
        raise PolicyRefused(f"policy signing_key / peers: {err}") from None
    return creds


def _next_plan(r: _Request) -> SecAggPlan:
    """Round t + 1's plan as a pipelined request of round t implies it: round t's, with
    round t + 1's label and sigma (:func:`~fedsgld.flower.secure_requests.next_plan`;
    keys signed for it are refused by any other plan)."""
    run_key, epoch, rnd = r.round_of
    return next_plan(
        r.secagg, secagg_label(run_key, epoch, rnd + 1), r.config.privacy.sigma(rnd + 1)
    )


def _ahead(
    r: _Request, creds: Credentials, context: Context, out: dict[str, Any], next_keys: Any
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


def site_mechanism(
    r: _Request, creds: Credentials, *, clip: float, sigma: float, sample_rate: float
) -> DDGParameters:
    """The round's distributed discrete Gaussian as this site builds it from the public
    numbers, checked against the plan (the mechanism its signed keys bind: sigma, clip,
    q, pre-noise, grid, share variance, bits) and the site's policy (a refusal
    otherwise). Its K counts the round's sites that the site's key list authenticates."""
    try:
        params = choose_ddg(
            noise_multiplier=sigma,
            clip=clip,
            dim=r.dimension(),
            sites=sum(v in creds.peers for v in r.secagg.sites),
            max_dropouts=r.secagg.max_dropouts,
            max_colluders=r.secagg.max_colluders,
            signal_norm=guard.number(
                "signal-norm", r.secure.signal_norm, lo=0.0, hi=float("inf"),
                limit="must be a finite number >= 0",
            ),
        )  # fmt: skip
        check_site_plan(
            r.secagg,
            params,
            clip=clip,
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            prenoise=r.secure.plan.prenoise,
            max_dropouts=r.policy.max_dropouts,
            max_colluders=r.policy.max_colluders,
            peers=creds.peers,
        )
    except ValueError as err:
        raise PolicyRefused(str(err)) from None
    return params


def _check_plan(r: _Request, creds: Credentials) -> None:
    sp, pol, site = r.secagg, r.policy, r.site
    unknown = [v for v in sp.sites if v not in creds.peers]
    checks = [
        (not unknown, f"the round names site(s) {unknown} outside the site's key list"),
        (len(sp.sites) >= creds.min_peers,
         f"the round has {len(sp.sites)} sites; policy min_peers is {creds.min_peers}"),
        (site.site_id in sp.sites, f"site {site.site_id} is not one of the round's sites"),
        (len(sp.sites) == r.config.run.sites,
         f"the round has {len(sp.sites)} sites, the run config {r.config.run.sites}"),
        (sp.length == padded_dimension(r.dimension()),
         f"secagg-length {sp.length} is not the padded dimension {padded_dimension(r.dimension())} "
         f"of {'the moment sums' if r.standardize else 'this model'}"),
        (sp.max_dropouts >= pol.max_dropouts,
         f"the round plans for {sp.max_dropouts} dropouts; policy max_dropouts is {pol.max_dropouts}"),
        (sp.max_colluders >= pol.max_colluders,
         f"the round plans for {sp.max_colluders} colluders; policy max_colluders is "
         f"{pol.max_colluders}"),
    ]  # fmt: skip
    for ok, why in checks:
        if not ok:
            raise PolicyRefused(f"secure aggregation plan refused: {why}")


def secagg_door(msg: Message, context: Context) -> Admission:
    """The admission of one step of a secure-aggregation round (module docstring); after
    its reply, the node keeps its sites' layer path check for the run."""
    r = _request(msg, context)
    return replace(_admission(r, context), after=partial(r.runtime.remember_checks, context))


def _admission(r: _Request, context: Context) -> Admission:
    guard.check_placement(r.policy, r.site.site_id, "secure")
    creds = site_credentials(r)
    _check_plan(r, creds)
    step_message(r.step, r.secure.message, one_shot=r.secagg.one_shot)
    nxt = r.secure.message.get("next_round", r.round_of[2] + 1)
    if isinstance(nxt, bool) or nxt != r.round_of[2] + 1:
        raise PolicyRefused(f"secure aggregation: the {r.step} step of round {r.round_of[2]} "
                            f"may ask for the keys of round {r.round_of[2] + 1} only, not {nxt!r}")  # fmt: skip
    if r.standardize:  # at every step: the site signs keys only for the config's release
        r = replace(r, standardizing=_standardize_request(r))
    if r.step != "masked_input":
        return Admission(r.policy, request=r)  # public keys, ciphertexts, shares: no charge
    if r.secagg.one_shot:  # the roster comes with it: authenticated and complete before
        try:  # the charge (the party checks it again, with its own keys)
            keys = roster.check_roster(r.secagg, r.site.site_id, r.secure.message["keys"], creds)
        except roster.RosterRefused as err:
            raise PolicyRefused(str(err)) from None
        if sorted(keys) != list(r.secagg.sites):
            raise PolicyRefused(f"secure aggregation: a one-shot round's roster must hold every "
                                f"site of the round, got {sorted(keys)}")  # fmt: skip
    if r.policy.epsilon is None:
        raise PolicyRefused(
            f"site {r.site.site_id} adds its noise share (secure aggregation) but has no budget "
            "of its own: give it a privacy-policy file with epsilon"
        )
    sums = _standardizing if r.standardize else _training
    params, q, request = sums(r, creds)
    kept = context.state.get(STATE.format(r.site.site_id))  # its party: the keys it signed
    if isinstance(kept, ConfigRecord) and kept.get("context") != r.secagg.context:
        raise PolicyRefused(f"secure aggregation: site {r.site.site_id} signed its keys of round "
                            f"{r.round_of[2]} for another plan (sites, kind, sigma, clip, q, "
                            "pre-noise, bits, dimension or share variance); refused before "
                            "any charge")  # fmt: skip
    return Admission(
        r.policy,
        r.site.site_id,
        event=DistributedDiscreteGaussianStep(params, q),
        round_of=r.round_of,
        request=request,
    )


def _training(r: _Request, creds: Credentials) -> tuple[DDGParameters, float, _Request]:
    """A training round's masked_input: the training request checked as everywhere, the
    round's mechanism as the site builds it."""
    plan, pol, run = r.secure.plan, r.policy, r.config.run
    (steps, clip) = guard.check_training(
        pol,
        steps=[(plan.sample_rate, plan.sigma)],
        clip=plan.clip,
        prenoise=plan.prenoise,
        seeded=run.randomness == "seeded",
        records=guard.public_records(pol, r.site),
    )
    ((q, sigma),) = steps
    if clip is None or sigma <= 0.0:
        raise PolicyRefused("secure aggregation releases private sums only: clip and sigma > 0")
    theta = guard.finite("theta", plan.theta_vector(r.site.fm.size))
    params = site_mechanism(r, creds, clip=clip, sigma=sigma, sample_rate=q)
    sampler = pol.randomness(
        seeded=run.randomness == "seeded", seed=run.seed, epoch=plan.epoch, run_secure=run.secure
    )
    training = Training(plan, r.site, theta, q, clip, plan.prenoise, sampler)
    return params, q, replace(r, training=training)


def _standardize_request(r: _Request) -> Standardizing:
    """A step of the pooled standardisation's round, checked at every step (the site signs
    keys for no other release): no next round, the checks of every pooled request
    (:func:`fedsgld.flower.guard.check_pooled_request`), sigma and clip against the policy,
    and the request's numbers exactly the run config's: sigma
    ``standardize_noise_multiplier``, clip sqrt(2 d) (one record's (u, u^2) bound), q = 1,
    no pre-noise. What the site will sum."""
    plan, pol, config = r.secure.plan, r.policy, r.config
    if {"next_round", "next_keys"} & set(r.secure.message):
        raise PolicyRefused("secure aggregation: the standardisation round has no next round")
    if not config.privacy.private:
        raise PolicyRefused("secure aggregation releases private sums only")
    check_pooled_request(pol, r.site, config)
    request, sigma = private_standardizing(pol, r.site, config)
    numbers = {"sigma": (plan.sigma, sigma), "clip": (plan.clip, sensitivity(r.dimension() // 2)),
               "sample-rate": (plan.sample_rate, 1.0), "prenoise": (plan.prenoise, 0.0)}  # fmt: skip
    for name, (got, want) in numbers.items():
        if got != want:
            raise PolicyRefused(f"the standardisation round's {name} is {got!r}; the run config "
                                f"makes it {want!r}")  # fmt: skip
    return request


def _standardizing(r: _Request, creds: Credentials) -> tuple[DDGParameters, float, _Request]:
    """The standardisation round's masked_input (its request checked at every step): the
    mechanism as the site builds it for its 2 d moment sums."""
    params = site_mechanism(
        r, creds, clip=sensitivity(r.dimension() // 2), sigma=r.secure.plan.sigma, sample_rate=1.0
    )
    return params, 1.0, r


def _masked_input(
    r: _Request, receipt: Charged | None, party: SiteParty, inbox: dict[str, Any]
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


def _site_sum(r: _Request, event: DistributedDiscreteGaussianStep) -> torch.Tensor:
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
    r: _Request, receipt: Charged | None, party: SiteParty, m: dict[str, Any]
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
    r: _Request = got.request
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
