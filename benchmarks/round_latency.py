"""Per-round wall time of one DP-SGLD round over each transport, on the paper CNN.

    python benchmarks/round_latency.py [--sites 4 16] [--rounds 6]
        [--transports engine,local_grid,ray,deploy,deploy_fast] [--task-poll S]
        [--local-steps E] [--json]
    python benchmarks/round_latency.py --demo [--json]

Transports (MNIST-5k, the paper CNN, q = 0.064, no evaluation rounds):

``engine``       the in-process engine (``fedsgld.engine.run``);
``local_grid``   the Flower apps over the in-process ``LocalGrid``;
``ray``          Flower's Ray simulation (``flwr run .`` on its local SuperLink);
``deploy``       a loopback deployment on Flower's stock ``flower-superlink`` and one stock
                 ``flower-supernode`` per site, with warm sites (the ``flwr-clientapp`` shim
                 of ``python -m fedsgld.deploy.warm install-shim`` first on each SuperNode's
                 PATH, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=--task-poll``, default 0.1);
``deploy_fast``  the same over the fast path: ``fedsgld superlink`` and one
                 ``fedsgld supernode`` per site (defaults), warm sites included.

Each number is the mean wall time of the rounds after the first (warm-up): the server
loop's own timer (``results.json`` -> ``round_wall_time_s.mean_after_first``, the same
key for every transport). The engine is timed first and again last, and its mean is used
(the machine's load drifts during a run; ``engine_runs`` has both).
Deployments use ``poll-interval = 0.05`` (how often
the ServerApp looks for replies). ``--json`` prints one object: ``engine``,
``local_grid``, ``ray``, ``deploy``, ``deploy_fast`` (seconds per round for the first
``--sites`` value), ``ratio_to_engine`` (each divided by ``engine``),
``seconds_per_round`` and ``ratio_to_engine_by_sites`` (every transport and site count),
``site_process_import_s``: the median time a fresh interpreter takes to import what a
site's task imports (what every message costs without warm sites), and
``cpu_busy_during_rounds``: for each deployment and site count, the fraction of the
machine's CPU time that was busy (``/proc/stat``, every process) while rounds 2..N ran,
which says whether the deployment's processes were waiting or computing.

``--demo`` runs ``simulations/demo.toml`` (DP-SGLD, 4 sites, until the budget halts it,
with its evaluation rounds) once in-process and once deployed on loopback over the fast
path, and reports the deployment's wall time (``flwr run`` start to finish), steps,
epsilon and pooled accuracy next to the in-process run's.

Every Flower process gets its own FLWR_HOME under a temporary directory and is stopped
by PID at the end (the detached local SuperLink of ``flwr run`` and the SuperExec
children are found by that FLWR_HOME in their environment). Flower's processes run with
Python's default bytecode caching (``PYTHONDONTWRITEBYTECODE`` removed from their
environment), as on a site's machine: the app bundle is compiled once, not per message.
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

from _report import add_report_option, report_cli  # benchmarks/_report.py

from fedsgld.deploy.loopback import flower_env
from fedsgld.deploy.loopback import run_config_arg as _run_config
from fedsgld.deploy.staging import stage_app

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRANSPORTS = ("engine", "local_grid", "ray", "deploy", "deploy_fast")
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
DEPLOY_RUN = {"poll-interval": 0.05, "wait-for-sites": 600.0, "round-timeout": 600.0}


def _env(home: Path, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = flower_env(home, PYTHONPATH=pythonpath.rstrip(os.pathsep), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def import_cost(tmp: Path, repeats: int = 3) -> float:
    """Median wall time of a fresh interpreter importing what a site's task imports (what
    every message costs a stock SuperNode without warm sites)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import fedsgld.apps.client_app, fedsgld.flower.sites, "
             "flwr.supernode.runtime.run_clientapp, torch.func, torch._dynamo"],
            check=True, env=_env(tmp / "import-home"),
        )  # fmt: skip
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}; log:\n{log.read_text()[-3000:]}")


