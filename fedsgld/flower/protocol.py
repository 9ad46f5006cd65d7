"""What the ServerApp and the ClientApp say to each other, and the Flower run config.

Three message types, one (node, site) pair per message (a SuperNode may host several sites):

``query``     server -> node: ``run`` (ConfigRecord: the flat run config, seed resolved).
              reply: ``sites`` (ConfigRecord, key ``json``: a JSON list with one entry per
              hosted site: site id, n_train, n_test, num_classes, input_shape,
              label_histogram). Site sizes are public in DP-SGLD (L = q * sum_k N_k).
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
              :mod:`fedsgld.flower.secure_site`), one message per site: ``plan`` (the
              train plan's fields and run config, without ``theta`` except at the
              ``masked_input`` step, plus the round's public secure-aggregation plan:
              ``secagg-step``, ``secagg-sites``, ``secagg-length``, ``secagg-bits``,
              ``secagg-dropouts``, ``secagg-colluders``, ``signal-norm``; and the step's
              protocol message, flattened under ``secagg/``: :mod:`fedsgld.secagg.wire`).
              reply: ``secagg`` (ConfigRecord: the site's protocol message, flattened).
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

The run config of a Flower run has the keys of ``fedsgld simulate``'s config (see
``fedsgld.config``) plus the Flower-only keys in :data:`FLOWER_KEYS`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from fedsgld.config import Config
from fedsgld.secagg import SecAggPlan
from fedsgld.strategies.secure_sum import round_label

QUERY = "query"
TRAIN = "train"
EVALUATE = "evaluate"
SECAGG = "train.secagg"
SECAGG_PREFIX = "secagg/"  # a step's protocol message inside the plan record

# Flower-only run-config keys and their defaults.
FLOWER_KEYS: dict[str, Any] = {
    "task": "train",  # "train": the gradient methods (key `method`); "pate": fedsgld.pate.server
    "out": "",  # result directory; empty: a new directory under runs/
    "resume": False,  # resume the run in `out` from its checkpoint
    "round-timeout": 600.0,  # seconds to wait for the replies of one round
    "wait-for-sites": 600.0,  # seconds to wait until every site has a connected node
    "poll-interval": 0.2,  # seconds between polls for replies (Flower's own loop sleeps 3 s)
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
)


def split_flower_options(run_config: dict[str, Any]) -> dict[str, Any]:
    """The Flower-only options of a run config (defaults filled in, values checked)."""
    opts = dict(FLOWER_KEYS)
    opts.update({k: v for k, v in run_config.items() if k in FLOWER_KEYS})
    if opts["task"] not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {opts['task']!r}")
    if not isinstance(opts["out"], str):
        raise ValueError(f"out must be a string (a directory), got {opts['out']!r}")
    if not isinstance(opts["resume"], bool):
        raise ValueError(f"resume must be true or false, got {opts['resume']!r}")
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


VECTOR_DTYPE = np.dtype("<f4")  # how theta_t and S_k travel: float32, little-endian


def pack_vector(v: Any) -> bytes:
    """A parameter-sized vector (tensor or array) as the bytes a train message carries."""
    if hasattr(v, "detach"):
        v = v.detach().cpu().numpy()
    a = np.asarray(v)
    if a.ndim != 1:
        raise ValueError(f"expected a vector, got shape {a.shape}")
    return a.astype(VECTOR_DTYPE, copy=False).tobytes()


def unpack_vector(b: Any, *, size: int, name: str) -> np.ndarray:
    """The float32 vector of ``size`` entries in ``b`` (bytes); ``ValueError`` otherwise."""
    if not isinstance(b, bytes):
        raise ValueError(f"{name} is a {type(b).__name__}, expected bytes (float32 ({size},))")
    if len(b) != size * VECTOR_DTYPE.itemsize:
        raise ValueError(
            f"{name} has {len(b)} bytes, expected float32 ({size},) = "
            f"{size * VECTOR_DTYPE.itemsize} bytes"
        )
    return np.frombuffer(b, dtype=VECTOR_DTYPE).astype(np.float32)


def run_record(config: Config) -> ConfigRecord:
    """The flat config (seed resolved by the server) as sent with every message."""
    return ConfigRecord({k: v for k, v in config.flat().items()})


def config_from_record(rec: ConfigRecord) -> Config:
    return Config.from_flat(dict(rec.items()))


RUN_PREFIX = "run."  # the run config's keys inside a train instruction's plan


def plan_record(fields: dict[str, Any], run: ConfigRecord) -> ConfigRecord:
    """A train instruction's ``plan``: the round's ``fields`` and the run config (each key
    prefixed ``run.``) in one record, one object fewer per message than a separate ``run``."""
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


def secagg_label(run_key: str, epoch: int, rnd: int) -> bytes:
    """The round label of a Flower secure-aggregation round: a resumed run (new epoch)
    never repeats one."""
    return round_label(f"{run_key}/{epoch}", rnd)


def secagg_fields(sp: SecAggPlan, step: str) -> dict[str, Any]:
    """A step's public secure-aggregation plan, as ``plan`` record fields."""
    return {
        "secagg-step": step,
        "secagg-sites": list(sp.sites),
        "secagg-length": sp.length,
        "secagg-bits": sp.bits,
        "secagg-dropouts": sp.max_dropouts,
        "secagg-colluders": sp.max_colluders,
    }


def secagg_plan(rec: Any, *, run_key: str, epoch: int, rnd: int) -> SecAggPlan:
    """The round's :class:`SecAggPlan` from a ``train.secagg`` plan record (``ValueError``,
    ``TypeError`` or ``KeyError`` for a malformed one)."""
    sites = rec["secagg-sites"]
    ints = [rec[k] for k in ("secagg-length", "secagg-bits", "secagg-dropouts", "secagg-colluders")]
    if not isinstance(sites, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in [*sites, *ints]
    ):
        raise TypeError("secagg-sites, -length, -bits, -dropouts, -colluders must be integers")
    length, bits, dropouts, colluders = ints
    return SecAggPlan(
        round_label=secagg_label(run_key, epoch, rnd), sites=tuple(sites), length=length,
        bits=bits, max_dropouts=dropouts, max_colluders=colluders,
    )  # fmt: skip


def data_fingerprint(config: Config, node_config: dict[str, Any]) -> str:
    """A key for everything that determines the sites a node hosts and their shards."""
    flat = config.flat()
    key = {
        "config": {k: flat[k] for k in DATA_KEYS if k in flat},
        "node": dict(sorted(node_config.items())),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
