"""Accuracy and ECE of ``server`` placement vs ``sites`` vs ``sites`` + secure aggregation.

    python benchmarks/secagg_accuracy.py [--sites 4 8] [--epsilon 4 1] [--rounds 300]
        [--config simulations/demo.toml] [--out runs/secagg_accuracy] [--set key=value ...]
        [--placements server sites "sites + secure aggregation"] [--drop N]

For every (sites, epsilon), three in-process runs of the demo config (MNIST-5k, CNN,
DP-SGLD, same seed and round limit): the noise added by the server (``server``), each site
adding the full noise to its own sum and stepping locally (``sites``, one local step per
round), and each site adding its share of the distributed discrete Gaussian to a secure sum
(``sites`` + ``secure_aggregation``). Prints one markdown row per run: rounds taken
(the budget may stop a run first), the reported epsilon, and the last iterate's pooled test
accuracy and ECE. The secure-aggregation shares come from the operating system: its rows
are not reproducible to the digit. ``--drop N`` (secure aggregation only, with
``--set max_dropouts=D``, N <= D): the last N sites fall silent at the ``masked_input``
step of every round (:func:`fedsgld.engine.secure_round`'s ``drop``): the round completes
without their inputs, the survivors' unmasking shares cancel their pairwise masks.
Each row also gives the median wall seconds of a round (results.json
``round_wall_time_s.median``).

``--seeds 0 1 2`` runs every row with each seed (the config's ``seed``: data split, model
initialisation, samples and, outside secure aggregation, the noise) and then prints one
row per (sites, epsilon, placement) with the mean and the standard deviation over the
seeds; ``--docs FILE`` writes that table into FILE between the markers
``<!-- secagg_accuracy:begin -->`` and ``<!-- secagg_accuracy:end -->``. A run whose
directory already holds ``results.json`` is read, not rerun, so an interrupted command
continues where it stopped (remove ``--out`` to start afresh).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

from _report import add_report_option, report_cli  # benchmarks/_report.py

from fedsgld import engine
from fedsgld.config import load_config
from fedsgld.config.loading import parse_overrides

VARIANTS = {
    "server": {"noise_placement": "server"},
    "sites": {"noise_placement": "sites", "local_steps": 1},
    "sites + secure aggregation": {
        "noise_placement": "sites",
        "local_steps": 1,
        "secure_aggregation": True,
    },
}


def dropping_rounds(silent: int):
    """The engine's ``one_round`` with the last ``silent`` sites silent from
    ``masked_input`` on in every round."""
    one_round = engine.one_round

    def round_with_drops(fed, server):
        if not silent:
            return one_round(fed, server)
        plan = server.plan()
        if plan is None:
            return None
        k = len(fed.sites)
        return engine.secure_round(fed, server, plan,
                                   drop=dict.fromkeys(range(k - silent, k), "masked_input"))  # fmt: skip

    return round_with_drops


def one(config: str, out: Path, over: dict, drop: int = 0) -> dict:
    done = out / "results.json"
    if done.is_file():  # a finished run of an earlier, interrupted command
        res = json.loads(done.read_text())
    else:
        cfg = load_config(config, over)
        saved = engine.one_round
        engine.one_round = dropping_rounds(drop)  # engine.run looks it up when it starts
        try:
            res = engine.run(cfg, out_dir=out, progress=False, log=lambda s: None)
        finally:
            engine.one_round = saved
    pr, m = res["privacy"], res["metrics"]["pooled"]
    return {
        "rounds": pr["steps"],
        "halted": pr["halted"],
        "epsilon": pr["epsilon"][pr["rigorous_accountant"]],
        "accuracy": m["accuracy"],
        "ece": m["ece"],
        "round_s": res["round_wall_time_s"]["median"],
    }


BEGIN, END = "<!-- secagg_accuracy:begin -->", "<!-- secagg_accuracy:end -->"


def _spread(values: list[float], digits: int) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summary(rows: list[dict]) -> str:
    """One markdown row per (sites, epsilon, placement): means ± std over the seeds."""
    lines = [
        "| sites | budget epsilon | placement | rounds | epsilon spent | accuracy | ECE | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["sites"], r["budget"], r["placement"]) for r in rows))
    for k, eps, name in keys:
        got = [r for r in rows if (r["sites"], r["budget"], r["placement"]) == (k, eps, name)]
        steps = sorted({r["rounds"] for r in got})
        span = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        halted = sum(r["halted"] for r in got)
        span += f" ({halted} halted by the budget)" if halted else ""
        lines.append(
            f"| {k} | {eps:g} | {name} | {span} | {max(r['epsilon'] for r in got):.3f} "
            f"| {_spread([r['accuracy'] for r in got], 4)} | {_spread([r['ece'] for r in got], 4)} "
            f"| {len(got)} |"
        )
    return "\n".join(lines)


def write_docs(path: Path, table: str, command: str) -> None:
    """Replace what lies between the markers in ``path`` with ``table``."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"--docs: {path} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = f"{BEGIN}\n<!-- written by: {command} -->\n\n{table}\n\n{END}"
    path.write_text(head + body + tail)


