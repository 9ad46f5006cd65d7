"""The audit tables of docs/audit.md: lower bounds vs the accountant's epsilon on MNIST-5k.

    python benchmarks/audit_table.py --docs docs/audit.md [--resume]   # the whole table
    python benchmarks/audit_table.py [--epsilons 1 4 8] [--methods dpsgld dpsgd]
        [--placements server sites secure] [--canaries 10000]
        [--breaks none clip4 rate4 noise_half] [--out runs/audit-table.json]
    python benchmarks/audit_table.py --ideal [--canaries 10000] [--epsilons 4]
    python benchmarks/audit_table.py --table runs/audit-table.json [more.json ...]

Every row is `fedsgld audit simulations/demo.toml --set method=M --set epsilon=E --set
noise_placement=P --canaries N` (the demo: MNIST-5k over 4 sites, the paper's CNN with
26,010 parameters, 300 rounds, two threads) with the canaries at site 0 and a fixed
inclusion seed (so the table is reproducible), and the mechanism broken or not: ``clip4``
clips every record at 4 C inside the per-record clipping (``clip_factors``), ``rate4``
makes the Poisson sampler draw at 4 q (``poisson_sample``), ``noise_half`` halves the
privacy noise wherever it is drawn (every charged Gaussian draw, ``Charged.noise``: the
server's, or each site's own with noise at the sites; with secure aggregation every site's
discrete Gaussian share at a quarter of its variance); the accountant is told none of it.
Placement ``secure`` is ``noise_placement = "sites"`` with ``secure_aggregation = true``
and one local step. DP-SGLD keeps the demo's schedule and halts when the budget is spent;
DP-SGD gets the constant noise multiplier that spends the budget in 300 steps (found here
by bisection with the PLD accountant).

Without any of ``--methods``, ``--placements``, ``--epsilons``, ``--breaks`` and
``--canaries`` it runs the whole table (:data:`GRID`): every method, placement and budget
unbroken with 10,000 canaries, the noise halved at budget 4 with 10,000 canaries, and
clipping at 4 C and sampling at 4 q with 1,000 (DP-SGLD, server). Every finished row is
written to ``--out`` at once; ``--resume`` keeps the rows already there (the same method,
placement, budget, break, canaries and ``--set``) instead of running them again, so an
interrupted table goes on where it stopped (``--report-only``: runs nothing). Prints the markdown table of the grid's rows
in ``--out``; ``--docs MD`` also writes it into MD between its ``<!-- audit_table: demo
-->`` and ``<!-- audit_table: end demo -->`` markers: a row of the grid that ``--out``
does not hold keeps its line from MD's table, marked *earlier run* (with the commits
those rows ran on), and rows in neither are listed as not yet measured. ``--table`` prints the table of rows written before (any JSON of rows).

``--ideal`` plays the idealised subsampled game of DP-SGD's setting instead (no training):
the likelihood ratio of the claimed mechanism's readings, with the audit's planned guess,
grid and corrections (:func:`fedsgld.privacy.audit_tradeoff.audit_run`), over a few seeds:
what an audit with this many canaries can certify at best.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
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
        import fedsgld.secagg.ddg as ddg
        from fedsgld.core.release import Charged

        noise, share = Charged.noise, ddg.discrete_gaussian

        def half(self, randomness, shape, *, std, **kw):
            return noise(self, randomness, shape, std=std / 2, **kw)

        def quarter(variance, size, *args):  # t (t - 1) about variance / 4
            t = (math.isqrt(variance) + 1 + 1) // 2
            return share(t * (t - 1), size, *args)

        with patch.object(Charged, "noise", half), patch.object(ddg, "discrete_gaussian", quarter):
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


#: placement name -> the config's settings
PLACEMENTS = {
    "server": {"noise_placement": "server"},
    "sites": {"noise_placement": "sites"},
    "secure": {"noise_placement": "sites", "secure_aggregation": True, "local_steps": 1},
}


def _grid() -> list[tuple[str, str, float, str, int]]:
    """The whole table: (method, placement, epsilon, break, canaries) rows, in order."""
    rows = [
        (m, p, e, "none", 10_000)
        for m in ("dpsgld", "dpsgd")
        for p in PLACEMENTS
        for e in (4.0, 1.0, 8.0)
    ]
    rows += [(m, p, 4.0, "noise_half", 10_000) for m in ("dpsgld", "dpsgd") for p in PLACEMENTS]
    return rows + [("dpsgld", "server", 4.0, b, 1_000) for b in ("clip4", "rate4")]


GRID = _grid()


def row_key(method: str, placement: str, eps: float, brk: str, canaries: int, sets) -> str:
    """What makes two rows the same measurement (``--resume``)."""
    return f"{method}|{placement}|{eps:g}|{brk}|{canaries}|{' '.join(sorted(sets))}"


def commit() -> str:
    """The checkout's commit (with ``+`` when fedsgld/ has uncommitted changes)."""

    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return head + ("+" if git("status", "--porcelain", "--", "fedsgld") else "")


