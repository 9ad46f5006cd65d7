"""``fedsgld pate CONFIG --out DIR`` and ``fedsgld pate-analysis VOTES.npz``."""

from __future__ import annotations

import argparse
import json
import sys


def add_pate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="PATE TOML config (see simulations/pate_mnist.toml)")
    p.add_argument("--out", default=None, help="result directory (default: a new one under runs/)")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )


def _parse_sets(items: list[str] | None) -> dict:
    from fedsgld.config import parse_overrides

    return parse_overrides(items)


def run_pate_command(args: argparse.Namespace) -> int:
    from fedsgld.engine import new_run_dir
    from fedsgld.pate.train import load_pate_config, run_pate

    try:
        config = load_pate_config(args.config, _parse_sets(args.set))
        out = args.out if args.out is not None else new_run_dir("runs", "pate")
        results = run_pate(config, out_dir=out)
    except (ValueError, OSError) as err:
        print(f"fedsgld pate: error: {err}", file=sys.stderr)
        return 2
    print(f"results in {out} ({results['seconds']:.1f}s)")
    return 0


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("votes", help="a votes_<mechanism>.npz file written by `fedsgld pate`")
    p.add_argument("--delta", type=float, default=None, help="delta (default: the file's)")
    p.add_argument(
        "--moments", type=int, default=None, help="LNMax: number of moments (default: the file's)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_analysis_command(args: argparse.Namespace) -> int:
    from fedsgld.pate.train import analyse_vote_file

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
