"""Per-round cost of secure aggregation with distributed discrete Gaussian noise.

    python benchmarks/secagg_cost.py [--sites 4 8] [--dim 100000] [--rounds 3] [--json]

For each number of sites K, ``--rounds`` whole rounds of :func:`fedsgld.secagg.run_round`
on K random vectors of ``--dim`` coordinates (noise multiplier 1.46, clip 1, no dropouts
planned; ``--max-dropouts`` to plan some), all parties in this one process. Reported
(medians over the rounds):

``site_s``         one site's compute (CPU seconds, robust to a loaded machine): its share of the four steps (encoding, masking,
                   share encryption and decryption), the sites' total divided by K (a
                   deployment runs the sites in parallel);
``encode_s``       of which the DDG encoding (CPU seconds) (rotation, rounding, discrete Gaussian share);
``server_s``       the server's compute (CPU seconds): relaying, unmasking and decoding;
``round_s``        the in-process round's wall time: all parties one after the other;
``sent_kib`` / ``received_kib``: bytes one site sends / receives in the round
                   (:func:`fedsgld.secagg.message_bytes`), against ``plain_kib``, the
                   float32 vector a site sends without secure aggregation;
``server_received_kib`` / ``server_sent_kib``: the server's side of the same messages;
``bits``           the modulus 2^bits chosen by :func:`fedsgld.privacy.distributed.choose_ddg`.

It also prints the accounting's price: epsilon of 60 and 600 DP-SGLD-like rounds
(q = 0.064, delta = 1e-5) under the distributed discrete Gaussian against the central
Gaussian (fedsgld's PLD accountant and RDP), and the noise multiplier the distributed
mechanism needs to reach the central epsilon.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.distributed import choose_ddg, ddg_epsilon
from fedsgld.secagg import encode, run_round

SIGMA, CLIP, Q, DELTA = 1.46, 1.0, 0.064, 1e-5


def one_size(sites: int, dim: int, rounds: int, max_dropouts: int) -> dict:
    p = choose_ddg(noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=sites,
                   max_dropouts=max_dropouts, signal_norm=5000.0 * CLIP)  # fmt: skip
    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 0.01, dim) for _ in range(sites)]
    rows = []
    for r in range(rounds):
        t0 = time.perf_counter()
        res = run_round(xs, p, round_label=b"bench %d" % r, max_dropouts=max_dropouts)
        wall = time.perf_counter() - t0
        c1 = time.process_time()
        encode(xs[0], p, b"bench encode")
        enc = time.process_time() - c1
        site = sum(v for k, v in res.cpu_seconds.items() if "(server)" not in k)
        server = sum(v for k, v in res.cpu_seconds.items() if "(server)" in k)
        rows.append((site / sites, enc, server, wall))
    med = [statistics.median(c) for c in zip(*rows)]
    return {
        "sites": sites,
        "dim": dim,
        "padded_dim": p.dim,
        "bits": p.bits,
        "site_s": med[0],
        "encode_s": med[1],
        "server_s": med[2],
        "round_s": med[3],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-dropouts", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [one_size(k, args.dim, args.rounds, args.max_dropouts) for k in args.sites]
    acct = accounting(args.sites[0], args.dim)
    if args.json:
        print(json.dumps({"rows": rows, "accounting": acct}, indent=2))
        return
    print("| K | d (padded) | bits | site CPU s | of which encode | server CPU s | in-process round wall s "
          "| sent KiB/site | received KiB/site | plain float32 KiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sites']} | {r['dim']} ({r['padded_dim']}) | {r['bits']} | {r['site_s']:.3f} "
              f"| {r['encode_s']:.3f} | {r['server_s']:.3f} | {r['round_s']:.2f} | "
              f"{r['sent_kib']:.0f} | {r['received_kib']:.1f} | {r['plain_kib']:.0f} |")  # fmt: skip
    print()
    print(f"accounting (q={Q}, sigma={SIGMA}, delta={DELTA}, K={args.sites[0]}):")
    for steps, a in acct.items():
        print(f"  {steps} rounds: central PLD eps {a['central_pld']:.3f}, DDG eps {a['ddg']:.3f}; "
              f"DDG reaches the central eps at sigma {a['ddg_sigma_for_central_eps']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