def code_commit(head: str) -> str:
    """The last commit at or before ``head`` that changed fedsgld/ (the code measured)."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h", head.rstrip("+"), "--", "fedsgld"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return (out.stdout.strip() or "unknown") + ("+" if head.endswith("+") else "")


def audit_row(method: str, eps: float, placement: str, brk: str, canaries: int, args) -> dict:
    """One audit of the demo (module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"--placements must be among {', '.join(PLACEMENTS)}; got {placement!r}")
    over = {"method": method, "epsilon": eps, **PLACEMENTS[placement]}
    over.update({"threads": 2, "eval_every": 0, **parse_overrides(args.set)})
    cfg = load_config(DEMO, over)
    if method == "dpsgd":
        p = cfg.privacy
        over["noise_multiplier"] = round(
            dpsgd_sigma(eps, q=p.sample_rate, steps=cfg.run.rounds, delta=p.delta), 4
        )
        cfg = load_config(DEMO, over)
    start = time.perf_counter()
    with broken(brk), saving(args.save_readings, f"{method}-{placement}-{eps:g}-{brk}"):
        r = run_audit(
            cfg,
            canaries=canaries,
            inclusion_seed=0,
            public_estimate=not args.no_public,
            progress=False,
            log=lambda s: None,
        )
    r["overrides"], r["break"], r["placement"] = over, brk, placement
    r["key"] = row_key(method, placement, eps, brk, canaries, args.set)
    r["commit"], r["seconds_row"] = commit(), round(time.perf_counter() - start, 1)
    return r