def _stop(procs: list[subprocess.Popen], tag: str) -> None:
    """Stop our processes by PID: those started here (their sessions), then any process
    whose environment carries ``tag`` (a FLWR_HOME under our temporary directory)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = False
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    if tag.encode() in (d / "environ").read_bytes():
                        os.kill(int(d.name), sig)
                        found = True
                except OSError:
                    pass
        if not found:
            return
        time.sleep(3)


CPU_BUSY: dict[str, dict[str, float]] = {}  # transport -> sites -> busy fraction


class MachineLoad:
    """Samples how busy the machine's CPUs are (``/proc/stat``, all processes) while a
    deployment runs; :meth:`busy` is the busy fraction between two times."""

    def __init__(self, every: float = 0.2) -> None:
        import threading

        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v) - idle, sum(v)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = self._read()
            if r is not None:
                self.samples.append((time.time(), *r))
            self._stop.wait(self._every)

    def __enter__(self) -> MachineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, t0: float, t1: float) -> float | None:
        inside = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(inside) < 2:
            return None
        (_, b0, n0), (_, b1, n1) = inside[0], inside[-1]
        return (b1 - b0) / (n1 - n0) if n1 > n0 else None


def _rounds_window(out: Path, r: dict) -> tuple[float, float]:
    """About when rounds 2..N ran: ``ledger.json`` is written after the last round's
    replies, before its step; the rounds before it took ``mean_after_first`` each."""
    rt = r["round_wall_time_s"]
    end = (out / "ledger.json").stat().st_mtime
    return end - (rt["count"] - 2) * rt["mean_after_first"], end


def _flower_round(out: Path) -> float:
    return json.loads((out / "results.json").read_text())["round_wall_time_s"]["mean_after_first"]


def engine_round(sites: int, rounds: int, tmp: Path, **_) -> float:
    from fedsgld import engine
    from fedsgld.config import load_config

    cfg = load_config(None, {**BASE, "sites": sites, "rounds": rounds})
    res = engine.run(cfg, out_dir=tmp / f"engine-{sites}", progress=False, log=lambda s: None)
    return res["round_wall_time_s"]["mean_after_first"]


def local_grid_round(sites: int, rounds: int, tmp: Path, **_) -> float:
    from fedsgld.apps import APPS
    from fedsgld.flower.local_grid import run_local

    out = tmp / f"local-{sites}"
    run_local({**BASE, "sites": sites, "rounds": rounds, "out": str(out)}, **APPS)
    return _flower_round(out)


def ray_round(sites: int, rounds: int, tmp: Path, **_) -> float:
    home = tmp / f"ray-home-{sites}"
    out = tmp / f"ray-{sites}"
    env = _env(home, FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_port()))
    try:
        subprocess.run(
            [str(BIN / "flwr"), "run", str(stage_app(ROOT, tmp / f"app-{sites}")), "--stream",
             "--run-config", _run_config({**BASE, "sites": sites, "rounds": rounds, "out": str(out)}),
             "--federation-config", f"num-supernodes={sites} client-resources-num-cpus=1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=True,
        )  # fmt: skip
    finally:
        _stop([], str(home))
    return _flower_round(out)


def deploy(
    cfg: dict, tmp: Path, name: str, *, fast: bool, task_poll: float = 0.1
) -> tuple[dict, float]:
    """A loopback deployment of run config ``cfg`` (one SuperNode per site); the run's
    results.json and the wall time of ``flwr run``."""
    from fedsgld.clients.approve import approve
    from fedsgld.config import load_config
    from fedsgld.deploy.export_sites import export_sites
    from fedsgld.deploy.shim import install_shim

    root = tmp / name
    files = export_sites(
        load_config(None, {k: v for k, v in cfg.items() if "-" not in k}), root / "data"
    )
    procs: list[subprocess.Popen] = []
    fedsgld = [sys.executable, "-m", "fedsgld.deploy"]  # `fedsgld supernode` without the full CLI
    shim_dir = root / "warm-bin"  # stock path: the warm-site shim first on PATH
    install_shim(str(shim_dir))
    policy = root / "policy.toml"  # every site approves the bundle `flwr run .` submits
    root.mkdir(parents=True, exist_ok=True)  # a lifetime budget; this run's server placement
    policy.write_text(  # one machine, one owner: the exact sizes are public
        "epsilon = 1000.0\nplacements = ['server']\npublic_records = 'exact'\n"
        "public_test_records = 'exact'\n"
    )
    approve(ROOT, policy)

    def start(tag: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(root / f"{tag}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                             start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    def listening(tag: str, make_args, env: dict[str, str]) -> int:
        """Start a process on a free port and wait until it listens there; a port taken
        between choosing and binding it (another process's) is chosen again."""
        for attempt in range(3):
            port = _port()
            proc = start(tag, make_args(port), env)
            try:
                _wait_port(port, proc, root / f"{tag}.log")
                return port
            except RuntimeError:
                if proc.poll() is None or attempt == 2:
                    raise
        raise AssertionError("not reached")

    try:
        link_cmd = [*fedsgld, "superlink", "--"] if fast else [str(BIN / "flower-superlink")]
        port = listening(
            "link",
            lambda p: [*link_cmd, "--insecure", "--host", "127.0.0.1", "--port", str(p),
                       "--disable-runtime-dependency-installation"],
            _env(root / "home-link"),
        )  # fmt: skip
        for k, f in enumerate(files):
            if fast:
                cmd, env = [*fedsgld, "supernode", "--"], _env(root / f"home-node{k}")
            else:
                cmd = [str(BIN / "flower-supernode")]
                env = _env(
                    root / f"home-node{k}", FLWR_SUPEREXEC_TASK_POLL_INTERVAL=f"{task_poll:g}"
                )
                env["PATH"] = os.pathsep.join([str(shim_dir), env["PATH"]])
            listening(
                f"node{k}",
                lambda p, f=f, k=k, cmd=cmd: [*cmd, "--insecure", "--superlink",
                    f"127.0.0.1:{port}", "--port", str(p),
                    "--node-config", f"site-id={k} site-data='{f}' privacy-policy='{policy}'"],
                env,
            )  # fmt: skip
        cli = root / "home-cli"
        cli.mkdir(parents=True, exist_ok=True)
        (cli / "config.toml").write_text(
            f'[superlink]\ndefault = "loop"\n\n[superlink.loop]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        out = root / "out"
        t0 = time.perf_counter()
        with MachineLoad() as load:
            res = subprocess.run(
                [str(BIN / "flwr"), "run", str(stage_app(ROOT, root / "app")), "loop", "--stream",
                 "--run-config", _run_config({**cfg, **DEPLOY_RUN, "out": str(out)})],
                cwd=ROOT, env=_env(cli), capture_output=True, text=True, timeout=7200,
            )  # fmt: skip
        took = time.perf_counter() - t0
        if res.returncode != 0 or not (out / "results.json").is_file():
            raise RuntimeError(f"{name}: flwr run failed:\n{(res.stdout + res.stderr)[-3000:]}")
        r = json.loads((out / "results.json").read_text())
        if r["round_wall_time_s"]["count"] >= 3:
            busy = load.busy(*_rounds_window(out, r))
            if busy is not None:
                CPU_BUSY.setdefault("deploy_fast" if fast else "deploy", {})[str(len(files))] = (
                    round(busy, 3)
                )
        return r, took
    finally:
        _stop(procs, str(root))


def deploy_round(sites: int, rounds: int, tmp: Path, *, task_poll: float = 0.1, **_) -> float:
    r, _ = deploy({**BASE, "sites": sites, "rounds": rounds}, tmp, f"deploy-{sites}",
                  fast=False, task_poll=task_poll)  # fmt: skip
    return r["round_wall_time_s"]["mean_after_first"]


def deploy_fast_round(sites: int, rounds: int, tmp: Path, **_) -> float:
    r, _ = deploy({**BASE, "sites": sites, "rounds": rounds}, tmp, f"fast-{sites}", fast=True)
    return r["round_wall_time_s"]["mean_after_first"]


ROUND = {
    "engine": engine_round,
    "local_grid": local_grid_round,
    "ray": ray_round,
    "deploy": deploy_round,
    "deploy_fast": deploy_fast_round,
}


def demo(tmp: Path, threads: int = 1) -> dict:
    """simulations/demo.toml in-process and deployed over the fast path."""
    from fedsgld import engine
    from fedsgld.config import load_config

    cfg = load_config(ROOT / "simulations" / "demo.toml", {})
    t0 = time.perf_counter()
    eng = engine.run(cfg, out_dir=tmp / "demo-engine", progress=False, log=lambda s: None)
    eng_wall = time.perf_counter() - t0
    # a deployed site refuses seeded randomness: the deployment draws from the OS, so its
    # noise (and accuracy) differs from the seeded in-process run's
    # noise (and accuracy) differs from the seeded in-process run's. One torch thread per
    # site (``--demo-threads``): here the sites share this machine's cores
    dep, dep_wall = deploy(
        {**cfg.flat(), "randomness": "os", "threads": threads}, tmp, "demo-fast", fast=True
    )

    def summary(r: dict, wall: float) -> dict:
        p = r["privacy"]
        return {
            "wall_time_s": round(wall, 1),
            "steps": p["steps"],
            "epsilon": p["epsilon"][p["rigorous_accountant"]],
            "pooled_accuracy": r["metrics"]["pooled"]["accuracy"],
            "pooled_ece": r["metrics"]["pooled"]["ece"],
            "round_s": r["round_wall_time_s"]["mean_after_first"],
        }

    return {"engine": summary(eng, eng_wall), "deploy_fast": summary(dep, dep_wall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"comma-separated, from {', '.join(TRANSPORTS)} (default: all)",
    )
    ap.add_argument(
        "--task-poll",
        type=float,
        default=0.1,
        help="deploy (stock SuperNodes): FLWR_SUPEREXEC_TASK_POLL_INTERVAL (Flower: 1.0)",
    )
    ap.add_argument(
        "--local-steps",
        type=int,
        default=0,
        help="noise_placement = 'sites' with this many local steps per round (default: server)",
    )
    ap.add_argument("--demo", action="store_true", help="time simulations/demo.toml deployed")
    ap.add_argument(
        "--demo-threads",
        type=int,
        default=1,
        help="--demo: torch threads of each deployed site (default 1: the sites share this "
        "machine's cores; 0: torch's default)",
    )
    ap.add_argument("--json", action="store_true")
    add_report_option(ap)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first round is left out)")
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = sorted(set(names) - set(TRANSPORTS))
    if bad:
        ap.error(f"--transports: unknown {bad}; choose from {', '.join(TRANSPORTS)}")
    if args.local_steps:
        BASE.update(noise_placement="sites", local_steps=args.local_steps)
    with tempfile.TemporaryDirectory(prefix="fedsgld-latency-") as d:
        if args.demo:
            res = demo(Path(d), threads=args.demo_threads)
            print(json.dumps(res) if args.json else json.dumps(res, indent=1))
            return 0
        per: dict[str, dict[str, float]] = {}
        engine_runs: dict[str, list[float]] = {}
        # the engine is timed first and again last (the machine's load drifts): its mean
        order = names + (["engine"] if "engine" in names and len(names) > 1 else [])
        for i, name in enumerate(order):
            for k in args.sites:
                t = ROUND[name](k, args.rounds, Path(d) / str(i), task_poll=args.task_poll)
                if name == "engine":
                    engine_runs.setdefault(str(k), []).append(t)
                    t = sum(engine_runs[str(k)]) / len(engine_runs[str(k)])
                per.setdefault(name, {})[str(k)] = t
                if not args.json:
                    print(f"{name:12s} {k:3d} sites: {t * 1000:9.1f} ms per round", flush=True)
        imports = import_cost(Path(d))
    first = str(args.sites[0])
    out: dict = {n: per[n][first] for n in names}
    ratios = {
        k: {n: round(per[n][k] / per["engine"][k], 2) for n in names}
        for k in map(str, args.sites)
        if "engine" in per
    }
    if ratios:
        out["ratio_to_engine"] = ratios[first]
    out.update(
        site_process_import_s=round(imports, 2),
        seconds_per_round=per,
        ratio_to_engine_by_sites=ratios,
        cpu_busy_during_rounds=CPU_BUSY,
        engine_runs=engine_runs,
        rounds=args.rounds,
        sites=args.sites,
    )
    if args.json:
        print(json.dumps(out))
    for k, r in ratios.items() if not args.json else ():
        print(f"{k} sites, relative to the in-process engine: "
              + ", ".join(f"{n} x{v:.1f}" for n, v in r.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    with report_cli():
        raise SystemExit(main())