def main() -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="simulations/demo.toml")
    ap.add_argument("--sites", type=int, nargs="+", default=[4])
    ap.add_argument("--epsilon", type=float, nargs="+", default=[4.0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="seeds (default: the config's)"
    )
    ap.add_argument("--out", default="runs/secagg_accuracy")
    ap.add_argument("--set", nargs="*", default=[], help="more settings, key=value")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", type=Path, default=None, help="write the summary into this file")
    ap.add_argument("--drop", type=int, default=0, help="sites silent in every secure round")
    ap.add_argument(
        "--placements", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
        help="which placements to run (default: all three)",
    )  # fmt: skip
    add_report_option(ap)
    a = ap.parse_args()
    extra = parse_overrides(a.set)
    if a.rounds is not None:
        extra["rounds"] = a.rounds
    seeds = a.seeds if a.seeds is not None else [None]
    rows = []
    plan = f", max_dropouts {extra.get('max_dropouts', 0)}, {a.drop} silent per round"
    plan = plan if extra.get("max_dropouts", 0) or a.drop else ""
    print(
        "| sites | epsilon | placement | seed | rounds | epsilon spent | accuracy | ECE | round s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k in a.sites:
        for eps in a.epsilon:
            for name in a.placements:
                for seed in seeds:
                    over = VARIANTS[name]
                    tag = name.replace(" + ", "_").replace(" ", "_")
                    secure = "secure_aggregation" in over
                    tag += f"_d{extra.get('max_dropouts', 0)}_s{a.drop}" if secure else ""
                    tag += f"_seed{seed}" if seed is not None else ""
                    seeded = {"seed": seed} if seed is not None else {}
                    r = one(a.config, Path(a.out) / f"k{k}_eps{eps:g}_{tag}",
                            {**extra, **over, **seeded, "sites": k, "epsilon": eps},
                            drop=a.drop if secure else 0)  # fmt: skip
                    label = name + (plan if secure else "")
                    rows.append({"sites": k, "budget": eps, "placement": label, "seed": seed, **r})
                    halted = ", halted by the budget" if r["halted"] else ""
                    print(f"| {k} | {eps:g} | {label} | {seed} | {r['rounds']}{halted} "
                          f"| {r['epsilon']:.3f} | {r['accuracy']:.4f} | {r['ece']:.4f} "
                          f"| {r['round_s']:.2f} |", flush=True)  # fmt: skip
    table = summary(rows)
    print()
    print(table)
    if a.docs is not None:
        write_docs(
            a.docs, table, "python benchmarks/secagg_accuracy.py " + shlex.join(sys.argv[1:])
        )
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    with report_cli():
        main()
