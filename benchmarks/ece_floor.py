"""The ECE a perfectly calibrated model would show on a finite test split.

For a finished run, take the last iterate's top-label confidences c_i on the test split
and draw hits h_i ~ Bernoulli(c_i): a model calibrated by construction, with the same
confidences and the same number of test records. The ECE of those draws (15 bins, as
`calibration_report`) is the sampling floor under which no measured ECE on that split
means anything.

    python benchmarks/ece_floor.py RUN_DIR [--draws 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedsgld.calibration.metrics import calibration_report
from fedsgld.config import Config
from fedsgld.engine import _logits
from fedsgld.federation import Federation


def test_confidences(run_dir: Path) -> tuple[np.ndarray, float, float]:
    """(top-label confidences on the test split, accuracy, ECE) of a run's last iterate."""
    res = json.loads((run_dir / "results.json").read_text())
    fed = Federation(Config.from_flat(res["config"]), log=lambda s: None)
    theta = torch.load(run_dir / "checkpoint.pt", weights_only=False)["server"]["theta"]
    z = torch.cat(
        [_logits(s, theta, d.x_test) for s, d in zip(fed.sites, fed.site_data, strict=True)]
    )
    y = torch.cat([d.y_test for d in fed.site_data])
    p = torch.softmax(z.double(), -1)
    rep = calibration_report(p.numpy(), y.numpy())
    return p.max(1).values.numpy(), rep["accuracy"], rep["ece"]


def floor(conf: np.ndarray, draws: int, seed: int = 0) -> tuple[float, float]:
    """Mean and std of the ECE of perfectly calibrated hits with confidences ``conf``."""
    rng = np.random.default_rng(seed)
    edges = np.linspace(0.0, 1.0, 16)
    b = np.clip(np.digitize(conf, edges[1:-1]), 0, 14)
    out = []
    for _ in range(draws):
        h = rng.random(conf.size) < conf
        e = 0.0
        for k in range(15):
            m = b == k
            if m.any():
                e += m.sum() / conf.size * abs(h[m].mean() - conf[m].mean())
        out.append(e)
    return float(np.mean(out)), float(np.std(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    for d in args.run_dirs:
        conf, acc, ece = test_confidences(Path(d))
        m, s = floor(conf, args.draws)
        print(
            f"{d}: n={conf.size} accuracy {acc:.3f} mean confidence {conf.mean():.3f} ECE {ece:.4f}; "
            f"calibrated floor {m:.4f} ± {s:.4f}"
        )


if __name__ == "__main__":
    main()
