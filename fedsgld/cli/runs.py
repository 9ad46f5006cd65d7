"""What ``fedsgld simulate`` and ``fedsgld compare`` do once their options are parsed:
run a federation on this machine (the in-process engine), and draw result directories
side by side. Imported only when one of them runs (it imports torch)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedsgld.cli.errors import UserError, _removed_on_failure
from fedsgld.config import load_config, parse_overrides
from fedsgld.engine import run
from fedsgld.run.layout import new_run_dir
from fedsgld.run.results import compare_runs


def simulate(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.set)
    if args.out is None and args.resume:
        raise UserError("--resume needs --out DIR (the run directory to resume)")
    config = load_config(args.config, overrides)  # every setting checked before any work

    out = Path(args.out) if args.out else new_run_dir(tag=config.privacy.method)
    with _removed_on_failure(out):
        results = run(
            config,
            out_dir=out,
            resume=args.resume,
            progress=not args.no_progress,
            config_source=str(args.config),
        )
    pr = results["privacy"]
    eps = ", ".join(f"{k}={v:.4f}" for k, v in pr["epsilon"].items())
    m = results["metrics"]["pooled"]
    print(
        f"{pr['method']}: {pr['steps']} steps, epsilon {eps} (budget {pr['budget']}, delta {pr['delta']:g}); "
        f"pooled accuracy {m['accuracy']:.4f}, NLL {m['nll']:.4f}, ECE {m['ece']:.4f}"
    )
    return 0


def compare(args: argparse.Namespace) -> int:
    try:
        path = compare_runs(args.runs, args.out, posterior=args.posterior)
    except ValueError as err:
        print(f"fedsgld compare: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
