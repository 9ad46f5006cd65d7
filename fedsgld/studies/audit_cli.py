"""``fedsgld audit``: run a config with canaries, print the bounds (or JSON), write
audit.json with ``--out`` (:func:`fedsgld.studies.audit.run_audit`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedsgld.config import load_config, parse_overrides
from fedsgld.studies.audit import run_audit


def main_audit(args) -> int:
    """``fedsgld audit``: run, print the bounds (or JSON), write audit.json with --out."""
    config = load_config(args.config, parse_overrides(args.set))
    if not (isinstance(args.canaries, int) and args.canaries >= 2):
        raise ValueError(f"--canaries must be an integer >= 2, got {args.canaries!r}")
    progress = not args.no_progress
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    out = run_audit(
        config,
        canaries=args.canaries,
        confidence=args.confidence,
        out_dir=args.out,
        site=args.site,
        progress=progress,
        log=log if progress else (lambda s: None),
    )
    if args.out is not None:
        path = Path(args.out) / "audit.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {path}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{out['method']} ({out['noise_placement']} noise), {out['steps']} rounds: epsilon "
            f"lower bound {out['epsilon_lower_bound']:.3f} at confidence {out['confidence']:g} "
            f"(one-run {out['epsilon_lower_bound_one_run']:.3f}, f-DP against the "
            f"{out['curve']} curve {out['epsilon_lower_bound_fdp']:.3f}; mu-GDP, assumed "
            f"Gaussian, {out['epsilon_lower_bound_gdp']:.3f}); accountant "
            f"{out['epsilon_accountant']:.3f} "
            f"({out['accountant']}, delta {out['delta']:g}); {out['correct']} of "
            f"{out['guesses']} guesses correct, {out['canaries']} canaries; {out['seconds']:.1f} s"
        )
        if out["flagged"]:
            print(
                "flagged: the lower bound exceeds the accountant's epsilon: the mechanism "
                "leaks more than it claims"
            )
    return 0
