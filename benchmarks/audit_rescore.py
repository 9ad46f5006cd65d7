"""Score one audit's saved readings several ways (docs/audit.md): what the public estimate
of the records' part buys.

    python benchmarks/audit_table.py ... --save-readings runs/audit-readings
    python benchmarks/audit_rescore.py runs/audit-readings/dpsgld-server-4-noise_half.npz

For the readings y (as released), the public estimates r_hat, their variances s and lasting
error variances e (:mod:`fedsgld.studies.audit_public`), prints the likelihood ratio's
separation, the planned guess's correct count and the two bounds (one-run, f-DP against the
claimed DP-SGLD curve of the readings' variances; this one score, so 80 % of each half of
the significance on the planned guess and the rest on the grid) for: y; y - r_hat;
y - r_hat weighed by v + s; y - w r_hat (the shrinkage); y - w r_hat weighed by v + s (the
audit's score). For a comparison of the variants only: the headline of the audit is
``fedsgld audit``'s (four scores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsgld.privacy.audit_bounds import count_correct  # noqa: E402
from fedsgld.privacy.audit_tradeoff import audit_run  # noqa: E402
from fedsgld.studies.audit_public import shrinkage  # noqa: E402
from fedsgld.studies.audit_scores import likelihood_ratio, plan_guess, separation  # noqa: E402


def main(path: str, delta: float = 1e-5) -> None:
    d = np.load(path)
    y, off, spread = d["rows"], d["offsets"], d["spreads"]
    var, inc, q = list(d["variances"]), d["included"], float(d["sample_rate"])
    ledger = [(q, v**0.5, 1) for v in var]
    plan = plan_guess(y.shape[0], q, var, delta=delta, significance=0.025)
    w = shrinkage(off, d["lasting"])[:, None]
    print(f"{path}: {y.shape[0]} canaries, {y.shape[1]} rounds, planned guess {plan}")
    print(f"shrinkage: w > 0.5 for {np.mean(w > 0.5):.2%} of the canaries")
    for name, ys, extra in (
        ("y", y, None),
        ("y - r_hat", y - off, None),
        ("y - r_hat, v + s", y - off, spread),
        ("y - w r_hat", y - w * off, None),
        ("y - w r_hat, v + s", y - w * off, spread),
    ):
        s = likelihood_ratio(ys, q, var, extra=extra)
        b = audit_run(s[None, :], inc, delta=delta, ledger=ledger, planned=[(0, *plan)])
        r, v = count_correct(s, inc, *plan)
        print(
            f"{name}: separation {separation(s, inc):.3f}, planned {v} / {r} correct, "
            f"one-run {b['one_run'].epsilon:.2f}, f-DP {b['fdp'].epsilon:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])
