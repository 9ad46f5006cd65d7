"""``fedsgld benchmark CONFIG``: several methods at the same (epsilon, delta), several seeds.

The config is a flat TOML file of run settings (like ``fedsgld simulate``'s) plus a
``[benchmark]`` table:

    [benchmark]
    methods = ["sgd", "dpsgd", "dpsgld"]   # plus rows for averaged models, see below
    seeds = [0, 1, 2]
    calibrate_dpsgd = true   # choose DP-SGD's sigma so that `rounds` steps spend exactly the budget

    [benchmark.overrides.sgd]  # settings of one method only (here: its own step size)
    lr = 0.05

Every (method, seed) is one ordinary run (its own result directory under OUT/runs/).
Besides each method's last iterate the table has a row per model the run derives at no
further privacy cost: the average over kept iterates, named honestly (``dpsgld+bma``, a
posterior average; ``sgd+avg``, ``dpsgd+avg``, ``dpvi+avg``, iterate averages), SWAG
fitted to the kept iterates (``+swag``) and, with ``recal_fraction > 0``, the privately
temperature-scaled last iterate (``+recal``, whose epsilon is part of the run's). The
benchmark writes OUT/benchmark.json and OUT/benchmark.md (mean and standard deviation over
seeds, per method, pooled and per site), OUT/reliability_methods.png (the methods'
pooled reliability diagrams on one plot, seed of the first run) and says plainly whether
the paper's finding (DP-SGD over-confident, DP-SGLD better calibrated at similar accuracy)
holds on this run.
OUT/calibration.md and OUT/calibration.json hold every metric with a 95 % bootstrap
interval and the paired comparisons with their verdicts (:mod:`.benchmark_intervals`).
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

from fedsgld import engine
from fedsgld.calibration.plots import plot_reliability_overlay
from fedsgld.calibration.recal import RecalPlan
from fedsgld.config import METHODS, Config, flatten_tables, parse_overrides
from fedsgld.files import write_json
from fedsgld.posteriors import iterate_average
from fedsgld.privacy import PrivacyAccountant
from fedsgld.run.layout import new_run_dir
from fedsgld.studies.benchmark_intervals import check_interval_settings, write_interval_report

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# the paper's finding: DP-SGLD better calibrated than DP-SGD at a similar accuracy, i.e.
# lower ECE and at most this much lower accuracy
ACCURACY_SLACK = 0.02

ROW_NAMES = (
    "A method's name alone is its last iterate. `+bma`: posterior average (Bayesian model "
    "averaging over a Langevin chain's samples); `+avg`: iterate average (the mean softmax "
    "over an optimiser's kept iterates, not a posterior); `+swag`: SWAG, a Gaussian fitted to "
    "the kept iterates and sampled. These cost no privacy. `+recal`: the last iterate "
    "temperature-scaled on each site's calibration split, whose epsilon is in the run's."
)

TABLE_METRICS = ("accuracy", "nll", "brier", "ece", "mce", "sce", "ace", "auc")


def calibrate_noise_multiplier(
    *,
    sample_rate: float,
    steps: int,
    epsilon: float,
    delta: float,
    accountant: str = "pld",
    sigma_grid: float = 0.0,
    tol: float = 1e-3,
    extra: list[tuple[float, float, int]] | None = None,
) -> float:
    """Smallest constant sigma (within ``tol``) whose ``steps`` steps keep epsilon <= budget.

    ``extra``: further steps [(q, sigma, count)] the run also spends (its reserved
    recalibration steps), composed with the ``steps`` training steps.

    ``sigma_grid`` is the run's accounting grid: sigma is judged after the same conservative
    rounding down that the run's accountant applies, so the run really gets ``steps`` steps.

    Bisection on sigma with the rigorous accountant; returns the upper end of the final
    bracket, so the returned sigma never overspends.
    """
    acc = PrivacyAccountant(delta=delta, accountant=accountant, sigma_rel_grid=sigma_grid)

    def eps(sigma: float) -> float:
        more = [(q, acc.bucket(sg), c) for q, sg, c in extra or []]
        return acc.rigorous_epsilon(ledger=[(sample_rate, acc.bucket(sigma), steps), *more])

    lo, hi = 0.3, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"no noise multiplier reaches epsilon={epsilon} in {steps} steps")
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if eps(mid) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def _mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation, skipping NaN/None; infinite values give inf."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    if any(math.isinf(v) for v in vals):
        return {"mean": float("inf"), "std": float("nan"), "n": len(vals)}
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


def _aggregate(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: _mean_std([b[k] for b in blocks]) for k in TABLE_METRICS}


def load_benchmark(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[Config, dict[str, Any]]:
    with Path(path).open("rb") as fh:
        raw = tomllib.load(fh)
    bench = dict(raw.pop("benchmark", {}))
    methods = bench.get("methods", ["sgd", "dpsgd", "dpsgld"])
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(
            f"benchmark.methods must be a non-empty list from {', '.join(METHODS)}; got {methods!r}"
        )
    seeds = bench.get("seeds", [0])
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ValueError(
            f"benchmark.seeds must be a non-empty list of integers >= 0; got {seeds!r}"
        )
    bench["methods"], bench["seeds"] = methods, seeds
    bench.setdefault("calibrate_dpsgd", True)
    check_interval_settings(bench)
    per_method = bench.setdefault("overrides", {})
    if not isinstance(per_method, dict):
        raise ValueError("benchmark.overrides must be a table of per-method tables")
    for m, over in per_method.items():
        if m not in methods or not isinstance(over, dict):
            raise ValueError(
                f"benchmark.overrides.{m}: must name one of the benchmark's methods "
                f"({', '.join(methods)}) and hold settings"
            )
        if "method" in over or "seed" in over:
            raise ValueError(f"benchmark.overrides.{m}: 'method' and 'seed' cannot be overridden")
    flat = flatten_tables(raw)
    flat.update(overrides or {})
    config = Config.from_flat(flat)
    for m, over in per_method.items():
        try:
            Config.from_flat({**flat, **over, "method": m})
        except ValueError as err:
            raise ValueError(f"benchmark.overrides.{m}: {err}") from None
    return config, bench


def _calibrated_dpsgd_sigma(base: dict[str, Any], bench: dict[str, Any], log) -> float | None:
    """DP-SGD's noise multiplier that spends the budget in ``rounds`` steps (None unless
    the benchmark runs DP-SGD with ``calibrate_dpsgd``)."""
    if "dpsgd" not in bench["methods"] or not bench["calibrate_dpsgd"]:
        return None
    # with recalibration the run also spends its reserved recalibration steps
    dpsgd_cfg = Config.from_flat(
        {**base, "method": "dpsgd", **bench.get("overrides", {}).get("dpsgd", {})}
    )
    recal = RecalPlan.from_config(dpsgd_cfg)
    dpsgd_sigma = calibrate_noise_multiplier(
        sample_rate=base["sample_rate"],
        steps=base["rounds"],
        epsilon=base["epsilon"],
        delta=base["delta"],
        accountant=base["accountant"],
        sigma_grid=base["sigma_grid"],
        extra=recal.ledger() if recal is not None else None,
    )
    log(
        f"DP-SGD noise multiplier calibrated to {dpsgd_sigma:.4f} for {base['rounds']} steps"
        + (" and the recalibration steps" if recal is not None else "")
    )
    return dpsgd_sigma


def _run_all(base, bench, dpsgd_sigma, out: Path, *, progress: bool, log):
    """Every method with every seed: the rows (one entry per run, derived rows included),
    the first seed's pooled test probabilities and labels per row (for the plot) and every
    seed's per-site test predictions per row (for the intervals)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    curves: dict[str, tuple] = {}
    preds: dict[str, list] = {}
    for method in bench["methods"]:
        for seed in bench["seeds"]:
            over = {**method_settings(method, bench, dpsgd_sigma), "seed": seed}
            cfg = Config.from_flat({**base, **over})
            log(f"== {method}, seed {seed}")
            res = engine.run(
                cfg, out_dir=out / "runs" / f"{method}-seed{seed}", progress=progress, log=log
            )
            entry = {
                "seed": seed,
                "steps": res["privacy"]["steps"],
                "epsilon": res["privacy"]["epsilon"],
                "halt_reason": res["privacy"]["halt_reason"],
                "pooled": res["metrics"]["pooled"],
                "sites": res["metrics"]["sites"],
                "out_dir": str(res.out_dir),
            }
            rows.setdefault(method, []).append(entry)
            ev = res.evaluations
            preds.setdefault(method, []).append(ev["last"].site_curves())
            if seed == bench["seeds"][0]:
                curves[method] = ev["last"].curve()
            for name, block, ev_key in derived_rows(method, res["metrics"]):
                rows.setdefault(name, []).append(
                    {
                        **entry,
                        "pooled": block["pooled"],
                        "sites": block["sites"],
                        "kind": block.get("kind"),
                        "samples": block.get("samples"),
                    }
                )
                p = ev.get(ev_key)
                if p is not None:
                    preds.setdefault(name, []).append(p.site_curves())
                if seed == bench["seeds"][0] and p is not None:
                    curves[name] = p.curve()
    return rows, curves, preds


