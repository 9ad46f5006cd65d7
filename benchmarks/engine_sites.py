"""In-process round time against the number of sites, at fixed total data.

    python benchmarks/engine_sites.py [--sites 4 16 64 256 1024] [--rounds 4]
        [--per-site-up-to N] [--threads N] [--placement server|sites] [--local-steps N]
        [--json]

The demo configuration (``simulations/demo.toml``: MNIST-5k, 5,000 records in all (an IID
split with 20 % of each site's records held out for testing), the paper CNN, DP-SGLD with pre-noise, q = 0.064) split over each number of sites; for each,
one federation is built and its rounds are run by the engine's round
(:func:`fedsgld.engine.one_round`: plan, charge, every site's clipped sum, noise, step)
with each site's own per-record pass (``site_pass = "per_site"``) and with one pass over
all sites' records (``"batched"``), alternating, each from a fresh server. A number is the
median wall time of rounds 2..``--rounds`` (round 1 warms up), and the median CPU time
this process used in them (all its threads: what the round costs, less sensitive than
wall time to other jobs on a shared machine). ``ratio_to_4_sites`` divides
each by the 4-site time of the same pass; ``batched / per_site`` compares the passes at
the same number of sites. No evaluation rounds. ``--placement sites`` times the ``sites``
placement instead (every site adds its own full noise and runs ``--local-steps`` local
steps; the first, from the server's parameters, is the one the batched pass covers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from fedsgld.config.loading import load_config
from fedsgld.data import load_dataset, make_sites
from fedsgld.engine import one_round
from fedsgld.federation import Federation

PASSES = ("per_site", "batched")


def round_times(fed: Federation, site_pass: str, rounds: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each of ``rounds`` engine rounds from a fresh server."""
    cfg = fed.config
    fed.config = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, site_pass=site_pass))
    server = fed.make_server()
    out = []
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        if one_round(fed, server) is None:
            raise RuntimeError("the run stopped before the rounds were timed")
        out.append((time.perf_counter() - t, time.process_time() - c))
    fed.config = cfg
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per pass, >= 2")
    ap.add_argument(
        "--per-site-up-to",
        type=int,
        default=1024,
        help="time the per-site pass only up to this many sites (it grows linearly)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--placement", choices=("server", "sites"), default="server")
    ap.add_argument("--local-steps", type=int, default=1, help="with --placement sites")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.rounds < 2:
        raise ValueError(f"--rounds must be >= 2, got {args.rounds}")
    table: dict[int, dict[str, float]] = {}
    load = [os.getloadavg()[0]]
    for k in args.sites:
        over = {"sites": k, "eval_every": 0, "threads": args.threads}
        if args.placement == "sites":
            over |= {"noise_placement": "sites", "local_steps": args.local_steps}
        cfg = load_config("simulations/demo.toml", over)
        t0 = time.perf_counter()
        # the demo's split (IID, 20 % test per site), with sites of >= 4 records so that
        # 1,024 sites fit in 5,000 records (the config's split asks for >= 10)
        data = make_sites(load_dataset("mnist5k", seed=0), sites=k, seed=0, min_size=4)
        fed = Federation(cfg, log=lambda *_: None, site_data=data)
        build = time.perf_counter() - t0
        row = {"build_s": build}
        for p in PASSES:
            if p == "per_site" and k > args.per_site_up_to:
                row[p] = row[f"{p} cpu"] = float("nan")
                continue
            times = round_times(fed, p, args.rounds)[1:]
            row[p] = statistics.median(w for w, _ in times)
            row[f"{p} cpu"] = statistics.median(c for _, c in times)
        table[k] = row
        if not args.json:
            print(f"{k} sites: built in {build:.2f} s; " + ", ".join(
                f"{p} {row[p]:.4f} s/round ({row[f'{p} cpu']:.4f} CPU s)" for p in PASSES),
                flush=True)  # fmt: skip
    load.append(os.getloadavg()[0])
    base = table.get(4)
    for row in table.values():
        row["batched / per_site"] = row["batched"] / row["per_site"]
        row["batched / per_site cpu"] = row["batched cpu"] / row["per_site cpu"]
        if base:
            for p in (*PASSES, *(f"{q} cpu" for q in PASSES)):
                row[f"{p} ratio_to_4_sites"] = row[p] / base[p]
    if args.json:
        print(json.dumps({"load_average_1min": load, "placement": args.placement,
                          "local_steps": args.local_steps, "sites": table}, indent=1))  # fmt: skip
        return
    print(f"load average (1 min) at start and end: {load[0]:.1f}, {load[1]:.1f}")
    print("\n| sites | per-site s/round | batched s/round | batched / per-site | per-site / 4 "
          "sites | batched / 4 sites | per-site CPU s | batched CPU s | CPU: per-site / 4 sites "
          "| CPU: batched / 4 sites |")  # fmt: skip
    print("|---" * 10 + "|")
    for k, row in table.items():

        def r4(p: str, row: dict[str, float] = row) -> str:
            return f"{row[f'{p} ratio_to_4_sites']:.2f}" if base else "-"

        print(f"| {k} | {row['per_site']:.4f} | {row['batched']:.4f} | "
              f"{row['batched / per_site']:.2f} | {r4('per_site')} | {r4('batched')} | "
              f"{row['per_site cpu']:.4f} | {row['batched cpu']:.4f} | {r4('per_site cpu')} | "
              f"{r4('batched cpu')} |")  # fmt: skip


if __name__ == "__main__":
    main()
