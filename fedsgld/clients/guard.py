"""The site's one door: every message a site answers passes :func:`site_guard` first.

The ClientApp (``fedsgld.apps.client_app``) is ``ClientApp(mods=[site_guard])``: Flower
calls the guard with every message before the handler of its type. For each type the
guard knows (:data:`DOORS`: ``query``, ``train``, ``evaluate``, ``query.pate``,
``train.pate``, ``evaluate.pate``) it goes, in this order:

1. **validate**: every setting the handler will read is parsed and checked (a finite
   number inside the policy's range; parameters of the dtype, shape and count of the
   site's model, finite). A request that fails raises :class:`PolicyRefused` naming the
   setting and the limit; Flower turns it into the error reply the server logs.
2. **charge**: the site's :class:`~fedsgld.clients.policy.SiteLedger` admits the request
   (replay numbering, evaluations per run key, the privacy cost of what the site will
   noise, within its budget) and persists it atomically (temporary file, fsync, rename).
3. **draw**: the noise of the release (evaluation statistics, vote counts), from the
   sampler the site's policy chooses (:meth:`SitePolicy.randomness`, hardened by default);
   a training site gets that sampler for its Poisson samples and noise.
4. **compute**: the handler runs; it has no policy checks of its own.
5. **release**: only what the policy lets out leaves (:mod:`fedsgld.clients.release`).

A message type the guard does not know is refused. A refusal (1 or 2) records nothing,
so it costs nothing. Every check that can fail runs before the charge; what can still
fail after it (the machine runs out of memory in step 4) leaves the charge in the ledger:
conservative, as nothing left the site. What each message may ask, what is checked, what
leaves and what it costs: docs/privacy.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedsgld.clients import release
from fedsgld.clients.policy import PolicyRefused, SiteLedger, SitePolicy
from fedsgld.clients.site import Site
from fedsgld.core.noise import Randomness
from fedsgld.flower.protocol import config_from_plan, config_from_record, unpack_vector
from fedsgld.flower.sites import hosted_site, hosted_sites, node_policy

Handler = Callable[[Message, Context], Message]
LEDGER_STATE = "fedsgld.ledger-{}"  # a site's ledger in context.state (policy without state_dir)


def _as_is(msg: Message, reply: Message, noise: Any) -> Message:
    return reply


@dataclass(frozen=True)
class Admission:
    """What the guard admitted for one message: who pays, what, and what may leave."""

    policy: SitePolicy
    site_id: int | None = None  # whose ledger pays (None: a query, nothing to charge)
    steps: tuple[tuple[float, float], ...] = ()  # (q, sigma) of every release the site noises
    round_of: tuple[str, int, int] | None = None  # (run key, epoch, round) of a training round
    evaluation_of: str | None = None  # run key of an evaluation
    noise_shape: tuple[int, ...] | None = None  # the release's noise, drawn after the charge
    noise_std: float = 0.0
    run_secure: bool = False  # the run asks for hardened draws (it cannot ask for plain ones)
    release: Callable[[Message, Message, Any], Message] = _as_is
    site: Site | None = None  # the training site, which draws its noise from ``randomness``
    randomness: Randomness | None = None


def site_guard(msg: Message, context: Context, call_next: Handler) -> Message:
    """The ClientApp mod every message passes: validate, charge, draw, compute, release."""
    kind = msg.metadata.message_type
    door = DOORS.get(kind)
    if door is None:
        raise PolicyRefused(
            f"the site refuses message type {kind!r}: its guard answers only {', '.join(DOORS)}"
        )
    try:
        adm = door(msg, context)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise PolicyRefused(f"{kind}: malformed request: {err}") from None
    _charge(context, adm)
    if adm.site is not None:
        adm.site.randomness = adm.randomness  # the policy's sampler, never the server's
    noise = None
    if adm.noise_shape is not None:
        noise = (
            adm.policy.randomness(seeded=False, seed=0, run_secure=adm.run_secure)
            .gaussian(adm.noise_shape, std=adm.noise_std, key=(0,), dtype=torch.float64)
            .numpy()
        )
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    return adm.release(msg, reply, noise)


def _charge(context: Context, adm: Admission) -> None:
    if adm.site_id is None or not (adm.steps or adm.round_of or adm.evaluation_of):
        return
    pol, sid = adm.policy, adm.site_id
    what = {"steps": adm.steps, "round_of": adm.round_of, "evaluation_of": adm.evaluation_of}
    if pol.state_dir is not None:
        with SiteLedger.open(sid, pol, Path(pol.state_dir) / f"fedsgld-site-{sid}.json") as led:
            led.admit(**what)
        return
    ledger = SiteLedger(sid, pol)  # a simulated node: the state lives for the run
    rec = context.state.get(LEDGER_STATE.format(sid))
    if isinstance(rec, ConfigRecord):
        ledger.load(json.loads(str(rec["json"])))
    ledger.admit(**what)
    context.state[LEDGER_STATE.format(sid)] = ConfigRecord({"json": json.dumps(ledger.to_json())})


# -- checks ---------------------------------------------------------------------------------


def _record(msg: Message, name: str, kind: type) -> Any:
    rec = msg.content.get(name) if msg.has_content() else None
    if not isinstance(rec, kind):
        raise PolicyRefused(f"request has no {kind.__name__} {name!r}")
    return rec


def _int(rec: Any, key: str) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PolicyRefused(f"{key} is {v!r}, expected an integer >= 0")
    return v


def _run_key(rec: Any) -> str:
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


def _finite(name: str, a: np.ndarray) -> np.ndarray:
    if not np.isfinite(a).all():
        raise PolicyRefused(f"{name} holds non-finite values")
    return a


def _array(rec: ArrayRecord, key: str, *, dtype: str, shape: tuple[int, ...], name: str):
    arr = rec[key]
    if arr.stype != "numpy.ndarray" or arr.dtype != dtype or tuple(arr.shape) != shape:
        raise PolicyRefused(
            f"{name} is {arr.dtype}{tuple(arr.shape)}, expected {dtype}{shape} (the site's model)"
        )
    return _finite(name, arr.numpy())


def check_training(
    policy: SitePolicy,
    *,
    steps: list[tuple[Any, Any]],
    clip: Any,
    prenoise: Any,
    seeded: bool,
) -> tuple[list[tuple[float, float]], float | None]:
    """The ranges of a training request: (steps, clip) as checked floats, or a refusal.

    ``steps``: the (q, sigma) of every noisy step (one for the server placement: the noise
    the server promises to add; ``local_steps`` for the sites placement). ``clip`` None:
    no clipping (a non-private method)."""
    pol = policy
    if seeded and not pol.insecure_seeded_noise:
        raise PolicyRefused(
            "the site refuses shared-seed randomness: it draws its noise and samples from its "
            "own operating system (set randomness = 'os'; a seeded run is for simulations, or "
            "a policy with insecure_seeded_noise = true)"
        )
    if len(steps) > pol.max_local_steps:
        raise PolicyRefused(
            f"request asks for {len(steps)} local steps; policy max_local_steps is "
            f"{pol.max_local_steps}"
        )
    number("prenoise", prenoise, lo=0.0, hi=math.inf, limit="must be a finite number >= 0")
    if clip is not None:
        clip = number(
            "clip", clip, lo=0.0, hi=pol.max_clip, lo_open=True,
            limit=f"must be a finite number in (0, policy max_clip {pol.max_clip:g}]",
        )  # fmt: skip
    checked = []
    for q, sigma in steps:
        q = number(
            "sample rate", q, lo=0.0, hi=pol.max_sample_rate, lo_open=True,
            limit=f"must be in (0, policy max_sample_rate {pol.max_sample_rate:g}]",
        )  # fmt: skip
        sigma = number(
            "noise multiplier", sigma, lo=pol.min_noise_multiplier, hi=math.inf,
            limit=f"must be finite and >= policy min_noise_multiplier {pol.min_noise_multiplier:g}",
        )  # fmt: skip
        checked.append((q, sigma))
    if (clip is None or any(s == 0.0 for _, s in checked)) and not pol.allow_non_private:
        raise PolicyRefused(
            "the site refuses a non-private request (no clipping or no noise); its policy "
            "would need allow_non_private = true"
        )
    return checked, clip


# -- the doors, one per message type ----------------------------------------------------------


def _query(msg: Message, context: Context) -> Admission:
    config = config_from_record(_record(msg, "run", ConfigRecord))
    policy = node_policy(context, config)
    hist = policy.share_label_histogram
    return Admission(policy, release=partial(release.sites_info, label_histogram=hist))


def _train(msg: Message, context: Context) -> Admission:
    plan = _record(msg, "plan", ConfigRecord)
    config = config_from_plan(plan)
    policy = node_policy(context, config)
    site = hosted_site(hosted_sites(context, config), plan.get("site-id"))
    rnd, epoch, run_key = _int(plan, "round"), _int(plan, "epoch"), _run_key(plan)
    _finite("theta", unpack_vector(plan.get("theta"), size=site.fm.size, name="theta"))
    priv = config.privacy
    if priv.noise_placement == "sites":
        e = priv.local_steps
        if plan.get("local-steps") != e or plan.get("first-step") != rnd * e:
            raise PolicyRefused(
                f"plan asks for local-steps={plan.get('local-steps')!r} first-step="
                f"{plan.get('first-step')!r}; the run config gives {e} local steps from step "
                f"{rnd * e}"
            )
        asked = [(priv.sample_rate, priv.sigma(rnd * e + i)) for i in range(e)]
        clip, prenoise = priv.clip_bound, priv.applied_prenoise
    else:
        asked = [(plan.get("sample-rate"), plan.get("sigma"))]
        clip, prenoise = plan.get("clip"), plan.get("prenoise")
    steps, clip = check_training(
        policy, steps=asked, clip=clip, prenoise=prenoise, seeded=config.run.randomness == "seeded"
    )
    private = clip is not None and all(s > 0.0 for _, s in steps)
    local = priv.noise_placement == "sites" and private
    if local and policy.epsilon is None:
        raise PolicyRefused(
            f"site {site.site_id} adds the noise (noise_placement = 'sites') but has no budget "
            "of its own: give it a privacy-policy file with epsilon"
        )
    run = config.run
    sampler = policy.randomness(
        seeded=run.randomness == "seeded", seed=run.seed, epoch=epoch, run_secure=run.secure
    )
    return Admission(
        policy,
        site.site_id,
        steps=tuple(steps) if local else (),
        round_of=(run_key, epoch, rnd),
        site=site,
        randomness=sampler,
    )


def _evaluation(
    policy: SitePolicy, site_id: int, run_key: str, group: str, *, run_secure: bool
) -> Admission:
    """One released evaluation: counted per run key; noised and charged under ``"dp"``."""
    dp = policy.evaluation == "dp"
    sigma = policy.evaluation_noise_multiplier
    return Admission(
        policy,
        site_id,
        steps=((1.0, sigma),) if dp else (),
        evaluation_of=run_key,
        noise_shape=(release.STATS_SIZE,) if dp else None,
        noise_std=sigma * release.STATS_SENSITIVITY,
        run_secure=run_secure,
        release=partial(release.evaluation, policy=policy, group=group),
    )


def _evaluate(msg: Message, context: Context) -> Admission:
    ev, thetas = _record(msg, "eval", ConfigRecord), _record(msg, "thetas", ArrayRecord)
    config = config_from_record(_record(msg, "run", ConfigRecord))
    policy = node_policy(context, config)
    site = hosted_site(hosted_sites(context, config), ev.get("site-id"), required=True)
    run_key = _run_key(ev)
    groups = json.loads(str(ev.get("groups")))
    n = len(thetas)
    if not isinstance(groups, dict) or len(groups) != 1:
        raise PolicyRefused("an evaluation message evaluates exactly one model (one group)")
    ((group, idx),) = groups.items()
    if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", group):
        raise PolicyRefused(f"group name {group!r} refused: letters, digits and _ only")
    if idx != list(range(n)) or sorted(thetas.keys()) != sorted(str(i) for i in range(n)):
        raise PolicyRefused(f"group {group!r} must average every parameter vector 0..{n - 1}")
    number(
        "parameter vectors", n, lo=1, hi=policy.max_models_per_evaluation,
        limit=f"policy max_models_per_evaluation is {policy.max_models_per_evaluation}",
    )  # fmt: skip
    for k in thetas.keys():
        _array(thetas, k, dtype="float32", shape=(site.fm.size,), name=f"parameter vector {k}")
    return _evaluation(policy, site.site_id, run_key, group, run_secure=config.run.secure)


def _pate(msg: Message, context: Context, *, shard: bool = True):
    """(config, policy, site id, the site's records) of a PATE message."""
    from fedsgld.pate.flower import pate_config_from_run_config, site_records

    config = pate_config_from_run_config(dict(_record(msg, "pate", ConfigRecord).items()))
    policy = SitePolicy.for_node(
        dict(context.node_config), run_epsilon=None, run_delta=config.delta
    )
    if not shard:
        return config, policy, None, None
    sid = _record(msg, "task", ConfigRecord).get("site-id")
    shards = site_records(config, dict(context.node_config))
    if isinstance(sid, bool) or not isinstance(sid, int) or sid not in shards:
        raise PolicyRefused(f"this node does not host site {sid!r} (it hosts {sorted(shards)})")
    return config, policy, sid, shards[sid]


def _query_pate(msg: Message, context: Context) -> Admission:
    _, policy, _, _ = _pate(msg, context, shard=False)
    return Admission(policy, release=partial(release.sites_info, label_histogram=None))


def _train_pate(msg: Message, context: Context) -> Admission:
    config, policy, sid, s = _pate(msg, context)
    x = _record(msg, "queries", ArrayRecord)
    shape = tuple(x["x"].shape) if "x" in x else ()
    n_queries = shape[0] if shape else 0
    if n_queries < 1:
        raise PolicyRefused("train.pate needs at least one public query")
    _array(x, "x", dtype="float32", shape=(n_queries, *s.x_train.shape[1:]), name="queries")
    noised = not policy.allow_non_private
    m = policy.vote_noise_multiplier
    std = m * release.vote_sensitivity(n_queries) if noised else 0.0
    return Admission(
        policy,
        sid,
        steps=((1.0, m),) if noised else (),
        noise_shape=(n_queries, int(s.num_classes)) if noised else None,
        noise_std=std,
        release=partial(
            release.votes,
            teachers=config.teachers_per_site,
            noise_std=std,
            share_accuracy=policy.evaluation == "exact",
        ),
    )


def _evaluate_pate(msg: Message, context: Context) -> Admission:
    from fedsgld.pate.train import _new_model

    config, policy, sid, s = _pate(msg, context)
    run_key = _run_key(_record(msg, "task", ConfigRecord))
    student = _record(msg, "student", ArrayRecord)
    shape = tuple(s.x_train.shape[1:])
    ref = _new_model(config.student_model, shape, int(s.num_classes), config.hidden, 0)
    want = ref.state_dict()
    if sorted(student.keys()) != sorted(want):
        raise PolicyRefused(
            f"student has parameters {sorted(student.keys())}, expected {sorted(want)}"
        )
    for k, t in want.items():
        dtype = str(t.numpy().dtype)
        _array(student, k, dtype=dtype, shape=tuple(t.shape), name=f"student parameter {k!r}")
    return _evaluation(policy, sid, run_key, "student", run_secure=False)


DOORS: dict[str, Callable[[Message, Context], Admission]] = {
    "query": _query,
    "train": _train,
    "evaluate": _evaluate,
    "query.pate": _query_pate,
    "train.pate": _train_pate,
    "evaluate.pate": _evaluate_pate,
}

__all__ = ["DOORS", "Admission", "check_training", "number", "site_guard"]
