"""A site's door for a secure-aggregation round over Flower (``train.secagg``).

``train.secagg`` messages (:mod:`fedsgld.flower.secure_protocol`) carry the five steps of a
round (:mod:`fedsgld.secagg.protocol`: ``advertise_keys``, ``share_keys``,
``masked_input``, ``consistency``, ``unmask``). Every one passes the site's guard like any
other message; its admission (:func:`secagg_door`) checks, in order:

1. the request: the run asks for secure aggregation, the site is hosted here and is one of
   the round's sites, the plan is for the run's number of sites and this model's
   (padded) dimension, and it plans for at least the dropouts and colluders the site's
   POLICY assumes (``max_dropouts``, ``max_colluders``: never the run's values); the
   site's credentials (:func:`site_credentials`: its policy's ``signing_key``, ``peers``
   and ``min_peers``) exist, and the round names only sites of its key list, at least
   ``min_peers`` of them; the step's protocol message has the step's shape
   (:func:`~fedsgld.flower.secure_requests.step_message`);
2. at ``masked_input``, where the site's noise share is drawn, the training request as
   everywhere (:func:`fedsgld.clients.guard.check_training`: sample rate, noise
   multiplier, clip against the policy), then the mechanism: the site builds the round's
   distributed discrete Gaussian ITSELF from the public numbers
   (:func:`fedsgld.privacy.distributed.choose_ddg`) and checks that the plan matches it
   (:func:`fedsgld.secagg.check_site_plan`), and the admission carries the round's
   :class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep`, which the guard
   charges to the site's ledger before the handler runs
   (:func:`fedsgld.flower.secure_site.handle_secagg`).

A round of kind ``standardize`` (:attr:`fedsgld.flower.secure_protocol.SecureStep.kind`: the
pooled standardisation's one release at the ``secure`` placement, before round 1) passes
the same door, with the request checked at EVERY step (the site signs keys for no other
release): no next round, the checks of every pooled request
(:func:`fedsgld.flower.guard.check_pooled_request`), ``standardize_noise_multiplier`` and
``standardize_clip`` against the policy, and sigma, clip, q and pre-noise exactly the run
config's (sigma, sqrt(2 d), 1, 0), the length the padded 2 d. At ``masked_input`` the
site builds the mechanism for its 2 d sums and the guard charges it (numbered by the run's
standardisation key and epoch: no replay).

In a one-shot round (:attr:`fedsgld.secagg.SecAggPlan.one_shot`: no dropouts planned) the
``masked_input`` request carries the roster: the door checks every entry against the key
list and that it holds every site of the round BEFORE the charge.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from flwr.app import ConfigRecord, Context, Message

from fedsgld.clients import guard
from fedsgld.clients.guard import Admission, Training
from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site import Site
from fedsgld.config import Config
from fedsgld.data.standardize import sensitivity
from fedsgld.flower.guard import (
    Standardizing,
    check_pooled_request,
    private_standardizing,
    request_record,
)
from fedsgld.flower.secure_protocol import SecureStep, decode_secure
from fedsgld.flower.secure_requests import step_message
from fedsgld.flower.site_runtime import SiteRuntime, site_runtime
from fedsgld.privacy.distributed import DDGParameters, choose_ddg, padded_dimension
from fedsgld.privacy.events import DistributedDiscreteGaussianStep
from fedsgld.secagg import SecAggPlan, check_site_plan, identity, roster
from fedsgld.secagg.identity import Credentials

STATE = "fedsgld.secagg-{}"  # a site's SiteParty between the steps of a round


@dataclass(frozen=True)
class SecureRequest:
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


def _request(msg: Message, context: Context) -> SecureRequest:
    request_record(msg, "plan", ConfigRecord)
    secure = decode_secure(msg.content)  # the one decoding of the message
    config = secure.plan.config
    if not config.privacy.secure_aggregation:
        raise PolicyRefused("train.secagg refused: the run config has secure_aggregation = false")
    runtime = site_runtime(context, config)
    site = runtime.site(secure.plan.site_id, required=True)
    return SecureRequest(secure, runtime.policy, site, runtime=runtime)


def site_credentials(r: SecureRequest) -> Credentials:
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


def site_mechanism(
    r: SecureRequest, creds: Credentials, *, clip: float, sigma: float, sample_rate: float
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


def _check_plan(r: SecureRequest, creds: Credentials) -> None:
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


def _admission(r: SecureRequest, context: Context) -> Admission:
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


def _training(r: SecureRequest, creds: Credentials) -> tuple[DDGParameters, float, SecureRequest]:
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


def _standardize_request(r: SecureRequest) -> Standardizing:
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


def _standardizing(
    r: SecureRequest, creds: Credentials
) -> tuple[DDGParameters, float, SecureRequest]:
    """The standardisation round's masked_input (its request checked at every step): the
    mechanism as the site builds it for its 2 d moment sums."""
    params = site_mechanism(
        r, creds, clip=sensitivity(r.dimension() // 2), sigma=r.secure.plan.sigma, sample_rate=1.0
    )
    return params, 1.0, r


__all__ = ["STATE", "SecureRequest", "secagg_door", "site_credentials", "site_mechanism"]
