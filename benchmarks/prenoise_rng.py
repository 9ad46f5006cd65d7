"""Cost of DP-SGLD's pre-noise on this machine: B x P standard normals per step.

Times, interleaved in one run, ways to draw the (B, P) = (256, 26,010) block of the paper
CNN's pre-noise (6.66 million normals) and prints nanoseconds per normal:

  torch_randn_f32     torch.randn(B, P) from an explicit CPU generator (what
                      fedsgld.core.noise.gaussian_noise does)
  fedsgld_substreams_f32   fedsgld.core.prenoise.prenoise_values on one thread: the
                      8 sub-streams of a chunk's pre-noise (key, SHAKE-256, 8 draws)
  torch_normal_f32_buffer   Tensor.normal_ into a preallocated buffer (no fresh memory)
  torch_randn_f32_rows16    the same block drawn 16 rows at a time (cache-sized pieces)
  torch_randn_f64     float64 draws (twice the bytes, same Mersenne Twister)
  torch_uniform_f32   uniforms only: the floor for any transform of torch's CPU stream
  numpy_pcg64 / numpy_sfc64 / numpy_philox   numpy's ziggurat on three bit generators
                      (they would need a numpy generator seeded from the torch one)
  philox_torch_ops    the 10 rounds of Philox4x32 (a counter-based stream) written as torch
                      tensor operations, bits only (no conversion to normals yet)

Everything runs on the calling thread with one torch thread, timed by that thread's CPU
time (which a busy machine disturbs far less than elapsed time). How the draw overlaps
with the gradients is measured by ``step_speed.py`` (dpsgld against
dpsgld_serial_prenoise).

    python benchmarks/prenoise_rng.py [--batch 256] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from fedsgld.core.prenoise import prenoise_values

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def philox_bits(n_blocks: int, key: tuple[int, int]) -> torch.Tensor:
    """Philox4x32-10 on counters 0..n_blocks-1 in int64 torch ops: (n_blocks, 4) 32-bit words."""
    c0 = torch.arange(n_blocks, dtype=torch.int64)
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = key
    for _ in range(10):
        p0 = c0 * M0  # exact: both factors < 2^32, the product wraps like uint64
        p1 = c2 * M1
        hi0, lo0 = (p0 >> 32) & MASK, p0 & MASK
        hi1, lo1 = (p1 >> 32) & MASK, p1 & MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return torch.stack([c0, c1, c2, c3], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--params", type=int, default=26010)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    B, P = args.batch, args.params
    n = B * P
    gen = torch.Generator().manual_seed(0)
    buf = torch.empty(B, P)
    rng = {
        "pcg64": np.random.Generator(np.random.PCG64(0)),
        "sfc64": np.random.Generator(np.random.SFC64(0)),
        "philox": np.random.Generator(np.random.Philox(0)),
    }
    out = np.empty((B, P), dtype=np.float32)

    def rows16():
        for s in range(0, B, 16):
            torch.randn(min(16, B - s), P, generator=gen)

    cases = {
        "torch_randn_f32": lambda: torch.randn(B, P, generator=gen),
        "fedsgld_substreams_f32": lambda: prenoise_values(n, std=1.0, generator=gen),
        "torch_normal_f32_buffer": lambda: buf.normal_(generator=gen),
        "torch_randn_f32_rows16": rows16,
        "torch_randn_f64": lambda: torch.randn(B, P, generator=gen, dtype=torch.float64),
        "torch_uniform_f32": lambda: buf.uniform_(generator=gen),
        "numpy_pcg64": lambda: rng["pcg64"].standard_normal(dtype=np.float32, out=out),
        "numpy_sfc64": lambda: rng["sfc64"].standard_normal(dtype=np.float32, out=out),
        "numpy_philox": lambda: rng["philox"].standard_normal(dtype=np.float32, out=out),
        "philox_torch_ops": lambda: philox_bits(n // 4, (1, 2)),
    }
    for f in cases.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, f in cases.items():
            t0 = time.thread_time()
            f()
            times[k].append(time.thread_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ns = {k: round(v * 1e9 / n, 2) for k, v in med.items()}
    ms = {k: round(v * 1e3, 2) for k, v in med.items()}
    result = {
        "normals": n,
        "threads": torch.get_num_threads(),
        "clock": "CPU time of the calling thread",
        "ns_per_normal": ns,
        "ms": ms,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{n:,} normals (B={B}, P={P}), 1 thread, CPU time, median of {args.repeats} "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    for k in cases:
        print(f"  {k:26s} {ms[k]:8.2f} ms  {ns[k]:6.2f} ns/normal")


if __name__ == "__main__":
    main()
