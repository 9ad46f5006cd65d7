"""The audit tables of docs/audit.md: lower bounds vs the accountant's epsilon on MNIST-5k.

    python benchmarks/audit_table.py [--epsilons 1 4 8] [--methods dpsgld dpsgd]
        [--placements server sites] [--canaries 10000] [--breaks none clip4 rate4 noise_half]
        [--out runs/audit-table.json]
    python benchmarks/audit_table.py --ideal [--canaries 10000] [--epsilons 4]
    python benchmarks/audit_table.py --table runs/audit-table.json [more.json ...]

Every row is `fedsgld audit simulations/demo.toml --set method=M --set epsilon=E --set
noise_placement=P --canaries N` (the demo: MNIST-5k over 4 sites, the paper's CNN with
26,010 parameters, 300 rounds, two threads) with the canaries at site 0 and a fixed
inclusion seed (so the table is reproducible), and the mechanism broken or not: ``clip4``
clips every record at 4 C inside the per-record clipping (``clip_factors``), ``rate4``
makes the Poisson sampler draw at 4 q (``poisson_sample``), ``noise_half`` halves the
server's noise (the accountant is told none of it). DP-SGLD keeps the demo's schedule and
halts when the budget is spent; DP-SGD gets the constant noise multiplier that spends the
budget in 300 steps (found here by bisection with the PLD accountant). Prints the markdown
table and writes every row's JSON; ``--table`` prints the table of rows written before
(rows run as separate invocations).

``--ideal`` plays the idealised subsampled game of DP-SGD's setting instead (no training):
the likelihood ratio of the claimed mechanism's readings, with the audit's planned guess,
grid and corrections (:func:`fedsgld.privacy.audit_tradeoff.audit_run`), over a few seeds:
what an audit with this many canaries can certify at best.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from fedsgld.config import load_config, parse_overrides  # noqa: E402
from fedsgld.privacy import PrivacyAccountant  # noqa: E402
from fedsgld.privacy.audit_bounds import count_correct  # noqa: E402
from fedsgld.privacy.audit_tradeoff import audit_run  # noqa: E402
from fedsgld.studies.audit import run_audit  # noqa: E402
from fedsgld.studies.audit_scores import (  # noqa: E402
    likelihood_ratio,
    plan_guess,
    separation,
    simulated_readings,
)

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


def ideal_games(m: int, epsilon: float, *, seeds: int = 3) -> None:
    """Print the idealised game's bounds with m canaries (module docstring)."""
    delta, q, steps = 1e-5, 0.064, 300
    sigma = dpsgd_sigma(epsilon, q=q, steps=steps, delta=delta)
    variances = [sigma**2] * steps
    plan = plan_guess(m, q, variances, delta=delta, significance=0.025)
    for seed in range(seeds):
        for noise in (1.0, 0.5):  # the claimed noise, and the noise halved (still claimed)
            truth = [v * noise**2 for v in variances]
            inc, y = simulated_readings(m, q, truth, seed=seed + 1)
            score = likelihood_ratio(y, q, variances)
            b = audit_run(
                score[None, :], inc, delta=delta, ledger=[(q, sigma, steps)], planned=[(0, *plan)]
            )
            print(
                f"m {m}, epsilon {epsilon:g}, seed {seed}: subsampled game (q {q}, sigma "
                f"{sigma:.4f}{' halved' if noise < 1 else ''}, {steps} steps, likelihood "
                f"ratio, separation {separation(score, inc):.2f}, planned {plan}: "
                f"{count_correct(score, inc, *plan)[1]} correct): one-run "
                f"{b['one_run'].epsilon:.2f}, f-DP (accountant's curve) {b['fdp'].epsilon:.2f}, "
                f"mu-GDP {b['gdp'].epsilon:.2f}",
                flush=True,
            )


@contextmanager
def broken(name: str):
    """The mechanism broken by ``name`` for the duration (module docstring)."""
    import fedsgld.core.clipping as clipping
    import fedsgld.core.mechanism as mechanism
    from fedsgld.core.noise import Randomness
    from fedsgld.core.streams import SERVER_STREAM

    if name == "none":
        yield
    elif name == "clip4":
        factors = clipping.clip_factors
        with patch.object(clipping, "clip_factors", lambda sq, c: factors(sq, 4 * c)):
            yield
    elif name == "rate4":
        sample = mechanism.poisson_sample

        def fast(n, *, sample_rate, generator):
            return sample(n, sample_rate=min(1.0, 4 * sample_rate), generator=generator)

        with patch.object(mechanism, "poisson_sample", fast):
            yield
    elif name == "noise_half":
        draw = Randomness.gaussian

        def half(self, shape, *, std, key, **kw):
            return draw(self, shape, std=std / 2 if key[0] == SERVER_STREAM else std, key=key, **kw)

        with patch.object(Randomness, "gaussian", half):
            yield
    else:
        raise ValueError(f"--breaks must be among none, clip4, rate4, noise_half; got {name!r}")


