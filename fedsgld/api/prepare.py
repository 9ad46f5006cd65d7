"""The Python API's arguments turned into a run: its config, its model and its sites, every
check made before any file is written or any budget spent (:mod:`fedsgld.api.checks`), the
plan applied (:mod:`fedsgld.api.plan`), and the early-stop warning given."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from fedsgld.api.checks import check_ignored_settings, checked_model, checked_sites
from fedsgld.api.configs import make_config
from fedsgld.api.plan import planned_config, warn_early_stop
from fedsgld.config import Config
from fedsgld.data.user import UserSites

ModelArg = Callable[[], nn.Module] | str | None


def split_arguments(
    model: ModelArg, sites: Sequence[Any] | int | None, settings: dict[str, Any]
) -> tuple[Callable[[], nn.Module] | None, Sequence[Any] | None, dict[str, Any]]:
    """(the model factory or None, the sites' data or None, the settings): a model's name
    and a number of sites become the config keys ``model`` and ``sites``."""
    if isinstance(model, str):
        settings, model = {**settings, "model": model}, None
    elif model is not None and not callable(model):
        raise ValueError("model: pass a function that returns an nn.Module (or a model's name)")
    if isinstance(sites, int) and not isinstance(sites, bool):  # the config key: a count
        settings, sites = {**settings, "sites": sites}, None
    if sites is not None:
        if isinstance(sites, (str, bytes)) or not isinstance(sites, Sequence):
            raise ValueError("sites: a list with one entry per site")
        settings = {**settings, "sites": len(sites)}
    return model, sites, settings


def prepare(
    config: str | Path | Config | Mapping[str, Any] | None,
    settings: Mapping[str, Any],
    model: Callable[[], nn.Module] | None,
    sites: Sequence[Any] | None,
    *,
    test_sites: Sequence[Any] | None,
    num_classes: int | None,
    small_sites: str,
    plan: str | None,
    resume: bool,
) -> tuple[Config, UserSites | None]:
    """The run's config (``plan`` applied) and the user's sites, every setting, record and
    the model checked; a new run that the budget will stop early warns once."""
    cfg = make_config(config, settings)  # every setting checked before any work
    check_ignored_settings(cfg, settings)
    cfg = planned_config(cfg, settings, plan)
    data = None
    if sites is not None:
        data = checked_sites(
            sites, test_sites, cfg, num_classes=num_classes, small_sites=small_sites
        )
    if model is not None and data is not None:
        checked_model(model, data, num_classes=num_classes)
    if not resume:
        warn_early_stop(cfg)
    return cfg, data


__all__ = ["ModelArg", "prepare", "split_arguments"]
