"""What runs ``fedsgld site init``, ``fedsgld site ledger`` and ``fedsgld site new-key``
(their options: :mod:`fedsgld.cli.site`, which imports this module only when one runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.policy_init import init_policy
from fedsgld.privacy import PrivacyAccountant
from fedsgld.secagg import identity


def _count(v: str | None) -> int | str | None:
    """A published count from the command line: an integer, "exact", or None (unset)."""
    return int(v) if v is not None and v.strip().isdigit() else v


def run_init(args: argparse.Namespace) -> int:
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


def run_ledger(args: argparse.Namespace) -> int:
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


def run_new_key(args: argparse.Namespace) -> int:
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
