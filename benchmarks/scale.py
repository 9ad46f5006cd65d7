"""Many sites: the engine, Flower's Ray simulation of fedsgld, and Flower's own floor.

    python benchmarks/scale.py [--sites 4 16 64] [--rounds 4] [--json]

For each number of sites (the demo config: MNIST-5k, 5,000 records in all, DP-SGLD, the
paper CNN, q = 0.064, no evaluation rounds, one torch thread per site), in one run and
interleaved per site count:

``engine``  the in-process engine (``fedsgld.engine.run``);
``ray``     fedsgld's apps on Flower's Ray simulation (``flwr run .`` on its local
            SuperLink, one SuperNode per site, ``client-resources-num-cpus=1``);
``floor``   a trivial Flower app on the same simulation (``benchmarks/flower_floor``: a
            ClientApp echoing one vector of as many float32 parameters as the CNN has,
            Flower's ``FedAvg.start``, train messages only): what Flower's simulation costs
            whatever the clients compute.

Seconds per round: the median of rounds 2..``--rounds`` (the first warms up). Start-up:
the wall time of ``flwr run`` less its rounds (Ray and its actors starting, the app
loading, each node preparing its sites, fedsgld's final evaluation, the results
written); ``fedsgld start-up`` is Ray's less the floor's: what preparing fedsgld's apps
and sites adds. Ray's actors run at this process's niceness, as the engine does (Ray's
default adds 15: ``RAY_worker_niceness=0``). A second table splits Ray's start-up by the
moments fedsgld's streamed log lines appear: the SuperLink up and the run submitted
(Flower's own; the floor's in brackets), Ray with its actors, their imports and every
node's sites up to the server knowing the sites, the first round, the final evaluation
and result files (plots included), and stopping. The machine's load average is printed before and after. Every Flower process
gets its own FLWR_HOME and is stopped by PID at the end (:mod:`round_latency`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_latency import BIN, ROOT, _env, _port, _stop  # noqa: E402

from fedsgld.deploy.loopback import run_config_arg  # noqa: E402

FLOOR_APP = ROOT / "benchmarks" / "flower_floor"
DEMO = ROOT / "simulations" / "demo.toml"
RUN = {"eval_every": 0, "checkpoint_every": 0, "threads": 1}


def demo_config(sites: int, rounds: int) -> dict:
    """The demo's settings at ``sites`` sites for ``rounds`` rounds, no evaluation rounds."""
    from fedsgld.config import load_config

    return {**load_config(DEMO, {}).flat(), **RUN, "sites": sites, "rounds": rounds}


def engine_round(sites: int, rounds: int, tmp: Path) -> dict:
    from fedsgld import engine
    from fedsgld.config import Config

    cfg = Config.from_flat(demo_config(sites, rounds))
    t0 = time.perf_counter()
    res = engine.run(cfg, out_dir=tmp / f"engine-{sites}", progress=False, log=lambda s: None)
    wall = time.perf_counter() - t0
    rt = res["round_wall_time_s"]
    return {"round_s": rt["median_after_first"], "startup_s": wall - rt["count"] * rt["mean"]}


#: fedsgld's (and Flower's) streamed log lines that mark the phases of a run
MARKS = {
    "simulation": "Starting Flower Simulation",
    "sites": "[fedsgld] sites:",
    "stopped": "[fedsgld] stopped after",
    "results": "[fedsgld] results in",
}


def _flwr_run(app: Path, run_config: str, nodes: int, home: Path) -> tuple[float, dict]:
    """``flwr run`` of ``app`` on ``nodes`` simulated SuperNodes: its wall time, and when
    (seconds from its start) each of :data:`MARKS` first appeared in its output."""
    # Ray's actors at this process's niceness, as the engine (Ray's default adds 15)
    env = _env(home, FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_port()), RAY_worker_niceness="0")
    marks: dict[str, float] = {}
    lines: list[str] = []
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            [str(BIN / "flwr"), "run", str(app), "--stream", "--run-config", run_config,
             "--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1"],
            cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for line in proc.stdout:
            lines.append(line)
            for name, text in MARKS.items():
                if name not in marks and text in line:
                    marks[name] = time.perf_counter() - t0
        rc = proc.wait(timeout=3600)
    finally:
        _stop([], str(home))
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"flwr run {app} failed:\n{''.join(lines)[-3000:]}")
    return wall, {**marks, "exit": wall}


