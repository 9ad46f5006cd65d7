"""A run's :class:`~fedsgld.config.Config` from what the Python API is given."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsgld.config import Config, load_config


def make_config(
    config: str | Path | Config | Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> Config:
    """A :class:`Config` from a TOML file, a Config, a flat mapping or nothing (defaults),
    with ``settings`` (flat config keys) over it; ValueError names an unknown key."""
    if isinstance(config, Config):
        return Config.from_flat({**config.flat(), **settings})
    if isinstance(config, Mapping):
        return load_config(None, {**config, **settings})
    return load_config(config, dict(settings))


__all__ = ["make_config"]
