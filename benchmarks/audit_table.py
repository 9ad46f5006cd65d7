"""The audit table of docs/audit.md: lower bound vs the accountant's epsilon on MNIST-5k.

    python benchmarks/audit_table.py [--epsilons 1 4 8] [--methods dpsgld dpsgd]
        [--canaries 1000] [--out runs/audit-table.json]

Every row is `fedsgld audit simulations/demo.toml --set method=M --set epsilon=E` (the
demo: MNIST-5k over 4 sites, the paper's CNN, 300 rounds, two threads) with 1,000
canaries at site 0 and a fixed inclusion seed (so the table is reproducible). DP-SGLD
keeps the demo's schedule and halts when the budget is spent; DP-SGD gets the constant
noise multiplier that spends the budget in 300 steps (found here by bisection with the
PLD accountant). Prints the markdown table and writes every row's JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsgld.config import load_config  # noqa: E402
from fedsgld.privacy import PrivacyAccountant  # noqa: E402
from fedsgld.studies.audit import run_audit  # noqa: E402


def dpsgd_sigma(epsilon: float, *, q: float, steps: int, delta: float) -> float:
    """The noise multiplier whose `steps` Poisson-subsampled Gaussian steps spend `epsilon`
    (within 0.5 %), by bisection on the PLD accountant."""

    def eps(sigma: float) -> float:
        acc = PrivacyAccountant(delta=delta, epsilon_budget=1e9, accountant="pld")
        return acc.rigorous_epsilon([(q, sigma, steps)])

    lo, hi = 0.3, 20.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        if eps(mid) > epsilon:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.005:
            break
    return hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--methods", nargs="+", default=["dpsgld", "dpsgd"])
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/audit-table.json")
    args = ap.parse_args()
    from fedsgld.config import parse_overrides

    rows = []
    for method in args.methods:
        for eps in args.epsilons:
            over = {"method": method, "epsilon": eps, "threads": 2, "eval_every": 0}
            over.update(parse_overrides(args.set))
            cfg = load_config(ROOT / "simulations/demo.toml", over)
            if method == "dpsgd":
                p = cfg.privacy
                over["noise_multiplier"] = round(
                    dpsgd_sigma(eps, q=p.sample_rate, steps=cfg.run.rounds, delta=p.delta), 4
                )
                cfg = load_config(ROOT / "simulations/demo.toml", over)
            t = time.perf_counter()
            r = run_audit(
                cfg, canaries=args.canaries, inclusion_seed=0, progress=False, log=lambda s: None
            )
            r["overrides"] = over
            rows.append(r)
            print(
                f"{method} eps {eps}: lower bound {r['epsilon_lower_bound']:.3f} "
                f"(one-run {r['epsilon_lower_bound_one_run']:.3f}, f-DP "
                f"{r['epsilon_lower_bound_fdp']:.3f}), accountant {r['epsilon_accountant']:.3f}, "
                f"{r['steps']} steps, {time.perf_counter() - t:.0f} s",
                flush=True,
            )
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(
        "| method | budget | steps | accountant epsilon | lower bound one-run | lower bound f-DP "
        "| correct / guesses | time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = {"dpsgld": "DP-SGLD", "dpsgd": "DP-SGD"}[r["method"]]
        extra = f" (sigma {r['overrides']['noise_multiplier']})" if r["method"] == "dpsgd" else ""
        print(
            f"| {name}{extra} | {r['epsilon_budget']:g} | {r['steps']} | "
            f"{r['epsilon_accountant']:.2f} | {r['epsilon_lower_bound_one_run']:.2f} | "
            f"{r['epsilon_lower_bound_fdp']:.2f} | {r['correct']} / {r['guesses']} | "
            f"{r['seconds']:.0f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
