"""What the ServerApp and the ClientApp say to each other, and the Flower run config.

The message types, one (node, site) pair per message (a SuperNode may host several sites):

``query``     server -> node: ``run`` (ConfigRecord: the flat run config, seed resolved).
              reply: ``sites`` (ConfigRecord, key ``json``: a JSON list with one entry per
              hosted site: site id, n_train, n_test, num_classes, input_shape,
              label_histogram). Sizes: as each site's policy publishes them (null: none).
``train``     server -> node: ``plan`` (ConfigRecord: round, epoch, run-key,
              sample-rate, sigma, prenoise, clip (absent: no clipping, method sgd),
              ``theta``: theta_t as bytes, float32 little-endian (P,), and the run config,
              each of its keys prefixed ``run.``; ``site-id`` only where a node hosts
              several sites: otherwise every site of a round gets the same record, which
              a deployment pushes to the SuperLink once).
              reply: ``sum`` (ConfigRecord: ``sum``, the clipped, pre-noised gradient sum
              S_k as bytes, float32 little-endian (P,); ``site-id``; ``round``). Never the
              realised batch size. With ``noise_placement = "sites"`` the reply is
              ``theta`` (the site's parameters after its local steps, same layout).
              Vectors travel as bytes in a ConfigRecord rather than as an ArrayRecord
              because a deployment moves every record, array and array chunk of a message
              as a separate request (flwr 1.41/1.42), and for the same reason the run
              config rides in the plan rather than in a ``run`` record of its own: 3
              objects per instruction and 3 per reply instead of 7 and 6, which shortens
              every deployed round.
``train.secagg``  server -> node, one step of a secure-aggregation round
              (``secure_aggregation = true``; :mod:`fedsgld.flower.secure_rounds`,
              :mod:`fedsgld.flower.secure_door`, :mod:`fedsgld.flower.secure_site`), one
              message per site: ``plan`` (the train plan's fields and run config, without ``theta`` except at the
              ``masked_input`` step, plus the round's public secure-aggregation plan:
              ``secagg-step``, ``secagg-sites``, ``secagg-length``, ``secagg-bits``,
              ``secagg-dropouts``, ``secagg-colluders``, ``secagg-neighbours``,
              ``secagg-one-shot``, ``signal-norm``, ``secagg-kind``; and the step's
              protocol message, flattened under ``secagg/``: :mod:`fedsgld.secagg.wire`).
              reply: ``secagg`` (ConfigRecord: the site's protocol message, flattened).
              ``secagg-kind = "standardize"``: the pooled standardisation's one secure
              round at the ``secure`` placement (round 0 of the run's standardisation
              key, q = 1, sigma and clip sqrt(2 d) from the run config, no theta).
``query.standardize``  server -> node, once per site before round 1
              (``standardize = "pooled"``, ``server`` or ``sites`` placement):
              ``standardize`` (ConfigRecord: site-id, run-key, epoch) and ``run``. reply: ``moments`` (ConfigRecord: ``moments``, the site's sums of the
              clipped (u, u^2), float64 little-endian (2 d,), noised by the site at the
              ``sites`` placement; ``site-id``). Every later message's run config carries
              the pooled statistics the server formed (``standardize_stats``).
``evaluate``  server -> node, one model per message: ``thetas`` (ArrayRecord ``{"0":
              theta_0, ...}``: one vector, or the posterior samples one model averages),
              ``eval`` (ConfigRecord: site-id, run-key, groups = JSON ``{"posterior": [0,
              1, ...]}``: one group, every vector), ``run``. reply: ``reports``
              (ConfigRecord ``json``: the site's calibration report of the group's mean
              softmax on its test split, ``release`` "dp" or "exact"), ``stats`` (its
              pooling statistics, noised under "dp") and ``meta``; ``pred-<group>``
              (ArrayRecord ``{"probs"}``) and ``labels`` only where the site's policy shares
              predictions (then the server computes pooled metrics and plots exactly as
              the in-process engine does). What a site releases is its guard's decision
              (:mod:`fedsgld.flower.guard`, :mod:`fedsgld.clients.guard`).

Each training message type has one codec here, between its typed value and its records:
``train`` is a :class:`fedsgld.core.plan.TrainPlan` (:func:`encode_train`,
:func:`decode_train`), ``train.secagg`` a :class:`~fedsgld.flower.secure_protocol.SecureStep`
(:mod:`fedsgld.flower.secure_protocol`, built on the train plan's fields here). The server encodes; the site's guard decodes once, refusing a
malformed record (a field of the wrong type, a field no site reads, a run config that does
not parse), and hands the typed value to the handler (:mod:`fedsgld.flower.handoff`).

The run config of a Flower run has the keys of ``fedsgld simulate``'s config (see
``fedsgld.config``) plus the Flower-only keys in :data:`FLOWER_KEYS`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedsgld.config import Config
from fedsgld.core.plan import VECTOR_DTYPE, TrainPlan, unpack_vector  # noqa: F401 - re-exported

QUERY = "query"
TRAIN = "train"
EVALUATE = "evaluate"
SECAGG = "train.secagg"
STANDARDIZE = "query.standardize"
SECAGG_PREFIX = "secagg/"  # a step's protocol message inside the plan record

# Flower-only run-config keys and their defaults.
FLOWER_KEYS: dict[str, Any] = {
    "task": "train",  # "train": the gradient methods (key `method`); "pate": fedsgld.pate.server
    "out": "",  # result directory; empty: a new directory under runs/
    "resume": False,  # resume the run in `out` from its checkpoint
    "round-timeout": 600.0,  # seconds to wait for the replies of one round
    "wait-for-sites": 600.0,  # seconds to wait until every site has a connected node
    # the longest wait between polls for replies (a simulation looks again 2 ms after a
    # reply and backs off; a deployment polls at this interval; Flower's own loop sleeps 3 s)
    "poll-interval": 0.2,
    # secure aggregation: ask for the next round's keys with each unmask (secure_rounds.py)
    "secagg-pipeline": True,
}

TASKS = ("train", "pate")

# Settings that determine a site's shard (and so the cache key of a node's sites).
DATA_KEYS = (
    "dataset",
    "data_path",
    "sites",
    "partition",
    "dirichlet_alpha",
    "test_fraction",
    "model",
    "backbone",
    "backbone_weights",
    "image_size",
    "hidden",
    "seed",
    "chunk_size",
    "standardize",
    "standardize_stats",
)


def split_flower_options(run_config: dict[str, Any]) -> dict[str, Any]:
    """The Flower-only options of a run config (defaults filled in, values checked)."""
    opts = dict(FLOWER_KEYS)
    opts.update({k: v for k, v in run_config.items() if k in FLOWER_KEYS})
    if opts["task"] not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {opts['task']!r}")
    if not isinstance(opts["out"], str):
        raise ValueError(f"out must be a string (a directory), got {opts['out']!r}")
    for k in ("resume", "secagg-pipeline"):
        if not isinstance(opts[k], bool):
            raise ValueError(f"{k} must be true or false, got {opts[k]!r}")
    for k in ("round-timeout", "wait-for-sites", "poll-interval"):
        v = opts[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{k} must be a number of seconds > 0, got {v!r}")
        opts[k] = float(v)
    return opts


def split_run_config(run_config: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """Build the :class:`Config` and the Flower-only options from a Flower run config.

    Unknown keys raise ``ValueError`` naming them (from :meth:`Config.from_flat`); the
    ``pate.*`` keys belong to ``task = "pate"`` and are ignored here.
    """
    opts = split_flower_options(run_config)
    flat = {
        k: v for k, v in run_config.items() if k not in FLOWER_KEYS and not k.startswith("pate.")
    }
    return Config.from_flat(flat), opts


def pack_vector(v: Any) -> bytes:
    """A parameter-sized vector (tensor or array) as the bytes a train message carries."""
    if hasattr(v, "detach"):
        v = v.detach().cpu().numpy()
    a = np.asarray(v)
    if a.ndim != 1:
        raise ValueError(f"expected a vector, got shape {a.shape}")
    return a.astype(VECTOR_DTYPE, copy=False).tobytes()


def run_record(config: Config) -> ConfigRecord:
    """The flat config (seed resolved by the server) as sent with every message."""
    return ConfigRecord({k: v for k, v in config.flat().items()})


def config_from_record(rec: ConfigRecord) -> Config:
    return Config.from_flat(dict(rec.items()))


RUN_PREFIX = "run."  # the run config's keys inside a train instruction's plan


def plan_record(fields: dict[str, Any], run: ConfigRecord) -> ConfigRecord:
    """A train instruction's ``plan``: the round's ``fields`` and the run config (each key
    prefixed ``run.``) in one record, one object fewer per message than a separate ``run``.
    The record as :func:`encode_train` writes it, from loose fields (tests that send a
    server's malformed requests)."""
    clash = sorted(k for k in fields if k.startswith(RUN_PREFIX))
    if clash:
        raise ValueError(f"plan fields must not start with {RUN_PREFIX!r}: {clash}")
    return ConfigRecord({**{RUN_PREFIX + k: v for k, v in run.items()}, **fields})


def config_from_plan(plan: ConfigRecord) -> Config:
    """The run config a train instruction's ``plan`` carries (:func:`plan_record`)."""
    n = len(RUN_PREFIX)
    flat = {k[n:]: v for k, v in plan.items() if k.startswith(RUN_PREFIX)}
    if not flat:
        raise ValueError(f"the train plan carries no run config ({RUN_PREFIX}* keys)")
    return Config.from_flat(flat)


# -- the train message: one codec -----------------------------------------------------------

TRAIN_FIELDS = ("site-id", "round", "epoch", "run-key", "sample-rate", "sigma", "prenoise",
                "clip", "local-steps", "first-step", "theta")  # fmt: skip


def train_fields(plan: TrainPlan) -> dict[str, Any]:
    rec: dict[str, Any] = {} if plan.site_id is None else {"site-id": plan.site_id}
    rec |= {
        "round": plan.round,
        "epoch": plan.epoch,
        "run-key": plan.run_key,
        "sample-rate": plan.sample_rate,
        "sigma": plan.sigma,
        "prenoise": plan.prenoise,
    }
    if plan.clip is not None:
        rec["clip"] = plan.clip
    if plan.local_steps is not None:
        rec["local-steps"] = plan.local_steps
    if plan.first_step is not None:
        rec["first-step"] = plan.first_step
    return rec


def encode_train(plan: TrainPlan) -> RecordDict:
    """A ``train`` message's content: one ``plan`` record (module docstring)."""
    rec = train_fields(plan)
    if plan.theta is not None:
        rec["theta"] = plan.theta
    return RecordDict({"plan": plan_record(rec, run_record(plan.config))})


def _whole(rec: dict[str, Any], key: str, *, optional: bool = False) -> int | None:
    v = rec.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{key} is {v!r}, expected an integer >= 0")
    return v


def real_field(rec: dict[str, Any], key: str, *, optional: bool = False) -> float | None:
    """A number as sent (NaN and infinities too: the site's policy judges the value)."""
    v = rec.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} is {v!r}, expected a number")
    return float(v)


