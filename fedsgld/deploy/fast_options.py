"""The options of ``fedsgld supernode`` and ``fedsgld superlink`` (the fast path,
:mod:`fedsgld.deploy.fast`): each wait's value, checked against its range when parsed, and
Flower's own arguments after ``--``."""

from __future__ import annotations

import argparse
import math


def _seconds(name: str, lo: float, hi: float):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo:g}, {hi:g}] seconds, got {s}")
        return v

    return parse


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"--predict must be in [0, 1], got {s}")
    return v


def _backoff_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--pull-backoff",
        type=_seconds("--pull-backoff", 0.001, 1.0),
        default=0.02,
        help="first retry of an object pull (Flower: 1; default 0.02)",
    )
    ap.add_argument(
        "--pull-backoff-cap",
        type=_seconds("--pull-backoff-cap", 0.001, 10.0),
        default=0.1,
        help="longest retry wait of an object pull (Flower: 10; default 0.1)",
    )


def _flower_arguments(ap: argparse.ArgumentParser, exe: str) -> None:
    ap.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        metavar=f"-- {exe.upper()}-ARGUMENTS",
        help=f"passed to Flower's {exe} unchanged (after --)",
    )


def add_supernode_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--pull-interval",
        type=_seconds("--pull-interval", 0.005, 3.0),
        default=0.05,
        help="seconds between pulls from the SuperLink while a run is active "
        "(Flower: 3 after every empty pull; default 0.05)",
    )
    ap.add_argument(
        "--predict",
        type=_fraction,
        default=0.7,
        help="after a reply, first wait this fraction of the shortest of the last three "
        "reply-to-next-message waits before polling (0: poll at once; default 0.7)",
    )
    ap.add_argument(
        "--reply-poll",
        type=_seconds("--reply-poll", 0.001, 0.5),
        default=0.01,
        help="seconds between local checks for the ClientApp's reply (Flower: 0.5; default 0.01)",
    )
    _backoff_arguments(ap)
    ap.add_argument(
        "--task-poll",
        type=_seconds("--task-poll", 0.01, 60.0),
        default=2.0,
        help="the SuperExec's task poll besides the SuperNode's wake-up "
        "(FLWR_SUPEREXEC_TASK_POLL_INTERVAL, if not set; Flower: 1; default 2)",
    )
    ap.add_argument(
        "--active-for",
        type=_seconds("--active-for", 0.0, 86400.0),
        default=60.0,
        help="a node that got a message within this many seconds polls fast (default 60)",
    )
    ap.add_argument(
        "--no-warm", action="store_true", help="no warm sites: Flower's own flwr-clientapp"
    )
    ap.add_argument(
        "--no-policy",
        action="store_true",
        help="start without a privacy-policy in the node config: the site then runs any app "
        "bundle the server submits, unchecked (without this, it refuses to start)",
    )
    _flower_arguments(ap, "flower-supernode")


def add_superlink_arguments(ap: argparse.ArgumentParser) -> None:
    _backoff_arguments(ap)
    _flower_arguments(ap, "flower-superlink")
