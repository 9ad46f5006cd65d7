"""The audit table of docs/audit.md: lower bound vs the accountant's epsilon on MNIST-5k.

    python benchmarks/audit_table.py [--epsilons 1 4 8] [--methods dpsgld dpsgd]
        [--placements server sites] [--canaries 25000] [--out runs/audit-table.json]
    python benchmarks/audit_table.py --ideal [--canaries 25000] [--epsilons 4]

Every row is `fedsgld audit simulations/demo.toml --set method=M --set epsilon=E --set
noise_placement=P --canaries 25000` (the demo: MNIST-5k over 4 sites, the paper's CNN
with 26,010 parameters, 300 rounds, two threads) with the canaries at site 0 and a fixed
inclusion seed (so the table is reproducible). DP-SGLD keeps the demo's schedule and
halts when the budget is spent; DP-SGD gets the constant noise multiplier that spends the
budget in 300 steps (found here by bisection with the PLD accountant). Prints the markdown
table and writes every row's JSON.

``--ideal`` plays the idealised games instead (no training): the Gaussian game at the
mu-GDP whose epsilon is the budget, and the subsampled game of DP-SGD's setting (q, the
noise multiplier, 300 steps) scored by the likelihood ratio, each with the same number of
canaries, guess grid and Bonferroni correction as the audit, over a few seeds: what an
audit with this many canaries can certify at best.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from fedsgld.config import load_config, parse_overrides  # noqa: E402
from fedsgld.privacy import PrivacyAccountant  # noqa: E402
from fedsgld.privacy import audit_bounds as ab  # noqa: E402
from fedsgld.studies.audit import run_audit  # noqa: E402
from fedsgld.studies.audit_scores import likelihood_ratio  # noqa: E402

DEMO = ROOT / "simulations/demo.toml"
NAMES = {"dpsgld": "DP-SGLD", "dpsgd": "DP-SGD"}


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


def ideal_games(m: int, epsilon: float, *, seeds: int = 3, tries: int = 4) -> None:
    """Print the idealised games' f-DP bounds with m canaries (module docstring); the
    correction divides the 5 % among ``tries`` scores times the audit's guess grid."""
    delta, q, steps = 1e-5, 0.064, 300
    mu = ab.gdp_mu_at(epsilon, delta)
    sigma = dpsgd_sigma(epsilon, q=q, steps=steps, delta=delta)
    pairs = ab.guess_pairs(m)
    conf = 1.0 - 0.05 / (tries * len(pairs))
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        inc = rng.random(m) < 0.5
        gauss = inc + rng.standard_normal(m) / mu
        y = np.zeros((m, steps), dtype=np.float32)
        for t in range(steps):  # one column at a time: m x steps float64 would be large
            y[:, t] = ((rng.random(m) < q) & inc) + sigma * rng.standard_normal(m)
        sub = likelihood_ratio(y, q, [sigma**2] * steps)
        got = [
            max(
                ab.fdp_epsilon(m, *ab.count_correct(s, inc, a, b), delta=delta, confidence=conf)
                for a, b in pairs
            )
            for s in (gauss, sub)
        ]
        print(
            f"m {m}, epsilon {epsilon:g}, seed {seed}: Gaussian game (mu {mu:.3f}) f-DP "
            f"{got[0]:.2f}; subsampled game (q {q}, sigma {sigma:.3f}, {steps} steps, "
            f"likelihood ratio) f-DP {got[1]:.2f}",
            flush=True,
        )


def audit_row(method: str, eps: float, placement: str, args) -> dict:
    """One audit of the demo (module docstring)."""
    over = {"method": method, "epsilon": eps, "noise_placement": placement}
    over.update({"threads": 2, "eval_every": 0, **parse_overrides(args.set)})
    cfg = load_config(DEMO, over)
    if method == "dpsgd":
        p = cfg.privacy
        over["noise_multiplier"] = round(
            dpsgd_sigma(eps, q=p.sample_rate, steps=cfg.run.rounds, delta=p.delta), 4
        )
        cfg = load_config(DEMO, over)
    r = run_audit(cfg, canaries=args.canaries, inclusion_seed=0, progress=False, log=lambda s: None)
    r["overrides"] = over
    return r


def table_line(r: dict) -> str:
    extra = f" (sigma {r['overrides']['noise_multiplier']})" if r["method"] == "dpsgd" else ""
    best = r["bounds"]["fdp"]
    guess = f"{best['k_in']} IN" + (f" + {best['k_out']} OUT" if best["k_out"] else "")
    return (
        f"| {NAMES[r['method']]}{extra} | {r['noise_placement']} | {r['epsilon_budget']:g} | "
        f"{r['steps']} | {r['epsilon_accountant']:.2f} | {r['epsilon_lower_bound_one_run']:.2f} | "
        f"{r['epsilon_lower_bound_fdp']:.2f} | {best['correct']} / {best['guesses']} ({guess}, "
        f"{best['score'].replace('_', ' ')}) | "
        f"{r['separation']['likelihood_ratio']:.2f} | {r['seconds']:.0f} s |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--methods", nargs="+", default=["dpsgld", "dpsgd"])
    ap.add_argument("--placements", nargs="+", default=["server", "sites"])
    ap.add_argument("--canaries", type=int, default=25_000)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/audit-table.json")
    ap.add_argument("--ideal", action="store_true", help="the idealised games only")
    args = ap.parse_args()
    if args.ideal:
        for eps in args.epsilons:
            ideal_games(args.canaries, eps)
        return 0
    rows = []
    for method in args.methods:
        for placement in args.placements:
            for eps in args.epsilons:
                t = time.perf_counter()
                rows.append(audit_row(method, eps, placement, args))
                r = rows[-1]
                print(
                    f"{method} {placement} eps {eps}: lower bound {r['epsilon_lower_bound']:.3f} "
                    f"(one-run {r['epsilon_lower_bound_one_run']:.3f}, f-DP "
                    f"{r['epsilon_lower_bound_fdp']:.3f}), accountant "
                    f"{r['epsilon_accountant']:.3f}, {r['steps']} steps, "
                    f"{time.perf_counter() - t:.0f} s",
                    flush=True,
                )
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(
        "| method | noise at | budget | steps | accountant epsilon | lower bound, one run "
        "| lower bound, f-DP | correct / guesses (f-DP) | LR separation | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(table_line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
