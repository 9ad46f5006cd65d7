"""A sweep's grid and the settings of each of its trials: ``--grid`` parsed into axes,
the points of each method, trial names, and a trial's flat run settings (the benchmark's
for its method, the point, the seed, the validation split, DP-SGD's calibrated noise)."""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

from fedsgld.calibration.recal import RecalPlan
from fedsgld.config import Config, parse_value
from fedsgld.studies.benchmark import calibrate_noise_multiplier, method_settings


def parse_grid(items: list[str] | None, methods: list[str]) -> dict[str | None, dict[str, list]]:
    """``KEY=V1,V2`` / ``METHOD.KEY=V1,V2`` -> {method or None: {key: [values]}}.

    ValueError names the item when a key is unknown, a value list is empty, a method is not
    one of the sweep's or a key is given twice for the same method."""
    fields = set(Config.from_flat({}).flat())
    grid: dict[str | None, dict[str, list]] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--grid expects KEY=V1,V2,... or METHOD.KEY=V1,V2,...; got {item!r}")
        lhs, rhs = (t.strip() for t in item.split("=", 1))
        method, key = lhs.split(".", 1) if "." in lhs else (None, lhs)
        if method is not None and method not in methods:
            raise ValueError(
                f"--grid {item!r}: {method!r} is not one of the sweep's methods ({', '.join(methods)})"
            )
        if key not in fields:
            raise ValueError(f"--grid {item!r}: unknown setting {key!r} (see `fedsgld config`)")
        if key in ("method", "seed"):
            raise ValueError(f"--grid {item!r}: methods and seeds are set with --methods / --seeds")
        values = [parse_value(v.strip()) for v in rhs.split(",") if v.strip()]
        if not values:
            raise ValueError(f"--grid {item!r}: no values")
        if key in grid.setdefault(method, {}):
            raise ValueError(f"--grid: {lhs!r} given twice")
        grid[method][key] = values
    return grid


def method_points(grid: dict[str | None, dict[str, list]], method: str) -> list[dict[str, Any]]:
    """Every grid point of one method: the product of the shared and its own axes."""
    axes = {**grid.get(None, {}), **grid.get(method, {})}
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values())]


def point_label(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items())


def trial_name(method: str, point: dict[str, Any], seed: int, phase: str = "grid") -> str:
    parts = [method] + [f"{k}={v}" for k, v in point.items()] + [f"seed{seed}"]
    if phase != "grid":
        parts.insert(1, phase)
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", "__".join(parts))


@functools.lru_cache(maxsize=256)
def _dpsgd_sigma(q: float, steps: int, eps: float, delta: float, acc: str, grid: float,
                 extra: tuple) -> float:  # fmt: skip
    return calibrate_noise_multiplier(
        sample_rate=q, steps=steps, epsilon=eps, delta=delta, accountant=acc,
        sigma_grid=grid, extra=list(extra) or None,
    )  # fmt: skip


def trial_config(
    base: dict[str, Any], bench: dict[str, Any], method: str, point: dict[str, Any], seed: int,
    *, validation_fraction: float, recal_fraction: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """A trial's flat run settings: the benchmark's for this method, the grid point, the
    seed, the validation split (with recalibration: a calibration split of
    ``recal_fraction`` and a smaller validation split, so that the trial trains on as many
    records as the others), one thread (trials run side by side) unless set, and for
    DP-SGD with ``calibrate_dpsgd`` the noise multiplier that spends the budget in
    ``rounds`` steps (recalibration steps included)."""
    flat = {**base, **method_settings(method, bench, None), **point, "seed": seed}
    flat["validation_fraction"] = validation_fraction
    if recal_fraction:
        # as many records held out of training as the other trials: a calibration split of
        # recal_fraction and a validation split of v' with v' + recal_fraction (1 - v') = v
        flat["recal_fraction"] = recal_fraction
        flat["validation_fraction"] = (validation_fraction - recal_fraction) / (1 - recal_fraction)
    if not base.get("threads"):
        flat["threads"] = 1
    if method == "dpsgd" and bench.get("calibrate_dpsgd", True) and "noise_multiplier" not in point:
        cfg = Config.from_flat(flat)
        recal = RecalPlan.from_config(cfg)
        flat["noise_multiplier"] = _dpsgd_sigma(
            cfg.privacy.sample_rate, cfg.run.rounds, cfg.privacy.epsilon, cfg.privacy.delta,
            cfg.privacy.accountant, cfg.privacy.sigma_grid,
            tuple(recal.ledger()) if recal is not None else (),
        )  # fmt: skip
    Config.from_flat(flat)  # a bad point fails here, naming the setting, before any trial runs
    return flat
