"""Per-round cost of secure aggregation with distributed discrete Gaussian noise.

    python benchmarks/secagg_cost.py [--sites 4 8] [--dim 100000] [--rounds 3] [--json]
    python benchmarks/secagg_cost.py --loopback [--sites 4 8] [--rounds 4] [--cold] [--fast]
        [--against sites server] [--json]
    python benchmarks/secagg_cost.py --engine [--sites 4 8 16] [--rounds 6] [--repeats 2]
        [--neighbours K] [--encoders auto|threads|processes] [--json]

For each number of sites K, ``--rounds`` whole rounds of :func:`fedsgld.secagg.run_round`
on K random vectors of ``--dim`` coordinates (noise multiplier 1.46, clip 1, no dropouts
planned; ``--max-dropouts`` to plan some), all parties in this one process. Reported
(medians over the rounds):

``site_s``         one site's compute (CPU seconds, robust to a loaded machine): its share
                   of the five steps (encoding, masking, signing and verifying, share
                   encryption and decryption), the sites' total divided by K (a
                   deployment runs the sites in parallel);
``consistency_s``  of which the consistency step (CPU seconds; printed in ms): checking and
                   signing U3;
``encode_s``       of which the DDG encoding (CPU seconds) (rotation, rounding, discrete Gaussian share);
``server_s``       the server's compute (CPU seconds): relaying, unmasking and decoding;
``round_s``        the in-process round's wall time: all parties one after the other;
``sent_kib`` / ``received_kib``: bytes one site sends / receives in the round
                   (:func:`fedsgld.secagg.message_bytes`), against ``plain_kib``, the
                   float32 vector a site sends without secure aggregation;
``server_received_kib`` / ``server_sent_kib``: the server's side of the same messages;
``bits``           the modulus 2^bits chosen by :func:`fedsgld.privacy.distributed.choose_ddg`.

``--drop N`` makes the last N sites fall silent from ``masked_input`` on in every round
(the server then rebuilds their mask keys and cancels their pairwise masks).
``--no-accounting`` skips the accounting below.

It also prints the accounting's price: epsilon of 60 and 600 DP-SGLD-like rounds
(q = 0.064, delta = 1e-5) under the distributed discrete Gaussian against the central
Gaussian (fedsgld's PLD accountant and RDP), and the noise multiplier the distributed
mechanism needs to reach the central epsilon.

``--engine`` measures whole rounds of the in-process engine (:func:`fedsgld.engine.run`)
on the model of ``simulations/demo.toml`` (MNIST-5k, the paper CNN, P = 26,010 padded to
d = 32,768; DP-SGLD, q = 0.064; its rounds cut to ``--rounds``, no evaluation rounds, a
budget that does not bind), for each K in ``--sites``: the ``sites`` placement (every site
adds its full noise), ``secure_aggregation = true`` (with ``--neighbours K``: SecAgg+'s
sparse neighbourhoods, ``secagg_neighbours = K``, where K <= sites - 2) and the
``server`` placement, one run
of each, ``--repeats`` times, in the orders ABC CBA ... (so that a drift in the machine's
load weighs on the three alike). Reported: the median wall time of rounds 2..N of each,
pooled over its runs (the first
includes warm-up: imports, key generation, the first accounting), the secure round's
ratio to the other two, and where the last secure round's time went
(:attr:`fedsgld.secagg.RoundResult.seconds`: the protocol's five steps, all parties, of
which the ``masked_input`` step: each site's guard, encoding and masking). ``--encoders``
sets the secure runs' ``secagg_encoders`` (where the sites' encodings run: the round's
threads, or child processes outside the interpreter lock); their CPU seconds include the
child processes' encodings.

``--loopback`` measures whole rounds of a real deployment instead
(:class:`fedsgld.deploy.loopback.Loopback`: one stock ``flower-superlink`` and one stock
``flower-supernode`` per site on 127.0.0.1, each with its own FLWR_HOME under a temporary
directory, started here and stopped by the PIDs started here). For each K in ``--sites``
it runs the model of ``simulations/demo.toml`` (MNIST-5k, the paper CNN, DP-SGLD, its
rounds cut to ``--rounds``, no evaluation rounds) twice on the same federation: with
``secure_aggregation = true`` (``noise_placement = "sites"``, ``local_steps = 1``) and in
the ``server`` placement. Each site has its own privacy-policy file (a budget of its own,
approving the bundle). Sites are warm (the ``flwr-clientapp`` shim of docs/deployment.md
first on PATH: a task is forked from a process that has imported torch); ``--cold`` runs
every task in a fresh interpreter, as Flower's own SuperNode does. Reported: the median
wall time of a round (the ServerApp's own timer, results.json ``round_wall_time_s``) of
both, their ratio, and the secure rounds' median protocol bytes and per-step seconds
(results.json ``flower.secure_aggregation``), and each run's peak memory: the summed
proportional set size (PSS, ``/proc/PID/smaps_rollup``) of the deployment's processes,
sampled every second.

The secure runs plan no dropouts, so they run one-shot rounds (``secagg_one_shot``, the
default: keys, then one masked input a round); ``--full`` runs the full protocol (five
steps, three a round when pipelined) for ``--engine`` and ``--loopback``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import add_report_option, report_to  # benchmarks/_report.py

from fedsgld.deploy.loopback import descendants
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.distributed import choose_ddg, ddg_epsilon
from fedsgld.secagg import encode, run_round

SIGMA, CLIP, Q, DELTA = 1.46, 1.0, 0.064, 1e-5


def one_size(sites: int, dim: int, rounds: int, max_dropouts: int, silent: int = 0) -> dict:
    p = choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=sites,
                   max_dropouts=max_dropouts, signal_norm=5000.0 * CLIP)  # fmt: skip
    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 0.01, dim) for _ in range(sites)]
    rows = []
    for r in range(rounds):
        t0 = time.perf_counter()
        drop = dict.fromkeys(range(sites - silent, sites), "masked_input")
        res = run_round(xs, p, round_label=b"bench %d" % r, max_dropouts=max_dropouts, drop=drop)
        wall = time.perf_counter() - t0
        c1 = time.process_time()
        encode(xs[0], p, b"bench encode")
        enc = time.process_time() - c1
        site = sum(v for k, v in res.cpu_seconds.items() if "(server)" not in k)
        server = sum(v for k, v in res.cpu_seconds.items() if "(server)" in k)
        check = res.cpu_seconds["consistency"] / sites
        rows.append((site / sites, enc, server, wall, check))
    med = [statistics.median(c) for c in zip(*rows)]
    return {
        "sites": sites,
        "max_dropouts": max_dropouts,
        "silent": silent,
        "dim": dim,
        "padded_dim": p.dim,
        "bits": p.bits,
        "site_s": med[0],
        "encode_s": med[1],
        "server_s": med[2],
        "round_s": med[3],
        "consistency_s": med[4],
        "sent_kib": statistics.mean(res.sent.values()) / 1024,
        "received_kib": statistics.mean(res.received.values()) / 1024,
        "plain_kib": 4 * dim / 1024,
        "server_received_kib": res.server_received / 1024,
        "server_sent_kib": res.server_sent / 1024,
    }


def accounting(sites: int, dim: int) -> dict:
    out = {}
    acc = PrivacyAccountant(delta=DELTA)
    for steps in (60, 600):
        p = choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=sites, signal_norm=5000.0)
        central = acc.rigorous_epsilon([(Q, SIGMA, steps)])
        ddg = ddg_epsilon([(Q, p, steps)], DELTA)[0]
        lo, hi = SIGMA, 4 * SIGMA  # the sigma at which the DDG reaches the central epsilon
        for _ in range(30):
            mid = (lo + hi) / 2
            pm = choose_ddg(
                noise_multiplier=mid, clip=CLIP, dim=dim, sites=sites, signal_norm=5000.0
            )
            lo, hi = (lo, mid) if ddg_epsilon([(Q, pm, steps)], DELTA)[0] <= central else (mid, hi)
        out[steps] = {"central_pld": central, "ddg": ddg, "ddg_sigma_for_central_eps": hi}
    return out


ROOT = Path(__file__).resolve().parents[1]
#: the demo's run config, without the keys a cost measurement does not want
SKIP = {"rounds", "burn_in", "thin", "max_samples", "eval_every", "checkpoint_every"}
LOOPBACK_RUN = {
    "eval_every": 0,
    "checkpoint_every": 0,
    "burn_in": 1000,
    "max_samples": 0,
    "threads": 1,
    "poll-interval": 0.05,
    "wait-for-sites": 600.0,
    "round-timeout": 600.0,
}
SECURE = {"secure_aggregation": True, "noise_placement": "sites", "local_steps": 1}
PLAIN = {"secure_aggregation": False, "noise_placement": "server"}


def demo_config() -> dict:
    import tomllib

    with open(ROOT / "simulations" / "demo.toml", "rb") as f:
        return {k: v for k, v in tomllib.load(f).items() if k not in SKIP}


def _pss_mib(pid: int) -> float:
    """A process's proportional set size (its private pages plus its share of shared ones)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration, ValueError):
        return 0.0  # gone, or not Linux


