"""``fedsgld site approve BUNDLE_OR_DIR [--policy FILE]``: a deployed site reviews an app
bundle and adds it to its policy's ``approved_apps`` (the check itself, and what this
command prints and writes, are :mod:`fedsgld.clients.approval`)."""

from __future__ import annotations

import argparse

from fedsgld.clients.approval import approve


def add_site_arguments(parser: argparse.ArgumentParser) -> None:
    """``fedsgld site approve BUNDLE_OR_DIR [--policy FILE]``."""
    sub = parser.add_subparsers(dest="site_command", required=True, metavar="SUBCOMMAND")
    ap = sub.add_parser(
        "approve",
        help="print an app bundle's digest and files; with --policy, approve it",
        description="Print the SHA-256 of an app bundle (a .fab file, or the bundle `flwr "
        "run DIR` would submit from a project directory) and every file it contains; with "
        "--policy, append it to the site's approved_apps.",
    )
    ap.add_argument("bundle", metavar="BUNDLE_OR_DIR", help="a .fab file or a project directory")
    ap.add_argument(
        "--policy",
        metavar="FILE",
        default=None,
        help="the site's policy file: append this bundle to its approved_apps (its text kept)",
    )
    ap.set_defaults(func=run_approve)


def run_approve(args: argparse.Namespace) -> int:
    _, text = approve(args.bundle, args.policy)
    print(text)
    return 0
