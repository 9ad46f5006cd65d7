"""``fedsgld deploy run ...`` and ``fedsgld deploy export-sites ...``: the deployment
helpers as subcommands of the one ``fedsgld`` command.

``fedsgld deploy run APP CONNECTION [flwr run options]`` is ``flwr run ... --stream``
whose exit status is the run's outcome (:mod:`fedsgld.deploy.run`);
``fedsgld deploy export-sites CONFIG --out DIR`` writes each site's records to its own file
(:mod:`fedsgld.deploy.export_sites`). ``python -m fedsgld.deploy run`` and
``python -m fedsgld.deploy.export_sites`` remain the same commands. Nothing here imports
more than argparse, so that help is fast; each runs its module only when used.
"""

from __future__ import annotations

import argparse
import importlib


def _run(args: argparse.Namespace) -> int:
    if not args.flwr_args or args.flwr_args[0] in ("-h", "--help"):
        args.run_parser.print_help()
        return 0 if args.flwr_args else 2
    main = importlib.import_module("fedsgld.deploy.run").main
    return int(main(list(args.flwr_args)) or 0)


def _export_sites(args: argparse.Namespace) -> int:
    main = importlib.import_module("fedsgld.deploy.export_sites").main
    argv = [*([args.config] if args.config else []), "--out", args.out]
    for item in args.set or []:
        argv += ["--set", item]
    return int(main(argv) or 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``deploy``'s two subcommands and their options."""
    sub = parser.add_subparsers(dest="deploy_command", required=True, metavar="DEPLOY_COMMAND")
    run = sub.add_parser(
        "run",
        help="flwr run whose exit status is the run's outcome",
        description="Run `flwr run APP CONNECTION ... --stream` (its output passes through) "
        "and exit with the run's outcome: 0 completed; 1 failed or stopped (the SuperLink's "
        "reason on stderr) or unknown; flwr run's own status when it could not start the "
        "run. Every argument after APP CONNECTION goes to flwr run unchanged.",
    )
    run.add_argument(
        "flwr_args",
        nargs=argparse.REMAINDER,
        metavar="APP CONNECTION ...",
        help="as for flwr run, e.g. . hospitals --run-config \"out='runs/d1' rounds=5\"",
    )
    run.set_defaults(func=_run, run_parser=run)
    export = sub.add_parser(
        "export-sites",
        help="write each site's records of a config's dataset to its own .npz file",
        description="Write DIR/site-<k>.npz (x_train, y_train, x_test, y_test, num_classes) "
        "for every site k: the in-process engine's split of the config's dataset (same "
        'partition and seed). A SuperNode started with --node-config "site-id=<k> '
        'site-data=DIR/site-<k>.npz" trains on exactly that file.',
    )
    export.add_argument(
        "config", nargs="?", default=None, help="TOML config (default: built-in defaults)"
    )
    export.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    export.add_argument("--out", required=True, help="output directory")
    export.set_defaults(func=_export_sites)


__all__ = ["add_arguments"]
