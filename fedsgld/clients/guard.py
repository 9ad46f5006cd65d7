"""What a site admits: a request's numbers checked against the site's policy, then charged.

Every message a site answers passes its guard first; the guard's Flower mod
(:func:`fedsgld.flower.guard.site_guard`) decodes the message and finds the hosted site,
and this module decides, with no transport in sight. For each request it goes, in order:

1. **validate**: every setting the handler will read is checked (a finite number inside
   the policy's range; :func:`number`, :func:`check_training`). A request that fails
   raises :class:`~fedsgld.clients.policy.PolicyRefused` naming the setting and the limit.
   What passes becomes an :class:`Admission`: who pays, what, and what may leave.
2. **charge**: the site's :class:`~fedsgld.clients.site_ledger.SiteLedger` admits the request
   (replay numbering, evaluations per run key, the privacy cost of what the site will
   noise, within its budget) and persists it atomically (temporary file, fsync, rename),
   or in the node's own memory (:class:`LedgerMemory`) for a simulated node (:func:`charge`).
3. **draw**: the noise of the release (evaluation statistics, vote counts), through the
   charge's receipt, from the sampler the site's policy chooses
   (:meth:`SitePolicy.randomness`, hardened by default; :func:`draw`).
4. **compute**: the handler runs on what was admitted (a training request: the
   :class:`Training`, whose sampler is the policy's, and the charge's receipt, through
   which a site that adds its own noise draws it); it has no policy checks of its own.
5. **release**: only what the policy lets out leaves (``Admission.release``).

A refusal (1 or 2) records nothing, so it costs nothing. Every check that can fail runs
before the charge; what can still fail after it (the machine runs out of memory in step 4)
leaves the charge in the ledger: conservative, as nothing left the site. What each message
may ask, what is checked, what leaves and what it costs: docs/privacy.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.release import STATS_SENSITIVITY, STATS_SIZE
from fedsgld.clients.site import Site
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.config.checks import (
    MAX_CLIP,
    MAX_NOISE_MULTIPLIER,
    MAX_PRENOISE,
    MAX_STEP_SIZE,
    MIN_SAMPLE_RATE,
)
from fedsgld.core import streams
from fedsgld.core.noise import Randomness
from fedsgld.core.plan import TrainPlan
from fedsgld.core.release import Charged
from fedsgld.privacy.events import DpEvent, GaussianRelease, subsampled_steps

# release(instruction, reply, noise) -> what leaves the site (noise None: nothing noised)
Release = Callable[[Any, Any, Any], Any]


def _as_is(msg: Any, reply: Any, noise: Any) -> Any:
    return reply


@dataclass(frozen=True)
class Admission:
    """What the guard admitted for one message: who pays, what, and what may leave."""

    policy: SitePolicy
    site_id: int | None = None  # whose ledger pays (None: a query, nothing to charge)
    event: DpEvent | None = None  # the privacy event of every release the site noises
    round_of: tuple[str, int, int] | None = None  # (run key, epoch, round) of a training round
    evaluation_of: str | None = None  # run key of an evaluation
    noise_shape: tuple[int, ...] | None = None  # the release's noise, drawn after the charge
    noise_std: float = 0.0
    run_secure: bool = False  # the run asks for hardened draws (it cannot ask for plain ones)
    release: Release = _as_is
    request: Any = None  # what the handler computes from, as admitted (a :class:`Training`)
    after: Callable[[], None] | None = None  # the transport's own bookkeeping after a reply


@dataclass(frozen=True)
class Training:
    """A training request as the guard admitted it: all the handler computes from, checked.

    ``plan``: the decoded instruction; ``site``: the hosted site it asks; ``theta``: theta_t,
    float32 of the site's parameter count, finite; ``sample_rate``, ``clip``,
    ``prenoise``: the numbers :func:`check_training` accepted (with noise at the sites the
    local steps' own come from the run config's schedule, held to the plan);
    ``randomness``: the sampler of the site's policy, which draws the Poisson samples,
    pre-noise and noise of this request (never the server's); ``at_site``: the site adds
    the noise (placement ``sites``: its local steps, charged to its ledger), else it
    returns its clipped sum; ``records``: the training-record count the site publishes,
    which normalises its own steps (L_k = q records), so its exact count never shapes a
    release."""

    plan: TrainPlan
    site: Site
    theta: np.ndarray
    sample_rate: float
    clip: float | None
    prenoise: float
    randomness: Randomness
    at_site: bool = False
    records: int | None = None  # the count the site publishes (None: its own, a simulation)


@dataclass(frozen=True)
class Evaluating:
    """An evaluation request as the guard admitted it: the hosted ``site``, the model
    ``group`` (one per message), its parameter vectors (``vectors``, float32 of the site's
    parameter count, finite, in order) and the run's ``config``."""

    site: Site
    group: str
    vectors: list[np.ndarray]
    config: Any


# -- 2 and 3: the charge, then the draw ---------------------------------------------------------


class LedgerMemory(Protocol):
    """Where a simulated node (a policy without ``state_dir``) keeps its sites' ledgers for
    the run: the JSON of :meth:`SiteLedger.to_json` per site id, None before the first."""

    def get(self, site_id: int) -> dict[str, Any] | None: ...

    def put(self, site_id: int, state: dict[str, Any]) -> None: ...


def charge(adm: Admission, memory: LedgerMemory) -> Charged | None:
    """The site's ledger admits ``adm`` (or refuses it) and keeps the record: on disk
    under the policy's ``state_dir``, else in ``memory``. Returns the receipt through which
    the release's noise is drawn (:mod:`fedsgld.core.release`); None where there is nothing
    to pay or keep (a query): such a request draws no noise."""
    if adm.site_id is not None:
        refusal = adm.policy.budget_refusal(adm.site_id)
        if refusal is not None:
            raise PolicyRefused(refusal)
    if adm.site_id is None or not (adm.event or adm.round_of or adm.evaluation_of):
        return None
    pol, sid = adm.policy, adm.site_id
    what = {"event": adm.event, "round_of": adm.round_of, "evaluation_of": adm.evaluation_of}
    if pol.state_dir is not None:
        try:
            with SiteLedger.open(sid, pol, Path(pol.state_dir) / f"fedsgld-site-{sid}.json") as led:
                return led.admit(**what)
        except OSError as err:  # a full or read-only disk: no charge kept, so no release
            why = os.strerror(err.errno) if err.errno else type(err).__name__
            raise PolicyRefused(
                f"site {sid} cannot write its ledger in its state directory ({why}); "
                "request refused, nothing released, the ledger file left as it was"
            ) from None
    ledger = SiteLedger(sid, pol)  # a simulated node: the state lives for the run
    saved = memory.get(sid)
    if saved is not None:
        ledger.load(saved)
    receipt = ledger.admit(**what)
    memory.put(sid, ledger.to_json())
    return receipt


def draw(adm: Admission, receipt: Charged | None) -> np.ndarray | None:
    """After the charge (``receipt``): the release's noise, drawn through the receipt from
    fresh entropy (None where the guard noises nothing). A training site's own noise is
    drawn by its handler, through the same receipt and the sampler of its
    :class:`Training`."""
    if adm.noise_shape is None:
        return None
    if receipt is None:
        raise PolicyRefused("a noised release without a charge: the site's ledger pays first")
    fresh = adm.policy.randomness(seeded=False, seed=0, run_secure=adm.run_secure)
    return receipt.noise(
        fresh, adm.noise_shape, std=adm.noise_std, key=streams.SITE_RELEASE, dtype=torch.float64
    ).numpy()


# -- 1: the checks ---------------------------------------------------------------------------


def whole_number(rec: Mapping[str, Any], key: str) -> int:
    """``rec[key]`` as an integer >= 0, else a refusal."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PolicyRefused(f"{key} is {v!r}, expected an integer >= 0")
    return v


def run_key(rec: Mapping[str, Any]) -> str:
    """The request's run key (what numbers its rounds and evaluations), else a refusal."""
    v = rec.get("run-key")
    if not isinstance(v, str) or not v:
        raise PolicyRefused(f"request has no run key (run-key is {v!r})")
    return v


def number(name: str, v: Any, *, lo: float, hi: float, limit: str, lo_open: bool = False) -> float:
    """``v`` as a finite float in [lo, hi] ((lo, hi] with ``lo_open``), else a refusal that
    names the setting and the limit."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and (v > lo if lo_open else v >= lo) and v <= hi:
        return float(v)
    raise PolicyRefused(f"{name} {v!r} refused: {limit}")


def finite(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` if every value is finite, else a refusal."""
    if not np.isfinite(a).all():
        raise PolicyRefused(f"{name} holds non-finite values")
    return a


def check_seeded(policy: SitePolicy, seeded: bool) -> None:
    """A refusal of a seeded run unless the policy allows shared-seed randomness."""
    if seeded and not policy.insecure_seeded_noise:
        raise PolicyRefused(
            "the site refuses shared-seed randomness: it draws its noise and samples from its "
            "own operating system (set randomness = 'os'; a seeded run is for simulations, or "
            "a policy with insecure_seeded_noise = true)"
        )


def check_training(
    policy: SitePolicy,
    *,
    steps: list[tuple[Any, Any]],
    clip: Any,
    prenoise: Any,
    seeded: bool,
    records: int | None = None,
) -> tuple[list[tuple[float, float]], float | None]:
    """The ranges of a training request: (steps, clip) as checked floats, or a refusal.

    ``steps``: the (q, sigma) of every noisy step (one for the server placement: the noise
    the server promises to add; ``local_steps`` for the sites placement). ``clip`` None:
    no clipping (a non-private method). ``records``: the site's training records; every
    step must expect at least the policy's ``min_expected_batch`` of them (q * records)."""
    pol = policy
    check_seeded(pol, seeded)
    if len(steps) > pol.max_local_steps:
        raise PolicyRefused(
            f"request asks for {len(steps)} local steps; policy max_local_steps is "
            f"{pol.max_local_steps}"
        )
    number("prenoise", prenoise, lo=0.0, hi=MAX_PRENOISE, limit=f"must be in [0, {MAX_PRENOISE:g}]")
    if clip is not None:
        top = min(pol.max_clip, MAX_CLIP)
        clip = number(
            "clip", clip, lo=0.0, hi=top, lo_open=True,
            limit=f"must be in (0, {top:g}] (policy max_clip {pol.max_clip:g}, at most {MAX_CLIP:g})",
        )  # fmt: skip
    checked = []
    for q, sigma in steps:
        q = number(
            "sample rate", q, lo=MIN_SAMPLE_RATE, hi=pol.max_sample_rate,
            limit=f"must be in [{MIN_SAMPLE_RATE:g}, policy max_sample_rate {pol.max_sample_rate:g}]",
        )  # fmt: skip
        sigma = number(
            "noise multiplier", sigma, lo=pol.min_noise_multiplier, hi=MAX_NOISE_MULTIPLIER,
            limit=f"must be in [policy min_noise_multiplier {pol.min_noise_multiplier:g}, "
            f"{MAX_NOISE_MULTIPLIER:g}]",
        )  # fmt: skip
        if records is not None and q * records < pol.min_expected_batch:
            raise PolicyRefused(
                f"sample rate {q:g} x {records} records expects {q * records:.3g} records per "
                f"release; policy min_expected_batch is {pol.min_expected_batch:g}"
            )
        checked.append((q, sigma))
    if (clip is None or any(s == 0.0 for _, s in checked)) and not pol.allow_non_private:
        raise PolicyRefused(
            "the site refuses a non-private request (no clipping or no noise); its policy "
            "would need allow_non_private = true"
        )
    return checked, clip


# -- what each kind of request is admitted as --------------------------------------------------


def training_admission(policy: SitePolicy, site: Site, plan: TrainPlan) -> Admission:
    """A training round of ``site`` as ``plan`` asks it: the steps it takes and their noise
    checked against the policy; the local steps charged where the site adds the noise. Its
    request is the :class:`Training` the handler computes from."""
    config, rnd = plan.config, plan.round
    priv = config.privacy
    at_site = priv.noise_placement == "sites"
    check_placement(policy, site.site_id, "sites" if at_site else "server")
    if at_site:
        e = priv.local_steps
        if plan.local_steps != e or plan.first_step != rnd * e:
            raise PolicyRefused(
                f"plan asks for local-steps={plan.local_steps!r} first-step="
                f"{plan.first_step!r}; the run config gives {e} local steps from step "
                f"{rnd * e}"
            )
        for t in range(rnd * e, rnd * e + e):  # the step sizes the site's update consumes
            number("step size", priv.step_size(t), lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                   limit=f"must be in (0, {MAX_STEP_SIZE:g}] (lr and its schedule)")  # fmt: skip
        asked = [(priv.sample_rate, priv.sigma(rnd * e + i)) for i in range(e)]
        clip, prenoise = priv.clip_bound, priv.applied_prenoise
    else:
        asked = [(plan.sample_rate, plan.sigma)]
        clip, prenoise = plan.clip, plan.prenoise
    run = config.run
    steps, clip = check_training(
        policy,
        steps=asked,
        clip=clip,
        prenoise=prenoise,
        seeded=run.randomness == "seeded",
        records=(records := public_records(policy, site)),
    )
    theta = finite("theta", plan.theta_vector(site.fm.size))
    private = clip is not None and all(s > 0.0 for _, s in steps)
    local = at_site and private
    if local and policy.epsilon is None:
        raise PolicyRefused(
            policy.budget_refusal(site.site_id)
            or f"site {site.site_id} adds the noise (noise_placement = 'sites') but has no "
            "budget of its own: give it a privacy-policy file with epsilon"
        )
    # the site's lifetime ledger holds every round it answers: its own noise, or (server
    # placement, deployed) the noise the server promises; a simulation's one party accounts
    # the server's noise in the run's own ledger
    charged = local or (private and not policy.simulated)
    sampler = policy.randomness(
        seeded=run.randomness == "seeded", seed=run.seed, epoch=plan.epoch, run_secure=run.secure
    )
    training = Training(
        plan, site, theta, steps[0][0], clip, float(prenoise), sampler, at_site, records
    )
    return Admission(
        policy,
        site.site_id,
        event=subsampled_steps(steps) if charged else None,
        round_of=plan.round_of,
        request=training,
    )


def public_records(policy: SitePolicy, site: Site) -> int:
    """The training-record count ``site`` publishes (its policy's ``public_records``; the
    true count only where the policy says "exact"), which every check and normalisation
    of a training request uses; a refusal where it publishes none. The exact count of a
    site's records differs between neighbouring data sets: it never decides a refusal or
    scales a release unless the policy makes it public."""
    n = policy.published("public_records", site.num_train)
    if n is None:
        sid = site.site_id
        raise PolicyRefused(policy.budget_refusal(sid) or policy.sizes_refusal(sid))
    return n


def check_placement(policy: SitePolicy, site_id: int, placement: str) -> None:
    """A refusal unless the site's policy lists ``placement`` (the server's choice of where
    the noise is added never weakens what the site accepts)."""
    if placement not in policy.placements:
        raise PolicyRefused(
            f"site {site_id} refuses placement {placement!r}: its policy accepts placements "
            f"{', '.join(policy.placements)}"
        )


def evaluation_admission(
    policy: SitePolicy, site_id: int, run_key: str, *, run_secure: bool, release: Release
) -> Admission:
    """One released evaluation: counted per run key; noised and charged under ``"dp"``."""
    dp = policy.evaluation == "dp"
    sigma = policy.evaluation_noise_multiplier
    return Admission(
        policy,
        site_id,
        event=GaussianRelease(sigma, STATS_SENSITIVITY) if dp else None,
        evaluation_of=run_key,
        noise_shape=(STATS_SIZE,) if dp else None,
        noise_std=sigma * STATS_SENSITIVITY,
        run_secure=run_secure,
        release=release,
    )


__all__ = [
    "Admission",
    "LedgerMemory",
    "Release",
    "Evaluating",
    "Training",
    "charge",
    "check_placement",
    "check_seeded",
    "check_training",
    "draw",
    "evaluation_admission",
    "finite",
    "number",
    "public_records",
    "run_key",
    "training_admission",
    "whole_number",
]
