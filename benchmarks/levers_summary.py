"""Summarise the sweeps of benchmarks/mnist5k_levers.sh: one line per lever and row, test
accuracy and ECE (mean ± std over the seeds), steps and epsilon.

    python benchmarks/levers_summary.py runs/mnist5k_levers
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(root: str) -> None:
    print("| lever | row | point | steps | epsilon | accuracy | ECE |")
    print("|---|---|---|---|---|---|---|")
    for sweep in sorted(Path(root).glob("*/sweep.json")):
        res = json.loads(sweep.read_text())
        for row, t in res["table"].items():
            p = t["pooled"]
            eps = t["epsilon"]["mean"]
            eps_text = "-" if eps is None or eps != eps else f"{eps:.2f}"
            print(
                f"| {sweep.parent.name} | {row} | {t['point_label']} | {t['steps']['mean']:.0f} | "
                f"{eps_text} | {p['accuracy']['mean']:.3f} ± "
                f"{p['accuracy']['std']:.3f} | {p['ece']['mean']:.4f} ± {p['ece']['std']:.4f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/mnist5k_levers")
