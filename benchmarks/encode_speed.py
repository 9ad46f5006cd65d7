"""CPU time of one site's DDG encoding (rotation, rounding, its discrete Gaussian share).

    python benchmarks/encode_speed.py [--params 26010] [--sites 16] [--sigma 1.0]
        [--repeats 200] [--threads 2] [--json]

One site's contribution to a secure-aggregation round (:func:`fedsgld.secagg.ddg.encode`)
for a vector of ``--params`` coordinates (the demo CNN's 26,010 by default, padded to
32,768) at the parameters :func:`fedsgld.privacy.distributed.choose_ddg` picks for
``--sites`` sites and noise multiplier ``--sigma``. Timed on a pool of ``--threads``
threads, as the in-process engine's sites answer (``run_round(workers=...)``), and on the
main thread alone: medians of ``--repeats`` encodings, each its own thread's CPU time
(:func:`time.thread_time`), after 20 unmeasured ones. Also the wall time of a round's
worth of encodings (``--sites`` of them), one after the other and on the pool (medians of
15): the pool's speed-up says how much of the encoding runs outside the GIL; and on
``--threads`` encoding processes (:class:`fedsgld.secagg.workers.EncodeWorkers`, called
from as many threads, as the engine's ``secagg_encoders = processes``), with a child's CPU
time per encoding. Compare two versions by putting another checkout's ``fedsgld/`` first
on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _report import add_report_option, report_cli  # benchmarks/_report.py

from fedsgld.privacy.distributed import choose_ddg
from fedsgld.secagg import ddg, workers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=26_010)
    ap.add_argument("--sites", type=int, default=16)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    add_report_option(ap)
    args = ap.parse_args()
    if args.repeats < 1 or args.threads < 1 or args.params < 1:
        ap.error("--params, --repeats and --threads must be >= 1")
    params = choose_ddg(noise_multiplier=args.sigma, clip=1.0, dim=args.params,
                        sites=args.sites, signal_norm=float(args.sites))  # fmt: skip
    vector = np.random.default_rng(0).normal(0.0, 0.01, args.params)

    def one(_: int) -> float:
        start = time.thread_time()
        ddg.encode(vector, params, b"encode-speed")
        return time.thread_time() - start

    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(one, range(20)))
        pooled = list(pool.map(one, range(args.repeats)))
        seq, par = [], []  # a round's encodings: one after the other, then on the pool
        for _ in range(15):
            t0 = time.perf_counter()
            for i in range(args.sites):
                one(i)
            seq.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(one, range(args.sites)))
            par.append(time.perf_counter() - t0)
    alone = [one(i) for i in range(20 + args.repeats)][20:]
    procs, child_ms = [], float("nan")  # the same round on as many encoding processes
    if workers.available():
        with workers.EncodeWorkers(args.threads) as children, \
                ThreadPoolExecutor(args.threads) as pool:  # fmt: skip

            def remote(_: int) -> None:
                children.encode(vector, params, b"encode-speed")

            list(pool.map(remote, range(2 * args.threads)))  # started and warm
            before, calls = children.cpu_seconds, 0
            for _ in range(15):
                t0 = time.perf_counter()
                list(pool.map(remote, range(args.sites)))
                procs.append(time.perf_counter() - t0)
                calls += args.sites
            child_ms = 1e3 * (children.cpu_seconds - before) / calls
    out = {
        "fedsgld": ddg.__file__,
        "dim": params.dim,
        "share_variance": params.share_variance,
        "threads": args.threads,
        "pool_cpu_ms": 1e3 * statistics.median(pooled),
        "main_thread_cpu_ms": 1e3 * statistics.median(alone),
        "round_wall_ms_one_by_one": 1e3 * statistics.median(seq),
        "round_wall_ms_pool": 1e3 * statistics.median(par),
        "round_wall_ms_processes": 1e3 * statistics.median(procs) if procs else float("nan"),
        "process_cpu_ms": child_ms,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['fedsgld']}: d = {params.dim}, s^2 = {params.share_variance}")
    print(f"one encoding, CPU ms (median of {args.repeats}): on a pool of {args.threads} "
          f"threads {out['pool_cpu_ms']:.2f}, on the main thread {out['main_thread_cpu_ms']:.2f}")  # fmt: skip
    print(f"{args.sites} encodings, wall ms (median of 15): one after the other "
          f"{out['round_wall_ms_one_by_one']:.1f}, on the pool {out['round_wall_ms_pool']:.1f} "
          f"({out['round_wall_ms_one_by_one'] / out['round_wall_ms_pool']:.2f} times faster), "
          f"on {args.threads} encoding processes {out['round_wall_ms_processes']:.1f} "
          f"({out['round_wall_ms_one_by_one'] / out['round_wall_ms_processes']:.2f} times "
          f"faster; an encoding {out['process_cpu_ms']:.2f} ms of the child's CPU)")  # fmt: skip


if __name__ == "__main__":
    with report_cli():
        main()
