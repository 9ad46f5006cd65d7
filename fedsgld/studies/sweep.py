"""``fedsgld sweep CONFIG --grid KEY=V1,V2,...``: hyper-parameters chosen on validation splits.

CONFIG is a benchmark config (run settings plus an optional ``[benchmark]`` table with
``methods``, ``seeds``, per-method ``overrides`` and ``calibrate_dpsgd``: see
:mod:`fedsgld.studies.benchmark`). Every ``--grid`` adds one axis; ``--grid dpsgld.temperature=..``
adds it for that method only. Each method runs every point of its own grid with every
seed, as an independent trial on Ray (a local Ray instance by default, an existing cluster
with ``--address``), one result directory per trial under ``OUT/trials/``.

Selection never looks at the test split. Every trial holds ``validation_fraction`` of each
site's training split out (``--validation-fraction``, default 0.2) and evaluates every model
there as well; for each table row (a method's last iterate, ``+avg``/``+bma``, ``+swag``)
the grid point with the best mean validation score over the seeds (``--select``, default
NLL) is chosen, and the row reports that point's TEST metrics, mean and standard deviation
over the seeds, pooled and per site. With ``--recal F`` the selected point of each
non-variational method is run again with ``recal_fraction = F`` (a calibration split held
out, private temperature scaling whose epsilon is reserved in the same budget), giving the
``+recal`` rows.

Tuning on private data has a privacy cost of its own: the reported epsilon is that of one
trial, not of the choice among them (Papernot & Steinke 2022). The sweep is for benchmarks
on data that may be used for tuning, or to fix settings before a private run.

Written: OUT/sweep.json (every trial, the selection, the table), OUT/sweep.md (the table,
per-site results and a sentence on which private model is best calibrated at which
accuracy cost) and OUT/sweep_accuracy_ece.png (test accuracy against ECE, every row's
grid points faint, the selected point bold). A crashed or interrupted sweep resumes:
finished trials are read back, unfinished ones resume from their checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from fedsgld.config import METHODS, Config, parse_overrides, parse_value

#: validation metrics a sweep can select on, and whether larger is better
SELECT = {"nll": False, "accuracy": True, "ece": False, "brier": False, "ace": False}
#: columns of the summary table
COLUMNS = ("accuracy", "nll", "ece", "ace", "brier")
#: methods whose last iterate can be temperature-scaled (``+recal``)
RECAL_METHODS = ("sgd", "dpsgd", "dpsgld")
PRIVATE = ("dpsgd", "dpsgld", "dpvi")
#: the verdict also names the best calibrated private row this close to the most accurate
NEAR_ACCURACY = 0.02


# ---------------------------------------------------------------------------- the grid
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


# ---------------------------------------------------------------------------- trials
@functools.lru_cache(maxsize=256)
def _dpsgd_sigma(q: float, steps: int, eps: float, delta: float, acc: str, grid: float,
                 extra: tuple) -> float:  # fmt: skip
    from fedsgld.studies.benchmark import calibrate_noise_multiplier

    return calibrate_noise_multiplier(
        sample_rate=q, steps=steps, epsilon=eps, delta=delta, accountant=acc,
        sigma_grid=grid, extra=list(extra) or None,
    )  # fmt: skip


def trial_config(
    base: dict[str, Any], bench: dict[str, Any], method: str, point: dict[str, Any], seed: int,
    *, validation_fraction: float, recal_fraction: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """A trial's flat run settings: the benchmark's for this method, the grid point, the
    seed, the validation split, one thread (trials run side by side) unless set, and for
    DP-SGD with ``calibrate_dpsgd`` the noise multiplier that spends the budget in
    ``rounds`` steps (recalibration steps included)."""
    from fedsgld.calibration.recal import RecalPlan
    from fedsgld.studies.benchmark import method_settings

    flat = {**base, **method_settings(method, bench, None), **point, "seed": seed}
    flat["validation_fraction"] = validation_fraction
    if recal_fraction:
        flat["recal_fraction"] = recal_fraction
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


def rows_of(method: str, block: dict[str, Any], metrics: dict[str, Any] | None) -> dict[str, str]:
    """{row name: key in ``block``} for one trial's result blocks (``metrics`` names the
    averaged model honestly: ``+bma`` or ``+avg``)."""
    from fedsgld.posteriors import iterate_average

    out = {}
    for key in block:
        if key == "last":
            out[method] = key
        elif key == "posterior":
            suffix = ((metrics or {}).get("posterior") or {}).get("suffix")
            out[method + (suffix or iterate_average(method)["suffix"])] = key
        elif key in ("swag", "recal"):
            out[f"{method}+{key}"] = key
    return out


def summarize_trial(res: dict[str, Any]) -> dict[str, Any]:
    """What the sweep keeps of one trial's results.json: per row, validation and test
    metrics (pooled and per site), steps and epsilon."""
    m = res["metrics"]
    test = {"last": {"pooled": m["pooled"], "sites": m["sites"]}}
    for key in ("posterior", "swag", "recal"):
        if m.get(key):
            test[key] = {"pooled": m[key]["pooled"], "sites": m[key]["sites"]}
    val = {k: v for k, v in (res.get("validation") or {}).items() if k != "note"}
    p = res["privacy"]
    return {
        "test": test,
        "validation": val,
        "steps": p["steps"],
        "epsilon": p["epsilon"].get(p.get("rigorous_accountant", "pld")),
        "halt_reason": p.get("halt_reason"),
        "out_dir": res.get("out_dir"),
        "recal_temperature": (m.get("recal") or {}).get("temperature"),
        "posterior_suffix": (m.get("posterior") or {}).get("suffix"),
    }


def run_trial(flat: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """One trial (in this process): resumes from its directory when a run started there."""
    import json

    from fedsgld import engine

    out = Path(out_dir)
    done = out / "results.json"
    if done.is_file():
        res = json.loads(done.read_text())
        res["out_dir"] = str(out)
        return summarize_trial(res)
    resume = (out / "checkpoint.pt").is_file() or (out / "ledger.json").is_file()
    res = engine.run(
        Config.from_flat(flat), out_dir=out, resume=resume, progress=False, log=lambda s: None
    )
    return summarize_trial(res)


class _Pool:
    """Trials side by side: Ray tasks (``workers`` CPUs locally, or an existing cluster),
    or this process one after another (``ray = False``)."""

    def __init__(self, *, ray: bool, address: str | None, workers: int, log) -> None:
        self.ray = None
        if ray:
            import os

            import ray as _ray

            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if not _ray.is_initialized():
                kw: dict[str, Any] = dict(
                    include_dashboard=False, log_to_driver=False, configure_logging=False
                )
                if address:
                    _ray.init(address=address, **kw)
                else:
                    _ray.init(num_cpus=workers, **kw)
            self.ray = _ray
            self._remote = _ray.remote(num_cpus=1, max_retries=0)(run_trial)
            where = address or f"a local Ray instance with {workers} CPU(s)"
            log(f"sweep: trials run as Ray tasks on {where}")

    def map(self, jobs: list[tuple[str, dict, str]], *, progress: bool):
        """Yield (name, summary or exception) as trials finish."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc="sweep trials", unit="trial")
        try:
            if self.ray is None:
                for name, flat, out in jobs:
                    try:
                        r: Any = run_trial(flat, out)
                    except Exception as err:  # reported per trial; the others go on
                        r = err
                    if bar:
                        bar.update()
                    yield name, r
                return
            pending = {self._remote.remote(flat, out): name for name, flat, out in jobs}
            while pending:
                done, _ = self.ray.wait(list(pending), num_returns=1)
                name = pending.pop(done[0])
                try:
                    r = self.ray.get(done[0])
                except Exception as err:
                    r = err
                if bar:
                    bar.update()
                yield name, r
        finally:
            if bar:
                bar.close()

    def close(self) -> None:
        if self.ray is not None:
            self.ray.shutdown()


