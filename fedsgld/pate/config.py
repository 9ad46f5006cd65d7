"""The settings of a PATE run: :class:`PateConfig` (a flat TOML table), checked when built.

:func:`load_pate_config` reads ``simulations/pate_*.toml``; over Flower the same fields
travel as the run-config keys ``pate.<field>`` (:mod:`fedsgld.pate.flower`). ``mechanisms``
names the noisy aggregations of :mod:`fedsgld.pate.aggregation` to release labels with.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedsgld.config.checks import MAX_STEP_SIZE, MODELS, is_import_path

MECHANISMS = ("lnmax", "gnmax", "confident_gnmax")


@dataclass(frozen=True)
class PateConfig:
    """Settings of a PATE run (a flat TOML table; ``dataset_options`` a sub-table)."""

    dataset: str = "mnist5k"
    data_path: str = ""
    dataset_options: dict[str, Any] = field(default_factory=dict)
    sites: int = 4
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    test_fraction: float = 0.2
    public_fraction: float = 0.2
    queries: int = 500
    teachers_per_site: int = 25
    teacher_model: str = "mlp"
    student_model: str = "mlp"
    hidden: int = 64
    teacher_epochs: int = 30
    student_epochs: int = 40
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    threads: int = 0
    # the aggregator's noise: seeded (simulations: derived from seed) | os (deployments:
    # fresh operating-system entropy at the aggregator, never sent anywhere)
    randomness: str = "seeded"
    # privacy
    mechanisms: tuple[str, ...] = ("lnmax", "gnmax")
    delta: float = 1e-5
    lnmax_gamma: float = 0.2
    moments: int = 8
    gnmax_sigma: float = 10.0
    threshold: float = 0.0
    sigma1: float = 0.0
    sigma2: float = 0.0

    def __post_init__(self) -> None:
        def bad(name: str, rng: str) -> ValueError:
            return ValueError(f"{name} must be {rng}, got {getattr(self, name)!r}")

        for name in ("sites", "queries", "teachers_per_site", "hidden", "teacher_epochs",
                     "student_epochs", "batch_size", "moments"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "an integer >= 1")
        for name in ("seed", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "an integer >= 0")
        for name in ("test_fraction", "public_fraction", "delta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise bad(name, "a number in (0, 1)")
        for name in ("lr", "lnmax_gamma", "gnmax_sigma", "dirichlet_alpha"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise bad(name, "a finite number > 0")
        if self.lr > MAX_STEP_SIZE:  # the teachers' steps at a site: past it they overflow
            raise bad("lr", f"in (0, {MAX_STEP_SIZE:g}]")
        for name in ("teacher_model", "student_model"):
            if getattr(self, name) not in MODELS and not is_import_path(getattr(self, name)):
                raise bad(name, f"one of {', '.join(MODELS)} or 'package.module:function'")
        if self.randomness not in ("seeded", "os"):
            raise bad("randomness", "one of seeded, os")
        mech = tuple(self.mechanisms)
        object.__setattr__(self, "mechanisms", mech)
        if not mech or any(m not in MECHANISMS for m in mech) or len(set(mech)) != len(mech):
            raise bad("mechanisms", f"a non-empty list of distinct names from {MECHANISMS}")
        if "confident_gnmax" in mech:
            for name in ("threshold", "sigma1", "sigma2"):
                v = getattr(self, name)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise bad(name, "a finite number > 0 (needed by confident_gnmax)")


def load_pate_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PateConfig:
    """Read a TOML file of :class:`PateConfig` keys (unknown keys raise ``ValueError``)."""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    raw.update(overrides or {})
    known = {f.name for f in fields(PateConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown PATE config keys: {', '.join(unknown)}")
    if "mechanisms" in raw:
        raw["mechanisms"] = tuple(raw["mechanisms"])
    return PateConfig(**raw)


__all__ = ["MECHANISMS", "PateConfig", "load_pate_config"]