class PeakMemory:
    """The peak, over one-second samples, of the summed PSS of this process's descendants
    (the deployment's SuperLink, SuperNodes, fork servers, tasks and ServerApp)."""

    def __init__(self) -> None:
        import threading

        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            total = sum(_pss_mib(p) for p in descendants(os.getpid()))
            self.peak_mib = max(self.peak_mib, total)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def loopback_run(cfg: dict, root: Path, *, warm: bool, fast: bool = False) -> dict:
    """One deployment of run config ``cfg`` under ``root``; its results.json."""
    from fedsgld.config import load_config
    from fedsgld.deploy.export_sites import export_sites
    from fedsgld.deploy.loopback import Loopback, approved_policy

    files = export_sites(load_config(None, {k: v for k, v in cfg.items() if "-" not in k}),
                         root / "data")  # fmt: skip
    from fedsgld.secagg.identity import consortium_files

    keys, peers = consortium_files(root / "keys", range(len(files)))
    nodes = []
    for k, f in enumerate(files):  # each site's own policy: its budget, its key, the bundle
        text = (  # every placement measured: the site accepts them all
            f'epsilon = 100.0\nplacements = ["secure", "sites", "server"]\n'
            'public_records = "exact"\npublic_test_records = "exact"\n'
            f'signing_key = "{keys[k]}"\npeers = "{peers}"\n'
        )
        policy = approved_policy(root / f"site{k}" / "policy.toml", text)
        nodes.append(f"site-id={k} site-data='{f}' privacy-policy='{policy}'")
    with Loopback(root / "flwr") as lo:
        lo.start(nodes, warm=warm, fast=fast, timeout=300.0)
        return lo.run({**cfg, "out": str(root / "out")}, timeout=3600.0)


