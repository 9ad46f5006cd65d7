"""``fedsgld sweep CONFIG --private-selection``: a hyper-parameter choice that is accounted.

The procedure (Papernot & Steinke 2022; the accounting is
:mod:`fedsgld.studies.sweep_accounting`):

1. Plan: every grid point's trial ledger (training and recalibration steps as its own
   accountant will allow them) and its score releases give one trial's RDP curve; the
   pointwise maximum over the points, repeated and selected with a random number of
   trials, gives epsilon_total. If it exceeds ``--total-epsilon`` the sweep refuses
   before any trial runs (a refused selection costs nothing).
2. Draw K, then for each trial a grid point and a seed, uniformly, with a generator that
   stays with the party running the selection (seeded by ``--selection-seed`` only for
   reproducible simulations; else from the operating system). The draws are written to
   ``OUT/selection_plan.json`` before any trial runs, and a rerun reuses them, so rerunning
   cannot redraw K.
3. Run the K trials; each releases a noisy validation score for each of its models
   (:func:`~fedsgld.studies.sweep_accounting.noisy_score`); the (trial, model) with the best
   noisy score is the result. Each trial's recorded ledger is checked against its plan.

Every site's records take part in every trial, so every site is charged the selection's
epsilon_total; ``OUT/selection.json`` lists the charge per site, with epsilon_trial, the
distribution of K and the chosen point (its test metrics: the test split decides nothing).
Privacy caveat: only the chosen trial's output may leave the party that ran the selection;
the other trials' results (kept under ``OUT/trials/`` in a simulation) and K must not.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from fedsgld.files import write_json
from fedsgld.studies.sweep_accounting import (
    PRIVATE_METHODS,
    SCORE_HIGHER,
    SelectionSettings,
    draw_trial_count,
    ledger_rdp,
    noisy_score,
    planned_ledger,
    selection_curve,
    selection_epsilon,
    trial_rdp,
)
from fedsgld.studies.sweep_grid import point_label
from fedsgld.studies.sweep_selection import rows_of

#: models each trial may release a score for: last iterate, average, SWAG, recalibrated
MAX_ROWS = 4


def plan_selection(
    candidates: list[tuple[str, dict[str, Any], dict[str, Any]]], settings: SelectionSettings
) -> dict[str, Any]:
    """The accounting before any trial runs. ``candidates``: (method, point, flat settings
    of a trial at that point). ValueError when a method is not private or when the
    procedure's epsilon exceeds the settings' total."""
    bad = sorted({m for m, _, _ in candidates if m not in PRIVATE_METHODS})
    if bad:
        raise ValueError(
            f"--private-selection selects among private trials only ({', '.join(PRIVATE_METHODS)});"
            f" drop {bad} from --methods"
        )
    if not candidates:
        raise ValueError("--private-selection: the grid has no point")
    rows = [_rows(flat) for _, _, flat in candidates]
    ledgers = [planned_ledger(flat) for _, _, flat in candidates]
    curves = [trial_rdp(led, scores=r, score_noise=settings.score_noise)
              for led, r in zip(ledgers, rows, strict=True)]  # fmt: skip
    eps = selection_epsilon(curves, settings)
    if eps["epsilon_total"] > settings.total_epsilon:
        raise ValueError(
            f"the selection would spend epsilon {eps['epsilon_total']:.4f} at delta "
            f"{settings.delta:g} (one trial {eps['epsilon_trial']:.4f}, {settings.mean:g} trials "
            f"expected), more than --total-epsilon {settings.total_epsilon:g}; lower the "
            "per-trial epsilon (--set epsilon=...), --selection-mean, or raise --score-noise"
        )
    total = selection_curve(curves, settings)
    return {"ledgers": ledgers, "rows": rows, "curves": curves, "rdp_total": total, **eps}


def _rows(flat: dict[str, Any]) -> int:
    """How many models a trial with these settings releases a score for (an upper bound)."""
    n = 1 + (flat.get("max_samples", 0) > 0) + (flat.get("swag_samples", 0) > 0)
    return min(MAX_ROWS, n + (flat.get("recal_fraction", 0) > 0))


def draw_trials(
    candidates: list, settings: SelectionSettings, path: Path, seed: int | None
) -> dict[str, Any]:
    """K, and each trial's candidate index and seed: read back from ``path`` when a
    previous run of the same selection drew them, else drawn now and written there."""
    if path.is_file():
        drawn = json.loads(path.read_text())
        if drawn["settings"] != _settings_dict(settings) or drawn["candidates"] != len(candidates):
            raise ValueError(
                f"{path} holds the draws of a different selection; use a new --out (a selection "
                "cannot be drawn again on the same data)"
            )
        if "selection_id" not in drawn:  # drawn before sites were charged: name it now
            drawn["selection_id"] = secrets.token_hex(8)
            write_json(path, drawn)
        return drawn
    entropy = seed if seed is not None else secrets.randbits(128)
    rng = np.random.default_rng(entropy)
    k = draw_trial_count(settings, rng)
    picks = [int(rng.integers(len(candidates))) for _ in range(k)]
    seeds = [int(rng.integers(2**31 - 1)) for _ in range(k)]
    drawn = {
        "selection_id": secrets.token_hex(8),  # the sites' request key: charged once
        "settings": _settings_dict(settings),
        "candidates": len(candidates),
        "trials": k,
        "picks": picks,
        "seeds": seeds,
        "score_entropy": int(rng.integers(2**62)),
        "randomness": "seeded (--selection-seed): a reproducible simulation"
        if seed is not None
        else "operating system",
    }
    write_json(path, drawn)
    return drawn


def _settings_dict(s: SelectionSettings) -> dict[str, Any]:
    return {"total_epsilon": s.total_epsilon, "delta": s.delta, "mean": s.mean,
            "shape": str(s.shape), "score_noise": s.score_noise, "select": s.select}  # fmt: skip


def choose(trials: list[dict[str, Any]], settings: SelectionSettings, entropy: int) -> dict | None:
    """The (trial, model) with the best noisy validation score, or None without trials.
    Scores are released per model from the pooled validation mean and the public split
    sizes; ties go to the first."""
    rng = np.random.default_rng(entropy)
    best, best_key = None, None
    higher = SCORE_HIGHER[settings.select]
    for t in sorted(trials, key=lambda t: t["index"]):
        s = t["summary"]
        rows = rows_of(t["method"], s["test"], {"posterior": {"suffix": s["posterior_suffix"]}})
        for row, key in rows.items():
            value = s["validation"][key]["pooled"][settings.select]
            score = noisy_score(value, s["n_validation"], select=settings.select,
                                score_noise=settings.score_noise, rng=rng)  # fmt: skip
            k = score if higher else -score
            if best_key is None or k > best_key:
                best_key = k
                best = {"trial": t["name"], "method": t["method"], "point": t["point"],
                        "point_label": point_label(t["point"]), "seed": t["seed"], "row": row,
                        f"noisy_validation_{settings.select}": score,
                        "test": s["test"][key]}  # fmt: skip
    return best


def check_ledgers(trials: list[dict[str, Any]], curves: list[np.ndarray]) -> None:
    """Each finished trial's recorded ledger must be within its planned curve."""
    for t in trials:
        got = ledger_rdp([tuple(e) for e in t["summary"]["ledger"]])
        planned = curves[t["candidate"]]
        if np.any(got > planned * (1 + 1e-9) + 1e-12):
            raise RuntimeError(
                f"trial {t['name']} spent more than planned for the selection; its result "
                "cannot be released"
            )


