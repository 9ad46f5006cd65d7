"""A node's sites, built once: :func:`site_runtime` builds the :class:`SiteRuntime` the handlers receive.

A SuperNode hosts one or more sites (hospitals). Which ones, and where their records
come from, is set by the node's ``node_config``:

``partition-id`` / ``num-partitions``  (Flower's simulation sets these) the node hosts the
    sites k < ``sites`` with ``k % num-partitions == partition-id``; their shards are the
    engine's split (:class:`fedsgld.federation.Federation`: same dataset, same
    ``make_sites`` call, same seed), so a seeded Flower run and the in-process engine see
    the same data.
``site-id``  the node hosts exactly this site (a deployment: one SuperNode per hospital).
``site-data``  an ``.npz`` file holding this site's own records (``x_train``, ``y_train``,
    ``x_test``, ``y_test``, optionally ``num_classes``); needs ``site-id``; no split.
    ``python -m fedsgld.deploy.export_sites`` writes such files from a config. A deployed
    node (``site-id``) reads ONLY this file: the site's files are the site's. A run config
    that names a file (``data_path``, ``backbone_weights``) is refused there, and no error
    the server receives names a path or an array of the site's files (the site's own log
    has the details).
``backbone-weights``  (deployed ``timm_head`` sites) the frozen backbone's weights file.
``data-path``  (simulated nodes only) where this node finds the dataset files (overrides
    the run config's ``data_path``); the shard is still the engine's split of that dataset.

``privacy-policy``  a TOML file with this site's privacy policy
    (:mod:`fedsgld.clients.policy`): the bounds it accepts, its own budget and ledger,
    and what it shares. Without one, a simulated node (``partition-id``) accepts the
    run's settings and a deployed node (``site-id``) applies
    :meth:`~fedsgld.clients.policy.SitePolicy.deployment_default`.
``state-dir``  where a node without a policy file keeps its sites' ledgers (default for
    a deployed node: ``$FEDSGLD_STATE_DIR``, else ``~/.fedsgld/sites``).

A node builds its own sites and nothing of the others' (only its shards are split off,
its one seeded model made and its sites built), once per process and run (a process-level
cache; shards split from a dataset are also kept in ``context.state``, except in a Ray
worker). The guard's admissions call :func:`site_runtime` (the node's policy first, so a
refusal comes before anything is loaded); the handlers compute from what they admitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context

from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.site import Site
from fedsgld.config import Config
from fedsgld.data.datasets import ArrayDataset
from fedsgld.federation import (
    backbone_features,
    build_site,
    resolve_seed,
    run_dataset,
    seeded_model,
    site_device,
    split_data,
    standardize_at_sites,
)
from fedsgld.flower import user_sites
from fedsgld.flower.hosted import HostedSites, hosted_site_ids, site_info
from fedsgld.flower.protocol import data_fingerprint
from fedsgld.flower.site_files import (
    SiteShard,
    deployed,
    own_records,
    read_node_policy,
    refuse_server_files,
)

log = logging.getLogger("fedsgld.site")

STATE_META = "fedsgld.sites"
STATE_SHARD = "fedsgld.shard-{}"
STATE_LIMIT_BYTES = 256 * 2**20  # shards larger than this are rebuilt, not kept in context.state


# this process's nodes' sites for the current run, by (run id, data key, the whole run
# config's key: the method sets the sites' parameter view): a simulation runs the
# messages of many nodes in each of its few processes (Ray actors), interleaved, so one
# entry per process would be replaced at almost every message
_CACHE: dict[tuple[int, str, str], HostedSites] = {}


def _config_key(config: Config) -> str:
    flat = json.dumps(config.flat(), sort_keys=True, default=str)
    return hashlib.sha256(flat.encode()).hexdigest()[:24]


def _model(config: Config, shard: Any, num_classes: int) -> torch.nn.Module:
    """The run's seeded model for a site's records (as the engine builds it)."""
    return seeded_model(config, tuple(shard.x_train.shape[1:]), num_classes, seed=config.run.seed)


def _site_from_shard(config: Config, shard: Any, model: torch.nn.Module) -> Site:
    """A site over ``shard``, seeded by the run (its training requests draw from the
    sampler of the node's policy, which the guard admits with them)."""
    return build_site(config, shard, model, seed=config.run.seed, device=site_device(config))


def node_policy(context: Context, config: Config) -> SitePolicy:
    """This node's privacy policy (its ``privacy-policy`` file, or the default for its kind)."""
    p = config.privacy
    return read_node_policy(
        dict(context.node_config), run_epsilon=p.epsilon if p.private else None, run_delta=p.delta
    )


# the sites' data key (data_fingerprint) whose model passed the per-record gradient
# layer-path check in an earlier task of this run (FlatModel.accept_layers_check)
LAYERS_STATE = "fedsgld.layers-checked"


def _layers_checked_before(context: Context, hosted: HostedSites) -> bool:
    rec = context.state.get(LAYERS_STATE)
    return isinstance(rec, ConfigRecord) and rec.get("key") == hosted.key


def layers_check_from_state(context: Context, hosted: HostedSites, site: Site) -> None:
    """Let ``site`` skip the per-record layer path's one-time check where this node already
    ran it for these sites in the run (kept in ``context.state``)."""
    if _layers_checked_before(context, hosted):
        site.fm.accept_layers_check()


def keep_layers_check(context: Context, hosted: HostedSites, site: Site) -> None:
    """Remember in ``context.state`` that ``site``'s layer path passed its one-time check."""
    if site.fm.layers_checked and not _layers_checked_before(context, hosted):
        context.state[LAYERS_STATE] = ConfigRecord({"key": hosted.key})


def _load_own(config: Config, node_config: dict[str, Any], site_id: int) -> tuple[SiteShard, int]:
    shard = own_records(node_config, site_id)
    # standardize = "site": by this file's own training records, at the site
    shard = standardize_at_sites(config, [shard], log=log.info)[0]
    if config.run.model == "timm_head":  # the engine's own feature step
        try:
            shard = backbone_features(config, shard)
        except Exception as err:  # noqa: BLE001 - the weights file is the site's
            log.error("site %d cannot compute its backbone features: %s", site_id, err)
            raise ValueError(
                f"site {site_id} cannot compute its backbone features from its node config's "
                "backbone-weights; the site's own log says why"
            ) from None
    return shard, shard.num_classes


# the run's dataset as last loaded in this process, by its settings and seed: the nodes
# of a simulation that share a process load it once
_DATASET: dict[tuple[str, str, int, int], ArrayDataset] = {}


def _split_own(config: Config, ids: list[int], seed: int) -> tuple[list[Any], int]:
    """The records of the sites ``ids`` in the engine's split of the run's dataset (the
    partition is drawn over the whole dataset; only these shards are made) and its
    number of classes."""
    run = config.run
    key = (run.dataset, run.data_path, run.max_records, seed)
    if key not in _DATASET:
        _DATASET.clear()
        _DATASET[key] = run_dataset(config, seed=seed)
    split = split_data(config, seed=seed, log=log.debug, only=ids, dataset=_DATASET[key])
    return split.site_data, split.num_classes


def _build(config: Config, node_config: dict[str, Any], key: str) -> HostedSites:
    """The node's own sites, nothing of the others': their shards, one seeded model for
    them, and the sites over it (as :class:`~fedsgld.federation.Federation` builds them)."""
    ids = hosted_site_ids(config.run.sites, node_config)
    if "site-data" in node_config and not deployed(node_config):
        raise ValueError("node config site-data needs site-id")
    if deployed(node_config):
        config = refuse_server_files(config, node_config)
        user_sites.check_site_model(config, node_config)  # an imported model: the site's choice
        shard, num_classes = _load_own(config, node_config, ids[0])
        sites = {ids[0]: _site_from_shard(config, shard, _model(config, shard, num_classes))}
        return HostedSites(key, sites, [site_info(shard, num_classes)], num_classes)
    if "data-path" in node_config:
        config = Config.from_flat({**config.flat(), "data_path": str(node_config["data-path"])})
    seed, _ = resolve_seed(config)
    shards, num_classes = _split_own(config, ids, seed)
    shape = tuple(shards[0].x_train.shape[1:])
    model = seeded_model(config, shape, num_classes, seed=seed)
    device = site_device(config)
    sites = {d.site_id: build_site(config, d, model, seed=seed, device=device) for d in shards}
    return HostedSites(key, sites, [site_info(d, num_classes) for d in shards], num_classes)


def _to_state(context: Context, hosted: HostedSites) -> None:
    size = sum(
        t.element_size() * t.numel()
        for s in hosted.sites.values()
        for t in (s.x_train, s.y_train, s.x_test, s.y_test)
    )
    if size > STATE_LIMIT_BYTES:
        return
    for k, s in hosted.sites.items():
        context.state[STATE_SHARD.format(k)] = ArrayRecord(
            {
                "x_train": Array(s.x_train.numpy()),
                "y_train": Array(s.y_train.numpy()),
                "x_test": Array(s.x_test.numpy()),
                "y_test": Array(s.y_test.numpy()),
            }
        )
    context.state[STATE_META] = ConfigRecord(
        {"key": hosted.key, "info": json.dumps(hosted.info), "num_classes": hosted.num_classes}
    )


def _from_state(context: Context, config: Config, key: str) -> HostedSites | None:
    meta = context.state.get(STATE_META)
    if not isinstance(meta, ConfigRecord) or meta.get("key") != key:
        return None
    info = json.loads(str(meta["info"]))
    num_classes = int(meta["num_classes"])
    model = None
    sites: dict[int, Site] = {}
    for entry in info:
        rec = context.state.get(STATE_SHARD.format(entry["site"]))
        if not isinstance(rec, ArrayRecord):
            return None
        arr = {
            n: torch.from_numpy(rec[n].numpy().copy())
            for n in ("x_train", "y_train", "x_test", "y_test")
        }
        shard = SiteShard(site_id=int(entry["site"]), num_classes=num_classes, **arr)
        if model is None:
            model = _model(config, shard, num_classes)
        sites[shard.site_id] = _site_from_shard(config, shard, model)
    return HostedSites(key, sites, info, num_classes)


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (Flower's simulation): it lives for the run and
    keeps its cache, and Ray copies a node's ``context.state`` to and from the worker with
    every message, so shards kept there would travel twice per message for nothing."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def hosted_sites(context: Context, config: Config) -> HostedSites:
    """The sites this node hosts for ``config`` (built once per process and run, then cached)."""
    node_config = dict(context.node_config)
    key = user_sites.cache_key(data_fingerprint(config, node_config))
    run = int(context.run_id)
    entry = (run, key, _config_key(config))
    hosted = _CACHE.get(entry)
    if hosted is None:
        # a site-data file is read again in each new process (a few ms); carried in
        # context.state, its records would travel to and from the SuperNode with every
        # message. Shards split from a dataset are costly to rebuild: those are kept there.
        from_file = deployed(node_config)
        hosted = user_sites.hosted_user_sites(config, node_config, key)  # the Python API's
        if hosted is None and not from_file:
            hosted = _from_state(context, config, key)
        if hosted is None:
            hosted = _build(config, node_config, key)
            if not from_file and not _in_ray_worker():
                _to_state(context, hosted)
        for old in [k for k in _CACHE if k[0] != run]:  # one run's shards per process
            del _CACHE[old]
        _CACHE[entry] = hosted
    return hosted


def hosted_site(hosted: HostedSites, site_id: Any, *, required: bool = False) -> Site:
    """The hosted site ``site_id`` names (None: the node's one site, unless ``required``)."""
    if site_id is None and not required:  # a train plan shared by nodes that host one site each
        if len(hosted.sites) == 1:
            return next(iter(hosted.sites.values()))
        raise ValueError(
            f"the plan names no site-id, but this node hosts several sites {sorted(hosted.sites)}"
        )
    if isinstance(site_id, bool) or not isinstance(site_id, int) or site_id not in hosted.sites:
        raise ValueError(
            f"this node does not host site {site_id!r} (it hosts {sorted(hosted.sites)})"
        )
    return hosted.sites[site_id]


def threads(config: Config) -> None:
    if config.perf.threads:
        torch.set_num_threads(config.perf.threads)


@dataclass(frozen=True)
class SiteRuntime:
    """A node's hosted sites for one run, ready: their records, model and :class:`Site`
    objects (``hosted``) and the node's privacy policy (``policy``)."""

    hosted: HostedSites
    policy: SitePolicy

    def site(self, site_id: Any, *, required: bool = False) -> Site:
        """The hosted site ``site_id`` names (:func:`hosted_site`)."""
        return hosted_site(self.hosted, site_id, required=required)

    def remember_checks(self, context: Context) -> None:
        """After a message: keep in ``context.state`` that the sites' per-record layer
        path passed its one-time check (a later process skips it)."""
        for site in self.hosted.sites.values():
            keep_layers_check(context, self.hosted, site)


def site_runtime(context: Context, config: Config) -> SiteRuntime:
    """The node's :class:`SiteRuntime` for ``config``: its policy read first (a refusal
    comes before anything is loaded), then its sites (built once per process and run), each
    told whether this node's layer path check already passed in the run."""
    policy = node_policy(context, config)
    hosted = hosted_sites(context, config)
    for site in hosted.sites.values():
        layers_check_from_state(context, hosted, site)
    return SiteRuntime(hosted, policy)


__all__ = [
    "HostedSites",
    "SiteRuntime",
    "SiteShard",
    "hosted_site",
    "hosted_sites",
    "keep_layers_check",
    "layers_check_from_state",
    "node_policy",
    "site_runtime",
    "threads",
]
