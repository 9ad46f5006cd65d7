"""A user's own model factory and per-site records, served by the project's ClientApp.

The Python API (``fedsgld.simulate(..., transport="flower" | "ray")``) builds the
ClientApp with one more mod, :func:`user_objects_mod`, outside the site's guard: while a
message is handled it makes the user's :class:`UserObjects` (the model factory and every
site's :class:`~fedsgld.data.partition.SiteData`) the node's, and
:func:`fedsgld.flower.site_runtime.site_runtime` builds the node's sites from them
(:func:`hosted_user_sites`) instead of from the config's dataset and model: node i of
Flower's simulation (``partition-id``) hosts the sites k with ``k % num-partitions == i``,
each a :class:`~fedsgld.clients.Site` over the user's records of site k and the user's
module, built by the factory under the run's seed (:func:`fedsgld.federation.seeded_model`),
exactly as the in-process engine builds them. The objects travel inside the ClientApp
object: in this process (:class:`fedsgld.flower.local_grid.LocalGrid`) or pickled with it
to Flower's Ray actors (``run_simulation``), never in a message.

A deployment cannot carry in-memory objects: there a site's records are its
``site-data`` file and the model is an importable factory (``model = "package.module:
factory"``, :mod:`fedsgld.models.imported`), which a deployed site builds only when its
own node config names the same factory (:func:`check_site_model`).

Privacy caveat: a simulation holds every site's records in one program; it shows what the
protocol computes, not that the records stayed apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Context, Message

from fedsgld.config import Config
from fedsgld.data.partition import SiteData
from fedsgld.federation import build_site, seeded_model, site_device, with_released_statistics
from fedsgld.flower.hosted import HostedSites, hosted_site_ids, site_info
from fedsgld.models.imported import is_import_path


@dataclass(frozen=True)
class UserObjects:
    """A user's model factory (None: the config's model) and every site's records (None:
    the config's dataset), for the nodes of one simulation."""

    model_fn: Callable[[], torch.nn.Module] | None
    site_data: list[SiteData] | None
    token: str = field(default="")

    @classmethod
    def of(
        cls, model_fn: Callable[[], torch.nn.Module] | None, site_data: list[SiteData] | None
    ) -> UserObjects:
        """The objects with a token that tells them apart from any other run's (the
        nodes' caches are keyed by it)."""
        h = hashlib.sha256(repr((id(model_fn), getattr(model_fn, "__qualname__", ""))).encode())
        for d in site_data or []:
            for t in (d.x_train, d.y_train, d.x_test, d.y_test):
                h.update(t.contiguous().numpy().tobytes())
        return cls(model_fn, site_data, h.hexdigest()[:16])


_ACTIVE: ContextVar[UserObjects | None] = ContextVar("fedsgld_user_objects", default=None)


def active() -> UserObjects | None:
    """The user objects of the message being handled (None: the config's model and data)."""
    return _ACTIVE.get()


class UserObjectsMod:
    """A ClientApp mod that makes ``objects`` the node's while a message is handled.

    A class at module level, not a closure: Ray pickles the ClientApp with its mods to
    its actors, and a closure would carry this module's context variable (which cannot
    be pickled) by value; an instance carries only ``objects``."""

    def __init__(self, objects: UserObjects) -> None:
        self.objects = objects

    def __call__(self, msg: Message, context: Context, call_next: Callable) -> Message:
        token = _ACTIVE.set(self.objects)
        try:
            return call_next(msg, context)
        finally:
            _ACTIVE.reset(token)


def user_objects_mod(objects: UserObjects) -> UserObjectsMod:
    """The mod of ``objects`` (:class:`UserObjectsMod`)."""
    return UserObjectsMod(objects)


def cache_key(key: str) -> str:
    """A node cache key that also names the active user objects."""
    objects = active()
    return key if objects is None else f"{key}-user-{objects.token}"


def hosted_user_sites(config: Config, node_config: dict[str, Any], key: str) -> HostedSites | None:
    """The node's sites built from the active user objects (None: there are none; the
    Python API always sends the records, the config's split where the user gave none)."""
    objects = active()
    if objects is None or objects.site_data is None:
        return None
    data = objects.site_data
    if len(data) != config.run.sites:
        raise ValueError(f"sites: {config.run.sites} in the run, {len(data)} given")
    ids = hosted_site_ids(config.run.sites, node_config)
    data = with_released_statistics(config, data)  # the pooled statistics, once released
    first = data[ids[0]]
    model = seeded_model(
        config,
        tuple(first.x_train.shape[1:]),
        first.num_classes,
        seed=config.run.seed,
        model_fn=objects.model_fn,
    )
    device = site_device(config)
    sites = {
        k: build_site(config, data[k], model, seed=config.run.seed, device=device) for k in ids
    }
    info = [site_info(data[k], data[k].num_classes) for k in ids]
    return HostedSites(key, sites, info, first.num_classes)


def check_site_code(name: object, node_config: dict[str, Any], *, setting: str = "model") -> None:
    """The one check of every setting that names code a site would build (DP-SGLD's
    ``model``, PATE's ``teacher_model`` and ``student_model``): a built-in name passes,
    and an import path (``"module:function"``) passes only where the site's own node config
    names the same one (its ``model``). Run before anything is imported or called; the
    refusal says nothing of what the site has installed or what its node config names."""
    if not is_import_path(name) or node_config.get("model") == name:
        return
    raise ValueError(
        f"{setting} {name!r} refused: a site builds an imported model only when its own "
        f"node config names that factory (model = {name!r})"
    )


def check_site_model(config: Config, node_config: dict[str, Any]) -> None:
    """A deployed site builds an imported model factory (``model = "module:function"``)
    only when its own node config names the same one (:func:`check_site_code`): the
    server cannot make a site import code it did not choose."""
    check_site_code(config.run.model, node_config)


__all__ = [
    "UserObjects",
    "UserObjectsMod",
    "active",
    "cache_key",
    "check_site_code",
    "check_site_model",
    "hosted_user_sites",
    "user_objects_mod",
]