def _table(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each row's metrics, steps and epsilons: mean and standard deviation over seeds."""
    table: dict[str, Any] = {}
    for method, entries in rows.items():
        site_ids = sorted(entries[0]["sites"], key=int)
        table[method] = {
            "pooled": _aggregate([e["pooled"] for e in entries]),
            "sites": {s: _aggregate([e["sites"][s] for e in entries]) for s in site_ids},
            "steps": _mean_std([e["steps"] for e in entries]),
            "epsilon": {
                k: _mean_std([e["epsilon"].get(k, float("nan")) for e in entries])
                for k in ("gdp", "pld", "rdp")
            },
        }
    return table


def run_benchmark(
    config: Config,
    bench: dict[str, Any],
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    log=print,
) -> dict[str, Any]:
    out = Path(out_dir) if out_dir else new_run_dir(tag="benchmark")
    out.mkdir(parents=True, exist_ok=True)
    base = config.flat()
    dpsgd_sigma = _calibrated_dpsgd_sigma(base, bench, log)
    rows, curves, preds = _run_all(base, bench, dpsgd_sigma, out, progress=progress, log=log)
    table = _table(rows)
    finding = paper_finding(table)
    result = {
        "config": base,
        "benchmark": bench,
        "dpsgd_noise_multiplier": dpsgd_sigma,
        "table": table,
        "runs": rows,
        "finding": finding,
    }
    write_json(out / "benchmark.json", result)
    (out / "benchmark.md").write_text(benchmark_markdown(result))
    plot_reliability_overlay(
        curves, out / "reliability_methods.png", title="pooled test, all methods"
    )
    full = {k: v for k, v in preds.items() if len(v) == len(bench["seeds"])}
    result["intervals"] = write_interval_report(
        out,
        full,
        dataset=base["dataset"],
        methods=bench["methods"],
        compare=bench.get("compare"),
        n_boot=bench["n_boot"],
        header=benchmark_markdown(result).split("\n")[:3],
    )
    log(f"benchmark written to {out} (intervals: calibration.md, calibration.json)")
    result["out_dir"] = str(out)
    return result


def method_settings(
    method: str, bench: dict[str, Any], dpsgd_sigma: float | None
) -> dict[str, Any]:
    """The settings one method's runs get on top of the benchmark's shared config: no
    pre-noise outside DP-SGLD, a constant step size for SGD and DP-SGD (whose noise
    multiplier is ``dpsgd_sigma`` when calibrated), no recalibration for variational
    methods, then the benchmark's own ``overrides`` of that method."""
    over: dict[str, Any] = {"method": method}
    if method != "dpsgld":
        over.update(prenoise=0.0)
    if method == "dpsgd":
        over["decay_gamma"] = 0.0
        if dpsgd_sigma is not None:
            over["noise_multiplier"] = dpsgd_sigma
    if method == "sgd":
        over["decay_gamma"] = 0.0
    if method in ("dpvi", "vi"):
        # temperature scaling applies to one network's logits, not to q's average;
        # variational methods train on the whole training split, unrecalibrated
        over["recal_fraction"] = 0.0
    over.update(bench.get("overrides", {}).get(method, {}))
    return over


def derived_rows(method: str, metrics: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """The rows a run adds beside its last iterate: (table name, metrics block, evaluation
    key). The kept iterates' average is ``METHOD+bma`` for Langevin methods (a posterior
    average) and ``METHOD+avg`` otherwise (an iterate average); ``METHOD+swag`` is SWAG
    fitted to the kept iterates, ``METHOD+recal`` the temperature-scaled last iterate."""
    out = []
    post = metrics.get("posterior")
    if post is not None:
        suffix = post.get("suffix") or iterate_average(method)["suffix"]
        out.append((method + suffix, post, "posterior"))
    for key in ("swag", "recal"):
        block = metrics.get(key)
        if block is not None:
            out.append((method + block["suffix"], block, key))
    return out


def paper_finding(table: dict[str, Any]) -> dict[str, Any]:
    """Knolle et al.: DP-SGD over-confident, DP-SGLD better calibrated at similar accuracy."""
    if "dpsgd" not in table or "dpsgld" not in table:
        return {"statement": "needs both dpsgd and dpsgld to compare"}
    out: dict[str, Any] = {}
    for variant in ("dpsgld", "dpsgld+bma"):
        if variant not in table:
            continue
        e_sgd = table["dpsgd"]["pooled"]["ece"]["mean"]
        e_sgld = table[variant]["pooled"]["ece"]["mean"]
        a_sgd = table["dpsgd"]["pooled"]["accuracy"]["mean"]
        a_sgld = table[variant]["pooled"]["accuracy"]["mean"]
        ratio = e_sgd / e_sgld if e_sgld > 0 else float("inf")
        # better calibrated AND at most ACCURACY_SLACK less accurate
        holds = ratio > 1.0 and a_sgld - a_sgd >= -ACCURACY_SLACK
        out[variant] = {
            "ece_ratio_dpsgd_over": ratio,
            "accuracy_difference": a_sgld - a_sgd,
            "holds": holds,
            "statement": (
                f"DP-SGD ECE {e_sgd:.4f} vs {variant} {e_sgld:.4f} (ratio {ratio:.2f}); accuracy "
                f"{a_sgd:.4f} vs {a_sgld:.4f} ({a_sgld - a_sgd:+.4f}). The paper's finding "
                + ("holds on this run." if holds else "does NOT hold on this run.")
                + (
                    f" (better calibrated, but more than {ACCURACY_SLACK:g} less accurate)"
                    if ratio > 1.0 and not holds
                    else ""
                )
            ),
        }
    return out


def benchmark_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# fedsgld benchmark",
        "",
        f"dataset `{cfg['dataset']}`, {cfg['sites']} sites ({cfg['partition']}), model `{cfg['model']}`, "
        f"epsilon {cfg['epsilon']:g} at delta {cfg['delta']:g}, up to {cfg['rounds']} rounds, "
        f"seeds {result['benchmark']['seeds']}.",
    ]
    for m, over in result["benchmark"].get("overrides", {}).items():
        lines.append(
            f"Settings of `{m}` only: " + ", ".join(f"`{k} = {v!r}`" for k, v in over.items()) + "."
        )
    if result["dpsgd_noise_multiplier"]:
        lines.append(
            f"DP-SGD noise multiplier calibrated to {result['dpsgd_noise_multiplier']:.4f}."
        )
    lines += ["", "## Pooled test metrics (mean ± std over seeds)", ""]
    lines += [ROW_NAMES, ""]
    cols = ["accuracy", "nll", "brier", "ece", "auc"]
    lines.append("| method | steps | epsilon (pld) | " + " | ".join(cols) + " |")
    lines.append("|---|---|---|" + "---|" * len(cols))
    for method, t in result["table"].items():
        cells = [f"{t['pooled'][c]['mean']:.4f} ± {t['pooled'][c]['std']:.4f}" for c in cols]
        eps = t["epsilon"]["pld"]["mean"]
        eps_s = "inf" if math.isinf(eps) else f"{eps:.3f}"
        lines.append(
            f"| {method} | {t['steps']['mean']:.0f} | {eps_s} | " + " | ".join(cells) + " |"
        )
    lines += ["", "## Per site: accuracy / ECE (mean over seeds)", ""]
    methods = list(result["table"])
    lines.append("| site | " + " | ".join(methods) + " |")
    lines.append("|---|" + "---|" * len(methods))
    sites = list(next(iter(result["table"].values()))["sites"])
    for s in sites:
        cells = []
        for m in methods:
            r = result["table"][m]["sites"][s]
            cells.append(f"{r['accuracy']['mean']:.3f} / {r['ece']['mean']:.4f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "## Does the paper's finding hold?", ""]
    for v in result["finding"].values():
        lines.append(f"- {v['statement'] if isinstance(v, dict) else v}")
    lines += ["", "Plot: `reliability_methods.png`; each run's own directory is under `runs/`.", ""]
    return "\n".join(lines)


def main_benchmark(args) -> int:
    try:
        config, bench = load_benchmark(args.config, parse_overrides(args.set))
    except (ValueError, OSError) as err:
        print(f"fedsgld benchmark: error: {err}", file=sys.stderr)
        return 2
    res = run_benchmark(config, bench, out_dir=args.out, progress=not args.no_progress)
    for v in res["finding"].values():
        print(v["statement"] if isinstance(v, dict) else v)
    return 0


__all__ = [
    "calibrate_noise_multiplier",
    "load_benchmark",
    "main_benchmark",
    "method_settings",
    "run_benchmark",
]
