"""``fedsgld site init``: a new site's policy (:mod:`fedsgld.clients.policy_init`);
``fedsgld site approve BUNDLE_OR_DIR [--policy FILE]``: a deployed site reviews an app
bundle and adds it to its policy's ``approved_apps`` (the check itself, and what this
command prints and writes, are :mod:`fedsgld.clients.approval`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsgld.cli.site_log import add_console_arguments, add_log_arguments
from fedsgld.clients.approval import approve


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
    ip.set_defaults(func=run_init)


def _count(v: str | None) -> int | str | None:
    """A published count from the command line: an integer, "exact", or None (unset)."""
    return int(v) if v is not None and v.strip().isdigit() else v


def run_init(args: argparse.Namespace) -> int:
    from fedsgld.clients.policy_init import init_policy  # torch: only when the command runs

    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    pol, public = init_policy(
        args.out,
        epsilon=args.epsilon,
        delta=args.delta,
        placements=placements,
        min_expected_batch=args.min_expected_batch,
        public_records=_count(args.public_records),
        public_test_records=_count(args.public_test_records),
        site_id=args.site_id,
        min_peers=args.min_peers,
        force=args.force,
    )
    d = Path(str(pol.state_dir))
    print(
        f"wrote {args.out}: lifetime epsilon {pol.epsilon:g} at delta {pol.delta:g}, placements "
        f"{', '.join(pol.placements)}; ledger in {d}\n"
        f"signing key {d / 'site.key'} (mode 0600: it never leaves this site); public key "
        f"{public} in {d / 'site.pub'}: send it to the consortium, and put every site's line "
        f"into {d / 'peers.toml'}\n"
        f"next: `fedsgld site approve BUNDLE --policy {args.out}`, then start the SuperNode "
        f"with site-data='FILE.npz' privacy-policy='{args.out}' in its --node-config"
    )
    return 0


def _add_ledger(sub) -> None:
    lp = sub.add_parser(
        "ledger",
        help="print what a site has spent: its ledger file (or the ledgers beside a policy)",
        description="Print a site's lifetime ledger: releases, epsilon spent of its budget, "
        "the runs it answered and the evaluations per run. FILE is a ledger "
        "(fedsgld-site-<id>.json) or a policy file (its state_dir's ledgers).",
    )
    lp.add_argument("file", metavar="FILE", help="a ledger file or a policy file")
    lp.set_defaults(func=run_ledger)


def run_ledger(args: argparse.Namespace) -> int:
    import json

    from fedsgld.clients.policy import SitePolicy
    from fedsgld.privacy import PrivacyAccountant

    path = Path(args.file).expanduser()
    if not path.is_file():
        raise ValueError(f"FILE {args.file!r}: no such file (a ledger or a policy file)")
    if path.suffix == ".toml":
        ledgers = sorted(
            Path(str(SitePolicy.from_file(path).state_dir)).glob("fedsgld-site-*.json")
        )
        if not ledgers:
            print(f"no ledger beside {args.file}: this site has answered nothing yet")
            return 0
    else:
        ledgers = [path]
    for led in ledgers:
        state = json.loads(led.read_text())
        acc = PrivacyAccountant.from_state_dict(state["ledger"])
        budget = state["ledger"].get("budget")
        of = f" of its budget {budget:g}" if budget is not None else " (no budget)"
        print(
            f"site {state['site']} ({led}): {acc.steps} releases, epsilon "
            f"{acc.rigorous_epsilon():.4f} spent{of} at delta {acc.delta:g}"
        )
        for key, (epoch, rnd) in state["answered"].items():
            print(f"  run {key}: answered up to round {rnd} of epoch {epoch}")
        for key, n in state.get("evaluations", {}).items():
            print(f"  run {key}: {n} evaluations")
    return 0


def _add_new_key(sub) -> None:
    kp = sub.add_parser(
        "new-key",
        help="rotate a site's signing key: a new key where its policy's signing_key points",
        description="Write a new Ed25519 signing key over the one the policy's signing_key "
        "names (the policy, its ledger and approvals are kept) and print the new public key "
        "line for the consortium's peers lists (docs/site-operators.md, section 4).",
    )
    kp.add_argument("policy", metavar="POLICY", help="the site's policy file")
    kp.set_defaults(func=run_new_key)


def run_new_key(args: argparse.Namespace) -> int:
    from fedsgld.clients.policy import SitePolicy
    from fedsgld.secagg import identity

    policy = SitePolicy.from_file(args.policy)
    if policy.signing_key is None:
        raise ValueError(
            f"POLICY {args.policy!r} names no signing_key (fedsgld site init writes one)"
        )
    key = Path(policy.signing_key)
    public = identity.generate(key, overwrite=True)
    pub = key.with_name("site.pub")
    before = pub.read_text() if pub.is_file() else ""
    old = before.split("=", 1)[0].strip() if "=" in before else ""  # this site's id, if known
    line = f'{old} = "{public}"' if old else public
    pub.write_text(line + "\n")
    peers = Path(getattr(policy.peers, "source", "") or "")
    if old and peers.suffix == ".toml" and peers.is_file():  # this site's own line, replaced
        rows = peers.read_text().splitlines()
        mine = [i for i, r in enumerate(rows) if r.split("=", 1)[0].strip() == old]
        for i in mine:
            rows[i] = line
        peers.write_text("\n".join(rows) + "\n")
    print(
        f"new signing key {key}; its public key line (send it to the consortium; every site "
        f"replaces this site's line in its peers list before the next round):\n{line}"
    )
    return 0


def run_approve(args: argparse.Namespace) -> int:
    if args.policy is not None and not Path(args.policy).expanduser().is_file():
        raise ValueError(
            f"--policy {args.policy!r}: no such policy file; write one with `fedsgld site init "
            f"--epsilon 4 --out {args.policy}`"
        )
    _, text = approve(args.bundle, args.policy)
    print(text)
    return 0
