"""``fedsgld sweep CONFIG --grid KEY=V1,V2,...``: hyper-parameters chosen on validation
splits, run. What the command does for a user, and its options, are
:mod:`fedsgld.studies.sweep_options`.

This module holds the run (:func:`run_sweep` and ``main``); the grid and each trial's
settings are :mod:`fedsgld.studies.sweep_grid`, running the trials
:mod:`fedsgld.studies.sweep_trials`, the selection and verdict
:mod:`fedsgld.studies.sweep_selection`, the table and plot
:mod:`fedsgld.studies.sweep_report`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

from fedsgld.config import METHODS, parse_overrides
from fedsgld.files import write_json
from fedsgld.run.layout import new_run_dir
from fedsgld.run.tracking import SweepTracker
from fedsgld.studies.benchmark import load_benchmark
from fedsgld.studies.sweep_accounting import SelectionSettings
from fedsgld.studies.sweep_charge import charge_selection, selection_release
from fedsgld.studies.sweep_grid import (
    method_points,
    parse_grid,
    point_label,
    trial_config,
    trial_name,
)
from fedsgld.studies.sweep_options import SELECT, add_arguments
from fedsgld.studies.sweep_private import (
    check_ledgers,
    choose,
    draw_trials,
    plan_selection,
    selection_event,
    selection_record,
)
from fedsgld.studies.sweep_report import plot_accuracy_ece, sweep_markdown
from fedsgld.studies.sweep_selection import RECAL_METHODS, select_rows, verdict
from fedsgld.studies.sweep_trials import _Pool


def _check_options(select: str, validation_fraction: float, recal: float, workers: int) -> None:
    if select not in SELECT:
        raise ValueError(f"--select must be one of {', '.join(SELECT)}; got {select!r}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            f"--validation-fraction must be in (0, 1): selection needs a validation split; "
            f"got {validation_fraction!r}"
        )
    if not 0.0 <= recal < validation_fraction:
        raise ValueError(
            f"--recal must be in [0, --validation-fraction {validation_fraction:g}) (0: no "
            "+recal rows; its calibration split comes out of the records held out for "
            f"validation, so +recal trials train on as many records); got {recal!r}"
        )
    if workers < 1:
        raise ValueError(f"--workers must be >= 1; got {workers}")


def _settings(
    config_path: str | Path,
    sets: list[str] | None,
    methods: list[str] | None,
    seeds: list[int] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep's flat run settings and its benchmark table, ``--methods`` and
    ``--seeds`` applied."""
    config, bench = load_benchmark(config_path, parse_overrides(sets))
    if methods:
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ValueError(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
        bench["methods"] = methods
    if seeds is not None:
        if not seeds or any(s < 0 for s in seeds):
            raise ValueError(f"--seeds must be integers >= 0; got {seeds!r}")
        bench["seeds"] = seeds
    base = config.flat()
    if base["recal_fraction"]:
        raise ValueError(
            "the config sets recal_fraction; a sweep adds +recal rows with --recal F instead "
            "(the other rows then train on the whole budget)"
        )
    return base, bench


def _job(base, bench, root, validation_fraction, method, point, seed, phase, recal_fraction=0.0):
    """One trial: (what the sweep records of it, its flat settings, its directory)."""
    name = trial_name(method, point, seed, phase)
    flat = trial_config(base, bench, method, point, seed,
                        validation_fraction=validation_fraction, recal_fraction=recal_fraction)  # fmt: skip
    flat["tracking"] = "none"  # the sweep's process logs each trial as a child run
    meta = {"name": name, "method": method, "point": point, "point_label": point_label(point),
            "seed": seed, "phase": phase}  # fmt: skip
    return meta, flat, str(root / "trials" / name)


def _execute(pool: _Pool, batch, trials: list, failed: dict[str, str], *, progress, log,
             tracker=None) -> None:  # fmt: skip
    """Run ``batch`` on ``pool``: each finished trial joins ``trials``, each failed one
    ``failed`` (its first line of error); ``tracker`` logs each as a child run."""
    meta = {m["name"]: m for m, _, _ in batch}
    for name, r in pool.map([(m["name"], f, o) for m, f, o in batch], progress=progress):
        if isinstance(r, Exception):
            failed[name] = f"{type(r).__name__}: {r}".splitlines()[0][:300]
            log(f"sweep: trial {name} failed: {failed[name]}")
            if tracker is not None:
                tracker.trial(meta[name], error=failed[name])
        else:
            trials.append({**meta[name], "summary": r})
            if tracker is not None:
                tracker.trial(trials[-1])


def _ordered(table: dict[str, dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """The table's rows in the benchmark's method order, each method's rows last iterate,
    averaged, SWAG, recalibrated."""
    order = {m: i for i, m in enumerate(methods)}
    suffix = {"": 0, "+avg": 1, "+bma": 1, "+swag": 2, "+recal": 3}

    def rank(kv):
        row, t = kv
        return (order.get(t["method"], 99), suffix.get(row[len(t["method"]) :], 9), row)

    return dict(sorted(table.items(), key=rank))


def _write(root: Path, result: dict[str, Any], log) -> None:
    """sweep.json, sweep.md and (with a table) sweep_accuracy_ece.png under ``root``."""
    write_json(root / "sweep.json", result)
    (root / "sweep.md").write_text(sweep_markdown(result))
    if result["table"]:
        plot_accuracy_ece(result, root / "sweep_accuracy_ece.png")
    log(f"sweep written to {root} ({len(result['trials'])} trials, {len(result['failed'])} failed)")


# ---------------------------------------------------------------------------- the command
def run_sweep(
    config_path: str | Path,
    *,
    grid_items: list[str] | None = None,
    sets: list[str] | None = None,
    methods: list[str] | None = None,
    seeds: list[int] | None = None,
    select: str = "nll",
    validation_fraction: float = 0.2,
    recal: float = 0.0,
    out: str | Path | None = None,
    use_ray: bool = True,
    address: str | None = None,
    workers: int = 2,
    progress: bool = True,
    private: SelectionSettings | None = None,
    selection_seed: int | None = None,
    site_ledgers: str | Path | None = None,
    log=print,
) -> dict[str, Any]:
    """Run a sweep (see :mod:`fedsgld.studies.sweep_options`); with ``private`` a selection
    whose privacy is accounted (:mod:`fedsgld.studies.sweep_private`) instead of the table,
    charged to the sites' ledger files in ``site_ledgers`` (:mod:`fedsgld.studies.sweep_charge`)."""
    if site_ledgers is not None and private is None:
        raise ValueError("--site-ledgers charges a private selection: add --private-selection")
    _check_options(select if private is None else "nll", validation_fraction, recal, workers)
    base, bench = _settings(config_path, sets, methods, seeds)
    grid = parse_grid(grid_items, bench["methods"])
    root = Path(out) if out else new_run_dir(tag="sweep")
    pool_kw = dict(ray=use_ray, address=address, workers=workers, log=log)
    if private is not None:
        return _run_private(base, bench, grid, root, private, validation_fraction, recal,
                            selection_seed, pool_kw, progress, log, site_ledgers)  # fmt: skip
    return _run_grid(base, bench, grid, root, select, validation_fraction, recal, pool_kw,
                     progress, log)  # fmt: skip


def _run_grid(base, bench, grid, root, select, validation_fraction, recal, pool_kw, progress,
              log) -> dict[str, Any]:  # fmt: skip
    """The grid: every point and seed, the best point per method on validation ``select``
    (and, with ``recal``, each selected point again with private recalibration)."""
    (root / "trials").mkdir(parents=True, exist_ok=True)
    job = functools.partial(_job, base, bench, root, validation_fraction)
    jobs = [
        job(m, p, s, "grid")
        for m in bench["methods"]
        for p in method_points(grid, m)
        for s in bench["seeds"]
    ]
    log(
        f"sweep: {len(jobs)} trials ("
        + ", ".join(f"{m}: {len(method_points(grid, m))} points" for m in bench["methods"])
        + f" x {len(bench['seeds'])} seeds), selecting on validation {select}; in {root}"
    )
    tracker = SweepTracker(base, root, log=log) if base.get("tracking") == "mlflow" else None
    pool = _Pool(**pool_kw)
    trials: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    execute = functools.partial(_execute, pool, trials=trials, failed=failed,
                                progress=progress, log=log, tracker=tracker)  # fmt: skip
    try:
        execute(jobs)
        table = select_rows(trials, select)
        if recal:
            chosen = [(row, t) for row, t in table.items() if row in RECAL_METHODS]
            rjobs = [job(t["method"], t["point"], s, "recal", recal)
                     for _, t in chosen for s in bench["seeds"]]  # fmt: skip
            if rjobs:
                log(f"sweep: {len(rjobs)} recalibration trials at the selected points")
                execute(rjobs)
                table = select_rows(trials, select)
    except BaseException:
        if tracker is not None:
            tracker.stop()
        raise
    finally:
        pool.close()
    table = _ordered(table, bench["methods"])
    result = {
        "config": base,
        "methods": bench["methods"],
        "seeds": bench["seeds"],
        "grid": {m or "": axes for m, axes in grid.items()},
        "select": select,
        "validation_fraction": validation_fraction,
        "recal_fraction": recal,
        "table": table,
        "verdict": verdict(table),
        "trials": trials,
        "failed": failed,
        "wall_time_s": time.perf_counter() - t0,
        "note": "hyper-parameters chosen on validation splits held out of training; test "
        "metrics reported. The epsilon is one trial's; the choice among trials on private "
        "data is not accounted.",
    }
    _write(root, result, log)
    if tracker is not None:
        tracker.finish(root)
    result["out_dir"] = str(root)
    return result


def _run_private(base, bench, grid, root, settings, validation_fraction, recal, seed, pool_kw,
                 progress, log, site_ledgers=None) -> dict[str, Any]:  # fmt: skip
    """The accounted selection: plan (or refuse), draw, charge the sites' ledgers, run the
    drawn trials, choose."""
    job = functools.partial(_job, base, bench, root, validation_fraction)
    cands = [(m, p, job(m, p, 0, "private", recal)[1])
             for m in bench["methods"] for p in method_points(grid, m)]  # fmt: skip
    plan = plan_selection(cands, settings)
    if base.get("tracking") != "none":  # what the selection keeps private stays here too
        log("sweep: a private selection is not tracked (its trials' scores are private)")
    root.mkdir(parents=True, exist_ok=True)
    drawn = draw_trials(cands, settings, root / "selection_plan.json", seed)
    log(f"sweep: private selection over {len(cands)} grid points, epsilon_total "
        f"{plan['epsilon_total']:.4f} (one trial {plan['epsilon_trial']:.4f}) at delta "
        f"{settings.delta:g}; running the drawn trials")  # fmt: skip
    release = selection_release(plan["rdp_total"], selection_event(settings, plan))
    ledgers = charge_selection(root / "selection_plan.json", drawn, release, site_ledgers,
                               sites=int(base["sites"]), delta=float(base["delta"]))  # fmt: skip
    if ledgers is not None:
        log(f"sweep: the selection is charged to {len(ledgers)} sites' ledgers at "
            f"{drawn['site_ledgers']}")  # fmt: skip
    jobs = []
    for i, (c, s) in enumerate(zip(drawn["picks"], drawn["seeds"], strict=True)):
        m, p, _ = cands[c]
        meta, flat, o = job(m, p, s, f"private{i}", recal)
        jobs.append(({**meta, "index": i, "candidate": c}, flat, o))
    trials: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    pool = _Pool(**pool_kw) if jobs else None
    t0 = time.perf_counter()
    try:
        if pool is not None:
            _execute(pool, jobs, trials, failed, progress=progress, log=log)
    finally:
        if pool is not None:
            pool.close()
    if failed:
        raise RuntimeError(f"{len(failed)} trial(s) failed; rerun the same command to resume")
    check_ledgers(trials, plan["curves"])
    chosen = choose(trials, settings, drawn["score_entropy"])
    record = selection_record(settings, plan, drawn, chosen, int(base["sites"]), ledgers)
    record["wall_time_s"] = time.perf_counter() - t0
    write_json(root / "selection.json", record)
    log(f"sweep: selection written to {root / 'selection.json'}")
    return {**record, "out_dir": str(root), "verdict": _private_verdict(record), "failed": {}}


def _private_verdict(record: dict[str, Any]) -> str:
    c = record["chosen"]
    head = (f"Private selection: epsilon_total {record['epsilon_total']:.4f} at delta "
            f"{record['delta']:g} ({record['trials_run']} trials run)")  # fmt: skip
    if c is None:
        return head + "; no trial was drawn, nothing is selected."
    t = c["test"]["pooled"]
    return (f"{head}; chosen {c['row']} at {c['point_label']}: test accuracy "
            f"{t['accuracy']:.3f}, ECE {t['ece']:.4f}.")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        private = None
        if args.private_selection:
            if args.total_epsilon is None:
                raise ValueError("--private-selection needs --total-epsilon (the whole budget)")
            private = SelectionSettings(
                total_epsilon=args.total_epsilon, delta=_delta(args), mean=args.selection_mean,
                shape=args.selection_shape, score_noise=args.score_noise,
                select=args.select or "accuracy",
            )  # fmt: skip
        res = run_sweep(
            args.config, grid_items=args.grid, sets=args.set, methods=args.methods,
            seeds=args.seeds, select=args.select or "nll", validation_fraction=args.validation_fraction,
            recal=args.recal, out=args.out, use_ray=not args.no_ray, address=args.address,
            workers=args.workers, progress=not args.no_progress, private=private,
            selection_seed=args.selection_seed, site_ledgers=args.site_ledgers,
        )  # fmt: skip
    except (ValueError, OSError, RuntimeError) as err:
        print(f"fedsgld sweep: error: {err}", file=sys.stderr)
        return 2
    print(res["verdict"])
    return 1 if res["failed"] else 0


def _delta(args: argparse.Namespace) -> float:
    """The delta the selection is accounted at: the config's (after --set)."""
    base, _ = _settings(args.config, args.set, None, None)
    return float(base["delta"])


__all__ = [
    "add_arguments",
    "main",
    "method_points",
    "parse_grid",
    "run_sweep",
    "select_rows",
    "verdict",
]