def selection_event(settings: SelectionSettings, plan: dict[str, Any]) -> str:
    """The selection's event, in words (also the label of the sites' ledger entries)."""
    return (f"RepeatAndSelect(one trial: training + recalibration + {max(plan['rows'])} score "
            f"releases at sigma_v {settings.score_noise:g}; {settings.distribution()['name']} "
            f"number of trials, mean {settings.mean:g})")  # fmt: skip


def selection_record(
    settings: SelectionSettings, plan: dict[str, Any], drawn: dict[str, Any],
    chosen: dict | None, sites: int, ledgers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What ``OUT/selection.json`` holds. ``ledgers``: the charges written into the sites'
    own ledger files (:mod:`fedsgld.studies.sweep_charge`), None where they have none."""
    total = plan["epsilon_total"]
    event = selection_event(settings, plan)
    on_file = {c["site"]: c for c in ledgers or []}
    none = {
        "ledger": None,
        "status": "stated only: the sites have no ledger files (--site-ledgers)",
    }
    return {
        "epsilon_total": total,
        "epsilon_trial": plan["epsilon_trial"],
        "delta": settings.delta,
        "total_epsilon_budget": settings.total_epsilon,
        "accountant": "rdp (Papernot & Steinke 2022, Theorems 2 and 6)",
        "distribution": settings.distribution(),
        "select": settings.select,
        "score_noise": settings.score_noise,
        "trials_run": drawn["trials"],
        "randomness": drawn["randomness"],
        "chosen": chosen,
        "selection_id": drawn.get("selection_id"),
        "site_charges": [
            {
                "site": k,
                "event": event,
                "epsilon": total,
                "delta": settings.delta,
                **on_file.get(k, none),
            }
            for k in range(sites)
        ],  # fmt: skip
        "site_ledger_charge": "each site's ledger file records the selection's RDP curve as "
        "one release (charged before any trial ran), composed there with its other releases "
        "by PLD as the (epsilon, delta) pair the curve gives at a share of the site's delta"
        if ledgers
        else None,
        "note": "epsilon_total covers the whole procedure: every trial's training and "
        "recalibration steps and its noisy validation scores, repeated a random number of "
        "times and the best released. epsilon_trial is one trial's (the worst grid point, "
        "RDP). Only the chosen trial's output may be released.",
    }