# ---------------------------------------------------------------------------- selection
def select_rows(trials: list[dict[str, Any]], select: str) -> dict[str, dict[str, Any]]:
    """For each row, the grid point with the best mean validation ``select`` over seeds
    (ties: the first point), and that point's test metrics aggregated over seeds.

    Rows of recalibration trials (phase ``recal``) are only their ``+recal`` rows; the
    other rows of those runs trained on a smaller split and budget and are not compared."""
    from fedsgld.studies.benchmark import _mean_std

    higher = SELECT[select]
    by_row: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for t in trials:
        s = t["summary"]
        rows = rows_of(t["method"], s["test"], {"posterior": {"suffix": s["posterior_suffix"]}})
        for row, key in rows.items():
            if (t["phase"] == "recal") != row.endswith("+recal"):
                continue
            by_row.setdefault(row, {}).setdefault(t["point_label"], []).append(
                {**t, "row_key": key}
            )
    out: dict[str, dict[str, Any]] = {}
    for row, points in by_row.items():
        scored = []
        for label, ts in points.items():
            vals = [t["summary"]["validation"].get(t["row_key"], {}).get("pooled", {}).get(select)
                    for t in ts]  # fmt: skip
            v = _mean_std([x for x in vals if x is not None])["mean"]
            scored.append((label, v, ts))
        finite = [x for x in scored if not math.isnan(x[1])]
        if not finite:
            continue
        best = (max if higher else min)(finite, key=lambda x: x[1])
        label, v, ts = best
        key = ts[0]["row_key"]
        pooled = [t["summary"]["test"][key]["pooled"] for t in ts]
        sites = sorted(ts[0]["summary"]["test"][key]["sites"], key=int)
        out[row] = {
            "method": ts[0]["method"],
            "point": ts[0]["point"],
            "point_label": label,
            "validation": {select: v},
            "seeds": [t["seed"] for t in ts],
            "pooled": {c: _mean_std([p.get(c) for p in pooled]) for c in (*COLUMNS, "auc")},
            "sites": {
                s: {
                    c: _mean_std([t["summary"]["test"][key]["sites"][s].get(c) for t in ts])
                    for c in COLUMNS
                }  # fmt: skip
                for s in sites
            },
            "steps": _mean_std([t["summary"]["steps"] for t in ts]),
            "epsilon": _mean_std([t["summary"]["epsilon"] for t in ts]),
            "grid": [
                {
                    "point_label": lb,
                    "validation": vv,
                    "test": {
                        c: _mean_std(
                            [t["summary"]["test"][t["row_key"]]["pooled"].get(c) for t in tt]
                        )["mean"]  # fmt: skip
                        for c in COLUMNS
                    },
                }
                for lb, vv, tt in scored
            ],
        }
    return out


