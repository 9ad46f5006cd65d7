"""What ``fedsgld site log`` and ``fedsgld site console`` run, imported only when they run:
the policy and the ledger check import torch and scipy, the console its web framework
(``fedsgld -h`` imports neither; :mod:`fedsgld.cli.site_log` holds their arguments)."""

from __future__ import annotations

import argparse
import json
import sys

from fedsgld.cli.console import serve
from fedsgld.cli.site_log import describe, select
from fedsgld.clients import audit_log
from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy


def run_log(args: argparse.Namespace) -> int:
    policy = SitePolicy.from_file(args.policy)
    if policy.state_dir is None:
        print("the policy names no state_dir: the site keeps no audit log", file=sys.stderr)
        return 1
    path = audit_log.audit_path(policy.state_dir)
    if args.verify:
        n, bad = verify(policy)
        if bad is not None:
            print(f"audit log NOT verified ({n} lines): {bad}", file=sys.stderr)
            return 1
        print(f"audit log verified: {n} lines, chain intact, agrees with the site's ledger(s)")
        return 0
    entries = [e for _, _, e in audit_log.read(path) if e is not None]
    for e in select(entries, run=args.run, refused=args.refused, since=args.since):
        print(json.dumps(e, sort_keys=True) if args.json else describe(e))
    return 0


def run_console(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in 1..65535")
    serve(args.policy, host=args.host, port=args.port, read_only=args.read_only)
    return 0


__all__ = ["run_console", "run_log"]
