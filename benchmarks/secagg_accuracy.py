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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="simulations/demo.toml")
    ap.add_argument("--sites", type=int, nargs="+", default=[4])
    ap.add_argument("--epsilon", type=float, nargs="+", default=[4.0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default="runs/secagg_accuracy")
    ap.add_argument("--set", nargs="*", default=[], help="more settings, key=value")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--drop", type=int, default=0, help="sites silent in every secure round")
    ap.add_argument(
        "--placements", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
        help="which placements to run (default: all three)",
    )  # fmt: skip
    a = ap.parse_args()
    extra = parse_overrides(a.set)
    if a.rounds is not None:
        extra["rounds"] = a.rounds
    rows = []
    plan = f", max_dropouts {extra.get('max_dropouts', 0)}, {a.drop} silent per round"
    print("| sites | epsilon | placement | rounds | epsilon spent | accuracy | ECE | round s |")
    print("|---|---|---|---|---|---|---|---|")
    for k in a.sites:
        for eps in a.epsilon:
            for name in a.placements:
                over = VARIANTS[name]
                tag = name.replace(" + ", "_").replace(" ", "_")
                secure = "secure_aggregation" in over
                tag += f"_d{extra.get('max_dropouts', 0)}_s{a.drop}" if secure else ""
                r = one(a.config, Path(a.out) / f"k{k}_eps{eps:g}_{tag}",
                        {**extra, **over, "sites": k, "epsilon": eps},
                        drop=a.drop if secure else 0)  # fmt: skip
                rows.append({"sites": k, "budget": eps, "placement": name, **r})
                halted = ", halted by the budget" if r["halted"] else ""
                label = name + (plan if secure else "")
                print(f"| {k} | {eps:g} | {label} | {r['rounds']}{halted} | {r['epsilon']:.3f} "
                      f"| {r['accuracy']:.4f} | {r['ece']:.4f} | {r['round_s']:.2f} |",
                      flush=True)  # fmt: skip
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