@contextmanager
def saving(folder: str | None, name: str):
    """With ``--save-readings DIR``: each audit's readings, public estimates and inclusion
    bits as DIR/name.npz (for scoring them otherwise later)."""
    if folder is None:
        yield
        return
    import numpy as np

    from fedsgld.studies.audit import CanaryAudit

    result = CanaryAudit.result

    def keep(self, **kw):
        out = result(self, **kw)
        Path(folder).mkdir(parents=True, exist_ok=True)
        opt = {
            k: np.stack(v, axis=1)
            for k, v in (
                ("offsets", self.offsets),
                ("spreads", self.spreads),
                ("lasting", self.lasting),
            )
            if v
        }
        np.savez_compressed(
            Path(folder) / f"{name}.npz",
            rows=np.stack(self.rows, axis=1),
            variances=np.asarray(self.variances),
            included=self._included.numpy(),
            sample_rate=self.sample_rate,
            **opt,
        )
        return out

    with patch.object(CanaryAudit, "result", keep):
        yield


def audit_row(method: str, eps: float, placement: str, brk: str, args) -> dict:
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
    with broken(brk), saving(args.save_readings, f"{method}-{placement}-{eps:g}-{brk}"):
        r = run_audit(
            cfg,
            canaries=args.canaries,
            inclusion_seed=0,
            public_estimate=not args.no_public,
            progress=False,
            log=lambda s: None,
        )
    r["overrides"], r["break"] = over, brk
    return r


HEADER = (
    "| method | noise at | break | canaries | steps | accountant epsilon | one run | f-DP, "
    "accountant's curve (noise scale) | f-DP, mu-GDP (assumed) | flagged | correct / guesses "
    "(f-DP) | time |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_line(r: dict) -> str:
    extra = f" (sigma {r['overrides']['noise_multiplier']})" if r["method"] == "dpsgd" else ""
    best = r["bounds"]["fdp"]
    guess = f"{best['k_in']} IN" + (f" + {best['k_out']} OUT" if best["k_out"] else "")
    planned = " planned" if best["significance"] > 0.01 else ""
    scale = f" (s {best['scale']:.2f})" if best.get("scale") else ""
    return (
        f"| {NAMES[r['method']]}{extra} | {r['noise_placement']} | {r['break']} | "
        f"{r['canaries']:,} | {r['steps']} | {r['epsilon_accountant']:.2f} | "
        f"{r['epsilon_lower_bound_one_run']:.2f} | {r['epsilon_lower_bound_fdp']:.2f}{scale} | "
        f"{r['epsilon_lower_bound_gdp']:.2f} | {'yes' if r['flagged'] else 'no'} | "
        f"{best['correct']} / {best['guesses']} ({guess}{planned}, "
        f"{best['score'].replace('_', ' ')}) | {r['seconds']:.0f} s |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--methods", nargs="+", default=["dpsgld", "dpsgd"])
    ap.add_argument("--placements", nargs="+", default=["server", "sites"])
    ap.add_argument("--canaries", type=int, default=10_000)
    ap.add_argument("--breaks", nargs="+", default=["none"])
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these rows")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/audit-table.json")
    ap.add_argument("--ideal", action="store_true", help="the idealised games only")
    ap.add_argument("--save-readings", metavar="DIR", help="keep every audit's readings here")
    ap.add_argument(
        "--no-public",
        action="store_true",
        help="the readings without the public estimate of the records' part",
    )
    args = ap.parse_args()
    if args.ideal:
        for eps in args.epsilons:
            ideal_games(args.canaries, eps)
        return 0
    if args.table:
        rows = [r for path in args.table for r in json.loads(Path(path).read_text())]
        print(HEADER)
        for r in rows:
            print(table_line(r))
        return 0
    rows = []
    for method in args.methods:
        for placement in args.placements:
            for eps in args.epsilons:
                for brk in args.breaks:
                    t = time.perf_counter()
                    rows.append(audit_row(method, eps, placement, brk, args))
                    r = rows[-1]
                    print(
                        f"{method} {placement} eps {eps} {brk}: lower bound "
                        f"{r['epsilon_lower_bound']:.3f} (one-run "
                        f"{r['epsilon_lower_bound_one_run']:.3f}, f-DP "
                        f"{r['epsilon_lower_bound_fdp']:.3f}), accountant "
                        f"{r['epsilon_accountant']:.3f}, flagged {r['flagged']}, {r['steps']} "
                        f"steps, {time.perf_counter() - t:.0f} s; separation "
                        f"{r['separation']} (without the public estimate: "
                        f"{r.get('separation_uncorrected')})",
                        flush=True,
                    )
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(HEADER)
    for r in rows:
        print(table_line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