def model_size(cfg: dict) -> int:
    """P, the number of the model's parameters (what a plain round's theta_t and S_k hold)."""
    from fedsgld.config import load_config
    from fedsgld.federation import run_dataset
    from fedsgld.models import build_model

    config = load_config(None, {k: v for k, v in cfg.items() if "-" not in k})
    data = run_dataset(config, seed=0)
    model = build_model(config.run.model, input_shape=tuple(data.x.shape[1:]),
                        num_classes=data.num_classes, hidden=config.run.hidden)  # fmt: skip
    return sum(p.numel() for p in model.parameters())


#: what ``--loopback`` compares: the secure round against these placements
LOOPBACK_PLACEMENTS = {
    "sites": {"secure_aggregation": False, "noise_placement": "sites", "local_steps": 1},
    "server": PLAIN,
}


def loopback_cost(
    sites: int, rounds: int, tmp: Path, *, warm: bool, fast: bool = False,
    against: tuple[str, ...] = ("sites", "server"),
) -> dict:  # fmt: skip
    """The secure deployment of the demo's model with ``sites`` sites, and the same
    deployment in each placement of ``against`` (one fresh federation per run)."""
    base = {**demo_config(), **LOOPBACK_RUN, "sites": sites, "rounds": rounds}
    runs, peak = {}, {}
    tag = "fast" if fast else ("warm" if warm else "cold")
    todo = [("secure", SECURE), *((a, LOOPBACK_PLACEMENTS[a]) for a in against)]
    for name, over in todo:
        t0 = time.perf_counter()
        with PeakMemory() as mem:
            runs[name] = loopback_run({**base, **over}, tmp / f"{name}-{tag}-{sites}",
                                      warm=warm, fast=fast)  # fmt: skip
        peak[name] = mem.peak_mib
        print(f"K={sites} {tag} {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sec = runs["secure"]
    cost = sec["flower"]["secure_aggregation"]
    s = sec["round_wall_time_s"]["median"]
    plain_kib = 4 * model_size(base) / 1024  # theta_t out, S_k back: float32, per site
    out = {
        "sites": sites,
        "rounds": rounds,
        "path": tag,
        "dim": sec["privacy"]["secure_aggregation"]["last_round"]["dim"],
        "secure_round_s": s,
        "secure_step_s": cost["median_seconds"],
        "server_sent_kib": cost["median_server_sent_bytes"] / 1024,
        "server_received_kib": cost["median_server_received_bytes"] / 1024,
        "plain_server_sent_kib": sites * plain_kib,
        "plain_server_received_kib": sites * plain_kib,
        "secure_epsilon": sec["privacy"]["secure_aggregation"]["epsilon"],
        "peak_pss_gib": {name: mib / 1024 for name, mib in peak.items()},
    }
    for a in against:
        p = runs[a]["round_wall_time_s"]["median"]
        out[f"{a}_round_s"], out[f"ratio_to_{a}"] = p, s / p
    return out


def print_loopback(rows: list[dict]) -> None:
    against = [k[: -len("_round_s")] for k in rows[0] if k.endswith("_round_s")
               and not k.startswith("secure")]  # fmt: skip
    print("| K | path | rounds | secure round s (median) | "
          + "".join(f"`{a}` round s | secure / `{a}` | " for a in against)
          + "secure steps s: keys / shares / masked input / consistency / unmask "
          "| secure: server sent / received KiB per round "
          "| plain: server sent / received KiB per round "
          "| peak memory GiB (PSS): secure / plain |")  # fmt: skip
    print("|---" * (8 + 2 * len(against)) + "|")
    for r in rows:
        st = r["secure_step_s"]
        steps = " / ".join(f"{st.get(k, 0.0):.2f}" for k in
                           ("advertise_keys", "share_keys", "masked_input", "consistency",
                            "unmask"))  # fmt: skip
        vs = "".join(f"{r[f'{a}_round_s']:.2f} | {r[f'ratio_to_{a}']:.2f} | " for a in against)
        print(f"| {r['sites']} | {r['path']} | {r['rounds']} | {r['secure_round_s']:.2f} | {vs}"
              f"{steps} | {r['server_sent_kib']:.0f} / {r['server_received_kib']:.0f} | "
              f"{r['plain_server_sent_kib']:.0f} / {r['plain_server_received_kib']:.0f} | "
              f"{' / '.join(f'{v:.1f}' for v in r['peak_pss_gib'].values())} |")  # fmt: skip


def _kind() -> str:
    """The secure runs' protocol: one-shot rounds (the default with no dropouts) or full."""
    return "full" if SECURE.get("secagg_one_shot") is False else "one-shot"


def main_loopback(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedsgld-secagg-") as tmp:
        rows = [loopback_cost(k, args.rounds, Path(tmp), warm=not args.cold, fast=args.fast,
                              against=tuple(args.against)) for k in args.sites]  # fmt: skip
    load = (load, os.getloadavg()[0])
    if args.json:
        print(json.dumps({"loopback": rows, "load_average": load}, indent=2))
        return
    path = "fast path" if args.fast else ("cold" if args.cold else "warm") + " stock sites"
    print(f"loopback deployment, {path}, demo CNN (padded dim {rows[0]['dim']}), {_kind()} "
          f"secure rounds; load average {load[0]:.1f} at the start, {load[1]:.1f} at the "
          "end:")  # fmt: skip
    print_loopback(rows)


ENGINE_RUN = {"eval_every": 0, "checkpoint_every": 0, "burn_in": 1000, "max_samples": 0,
              "epsilon": 1000.0}  # fmt: skip
PLACEMENTS = {
    "sites": {"secure_aggregation": False, "noise_placement": "sites", "local_steps": 1},
    "secure": SECURE,
    "server": PLAIN,
}


def engine_rounds(cfg: dict) -> tuple[list[float], list[float], object]:
    """The wall and the CPU seconds (this process, all its threads, and the encodings of
    its encoding processes where the run has them) of every round of one in-process run
    of ``cfg`` (between two per-round callbacks), and its server."""
    from fedsgld import engine
    from fedsgld.config import load_config

    stamps: list[tuple[float, float]] = []
    built: dict = {}

    def cpu_now() -> float:  # this process, and its encoding processes' encodings
        workers = built["federation"].encode_workers if built else None
        return time.process_time() + (workers.cpu_seconds if workers is not None else 0.0)

    def stamp(info) -> None:
        stamps.append((time.perf_counter(), cpu_now()))

    with tempfile.TemporaryDirectory(prefix="fedsgld-secagg-") as tmp:
        t0 = (time.perf_counter(), time.process_time())
        engine.run(load_config(None, cfg), out_dir=tmp, progress=False, log=lambda s: None,
                   on_round=stamp, built=built)  # fmt: skip
    pairs = list(zip([t0, *stamps[:-1]], stamps, strict=True))
    wall = [b[0] - a[0] for a, b in pairs]
    cpu = [b[1] - a[1] for a, b in pairs]
    return wall, cpu, built["server"]


def engine_cost(
    sites: int, rounds: int, repeats: int = 2, neighbours: int = 0, encoders: str = "auto"
) -> dict:
    """Median round seconds (rounds 2..N of every run: wall and CPU) of the three
    placements, run ``repeats`` times in the orders ABC CBA ABC ... (a drift of the
    machine's load then weighs on all three alike). ``neighbours``: the secure
    placement's ``secagg_neighbours`` where ``sites`` allows it (k <= sites - 2), else
    the complete graph."""
    k = neighbours if neighbours <= sites - 2 else 0
    base = {**demo_config(), **ENGINE_RUN, "sites": sites, "rounds": rounds,
            "secagg_neighbours": k, "secagg_encoders": encoders}  # fmt: skip
    out: dict = {"sites": sites, "rounds": rounds, "repeats": repeats, "neighbours": k,
                 "encoders": encoders}  # fmt: skip
    wall: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    cpu: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    order = list(PLACEMENTS)
    for rep in range(repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            w, c, server = engine_rounds({**base, **PLACEMENTS[name]})
            wall[name] += w[1:]
            cpu[name] += c[1:]
            if name == "secure":
                last = server.mode.last_round  # the last round's RoundResult
                out["protocol_s"] = sum(last.seconds.values())
                out["masked_input_s"] = last.seconds["masked_input"]
                out["dim"] = int(last.total.shape[0])
    for name in PLACEMENTS:
        out[f"{name}_round_s"] = statistics.median(wall[name])
        out[f"{name}_round_cpu_s"] = statistics.median(cpu[name])
    for unit in ("", "_cpu"):
        secure = out[f"secure_round{unit}_s"]
        out[f"secure_to_sites{unit}"] = secure / out[f"sites_round{unit}_s"]
        out[f"secure_to_server{unit}"] = secure / out[f"server_round{unit}_s"]
    return out


def print_engine(rows: list[dict]) -> None:
    print("| K | neighbours | rounds | `sites` round s | secure round s | `server` round s "
          "| secure / sites | secure / server | the same in CPU s: sites / secure / server "
          "| CPU ratios: secure / sites, secure / server "
          "| secure: protocol s (last round) | of which masked_input s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sites']} | {r['neighbours'] or 'all'} | {r['rounds']} | {r['sites_round_s']:.3f} | "
              f"{r['secure_round_s']:.3f} | {r['server_round_s']:.3f} | "
              f"{r['secure_to_sites']:.2f} | {r['secure_to_server']:.2f} | "
              f"{r['sites_round_cpu_s']:.3f} / {r['secure_round_cpu_s']:.3f} / "
              f"{r['server_round_cpu_s']:.3f} | {r['secure_to_sites_cpu']:.2f}, "
              f"{r['secure_to_server_cpu']:.2f} | "
              f"{r['protocol_s']:.3f} | {r['masked_input_s']:.3f} |")  # fmt: skip


def main_engine(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    rows = [engine_cost(k, args.rounds, args.repeats, args.neighbours, args.encoders)
            for k in args.sites]  # fmt: skip
    load = (load, os.getloadavg()[0])
    if args.json:
        print(json.dumps({"engine": rows, "load_average": load}, indent=2))
        return
    print(f"in-process engine, demo CNN, {_kind()} secure rounds, secagg_encoders = "
          f"{args.encoders}; load average "
          f"{load[0]:.1f} at the start, {load[1]:.1f} at the end:")  # fmt: skip
    print_engine(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument(
        "--rounds", type=int, default=None, help="default 3; --loopback: 4; --engine: 6"
    )
    ap.add_argument("--max-dropouts", type=int, default=0)
    ap.add_argument(
        "--drop",
        type=int,
        default=0,
        help="sites silent from masked_input on in every round (<= --max-dropouts)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-accounting", action="store_true", help="only the rounds' cost")
    ap.add_argument("--loopback", action="store_true", help="rounds of a real deployment")
    ap.add_argument("--cold", action="store_true", help="--loopback: no warm sites")
    ap.add_argument("--fast", action="store_true", help="--loopback: the fast path")
    ap.add_argument("--against", nargs="+", default=["sites", "server"],
                    choices=["sites", "server"], help="--loopback: plain placements measured")  # fmt: skip
    ap.add_argument("--engine", action="store_true", help="rounds of the in-process engine")
    ap.add_argument("--repeats", type=int, default=2, help="--engine: runs of each placement")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="--engine: secagg_neighbours of the secure runs (0: every pair; "
                    "used where it is <= sites - 2)")  # fmt: skip
    ap.add_argument("--full", action="store_true",
                    help="--engine, --loopback: the secure runs with secagg_one_shot = false "
                    "(the full protocol; one-shot rounds are the default with no dropouts)")  # fmt: skip
    ap.add_argument("--encoders", default="auto", choices=["auto", "threads", "processes"],
                    help="--engine: secagg_encoders of the secure runs (auto: processes from "
                    "8 sites up on 2 or more threads)")  # fmt: skip
    add_report_option(ap)
    args = ap.parse_args()
    with report_to(args.report):
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.full:  # PLACEMENTS["secure"] is this same dict
        SECURE["secagg_one_shot"] = False
    if args.engine:
        args.rounds = args.rounds or 6
        main_engine(args)
        return
    if args.loopback:
        args.rounds = args.rounds or 4
        main_loopback(args)
        return
    args.rounds = args.rounds or 3
    rows = [one_size(k, args.dim, args.rounds, args.max_dropouts, args.drop) for k in args.sites]
    acct = {} if args.no_accounting else accounting(args.sites[0], args.dim)
    if args.json:
        print(json.dumps({"rows": rows, "accounting": acct}, indent=2))
        return
    print("| K | dropouts planned / silent | d (padded) | bits | site CPU s | of which encode "
          "| of which consistency (ms) "
          "| server CPU s | in-process round wall s "
          "| sent KiB/site | received KiB/site | plain float32 KiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sites']} | {r['max_dropouts']} / {r['silent']} | {r['dim']} ({r['padded_dim']}) | {r['bits']} | {r['site_s']:.3f} "
              f"| {r['encode_s']:.3f} | {1e3 * r['consistency_s']:.3f} | {r['server_s']:.3f} "
              f"| {r['round_s']:.2f} | "
              f"{r['sent_kib']:.0f} | {r['received_kib']:.1f} | {r['plain_kib']:.0f} |")  # fmt: skip
    if not acct:
        return
    print()
    print(f"accounting (q={Q}, sigma={SIGMA}, delta={DELTA}, K={args.sites[0]}):")
    for steps, a in acct.items():
        print(f"  {steps} rounds: central PLD eps {a['central_pld']:.3f}, DDG eps {a['ddg']:.3f}; "
              f"DDG reaches the central eps at sigma {a['ddg_sigma_for_central_eps']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
