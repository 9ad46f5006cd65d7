"""Per-round wall time of one DP-SGLD round over each transport, on the paper CNN.

    python benchmarks/round_latency.py [--sites 4 16] [--rounds 6] [--skip-local] [--skip-sim]
        [--skip-deploy] [--local-steps E] [--superexec-poll S] [--json]

Transports: the in-process engine (``fedsgld.engine.run``), the Flower apps over the
in-process ``LocalGrid`` (``fedsgld.apps.local_grid.run_local``), Flower's Ray simulation
(``flwr run .``) and a loopback deployment (one ``flower-superlink``, one
``flower-supernode`` per site, ``flwr run . <connection>``). Flower runs report the
server loop's own mean round time (``results.json`` -> ``round_wall_time_s``,
training rounds only, no evaluation, the first round (warm-up) left out); the engine's
results.json has the same field for its own loop. MNIST-5k, the
paper CNN, q = 0.064, no evaluation rounds. Every Flower process gets its own FLWR_HOME
under a temporary directory and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BASE = {
    "dataset": "mnist5k",
    "model": "cnn",
    "sample_rate": 0.064,
    "lr": 2.0,
    "temperature": 1.0,
    "decay_gamma": 0.5,
    "decay_t0": 50.0,
    "prenoise": 0.01,
    "epsilon": 4.0,
    "eval_every": 0,
    "checkpoint_every": 0,
    "burn_in": 1000,
    "max_samples": 0,
    "seed": 0,
    "threads": 1,
}


def _env(home: Path, **extra: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=os.pathsep.join(
            [str(Path(sys.executable).parent), env.get("PATH", "")]
        ),  # flower-superexec
        **extra,
    )
    return env


SUPEREXEC_POLL: float | None = None  # --superexec-poll: FLWR_SUPEREXEC_TASK_POLL_INTERVAL


def import_cost(repeats: int = 3) -> float:
    """Median wall time of a fresh interpreter importing what a site process imports."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import fedsgld.apps.client_app, fedsgld.clients.flower"],
            check=True,
        )
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_config(cfg: dict) -> str:
    return " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v!r}" for k, v in cfg.items())


def _stop(procs: list[subprocess.Popen], tag: str) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    # the detached local SuperLink of `flwr run` and SuperExec children carry our FLWR_HOME
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if tag.encode() in (d / "environ").read_bytes():
                    os.kill(int(d.name), signal.SIGTERM)
            except OSError:
                pass


def engine_round(sites: int, rounds: int, tmp: Path) -> float:
    from fedsgld import engine
    from fedsgld.config import load_config

    cfg = load_config(None, {**BASE, "sites": sites, "rounds": rounds})
    res = engine.run(cfg, out_dir=tmp / f"engine-{sites}", progress=False, log=lambda s: None)
    return res["round_wall_time_s"]["mean_after_first"]


def local_grid_round(sites: int, rounds: int, tmp: Path) -> float:
    from fedsgld.apps.local_grid import run_local

    out = tmp / f"local-{sites}"
    run_local({**BASE, "sites": sites, "rounds": rounds, "out": str(out)})
    return json.loads((out / "results.json").read_text())["round_wall_time_s"]["mean_after_first"]


def simulation_round(sites: int, rounds: int, tmp: Path) -> float:
    home = tmp / f"sim-home-{sites}"
    out = tmp / f"sim-{sites}"
    env = _env(home, FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_port()))
    try:
        subprocess.run(
            [str(BIN / "flwr"), "run", ".", "--stream",
             "--run-config", _run_config({**BASE, "sites": sites, "rounds": rounds, "out": str(out)}),
             "--federation-config", f"num-supernodes={sites} client-resources-num-cpus=1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=True,
        )  # fmt: skip
    finally:
        _stop([], str(home))
    return json.loads((out / "results.json").read_text())["round_wall_time_s"]["mean_after_first"]


def deployment_round(sites: int, rounds: int, tmp: Path) -> float:
    from fedsgld.apps.export_sites import export_sites
    from fedsgld.config import load_config

    root = tmp / f"deploy-{sites}"
    cfg = {**BASE, "sites": sites, "rounds": rounds}
    files = export_sites(load_config(None, cfg), root / "data")
    port = _port()
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> None:
        extra = (
            {}
            if SUPEREXEC_POLL is None
            else {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(SUPEREXEC_POLL)}
        )
        log = open(root / f"{name}.log", "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                args,
                env=_env(root / f"home-{name}", **extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    try:
        start(
            "link",
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
        )
        time.sleep(3)
        for k, f in enumerate(files):
            start(
                f"node{k}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(_port()),
                    "--node-config",
                    f"site-id={k} site-data='{f}'",
                ],
            )
        cli = root / "home-cli"
        cli.mkdir(parents=True, exist_ok=True)
        (cli / "config.toml").write_text(
            f'[superlink]\ndefault = "loop"\n\n[superlink.loop]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        out = root / "out"
        subprocess.run(
            [str(BIN / "flwr"), "run", ".", "loop", "--stream",
             "--run-config", _run_config({**cfg, "out": str(out), "poll-interval": 0.1})],
            cwd=ROOT, env=_env(cli), capture_output=True, text=True, timeout=3600, check=True,
        )  # fmt: skip
    finally:
        _stop(procs, str(root))
    return json.loads((out / "results.json").read_text())["round_wall_time_s"]["mean_after_first"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip-sim", action="store_true", help="skip Flower's Ray simulation")
    ap.add_argument("--skip-deploy", action="store_true", help="skip the loopback deployment")
    ap.add_argument(
        "--superexec-poll",
        type=float,
        default=None,
        help="deployment: seconds between the SuperNodes' SuperExec task polls "
        "(FLWR_SUPEREXEC_TASK_POLL_INTERVAL; Flower's default 1.0)",
    )
    ap.add_argument("--skip-local", action="store_true", help="skip the engine and LocalGrid")
    ap.add_argument(
        "--local-steps",
        type=int,
        default=0,
        help="noise_placement = 'sites' with this many local steps per round (default: server)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    global SUPEREXEC_POLL
    SUPEREXEC_POLL = args.superexec_poll
    if args.local_steps:
        BASE.update(noise_placement="sites", local_steps=args.local_steps)
    transports = {} if args.skip_local else {"engine": engine_round, "local_grid": local_grid_round}
    if not args.skip_sim:
        transports["simulation"] = simulation_round
    if not args.skip_deploy:
        transports["deployment"] = deployment_round
    res: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="fedsgld-latency-") as d:
        for name, fn in transports.items():
            for k in args.sites:
                t = fn(k, args.rounds, Path(d))
                res.setdefault(name, {})[str(k)] = t
                if not args.json:
                    print(f"{name:11s} {k:3d} sites: {t * 1000:9.1f} ms per round", flush=True)
    imports = import_cost()
    if args.json:
        print(
            json.dumps(
                {"seconds_per_round": res, "rounds": args.rounds, "site_process_import_s": imports}
            )
        )
    else:
        print(f"a fresh site process imports torch, flwr and fedsgld in {imports:.2f} s")
        for k in args.sites if "engine" in res else []:
            base = res["engine"][str(k)]
            print(
                f"{k} sites, relative to the in-process engine: "
                + ", ".join(f"{n} x{v[str(k)] / base:.1f}" for n, v in res.items())
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