HEADER = (
    "| method | noise at | budget | break | canaries | steps | accountant epsilon | one run | "
    "f-DP, accountant's curve (noise scale) | f-DP, mu-GDP (assumed) | flagged | correct / "
    "guesses (f-DP) | time |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_line(r: dict) -> str:
    extra = f" (sigma {r['overrides']['noise_multiplier']})" if r["method"] == "dpsgd" else ""
    best = r["bounds"]["fdp"]
    guess = f"{best['k_in']} IN" + (f" + {best['k_out']} OUT" if best["k_out"] else "")
    planned = " planned" if best["significance"] > 0.01 else ""
    scale = f" (s {best['scale']:.2f})" if best.get("scale") else ""
    return (
        f"| {NAMES[r['method']]}{extra} | {r.get('placement', r['noise_placement'])} | "
        f"{r['epsilon_budget']:g} | {r['break']} | "
        f"{r['canaries']:,} | {r['steps']} | {r['epsilon_accountant']:.2f} | "
        f"{r['epsilon_lower_bound_one_run']:.2f} | {r['epsilon_lower_bound_fdp']:.2f}{scale} | "
        f"{r['epsilon_lower_bound_gdp']:.2f} | {'yes' if r['flagged'] else 'no'} | "
        f"{best['correct']} / {best['guesses']} ({guess}{planned}, "
        f"{best['score'].replace('_', ' ')}) | {r['seconds']:.0f} s |"
    )


EARLIER = "earlier run"
EARLIER_NOTE = (
    f"Rows whose time says *{EARLIER}* were measured by an earlier run of this command and "
    "are kept from the page until this command measures them again: measured on commit "
)


def row_cells(method: str, placement: str, eps: float, brk: str, canaries: int) -> tuple:
    """A row's first five cells as the table writes them (the method without its sigma)."""
    return (NAMES[method], placement, f"{eps:g}", brk, f"{canaries:,}")


def earlier_rows(doc: str) -> tuple[dict[tuple, str], list[str]]:
    """The rows of the table already between ``doc``'s demo markers, by their first five
    cells, each marked as an earlier run's, and the commits they were measured on."""
    begin, end = "<!-- audit_table: demo -->", "<!-- audit_table: end demo -->"
    if doc.count(begin) != 1 or doc.count(end) != 1:
        return {}, []
    body = doc.split(begin)[1].split(end)[0]
    rows, commits = {}, []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| DP-") and len(cells) == 13:
            key = (cells[0].split(" (")[0], *cells[1:5])
            if EARLIER not in cells[12]:
                cells[12] = f"{cells[12]}, *{EARLIER}*"
            rows[key] = "| " + " | ".join(cells) + " |"
        for head in ("Measured on commit ", EARLIER_NOTE):
            if line.startswith(head):
                commits += [c.strip() for c in line[len(head) :].split(" (")[0].split(",")]
    return rows, commits


def report(rows: list[dict | str], missing: list[str], earlier: list[str] = ()) -> str:
    """The markdown table of ``rows`` (a row, or a line kept from the page, measured on the
    commits ``earlier``), then the commits they ran on and the rows missing."""
    lines = [HEADER, *(r if isinstance(r, str) else table_line(r) for r in rows)]
    kept = [r for r in rows if isinstance(r, str)]
    rows = [r for r in rows if not isinstance(r, str)]
    commits = sorted({r.get("commit", "unknown") for r in rows})
    code = sorted({code_commit(c) for c in commits})
    if rows:
        lines += [
            "",
            f"Measured on commit {', '.join(commits)} (fedsgld/ as of {', '.join(code)}).",
        ]
    if kept:
        old = sorted(set(earlier))
        lines += ["", f"{EARLIER_NOTE}{', '.join(old)} (fedsgld/ as of "
                  f"{', '.join(sorted({code_commit(c) for c in old}))})."]  # fmt: skip
    if missing:
        lines += ["", "Not yet measured by this command (`--resume` runs them):", ""]
        lines += [f"* {m}" for m in missing]
    return "\n".join(lines)


def splice_docs(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- audit_table: NAME -->`` and ``<!-- audit_table: end
    NAME -->`` in ``path`` by ``body``."""
    doc = path.read_text()
    begin, end = f"<!-- audit_table: {name} -->", f"<!-- audit_table: end {name} -->"
    if doc.count(begin) != 1 or doc.count(end) != 1:
        raise SystemExit(f"{path}: needs exactly one {begin} and one {end}")
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    path.write_text(f"{head}{begin}\n\n{body.strip()}\n\n{end}{tail}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epsilons", type=float, nargs="+")
    ap.add_argument("--methods", nargs="+", choices=list(NAMES))
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS))
    ap.add_argument("--canaries", type=int)
    ap.add_argument("--breaks", nargs="+", choices=["none", "clip4", "rate4", "noise_half"])
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these rows")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/audit-table.json")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out")
    ap.add_argument("--docs", metavar="MD", help="write the table into MD (docs/audit.md)")
    ap.add_argument("--report", metavar="PATH", help="append this run's output, with the "
                    "commit, machine and command, to PATH (benchmarks/results/audit_table.md)")  # fmt: skip
    ap.add_argument(
        "--report-only", action="store_true", help="run nothing: the table of the rows in --out"
    )
    ap.add_argument("--ideal", action="store_true", help="the idealised games only")
    ap.add_argument("--save-readings", metavar="DIR", help="keep every audit's readings here")
    ap.add_argument(
        "--no-public",
        action="store_true",
        help="the readings without the public estimate of the records' part",
    )
    args = ap.parse_args(argv)
    if args.canaries is not None and args.canaries < 2:
        ap.error(f"--canaries must be an integer >= 2, got {args.canaries}")
    return args


def planned_rows(args) -> list[tuple[str, str, float, str, int]]:
    """The rows asked for: the grid's, or the product of the options given."""
    if all(getattr(args, k) is None for k in ("methods", "placements", "epsilons", "breaks")):
        if args.canaries is None:
            return list(GRID)
    return [
        (m, p, e, b, args.canaries or 10_000)
        for m in args.methods or ["dpsgld", "dpsgd"]
        for p in args.placements or list(PLACEMENTS)
        for e in args.epsilons or [4.0, 1.0, 8.0]
        for b in args.breaks or ["none"]
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.ideal:
        for eps in args.epsilons or [4.0]:
            ideal_games(args.canaries or 10_000, eps)
        return 0
    if args.table:
        rows = [r for path in args.table for r in json.loads(Path(path).read_text())]
        print(report(rows, []))
        return 0
    out = Path(args.out)
    keep = args.resume or args.report_only
    kept = json.loads(out.read_text()) if keep and out.exists() else []
    done = {r.get("key"): r for r in kept}
    plan = planned_rows(args)
    for method, placement, eps, brk, m in plan:
        key = row_key(method, placement, eps, brk, m, args.set)
        if key in done or args.report_only:
            continue
        r = done[key] = audit_row(method, eps, placement, brk, m, args)
        print(
            f"{method} {placement} eps {eps:g} {brk} ({m} canaries): lower bound "
            f"{r['epsilon_lower_bound']:.3f} (one-run {r['epsilon_lower_bound_one_run']:.3f}, "
            f"f-DP {r['epsilon_lower_bound_fdp']:.3f}), accountant "
            f"{r['epsilon_accountant']:.3f}, flagged {r['flagged']}, {r['steps']} steps, "
            f"{r['seconds_row']:.0f} s; separation {r['separation']} (without the public "
            f"estimate: {r.get('separation_uncorrected')})",
            flush=True,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(list(done.values()), indent=2) + "\n")
    keys = [row_key(*row, args.set) for row in plan]
    # with --docs, a row this command has not measured keeps the page's line, if it has one
    page, commits = earlier_rows(Path(args.docs).read_text()) if args.docs else ({}, [])
    rows = [done[k] if k in done else page.get(row_cells(*row))
            for row, k in zip(plan, keys, strict=True)]  # fmt: skip
    missing = [
        f"{NAMES[m]}, {p}, epsilon {e:g}, {b}, {n:,} canaries"
        for (m, p, e, b, n), r in zip(plan, rows, strict=True)
        if r is None
    ]
    text = report([r for r in rows if r is not None], missing, commits)
    if args.docs:
        splice_docs(Path(args.docs), "demo", text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    from _report import report_cli  # benchmarks/_report.py: on the path only as a script

    with report_cli():  # --report PATH: append this run's output to a report
        raise SystemExit(main())