def read_train_plan(
    rec: ConfigRecord, *, extra: tuple[str, ...] = (), prefix: str = ""
) -> TrainPlan:
    """The :class:`TrainPlan` in a plan record whose other fields are ``extra`` and those
    under ``prefix``; ``ValueError`` for a malformed one."""
    config = config_from_plan(rec)
    fields = {k: v for k, v in rec.items() if not k.startswith(RUN_PREFIX)}
    unknown = sorted(
        k
        for k in fields
        if k not in TRAIN_FIELDS and k not in extra and not (prefix and k.startswith(prefix))
    )
    if unknown:
        raise ValueError(f"the plan carries fields no site reads: {unknown}")
    key = fields.get("run-key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"request has no run key (run-key is {key!r})")
    theta = fields.get("theta")
    if theta is not None and not isinstance(theta, bytes):
        raise ValueError(f"theta is a {type(theta).__name__}, expected bytes (float32)")
    site_id = fields.get("site-id")
    if site_id is not None and (isinstance(site_id, bool) or not isinstance(site_id, int)):
        raise ValueError(f"site-id is {site_id!r}, expected an integer")
    return TrainPlan(
        round=_whole(fields, "round"),
        epoch=_whole(fields, "epoch"),
        run_key=key,
        sample_rate=real_field(fields, "sample-rate"),
        sigma=real_field(fields, "sigma"),
        prenoise=real_field(fields, "prenoise"),
        clip=real_field(fields, "clip", optional=True),
        config=config,
        theta=theta,
        site_id=site_id,
        local_steps=_whole(fields, "local-steps", optional=True),
        first_step=_whole(fields, "first-step", optional=True),
    )  # type: ignore[arg-type]


def decode_train(content: RecordDict) -> TrainPlan:
    """The :class:`TrainPlan` a ``train`` message carries (:func:`encode_train`);
    ``ValueError`` (or ``KeyError`` without a ``plan`` record) for a malformed one: a field
    of the wrong type, a field no site reads, a run config that does not parse. Whether the
    numbers are acceptable is the site's policy's to judge (:mod:`fedsgld.clients.guard`)."""
    return read_train_plan(plan_record_in(content))


def plan_record_in(content: RecordDict) -> ConfigRecord:
    rec = content.get("plan")
    if not isinstance(rec, ConfigRecord):
        raise ValueError("request has no ConfigRecord 'plan'")
    return rec


# -- the evaluate message: one codec --------------------------------------------------------


@dataclass(frozen=True)
class EvaluateRequest:
    """An ``evaluate`` message as decoded (:func:`decode_evaluate`): the site it asks (``site_id`` as sent, resolved by
    the site's guard), the run key, the model groups ``{group: [indices]}``, the parameter
    vectors (``thetas``, keyed "0", "1", ...; their dtype and size are checked by the
    site's guard against its model) and the run's config."""

    site_id: Any
    run_key: Any
    groups: dict[str, Any]
    thetas: ArrayRecord
    config: Config


def encode_evaluate(
    *, site_id: int, run_key: str, groups: dict[str, list[int]], thetas: ArrayRecord,
    run: ConfigRecord,
) -> RecordDict:  # fmt: skip
    """The content of an ``evaluate`` message that :func:`decode_evaluate` reads (``run``:
    the run config's record, shared by every message of the run)."""
    rec = {"site-id": site_id, "groups": json.dumps(groups), "run-key": run_key}
    return RecordDict({"thetas": thetas, "eval": ConfigRecord(rec), "run": run})


def decode_evaluate(content: RecordDict) -> EvaluateRequest:
    """The :class:`EvaluateRequest` an ``evaluate`` message carries (:func:`encode_evaluate`);
    ``ValueError`` for a malformed one (a missing or mistyped record, groups that are not a
    JSON object, a run config that does not parse)."""
    parts = {"eval": ConfigRecord, "thetas": ArrayRecord, "run": ConfigRecord}
    for name, kind in parts.items():
        if not isinstance(content.get(name), kind):
            raise ValueError(f"request has no {kind.__name__} {name!r}")
    ev = content["eval"]
    groups = json.loads(str(ev.get("groups")))
    if not isinstance(groups, dict):
        raise ValueError(f"groups must be a JSON object {{group: [indices]}}, got {groups!r}")
    config = config_from_record(content["run"])
    return EvaluateRequest(ev.get("site-id"), ev.get("run-key"), groups, content["thetas"], config)


# -- the query.standardize message: one codec --------------------------------------------------


@dataclass(frozen=True)
class StandardizeRequest:
    """A ``query.standardize`` message as decoded (:func:`decode_standardize`): the site it
    asks (``site_id`` as sent), the run key, the run's epoch (a resumed run's release is a
    new one) and the run's config, whose ``standardize_*`` settings and placement say what
    the site computes and how it is noised."""

    site_id: Any
    run_key: Any
    epoch: Any
    config: Config


def encode_standardize(*, site_id: int, run_key: str, epoch: int, run: ConfigRecord) -> RecordDict:
    """The content of a ``query.standardize`` message (:func:`decode_standardize`)."""
    rec = ConfigRecord({"site-id": site_id, "run-key": run_key, "epoch": epoch})
    return RecordDict({"standardize": rec, "run": run})


def decode_standardize(content: RecordDict) -> StandardizeRequest:
    """The :class:`StandardizeRequest` a ``query.standardize`` message carries; ``ValueError``
    for a malformed one (a missing record, a field no site reads, a run config that does not
    parse)."""
    for name in ("standardize", "run"):
        if not isinstance(content.get(name), ConfigRecord):
            raise ValueError(f"request has no ConfigRecord {name!r}")
    rec = dict(content["standardize"].items())
    extra = sorted(set(rec) - {"site-id", "run-key", "epoch"})
    if extra:
        raise ValueError(f"fields no site reads: {extra}")
    config = config_from_record(content["run"])
    return StandardizeRequest(rec.get("site-id"), rec.get("run-key"), rec.get("epoch"), config)


MOMENTS_DTYPE = "<f8"  # a site's moment sums on the wire: float64 little-endian, (2 d,)


def data_fingerprint(config: Config, node_config: dict[str, Any]) -> str:
    """A key for everything that determines the sites a node hosts and their shards."""
    flat = config.flat()
    key = {
        "config": {k: flat[k] for k in DATA_KEYS if k in flat},
        "node": dict(sorted(node_config.items())),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