def verdict(table: dict[str, dict[str, Any]]) -> str:
    """Which private row is best calibrated (lowest test ECE) and at which accuracy cost
    against the most accurate private row."""
    private = {r: t for r, t in table.items() if r.split("+")[0] in PRIVATE}
    if not private:
        return "No private method in this sweep."
    best = min(private, key=lambda r: private[r]["pooled"]["ece"]["mean"])
    top = max(private, key=lambda r: private[r]["pooled"]["accuracy"]["mean"])
    b, a = private[best]["pooled"], private[top]["pooled"]
    text = (
        f"Best calibrated private model: {best} (ECE {b['ece']['mean']:.4f}, accuracy "
        f"{b['accuracy']['mean']:.3f})"
    )
    if best == top:
        return text + ", also the most accurate private model."
    cost = b["accuracy"]["mean"] - a["accuracy"]["mean"]
    text += (
        f", {cost * 100:+.1f} accuracy points against the most accurate private model, "
        f"{top} (accuracy {a['accuracy']['mean']:.3f}, ECE {a['ece']['mean']:.4f})."
    )
    near = {
        r: t
        for r, t in private.items()
        if t["pooled"]["accuracy"]["mean"] >= a["accuracy"]["mean"] - NEAR_ACCURACY
    }
    if cost < -NEAR_ACCURACY:
        r = min(near, key=lambda r: near[r]["pooled"]["ece"]["mean"])
        p = near[r]["pooled"]
        text += (
            f" Within {NEAR_ACCURACY * 100:g} accuracy points of it, the best calibrated is "
            f"{r} (ECE {p['ece']['mean']:.4f}, accuracy {p['accuracy']['mean']:.3f})."
        )
    return text


