"""Run settings: privacy settings, performance settings and everything else, all frozen.

The bottom of fedsgld above the torch-free accountants: every other layer reads its
settings from here. What each module holds, top-down:

- :mod:`~fedsgld.config.settings`: :class:`Config`, a whole run, grouping
  :class:`PrivacySettings` (:mod:`~fedsgld.config.privacy_settings`; the only group that
  reaches the accountant and the result file's privacy block), :class:`PerfSettings` and
  :class:`RunSettings`;
- :mod:`~fedsgld.config.checks`: the valid choices and the checks behind every setting
  (each invalid value raises ``ValueError`` naming the setting and its valid range, before
  any work starts), and the message for an unknown setting;
- :mod:`~fedsgld.config.loading`: config files (flat TOML tables whose keys are the field
  names) and ``--set KEY=VALUE`` overrides;
- :mod:`~fedsgld.config.reference`: every field carries a one-line ``help`` in its
  metadata; :func:`settings_reference` reads them with the defaults, and ``fedsgld
  simulate -h``, ``fedsgld config`` and ``docs/config.md`` are generated from it;
- :mod:`~fedsgld.config.device`: the device setting resolved to a torch device.

Only the last imports torch, and only when a run asks for its device, so that the
command-line help is fast.
"""

from __future__ import annotations

from fedsgld.config.checks import (
    ACCOUNTANTS,
    DEVICES,
    LR_SCHEDULES,
    METHODS,
    MODELS,
    OPTIMIZERS,
    PARTITIONS,
    PLACEMENTS,
    RANDOMNESS,
    SECURE_NOISE,
    _choice,
    _int,
    _num,
    setting,
    unknown_settings_message,
)
from fedsgld.config.loading import flatten_tables, load_config, parse_overrides, parse_value
from fedsgld.config.privacy_settings import PrivacySettings
from fedsgld.config.reference import (
    SettingDoc,
    settings_markdown,
    settings_reference,
    settings_text,
    toml_value,
)
from fedsgld.config.settings import Config, PerfSettings, RunSettings

__all__ = [
    "ACCOUNTANTS",
    "DEVICES",
    "LR_SCHEDULES",
    "METHODS",
    "MODELS",
    "OPTIMIZERS",
    "PARTITIONS",
    "PLACEMENTS",
    "RANDOMNESS",
    "SECURE_NOISE",
    "Config",
    "PerfSettings",
    "PrivacySettings",
    "RunSettings",
    "SettingDoc",
    "_choice",
    "_int",
    "_num",
    "flatten_tables",
    "load_config",
    "parse_overrides",
    "parse_value",
    "setting",
    "settings_markdown",
    "settings_reference",
    "settings_text",
    "toml_value",
    "unknown_settings_message",
]
