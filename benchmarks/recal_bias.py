"""Why the clipped-gradient temperature fit failed, on a finished run with a calibration
split: the roots (in log T) of the calibration split's mean NLL gradient, of the same
gradient clipped to 1 per record (the old private fit's statistic), and of the confidence
gap (today's), the test ECE at each, and the test ECE of private fits with each statistic
at the run's recalibration settings over ``--draws`` noise draws.

    python benchmarks/recal_bias.py RUN_DIR [--draws 30]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from fedsgld.calibration.metrics import calibration_report
from fedsgld.calibration.recal import confidence_gaps, tail_average, temperature_gradients
from fedsgld.config import Config
from fedsgld.engine import _logits
from fedsgld.federation import Federation


def _root(stat, lo: float = -3.0, hi: float = 3.0) -> float:
    """Bisection for the zero of a mean statistic that rises through zero in log T."""
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if stat(mid) > 0 else (mid, hi)
    return 0.5 * (lo + hi)


def _fit(stat, n: int, *, steps: int, sigma: float, lr: float, seed: int) -> float:
    """The private fit's iteration (full batch): s <- s - lr (sum + sigma xi) / n, tail mean."""
    g = torch.Generator().manual_seed(seed)
    s, trace = 0.0, []
    for _ in range(steps):
        total = stat(s) * n + sigma * float(torch.randn(1, generator=g, dtype=torch.float64))
        s -= lr * total / n
        trace.append(s)
    return tail_average(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--draws", type=int, default=30)
    args = ap.parse_args()
    d = Path(args.run_dir)
    res = json.loads((d / "results.json").read_text())
    cfg = Config.from_flat(res["config"])
    fed = Federation(cfg, log=lambda s: None)
    theta = torch.load(d / "checkpoint.pt", weights_only=False)["server"]["theta"]
    zc = torch.cat(
        [_logits(s, theta, x) for s, (x, _) in zip(fed.sites, fed.cal_data, strict=True)]
    )
    yc = torch.cat([y for _, y in fed.cal_data])
    zt = torch.cat(
        [_logits(s, theta, t.x_test) for s, t in zip(fed.sites, fed.site_data, strict=True)]
    )
    yt = torch.cat([t.y_test for t in fed.site_data])

    def ece(log_t: float) -> float:
        return calibration_report(
            torch.softmax(zt.double() * math.exp(-log_t), -1).numpy(), yt.numpy()
        )["ece"]

    stats = {
        "NLL gradient (unclipped)": lambda s: float(temperature_gradients(zc, yc, s).mean()),
        "NLL gradient clipped to 1 (old fit)": lambda s: float(
            temperature_gradients(zc, yc, s).clamp(-1, 1).mean()
        ),
        "confidence gap (today's fit)": lambda s: float(confidence_gaps(zc, yc, s).mean()),
    }
    p = cfg.privacy
    print(
        f"{d}: {len(yc)} calibration records, {len(yt)} test records; test ECE at T = 1: {ece(0.0):.4f}"
    )
    for name, stat in stats.items():
        r = _root(stat)
        line = f"- {name}: root T = {math.exp(r):.3f}, test ECE there {ece(r):.4f}"
        if "unclipped" not in name:
            lr = 0.5 if "old" in name else cfg.run.recal_lr  # the old fit's default step size
            fits = [_fit(stat, len(yc), steps=p.recal_steps, sigma=p.recal_noise_multiplier * p.recal_clip,
                         lr=lr, seed=k) for k in range(args.draws)]  # fmt: skip
            e = np.array([ece(s) for s in fits])
            line += (f"; private fit ({p.recal_steps} steps, sigma {p.recal_noise_multiplier:g}, lr {lr:g}) "
                     f"over {args.draws} draws: test ECE {e.mean():.4f} ± {e.std():.4f}, worse than "
                     f"T = 1 in {int((e > ece(0.0)).sum())}")  # fmt: skip
        print(line)


if __name__ == "__main__":
    main()