def _split(marks: dict[str, float]) -> dict[str, float]:
    """fedsgld's start-up by phase: the SuperLink up and the run submitted (Flower's own,
    the floor's too); Ray, its actors, their imports and every node's sites, up to the
    server knowing the sites; the final evaluation and result files (plots); the end."""
    return {
        "link_s": marks["simulation"],
        "to_sites_s": marks["sites"] - marks["simulation"],
        "final_s": marks["results"] - marks["stopped"],
        "exit_s": marks["exit"] - marks["results"],
    }


def ray_round(sites: int, rounds: int, tmp: Path) -> dict:
    out = tmp / f"ray-{sites}"
    cfg = run_config_arg({**demo_config(sites, rounds), "out": str(out)})
    wall, marks = _flwr_run(ROOT, cfg, sites, tmp / f"ray-home-{sites}")
    if not (out / "results.json").is_file():
        raise RuntimeError(f"the Ray simulation at {sites} sites wrote no results")
    rt = json.loads((out / "results.json").read_text())["round_wall_time_s"]
    split = {**_split(marks), "first_round_s": rt["first"]}
    return {"round_s": rt["median_after_first"], "startup_s": wall - rt["count"] * rt["mean"],
            "split": split}  # fmt: skip


def floor_round(sites: int, rounds: int, tmp: Path, params: int) -> dict:
    out = tmp / f"floor-{sites}.json"
    cfg = run_config_arg({"rounds": rounds, "params": params, "out": str(out)})
    wall, marks = _flwr_run(FLOOR_APP, cfg, sites, tmp / f"floor-home-{sites}")
    times = json.loads(out.read_text())["round_s"]
    return {"round_s": statistics.median(times[1:]), "startup_s": wall - sum(times),
            "link_s": marks["simulation"]}  # fmt: skip


def cnn_params() -> int:
    """How many parameters the demo's CNN has (what every train message carries)."""
    from fedsgld.config import Config
    from fedsgld.federation import initial_theta

    cfg = Config.from_flat(demo_config(4, 4))
    return int(initial_theta(cfg, (1, 28, 28), 10).numel())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first round is left out)")
    if any(k < 1 for k in args.sites):
        ap.error("--sites: every count must be at least 1")
    params = cnn_params()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedsgld-scale-") as d:
        for k in args.sites:
            tmp = Path(d) / str(k)
            tmp.mkdir()
            eng = engine_round(k, args.rounds, tmp)
            ray = ray_round(k, args.rounds, tmp)
            floor = floor_round(k, args.rounds, tmp, params)
            row = {
                "sites": k,
                "engine_s": eng["round_s"],
                "ray_s": ray["round_s"],
                "floor_s": floor["round_s"],
                "ray_over_engine": ray["round_s"] / eng["round_s"],
                "ray_over_floor": ray["round_s"] / floor["round_s"],
                "ray_startup_s": ray["startup_s"],
                "floor_startup_s": floor["startup_s"],
                "fedsgld_startup_s": ray["startup_s"] - floor["startup_s"],
                **{f"ray_{n}": v for n, v in ray["split"].items()},
                "floor_link_s": floor["link_s"],
            }
            rows.append(row)
            if not args.json:
                print(json.dumps({r: round(v, 3) for r, v in row.items()}), flush=True)
    result = {
        "params": params,
        "rounds": args.rounds,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nload average (1, 5, 15 min): before {result['load_before']}, "
          f"after {result['load_after']}; {params} parameters per message")  # fmt: skip
    print("| sites | engine s/round | Ray s/round | floor s/round | Ray / engine | "
          "Ray / floor | Ray start-up s | floor start-up s | fedsgld start-up s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sites']} | {r['engine_s']:.3f} | {r['ray_s']:.3f} | {r['floor_s']:.3f} | "
            f"{r['ray_over_engine']:.2f} | {r['ray_over_floor']:.2f} | "
            f"{r['ray_startup_s']:.1f} | {r['floor_startup_s']:.1f} | "
            f"{r['fedsgld_startup_s']:.1f} |"
        )
    print("\nRay start-up by phase, seconds (SuperLink up and run submitted; then Ray, "
          "its actors and every node's sites; first round; final evaluation and result "
          "files; stopping):")  # fmt: skip
    print("| sites | SuperLink (floor) | to sites known | first round | final | exit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sites']} | {r['ray_link_s']:.1f} ({r['floor_link_s']:.1f}) | "
            f"{r['ray_to_sites_s']:.1f} | {r['ray_first_round_s']:.1f} | "
            f"{r['ray_final_s']:.1f} | {r['ray_exit_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