# ---------------------------------------------------------------------------- outputs
def sweep_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    table = result["table"]
    lines = [
        "# fedsgld sweep",
        "",
        f"dataset `{cfg['dataset']}`, {cfg['sites']} sites ({cfg['partition']}), model "
        f"`{cfg['model']}`, epsilon {cfg['epsilon']:g} at delta {cfg['delta']:g}, up to "
        f"{cfg['rounds']} rounds, seeds {result['seeds']}. Each row's grid point was chosen "
        f"on the validation splits ({result['validation_fraction']:g} of each site's "
        f"training split) by mean {result['select']} over seeds; the metrics are on the test "
        "split (mean ± std over seeds).",
        "",
        "Grid: "
        + "; ".join(
            f"{m or 'every method'}: " + ", ".join(f"{k} in {v}" for k, v in axes.items())
            for m, axes in result["grid"].items()
        )
        + ".",
        "",
        "| row | selected | steps | epsilon | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for row, t in table.items():
        eps = t["epsilon"]["mean"]
        cells = [f"{t['pooled'][c]['mean']:.4f} ± {t['pooled'][c]['std']:.4f}" for c in COLUMNS]
        lines.append(
            f"| {row} | {t['point_label'] or '-'} | {t['steps']['mean']:.0f} | "
            f"{'inf' if eps is None or math.isinf(eps) else f'{eps:.3f}'} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", verdict(table), "", "## Per site: accuracy / ECE (test, mean over seeds)", ""]
    rows = list(table)
    if rows:
        sites = list(table[rows[0]]["sites"])
        lines.append("| site | " + " | ".join(rows) + " |")
        lines.append("|---|" + "---|" * len(rows))
        for s in sites:
            cells = [
                f"{table[r]['sites'][s]['accuracy']['mean']:.3f} / {table[r]['sites'][s]['ece']['mean']:.4f}"
                if s in table[r]["sites"] else "-"
                for r in rows
            ]  # fmt: skip
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if result["failed"]:
        lines += ["", "## Failed trials", ""]
        lines += [f"- `{n}`: {e}" for n, e in result["failed"].items()]
    lines += [
        "",
        "Rows: a method's name alone is its last iterate; `+bma` the posterior average of a "
        "Langevin chain; `+avg` an iterate average (not a posterior); `+swag` SWAG fitted to "
        "the kept iterates; `+recal` the last iterate privately temperature-scaled (run at the "
        "method's selected point with a calibration split held out; its epsilon is in the "
        "run's). The epsilon is one trial's: choosing among the grid on private data costs "
        "privacy of its own that it does not include.",
        "",
        "Plot: `sweep_accuracy_ece.png`. Every trial's directory is under `trials/`.",
        "",
    ]
    return "\n".join(lines)


def plot_accuracy_ece(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for i, (row, t) in enumerate(result["table"].items()):
        color = f"C{i % 10}"
        xs = [g["test"]["ece"] for g in t["grid"]]
        ys = [g["test"]["accuracy"] for g in t["grid"]]
        ax.scatter(xs, ys, s=14, color=color, alpha=0.3)
        ax.errorbar(
            t["pooled"]["ece"]["mean"], t["pooled"]["accuracy"]["mean"],
            xerr=t["pooled"]["ece"]["std"], yerr=t["pooled"]["accuracy"]["std"],
            fmt="o", color=color, label=row, markersize=7, capsize=2,
        )  # fmt: skip
    cfg = result["config"]
    ax.set_xlabel("test ECE (lower is better)")
    ax.set_ylabel("test accuracy")
    ax.set_title(
        f"{cfg['dataset']}, epsilon {cfg['epsilon']:g}: selected on validation (bold), "
        "grid (faint)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    log=print,
) -> dict[str, Any]:
    from fedsgld.engine import new_run_dir, write_json
    from fedsgld.studies.benchmark import load_benchmark

    if select not in SELECT:
        raise ValueError(f"--select must be one of {', '.join(SELECT)}; got {select!r}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            f"--validation-fraction must be in (0, 1): selection needs a validation split; "
            f"got {validation_fraction!r}"
        )
    if not 0.0 <= recal < 1.0:
        raise ValueError(f"--recal must be in [0, 1) (0: no +recal rows); got {recal!r}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1; got {workers}")
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
    grid = parse_grid(grid_items, bench["methods"])
    root = Path(out) if out else new_run_dir(tag="sweep")
    (root / "trials").mkdir(parents=True, exist_ok=True)

    def job(method, point, seed, phase, recal_fraction=0.0):
        name = trial_name(method, point, seed, phase)
        flat = trial_config(base, bench, method, point, seed,
                            validation_fraction=validation_fraction, recal_fraction=recal_fraction)  # fmt: skip
        meta = {"name": name, "method": method, "point": point, "point_label": point_label(point),
                "seed": seed, "phase": phase}  # fmt: skip
        return meta, flat, str(root / "trials" / name)

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
    pool = _Pool(ray=use_ray, address=address, workers=workers, log=log)
    trials: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    t0 = time.perf_counter()

    def execute(batch):
        meta = {m["name"]: m for m, _, _ in batch}
        for name, r in pool.map([(m["name"], f, o) for m, f, o in batch], progress=progress):
            if isinstance(r, Exception):
                failed[name] = f"{type(r).__name__}: {r}".splitlines()[0][:300]
                log(f"sweep: trial {name} failed: {failed[name]}")
            else:
                trials.append({**meta[name], "summary": r})

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
    finally:
        pool.close()
    order = {m: i for i, m in enumerate(bench["methods"])}
    suffix = {"": 0, "+avg": 1, "+bma": 1, "+swag": 2, "+recal": 3}

    def rank(kv):
        row, t = kv
        return (order.get(t["method"], 99), suffix.get(row[len(t["method"]) :], 9), row)

    table = dict(sorted(table.items(), key=rank))
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
    write_json(root / "sweep.json", result)
    (root / "sweep.md").write_text(sweep_markdown(result))
    if table:
        plot_accuracy_ece(result, root / "sweep_accuracy_ece.png")
    log(f"sweep written to {root} ({len(trials)} trials, {len(failed)} failed)")
    result["out_dir"] = str(root)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="benchmark config: run settings and a [benchmark] table")
    p.add_argument(
        "--grid", action="append", metavar="[METHOD.]KEY=V1,V2,...",
        help="one axis of the grid (repeatable); METHOD. limits it to that method",
    )  # fmt: skip
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run setting")
    p.add_argument("--methods", nargs="+", help="methods to sweep (default: the config's)")
    p.add_argument(
        "--seeds", nargs="+", type=int, help="seeds of every point (default: the config's)"
    )
    p.add_argument(
        "--select", default="nll", choices=sorted(SELECT),
        help="validation metric that picks each row's point (default: nll)",
    )  # fmt: skip
    p.add_argument(
        "--validation-fraction", type=float, default=0.2,
        help="share of each site's training split held out for selection, in (0, 1) (default 0.2)",
    )  # fmt: skip
    p.add_argument(
        "--recal", type=float, default=0.0, metavar="F",
        help="also run each selected sgd/dpsgd/dpsgld point with recal_fraction F (+recal rows)",
    )  # fmt: skip
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: local Ray)")
    p.add_argument(
        "--workers", type=int, default=2, help="CPUs of the local Ray instance (default 2)"
    )
    p.add_argument("--no-ray", action="store_true", help="run the trials in this process, in turn")
    p.add_argument("--out", default=None, help="output directory (default: a new one under runs/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    try:
        res = run_sweep(
            args.config, grid_items=args.grid, sets=args.set, methods=args.methods,
            seeds=args.seeds, select=args.select, validation_fraction=args.validation_fraction,
            recal=args.recal, out=args.out, use_ray=not args.no_ray, address=args.address,
            workers=args.workers, progress=not args.no_progress,
        )  # fmt: skip
    except (ValueError, OSError) as err:
        print(f"fedsgld sweep: error: {err}", file=sys.stderr)
        return 2
    print(res["verdict"])
    return 1 if res["failed"] else 0


__all__ = ["main", "method_points", "parse_grid", "run_sweep", "select_rows", "verdict"]
