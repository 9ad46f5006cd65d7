"""fedsgld on a GPU, in one command: the step benchmark, the demo against the CPU, 64 sites.

    python benchmarks/gpu_check.py [--out benchmarks/results] [--rounds 30] [--cpu-dry-run]

On a machine with a CUDA GPU (about 3 minutes on one, well under 8), it runs:

1. **The step** (benchmarks/step_speed.py's functions: the paper CNN, batch 256): plain SGD,
   fedsgld's DP-SGLD step (pre-noise rho = 0.01), its DP-SGD step (no pre-noise: the same
   clipped sum) and Opacus' DP-SGD, on CUDA; samples/s and ratios to plain SGD, one run.
2. **The maths on both devices**: the clipped per-record gradient sum of the demo's batch
   (no pre-noise) on CUDA against the CPU, same parameters and records: max relative
   difference <= 1e-4 (float32 reductions in another order).
3. **The demo, short** (simulations/demo.toml, ``--rounds`` rounds, evaluated at the end),
   with ``device = "cuda"`` and on the CPU, same seed. A CUDA generator is Philox, not the
   CPU's Mersenne Twister, so the same seed draws other samples and noise: the runs agree
   exactly on the privacy spent (steps, ledger, epsilon) and statistically on the rest:
   pooled test accuracy within 0.05 and NLL within 0.15 of each other.
4. **The engine at 64 sites** (the demo's data split over 64 sites, both site passes),
   seconds per round on CUDA.

It writes ``gpu_check.json`` and ``gpu_check.md`` under ``--out`` (the commit, the machine,
the command, every number and whether each check passed) and exits 1 if a check failed.
Without a GPU it says so in one line and exits 2; ``--cpu-dry-run`` runs the same code
paths on the CPU at a tiny size (both "devices" are the CPU, so the demo runs must agree
exactly), which is what the test suite runs (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_speed import PRENOISE, data, make_dpsgld, make_opacus, make_sgd, time_steps  # noqa: E402

from fedsgld.config.loading import load_config  # noqa: E402
from fedsgld.core.mechanism import FlatModel, clipped_gradient_sum  # noqa: E402
from fedsgld.data import load_dataset, make_sites  # noqa: E402
from fedsgld.engine import one_round, run  # noqa: E402
from fedsgld.federation import Federation  # noqa: E402
from fedsgld.models import PaperCNN  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "simulations" / "demo.toml"
NO_GPU = (
    "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine "
    "with one, or add --cpu-dry-run to run the same code paths on the CPU at a tiny size"
)
MATH_RTOL = 1e-4
ACC_TOL, NLL_TOL = 0.05, 0.15


def step_benchmark(device: torch.device, batch: int, repeats: int) -> dict[str, Any]:
    """Part 1: seconds per step of each step function, ratios to plain SGD (one run)."""
    torch.manual_seed(0)
    x, y = data(batch, (1, 28, 28), device)
    steps = {
        "sgd": make_sgd(PaperCNN(), batch, device),
        "dpsgld": make_dpsgld(PaperCNN(), batch, device, prenoise=PRENOISE),
        "dpsgd": make_dpsgld(PaperCNN(), batch, device, prenoise=0.0),
        "opacus": make_opacus(PaperCNN(), batch, device),
    }
    med = time_steps(steps, x, y, repeats=repeats, warmup=3, device=device)
    return {
        "batch": batch,
        "repeats": repeats,
        "samples_per_s": {k: round(batch / v, 1) for k, v in med.items()},
        "ms_per_step": {k: round(v * 1e3, 3) for k, v in med.items()},
        "ratio_to_sgd": {k: round(v / med["sgd"], 3) for k, v in med.items()},
    }


def math_check(device: torch.device, batch: int) -> dict[str, Any]:
    """Part 2: the clipped sum of one batch on ``device`` against the CPU."""
    torch.manual_seed(0)
    model = PaperCNN()
    x, y = data(batch, (1, 28, 28), torch.device("cpu"))
    sums = {}
    for dev in (torch.device("cpu"), device):
        fm = FlatModel(model, device=dev)
        s = clipped_gradient_sum(fm, fm.flatten(), x.to(dev), y.to(dev), clip=1.0)
        sums[dev.type] = s.detach().cpu()
    ref, other = sums["cpu"], sums[device.type]
    rel = float((other - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return {"max_relative_difference": rel, "tolerance": MATH_RTOL, "passed": rel <= MATH_RTOL}


def demo_runs(device: torch.device, rounds: int, over: dict[str, Any]) -> dict[str, Any]:
    """Part 3: the demo for ``rounds`` rounds on ``device`` and on the CPU, same seed."""
    out: dict[str, Any] = {"rounds": rounds, "config": str(DEMO.relative_to(ROOT)), **over}
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dev in (("cpu", "cpu"), ("device", device.type)):
            cfg = load_config(DEMO, {**over, "rounds": rounds, "eval_every": rounds,
                                     "burn_in": max(0, rounds - 2), "thin": 1,
                                     "checkpoint_every": 0, "device": dev})  # fmt: skip
            t0 = time.perf_counter()
            r = run(cfg, out_dir=Path(tmp) / name, progress=False, log=lambda s: None).results
            res[name] = r
            out[f"{name}_wall_s"] = round(time.perf_counter() - t0, 2)
    a, b = res["cpu"], res["device"]
    pa, pb = a["privacy"], b["privacy"]
    ma, mb = a["metrics"]["pooled"], b["metrics"]["pooled"]
    exact = device.type == "cpu"  # a dry run: the same generator, the same numbers
    acc_tol, nll_tol = (0.0, 0.0) if exact else (ACC_TOL, NLL_TOL)
    out.update(
        steps={"cpu": pa["steps"], "device": pb["steps"]},
        epsilon={"cpu": pa["epsilon"], "device": pb["epsilon"]},
        accuracy={"cpu": ma["accuracy"], "device": mb["accuracy"], "tolerance": acc_tol},
        nll={"cpu": ma["nll"], "device": mb["nll"], "tolerance": nll_tol},
    )
    out["passed"] = bool(
        pa["steps"] == pb["steps"]
        and pa["ledger"] == pb["ledger"]
        and pa["epsilon"] == pb["epsilon"]
        and abs(ma["accuracy"] - mb["accuracy"]) <= acc_tol
        and abs(ma["nll"] - mb["nll"]) <= nll_tol + 1e-12
    )
    return out


def many_sites(
    device: torch.device, sites: int, rounds: int, over: dict[str, Any]
) -> dict[str, Any]:
    """Part 4: seconds per engine round (median of rounds 2..) at ``sites`` sites."""
    cfg = load_config(DEMO, {**over, "sites": sites, "eval_every": 0, "device": device.type})
    data_ = make_sites(load_dataset("mnist5k", seed=0), sites=sites, seed=0, min_size=4)
    fed = Federation(cfg, log=lambda *_: None, site_data=data_)
    row: dict[str, Any] = {"sites": sites, "rounds": rounds, **over}
    for site_pass in ("per_site", "batched"):
        fed.config = dataclasses.replace(
            cfg, perf=dataclasses.replace(cfg.perf, site_pass=site_pass)
        )
        server = fed.make_server()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            if one_round(fed, server) is None:
                raise RuntimeError("the run stopped before the rounds were timed")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        row[f"{site_pass}_s_per_round"] = round(statistics.median(times[1:]), 4)
    return row


def machine(device: torch.device) -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    info = {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    return info


def markdown(rep: dict[str, Any]) -> str:
    m, st = rep["machine"], rep["step"]
    lines = [
        f"# GPU check: {'passed' if rep['passed'] else 'FAILED'}",
        "",
        f"`{rep['command']}` on {m['gpu'] or m['device']} (torch {m['torch']}, CUDA "
        f"{m['cuda']}, {m['cpu_count']} CPUs), commit {m['commit'][:12]}"
        + (" with uncommitted changes" if m["uncommitted_changes"] else "")
        + f", {rep['wall_s']:.0f} s in all{' (CPU dry run)' if rep['dry_run'] else ''}.",
        "",
        f"## One training step (paper CNN, batch {st['batch']}, median of {st['repeats']})",
        "",
        "| step | samples/s | ms | relative to plain SGD |",
        "|---|---|---|---|",
    ]
    for k in st["samples_per_s"]:
        lines.append(
            f"| {k} | {st['samples_per_s'][k]} | {st['ms_per_step'][k]} | {st['ratio_to_sgd'][k]} |"
        )
    mc, d, s = rep["math"], rep["demo"], rep["sites"]
    lines += [
        "",
        f"## Checks\n\n- clipped sum, device against CPU: max relative difference "
        f"{mc['max_relative_difference']:.2e} (tolerance {mc['tolerance']:g}): "
        f"{'ok' if mc['passed'] else 'FAILED'}",
        f"- demo, {d['rounds']} rounds, same seed: steps {d['steps']}, epsilon equal: "
        f"{d['epsilon']['cpu'] == d['epsilon']['device']}; pooled accuracy CPU "
        f"{d['accuracy']['cpu']:.4f}, device {d['accuracy']['device']:.4f} (tolerance "
        f"{d['accuracy']['tolerance']:g}); NLL {d['nll']['cpu']:.4f} / {d['nll']['device']:.4f}"
        f" (tolerance {d['nll']['tolerance']:g}); wall {d['cpu_wall_s']} s CPU, "
        f"{d['device_wall_s']} s device: {'ok' if d['passed'] else 'FAILED'}",
        f"- engine at {s['sites']} sites: {s['per_site_s_per_round']} s/round per site, "
        f"{s['batched_s_per_round']} s/round batched",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rounds", type=int, default=30, help="rounds of each demo run")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same paths, CPU, tiny")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    t0 = time.perf_counter()
    small = {"max_records": 200, "sites": 2} if dry else {}
    rep: dict[str, Any] = {
        "command": " ".join(
            ["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "dry_run": dry,
        "machine": machine(device),
        "step": step_benchmark(device, 16 if dry else 256, 2 if dry else 30),
        "math": math_check(device, 16 if dry else 256),
        "demo": demo_runs(device, 2 if dry else args.rounds, small),
        "sites": many_sites(
            device, 8 if dry else 64, 2 if dry else 4, {"sample_rate": 0.005} if dry else {}
        ),  # fmt: skip
    }
    rep["wall_s"] = round(time.perf_counter() - t0, 1)
    rep["passed"] = bool(rep["math"]["passed"] and rep["demo"]["passed"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
