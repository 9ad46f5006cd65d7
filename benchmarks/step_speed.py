"""Samples per second of one training step on the paper CNN, batch 256, on the CPU.

  sgd     plain SGD: forward, backward of the mean loss, parameter update
  dpsgld  fedsgld's DP-SGLD step: per-record gradients (torch.func), pre-noise, clipping,
          clipped sum, server noise sigma*C and the Langevin update
  dpsgld_no_prenoise  the same with rho = 0 (pre-noise is B x P Gaussian draws per step)
  opacus  Opacus' DP-SGD step (GradSampleModule hooks + DPOptimizer)

All three are timed in the same process, interleaved over repeats, and reported with
ratios to plain SGD (ratios are what transfers between machines; absolute times do not).

    python benchmarks/step_speed.py [--batch 256] [--repeats 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from fedsgld.core.mechanism import FlatModel, clipped_gradient_sum, langevin_update
from fedsgld.models import PaperCNN
from fedsgld.privacy.noise import seeded_generator


def make_sgd(batch):
    model = PaperCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def make_dpsgld(batch, chunk_size, prenoise=0.01):
    fm = FlatModel(PaperCNN())
    state = {"theta": fm.flatten(), "t": 0}
    gen = seeded_generator(0, 1)

    def step(x, y):
        s = clipped_gradient_sum(
            fm,
            state["theta"],
            x,
            y,
            clip=1.0,
            prenoise=prenoise,
            generator=gen,
            chunk_size=chunk_size,
        )
        state["theta"] = langevin_update(
            state["theta"],
            s,
            step_size=0.1,
            noise_std=1.0,
            expected_batch=float(batch),
            weight_decay=0.0,
            generator=gen,
        )
        state["t"] += 1

    return step


def make_opacus(batch):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(PaperCNN())
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
    )

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print one JSON object of samples/s")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))
    steps = {
        "sgd": make_sgd(args.batch),
        "dpsgld": make_dpsgld(args.batch, args.chunk_size),
        "dpsgld_no_prenoise": make_dpsgld(args.batch, args.chunk_size, prenoise=0.0),
        "opacus": make_opacus(args.batch),
    }
    for fn in steps.values():
        for _ in range(args.warmup):
            fn(x, y)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits all alike
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn(x, y)
            times[k].append(time.perf_counter() - t0)
    sps = {k: args.batch / statistics.median(v) for k, v in times.items()}
    if args.json:
        print(json.dumps(sps))
        return
    print(
        f"paper CNN, batch {args.batch}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    for k, v in sps.items():
        print(f"  {k:18s} {v:9.0f} samples/s   step time x{sps['sgd'] / v:.2f} of plain SGD")


if __name__ == "__main__":
    main()
