"""``fedsgld deploy run ...`` and ``fedsgld deploy export-sites ...``: the deployment
helpers as subcommands of the one ``fedsgld`` command.

``fedsgld deploy run APP CONNECTION [flwr run options]`` is ``flwr run ... --stream``
whose exit status is the run's outcome (:mod:`fedsgld.deploy.run`);
``fedsgld deploy local [flwr run options]`` the same for a local simulation on a SuperLink
of its own (:mod:`fedsgld.deploy.local`);
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


def _local(args: argparse.Namespace) -> int:
    run_local = importlib.import_module("fedsgld.deploy.local").run_local
    return int(run_local(list(args.flwr_args), home=args.home, ray_address=args.ray_address) or 0)


def _export_sites(args: argparse.Namespace) -> int:
    main = importlib.import_module("fedsgld.deploy.export_sites").main
    argv = [*([args.config] if args.config else []), "--out", args.out]
    for item in args.set or []:
        argv += ["--set", item]
    return int(main(argv) or 0)


#: deploy's subcommands whose arguments after their own options go to ``flwr run`` as given.
PASSTHROUGH = {"run": (), "local": ("--home", "--ray-address")}


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``fedsgld deploy run|local [own options] ARGS...``: (the line up to ARGS, ARGS), so
    that ARGS, flwr run's options included, reach flwr run untouched by this parser
    (None: not such a line, or a request for help)."""
    if "deploy" not in argv:
        return argv, None
    i = argv.index("deploy") + 1
    if i >= len(argv) or argv[i] not in PASSTHROUGH:
        return argv, None
    own, j = PASSTHROUGH[argv[i]], i + 1
    while j < len(argv):
        if argv[j] in own and j + 1 < len(argv):
            j += 2
        elif any(argv[j].startswith(f"{o}=") for o in own):
            j += 1
        else:
            break
    if argv[j : j + 1] in (["-h"], ["--help"]):
        return argv, None
    return argv[:j], argv[j:]


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
        nargs="*",
        metavar="APP CONNECTION ...",
        help="as for flwr run, e.g. . hospitals --run-config \"out='runs/d1' rounds=5\"",
    )
    run.set_defaults(func=_run, run_parser=run)
    local = sub.add_parser(
        "local",
        help="a Flower simulation on its own SuperLink (a free port), stopped afterwards",
        description="Start flower-superlink --simulation on a free port of 127.0.0.1 with "
        "its own FLWR_HOME (printed, with its PID), run `flwr run . --stream` with the "
        "options given against it (exit status: the run's outcome), then stop that "
        "SuperLink by its PID, also on Ctrl-C. Unlike plain `flwr run .`, it never uses "
        "a SuperLink that was already listening and leaves none running.",
    )
    local.add_argument(
        "--home", default=None, help="FLWR_HOME and logs here (default: runs/flwr-local-PORT)"
    )
    local.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="the simulation's Ray: local (one of its own, stopped with the run) or HOST:PORT "
        "of a running cluster's head, joined and left running (default: $RAY_ADDRESS if "
        "set, else local)",
    )
    local.add_argument(
        "flwr_args",
        nargs="*",
        metavar="...",
        help='flwr run options, e.g. --run-config "rounds=20" --federation-config '
        '"num-supernodes=4"',
    )
    local.set_defaults(func=_local)
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
