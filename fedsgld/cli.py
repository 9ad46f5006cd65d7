"""The ``fedsgld`` command.

fedsgld simulate CONFIG [--set key=value ...] [--out DIR] [--resume]
fedsgld privacy --sample-rate Q (--steps T | --epsilon E) --delta D
                (--noise-multiplier S | --lr A0 --temperature TAU [--decay-gamma G --decay-t0 T0])
"""

from __future__ import annotations

import argparse
import sys


def _simulate(args: argparse.Namespace) -> int:
    from .config import load_config, parse_overrides
    from .engine import run

    try:
        overrides = parse_overrides(args.set)
        if args.out is None and args.resume:
            raise ValueError("--resume needs --out DIR (the run directory to resume)")
        config = load_config(args.config, overrides)
    except ValueError as err:
        print(f"fedsgld simulate: error: {err}", file=sys.stderr)
        return 2
    try:
        results = run(
            config,
            out_dir=args.out,
            resume=args.resume,
            progress=not args.no_progress,
            config_source=str(args.config),
        )
    except ValueError as err:
        print(f"fedsgld simulate: error: {err}", file=sys.stderr)
        return 2
    pr = results["privacy"]
    eps = ", ".join(f"{k}={v:.4f}" for k, v in pr["epsilon"].items())
    m = results["metrics"]["pooled"]
    print(
        f"{pr['method']}: {pr['steps']} steps, epsilon {eps} (budget {pr['budget']}, delta {pr['delta']:g}); "
        f"pooled accuracy {m['accuracy']:.4f}, NLL {m['nll']:.4f}, ECE {m['ece']:.4f}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .privacy import cli as privacy_cli

    parser = argparse.ArgumentParser(prog="fedsgld", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run a federation on this machine (in-process engine)")
    sim.add_argument("config", help="TOML config file (see simulations/)")
    sim.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    sim.add_argument(
        "--out", default=None, help="result directory (default: a new one under runs/)"
    )
    sim.add_argument(
        "--resume", action="store_true", help="resume the run in --out from its checkpoint"
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.set_defaults(func=_simulate)

    bench = sub.add_parser(
        "benchmark", help="several methods and seeds at the same (epsilon, delta)"
    )
    bench.add_argument("config", help="TOML config with a [benchmark] table (see simulations/)")
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run setting")
    bench.add_argument(
        "--out", default=None, help="output directory (default: a new one under runs/)"
    )
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(
        func=lambda a: __import__("fedsgld.benchmark", fromlist=["x"]).main_benchmark(a)
    )

    priv = sub.add_parser(
        "privacy", help="epsilon of a DP-SGD / DP-SGLD schedule, or steps a budget allows"
    )
    privacy_cli.add_arguments(priv)
    priv.set_defaults(func=privacy_cli.run)

    from .pate import cli as pate_cli

    pate = sub.add_parser("pate", help="PATE: teachers per site, noisy votes, a student")
    pate_cli.add_pate_arguments(pate)
    pate.set_defaults(func=pate_cli.run_pate_command)
    pate_an = sub.add_parser("pate-analysis", help="epsilons of a saved PATE vote file")
    pate_cli.add_analysis_arguments(pate_an)
    pate_an.set_defaults(func=pate_cli.run_analysis_command)
    from .deploy import fast as deploy_fast

    deploy_fast.register(sub)  # supernode, superlink: Flower's, its fixed waits shortened
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
