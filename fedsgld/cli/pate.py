"""What ``fedsgld pate CONFIG --out DIR`` and ``fedsgld pate-analysis VOTES.npz`` do once
their options (:mod:`fedsgld.cli.options`) are parsed. Imported only when one of them runs
(PATE's training imports torch)."""

from __future__ import annotations

import argparse
import json
import sys

from fedsgld.config import parse_overrides
from fedsgld.pate.train import analyse_vote_file, load_pate_config, run_pate
from fedsgld.run.layout import new_run_dir


def run_pate_command(args: argparse.Namespace) -> int:
    try:
        config = load_pate_config(args.config, parse_overrides(args.set))
        out = args.out if args.out is not None else new_run_dir("runs", "pate")
        quiet = getattr(args, "no_progress", False)
        results = run_pate(config, out_dir=out, log=(lambda _line: None) if quiet else print)
    except (ValueError, OSError) as err:
        print(f"fedsgld pate: error: {err}", file=sys.stderr)
        return 2
    print(f"results in {out} ({results['seconds']:.1f}s)")
    return 0


def run_analysis_command(args: argparse.Namespace) -> int:
    try:
        r = analyse_vote_file(args.votes, delta=args.delta, moments=args.moments)
    except (ValueError, OSError, KeyError) as err:
        print(f"fedsgld pate-analysis: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    p, e = r["params"], r["epsilon"]
    print(
        f"{p['mechanism']}: {r['teachers']} teachers, {r['answered']}/{r['queries']} queries "
        f"answered, delta {p['delta']:g}\n"
        f"  epsilon data-independent {e['data_independent']:.4f}\n"
        f"  epsilon data-dependent   {e['data_dependent']:.4f} (depends on the private votes: "
        "not private to release)"
    )
    return 0
