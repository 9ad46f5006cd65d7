"""The options of fedsgld's own commands (simulate, audit, benchmark, config, compare,
pate, pate-analysis), one function per command.

Nothing here imports more than argparse and the torch-free settings, so that a command's
help (``fedsgld simulate -h``) starts fast; what a command does once parsed is in the
module :data:`fedsgld.cli.commands.SUBCOMMANDS` names for it, imported only to run it.
"""

from __future__ import annotations

import argparse

from fedsgld.config import settings_text
from fedsgld.config.loading import tracking_options


def simulate(sim: argparse.ArgumentParser) -> None:
    sim.epilog = settings_text()
    sim.add_argument("config", help="TOML config file (see simulations/); keys below")
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
    tracking_options(sim)


def audit(aud: argparse.ArgumentParser) -> None:
    aud.add_argument("config", help="TOML config file (see simulations/)")
    aud.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    aud.add_argument(
        "--canaries", type=int, default=1000, metavar="M", help="canaries (default 1000)"
    )
    aud.add_argument(
        "--confidence", type=float, default=0.95, help="confidence of the bound (default 0.95)"
    )
    aud.add_argument(
        "--site", type=int, default=0, help="the site holding the canaries (default 0)"
    )
    aud.add_argument("--json", action="store_true", help="print the result as JSON")
    aud.add_argument(
        "--out", default=None, help="keep the run here, with audit.json (default: not kept)"
    )
    aud.add_argument("--no-progress", action="store_true", help="no progress bar")


def benchmark(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("config", help="TOML config with a [benchmark] table (see simulations/)")
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run setting")
    bench.add_argument(
        "--out", default=None, help="output directory (default: a new one under runs/)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    tracking_options(bench)


def config(cfg: argparse.ArgumentParser) -> None:
    cfg.add_argument(
        "--markdown", action="store_true", help="print docs/config.md (markdown tables)"
    )


def compare(cmp_: argparse.ArgumentParser) -> None:
    cmp_.add_argument("runs", nargs="+", metavar="RUN_DIR", help="result directories to compare")
    cmp_.add_argument(
        "--out", default="compare.png", help="PNG file to write (default: compare.png)"
    )
    cmp_.add_argument(
        "--posterior", action="store_true", help="also draw each run's posterior average"
    )


def pate(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="PATE TOML config (see simulations/pate_mnist.toml)")
    p.add_argument("--out", default=None, help="result directory (default: a new one under runs/)")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress lines (only the result line)"
    )


def pate_analysis(p: argparse.ArgumentParser) -> None:
    p.add_argument("votes", help="a votes_<mechanism>.npz file written by `fedsgld pate`")
    p.add_argument("--delta", type=float, default=None, help="delta (default: the file's)")
    p.add_argument(
        "--moments", type=int, default=None, help="LNMax: number of moments (default: the file's)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
