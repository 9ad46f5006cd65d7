"""Samples per second of one training step on the paper CNN, batch 256, CPU or GPU.

  sgd                 plain SGD: forward, backward of the mean loss, parameter update
  dpsgld              fedsgld's DP-SGLD step: per-record gradients, pre-noise rho = 0.01,
                      clipping, clipped sum, server noise sigma*C and the Langevin update
  dpsgld_noprenoise   the same with rho = 0 (clip norms first, no per-record gradient)
  opacus              Opacus' DP-SGD step (GradSampleModule hooks + DPOptimizer)
  opacus_ghost        Opacus' ghost clipping (two backward passes; cannot pre-noise)
  dpsgld_func, dpsgld_func_noprenoise   fedsgld's steps with per-record gradients from
                      torch.func (vmap over the one-record gradient), for comparison
  dpsgld_serial_prenoise   dpsgld with the pre-noise drawn on the calling thread (what a
                      run with threads = 1 does) instead of beside the gradients
  dpsgld_one_stream   dpsgld with each chunk's pre-noise drawn from the party's one
                      generator stream on one thread (before fedsgld split it over 8
                      sub-streams drawn on up to half of torch's threads)

All are timed in the same process, interleaved over repeats, and reported with ratios to
plain SGD measured in that run (ratios are what transfers between machines on the CPU).
``--json`` prints one JSON object; it also holds the peak memory of the DP-SGLD step at
batch 256 and 4,096 (each measured in a fresh subprocess) and, unless ``--no-models``, the
per-record gradient paths on each model (the paper CNN, the MLP, logistic regression and
the dense head over frozen backbone features).

    python benchmarks/step_speed.py [--batch 256] [--repeats 30] [--device cpu] [--json]
        [--threads N] [--clock wall|cpu] [--stat median|min] [--no-models] [--no-memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from _report import add_report_option, report_cli  # benchmarks/_report.py

from fedsgld.core import per_record
from fedsgld.core.device import resolve_device
from fedsgld.core.mechanism import FlatModel, clipped_gradient_sum, langevin_update
from fedsgld.core.noise import gaussian_noise, seeded_generator
from fedsgld.models import PaperCNN, build_model

PRENOISE = 0.01  # the paper's rho (simulations/*.toml)
MAIN_STEPS = ("sgd", "dpsgld", "dpsgld_noprenoise", "opacus", "opacus_ghost")


def make_sgd(model, batch, device):
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def make_dpsgld(model, batch, device, *, prenoise, grad_path="auto", chunk_size=256):
    fm = FlatModel(model, device=device, grad_path=grad_path)
    state = {"theta": fm.flatten()}
    gen = seeded_generator(0, 1, device=fm.device)

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
        noisy = s + gaussian_noise(s.shape, std=1.0, generator=gen)
        state["theta"] = langevin_update(
            state["theta"], noisy, step_size=0.1, expected_batch=float(batch), weight_decay=0.0
        )

    step.fm = fm
    return step


def serial_prenoise(step):
    """The step with its pre-noise drawn on the calling thread, not beside the gradients."""
    background = per_record.draw_in_background

    def serial(x, y):
        per_record.draw_in_background = lambda generator: False
        try:
            step(x, y)
        finally:
            per_record.draw_in_background = background

    return serial


def one_stream_prenoise(step):
    """The step with each chunk's pre-noise drawn as one ``gaussian_noise`` from the party's
    generator, on one thread (no sub-streams)."""
    from fedsgld.core import prenoise as pn

    values = pn.prenoise_values

    def single(n, *, std, generator, threads=1):
        return gaussian_noise((n,), std=std, generator=generator)

    def one(x, y):
        pn.prenoise_values = single
        try:
            step(x, y)
        finally:
            pn.prenoise_values = values

    return one


def make_opacus(model, batch, device):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(model.to(device))
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
    )

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def make_opacus_ghost(model, batch, device):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = GradSampleModuleFastGradientClipping(
        model.to(device), max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="mean"
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        loss_reduction="mean",
    )
    loss_fn = DPLossFastGradientClipping(
        model, opt, torch.nn.CrossEntropyLoss(), loss_reduction="mean"
    )

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(steps, x, y, *, repeats, warmup, device, clock=time.perf_counter, stat="median"):
    """Seconds per step of each step function (median or minimum over repeats), the
    functions interleaved so that drift in machine load hits all alike."""
    for fn in steps.values():
        for _ in range(warmup):
            fn(x, y)
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # interleaved, so drift in machine load hits all alike
        for k, fn in steps.items():
            _sync(device)
            t0 = clock()
            fn(x, y)
            _sync(device)
            times[k].append(clock() - t0)
    pick = statistics.median if stat == "median" else min
    return {k: pick(v) for k, v in times.items()}


def data(batch, input_shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *input_shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


# -- peak memory ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(batch: int, device_name: str, chunk_size: int) -> dict:
    """Run in a fresh process: peak memory above the steady state of one DP-SGLD step."""
    device = resolve_device(device_name)
    torch.manual_seed(0)
    step = make_dpsgld(PaperCNN(), batch, device, prenoise=PRENOISE, chunk_size=chunk_size)
    small_x, small_y = data(8, (1, 28, 28), device)
    step(small_x, small_y)  # one-time initialisation (thread pools, kernels)
    x, y = data(batch, (1, 28, 28), device)
    input_mb = (x.numel() * x.element_size() + y.numel() * y.element_size()) / 2**20
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(x, y)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        how = "torch.cuda.max_memory_allocated above the allocation before the step"
    else:
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak resident set size (VmHWM)
        step(x, y)
        peak = (_status_kib("VmHWM") - before) * 1024
        how = "VmHWM above VmRSS before the step, glibc mmap threshold 64 KiB"
    return {"peak_mb": round(peak / 2**20, 1), "input_mb": round(input_mb, 1), "how": how}


def peak_memory(batch: int, device: torch.device, chunk_size: int, threads: int) -> dict | None:
    if device.type == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        return None
    env = dict(os.environ)
    # large blocks come from and go back to the OS at once, so the resident set follows
    # what is allocated rather than what glibc keeps for reuse
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["MALLOC_TRIM_THRESHOLD_"] = "65536"
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--memory-child",
            str(batch),
            "--device",
            str(device),
            "--chunk-size",
            str(chunk_size),
            "--threads",
            str(threads),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- per-record gradient paths on each model ---------------------------------------------
MODEL_CASES = {
    "cnn": (1, 28, 28),
    "mlp": (1, 28, 28),
    "logreg": (1, 28, 28),
    "timm_head": (1280,),  # efficientnet_b1 features
}


def model_paths(batch, repeats, warmup, device, clock, stat):
    out = {}
    for name, shape in MODEL_CASES.items():
        torch.manual_seed(0)
        proto = build_model(name, input_shape=shape, num_classes=10)

        def fresh(proto=proto):
            return copy.deepcopy(proto)

        steps = {
            "sgd": make_sgd(fresh(), batch, device),
            "layers": make_dpsgld(fresh(), batch, device, prenoise=PRENOISE, grad_path="layers"),
            "layers_noprenoise": make_dpsgld(
                fresh(), batch, device, prenoise=0.0, grad_path="layers"
            ),
            "func": make_dpsgld(fresh(), batch, device, prenoise=PRENOISE, grad_path="func"),
            "func_noprenoise": make_dpsgld(fresh(), batch, device, prenoise=0.0, grad_path="func"),
        }
        x, y = data(batch, shape, device)
        med = time_steps(
            steps, x, y, repeats=repeats, warmup=warmup, device=device, clock=clock, stat=stat
        )
        out[name] = {
            "params": FlatModel(fresh()).size,
            "samples_per_s": {k: round(batch / v, 1) for k, v in med.items()},
            "ratio_to_sgd": {k: round(v / med["sgd"], 3) for k, v in med.items()},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="median over repeats, or the minimum (the least disturbed step on a busy machine)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: CPU time of this process (all its threads), which a "
        "loaded machine disturbs less; with --threads 1 it is the single-core step time",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--no-models", action="store_true", help="skip the per-model path table")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    ap.add_argument("--model-repeats", type=int, default=10)
    ap.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    add_report_option(ap)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.memory_child:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(peak_memory_child(args.memory_child, args.device, args.chunk_size)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    device = resolve_device(args.device)
    if device.type == "cuda" and args.clock == "cpu":
        raise SystemExit("--clock cpu measures the CPU; use --clock wall on a GPU")
    torch.manual_seed(0)
    x, y = data(args.batch, (1, 28, 28), device)
    dps = make_dpsgld(PaperCNN(), args.batch, device, prenoise=PRENOISE)
    steps = {
        "sgd": make_sgd(PaperCNN(), args.batch, device),
        "dpsgld": dps,
        "dpsgld_noprenoise": make_dpsgld(PaperCNN(), args.batch, device, prenoise=0.0),
        "opacus": make_opacus(PaperCNN(), args.batch, device),
        "opacus_ghost": make_opacus_ghost(PaperCNN(), args.batch, device),
        "dpsgld_func": make_dpsgld(
            PaperCNN(), args.batch, device, prenoise=PRENOISE, grad_path="func"
        ),
        "dpsgld_func_noprenoise": make_dpsgld(
            PaperCNN(), args.batch, device, prenoise=0.0, grad_path="func"
        ),
        "dpsgld_serial_prenoise": serial_prenoise(
            make_dpsgld(PaperCNN(), args.batch, device, prenoise=PRENOISE)
        ),
        "dpsgld_one_stream": one_stream_prenoise(
            make_dpsgld(PaperCNN(), args.batch, device, prenoise=PRENOISE)
        ),
    }
    med = time_steps(
        steps,
        x,
        y,
        repeats=args.repeats,
        warmup=args.warmup,
        device=device,
        clock=clock,
        stat=args.stat,
    )
    result = {
        "model": "paper CNN (26,010 parameters)",
        "batch": args.batch,
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "stat": args.stat,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "repeats": args.repeats,
        "grad_path": dps.fm.grad_path,
        "samples_per_s": {k: round(args.batch / v, 1) for k, v in med.items()},
        "ratio_to_sgd": {k: round(v / med["sgd"], 3) for k, v in med.items()},
        "ms_per_step": {k: round(v * 1e3, 2) for k, v in med.items()},
    }
    if not args.no_memory:
        result["peak_memory_mb"] = {
            str(b): peak_memory(b, device, args.chunk_size, torch.get_num_threads())
            for b in (256, 4096)
        }
        result["chunk_size"] = args.chunk_size
    if not args.no_models:
        result["models"] = model_paths(
            args.batch, args.model_repeats, args.warmup, device, clock, args.stat
        )
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"paper CNN, batch {args.batch}, {result['device']}, {result['threads']} threads, "
        f"{args.clock} clock, {args.stat} of {args.repeats} (per-record gradients: "
        f"{result['grad_path']}; load average {result['load_average']})"
    )
    for k in steps:
        print(
            f"  {k:24s} {result['samples_per_s'][k]:9.0f} samples/s   "
            f"{result['ms_per_step'][k]:8.2f} ms   x{result['ratio_to_sgd'][k]:.2f} of plain SGD"
        )
    for b, mem in result.get("peak_memory_mb", {}).items():
        if mem:
            print(
                f"  peak memory of the DP-SGLD step at batch {b}: {mem['peak_mb']} MiB "
                f"(records {mem['input_mb']} MiB)"
            )
    for name, r in result.get("models", {}).items():
        ratios = "  ".join(f"{k} x{v:.2f}" for k, v in r["ratio_to_sgd"].items() if k != "sgd")
        print(f"  {name:10s} P={r['params']:7d}  {ratios}")


if __name__ == "__main__":
    with report_cli():
        main()
