"""``fedsgld site init``: a new site's policy (:mod:`fedsgld.clients.policy_init`);
``fedsgld site approve BUNDLE_OR_DIR [--policy FILE]``: a deployed site reviews an app
bundle and adds it to its policy's ``approved_apps`` (the check itself, and what this
command prints and writes, are :mod:`fedsgld.clients.approval`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsgld.cli.commands import _runner
from fedsgld.cli.site_log import add_console_arguments, add_log_arguments
from fedsgld.clients.approve import approve

#: What runs each subcommand, imported only when it runs (the policy and ledger need torch).
RUNS = {
    "init": "fedsgld.cli.site_run:run_init",
    "ledger": "fedsgld.cli.site_run:run_ledger",
    "new-key": "fedsgld.cli.site_run:run_new_key",
}


def add_site_arguments(parser: argparse.ArgumentParser) -> None:
    """``fedsgld site init ...`` and ``fedsgld site approve BUNDLE_OR_DIR [--policy FILE]``."""
    sub = parser.add_subparsers(dest="site_command", required=True, metavar="SUBCOMMAND")
    _add_init(sub)
    _add_ledger(sub)
    _add_new_key(sub)
    add_log_arguments(sub)
    add_console_arguments(sub)
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


def _add_init(sub) -> None:
    ip = sub.add_parser(
        "init",
        help="write a new site's privacy policy (a lifetime budget, safe defaults, commented)",
        description="Write a commented privacy policy for a deployed site: its lifetime budget, "
        "the placements it accepts (default: secure aggregation or its own noise, never the "
        "server's), the bounds of every request. Start the site's SuperNode with "
        "privacy-policy=FILE in its --node-config (docs/site-operators.md).",
    )
    ip.add_argument("--epsilon", type=float, required=True, help="the site's lifetime budget, > 0")
    ip.add_argument("--delta", type=float, default=1e-5, help="(default 1e-5)")
    ip.add_argument("--out", metavar="FILE", required=True, help="the policy file to write")
    ip.add_argument(
        "--placements",
        default="secure,sites",
        help="comma-separated, from secure,sites,server (default secure,sites; 'server' "
        "trusts the server with the site's clipped sums)",
    )
    ip.add_argument(
        "--min-expected-batch", type=float, default=16.0,
        help="refuse requests expecting fewer records per release (default 16)",
    )  # fmt: skip
    ip.add_argument(
        "--public-records", default=None, metavar="N",
        help="the training-record count the site publishes (a rounded figure, or 'exact'); "
        "without it the site answers no training request",
    )  # fmt: skip
    ip.add_argument(
        "--public-test-records", default=None, metavar="N",
        help="the test-record count the site publishes (a rounded figure, or 'exact')",
    )  # fmt: skip
    ip.add_argument(
        "--site-id", type=int, default=None,
        help="this site's id in the consortium: starts peers.toml with its own key line",
    )  # fmt: skip
    ip.add_argument(
        "--min-peers", type=int, default=2,
        help="the fewest authenticated sites a secure round may count on (default 2)",
    )  # fmt: skip
    ip.add_argument("--force", action="store_true", help="replace an existing policy and key")
    ip.set_defaults(func=_runner(RUNS["init"]))


def _add_ledger(sub) -> None:
    lp = sub.add_parser(
        "ledger",
        help="print what a site has spent: its ledger file (or the ledgers beside a policy)",
        description="Print a site's lifetime ledger: releases, epsilon spent of its budget, "
        "the runs it answered and the evaluations per run. FILE is a ledger "
        "(fedsgld-site-<id>.json) or a policy file (its state_dir's ledgers).",
    )
    lp.add_argument("file", metavar="FILE", help="a ledger file or a policy file")
    lp.set_defaults(func=_runner(RUNS["ledger"]))


def _add_new_key(sub) -> None:
    kp = sub.add_parser(
        "new-key",
        help="rotate a site's signing key: a new key where its policy's signing_key points",
        description="Write a new Ed25519 signing key over the one the policy's signing_key "
        "names (the policy, its ledger and approvals are kept) and print the new public key "
        "line for the consortium's peers lists (docs/site-operators.md, section 4).",
    )
    kp.add_argument("policy", metavar="POLICY", help="the site's policy file")
    kp.set_defaults(func=_runner(RUNS["new-key"]))


def run_approve(args: argparse.Namespace) -> int:
    if args.policy is not None and not Path(args.policy).expanduser().is_file():
        raise ValueError(
            f"--policy {args.policy!r}: no such policy file; write one with `fedsgld site init "
            f"--epsilon 4 --out {args.policy}`"
        )
    _, text = approve(args.bundle, args.policy)
    print(text)
    return 0
