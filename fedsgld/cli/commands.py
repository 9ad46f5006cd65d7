"""The fedsgld command: federated DP-SGLD runs, benchmarks, privacy accounting and PATE.

fedsgld simulate CONFIG [--set key=value ...] [--out DIR] [--resume]
fedsgld benchmark CONFIG [--set key=value ...] [--out DIR]
fedsgld sweep CONFIG --grid [METHOD.]KEY=V1,V2,... [--seeds S ...] [--recal F] [--out DIR]
fedsgld audit CONFIG [--set key=value ...] [--canaries M] [--confidence C] [--json] [--out DIR]
fedsgld config [--markdown]
fedsgld compare RUN_DIR [RUN_DIR ...] --out FILE
fedsgld privacy --sample-rate Q (--steps T | --epsilon E) --delta D
                (--noise-multiplier S | --lr A0 --temperature TAU [--decay-gamma G --decay-t0 T0])
fedsgld site approve BUNDLE_OR_DIR [--policy FILE]

Help (-h) and --version import neither torch nor the accountants: a subcommand's heavy
modules are imported only when that subcommand runs (or prints its own help).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
from pathlib import Path

from fedsgld import __version__

COMMANDS = (
    "simulate",
    "audit",
    "benchmark",
    "sweep",
    "config",
    "compare",
    "privacy",
    "pate",
    "pate-analysis",
    "supernode",
    "superlink",
    "site",
)


class _PlainFormatter(argparse.RawDescriptionHelpFormatter):
    """Help as plain text: reStructuredText's ``literal`` and :role:`x` markup removed."""

    @staticmethod
    def _plain(text: str) -> str:
        text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
        return text.replace("``", "")

    def _format_text(self, text: str) -> str:
        return super()._format_text(self._plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return self._plain(super()._expand_help(action))


def _version_text() -> str:
    """fedsgld's version and those of its main dependencies, read without importing them."""
    from importlib import metadata

    parts = []
    for dist in ("torch", "flwr", "dp-accounting", "opacus"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    py = ".".join(str(v) for v in sys.version_info[:3])
    return f"fedsgld {__version__} (Python {py}; {', '.join(parts)})"


def _simulate(args: argparse.Namespace) -> int:
    from fedsgld.config import load_config, parse_overrides

    overrides = parse_overrides(args.set)
    if args.out is None and args.resume:
        raise UserError("--resume needs --out DIR (the run directory to resume)")
    config = load_config(args.config, overrides)  # every setting checked before any work

    from fedsgld.engine import run
    from fedsgld.run.lifecycle import new_run_dir

    out = Path(args.out) if args.out else new_run_dir(tag=config.privacy.method)
    with _removed_on_failure(out):
        results = run(
            config,
            out_dir=out,
            resume=args.resume,
            progress=not args.no_progress,
            config_source=str(args.config),
        )
    pr = results["privacy"]
    eps = ", ".join(f"{k}={v:.4f}" for k, v in pr["epsilon"].items())
    m = results["metrics"]["pooled"]
    print(
        f"{pr['method']}: {pr['steps']} steps, epsilon {eps} (budget {pr['budget']}, delta {pr['delta']:g}); "
        f"pooled accuracy {m['accuracy']:.4f}, NLL {m['nll']:.4f}, ECE {m['ece']:.4f}"
    )
    return 0


def _audit(args: argparse.Namespace) -> int:
    from fedsgld.studies.audit import main_audit

    return main_audit(args)


def _config(args: argparse.Namespace) -> int:
    from fedsgld.config import settings_markdown, settings_text

    sys.stdout.write(settings_markdown() if args.markdown else settings_text())
    return 0


def _compare(args: argparse.Namespace) -> int:
    try:
        from fedsgld.run.results import compare_runs

        path = compare_runs(args.runs, args.out, posterior=args.posterior)
    except ValueError as err:
        print(f"fedsgld compare: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    from fedsgld.studies.benchmark import main_benchmark

    return main_benchmark(args)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``fedsgld`` parser.

    With ``command`` (one of :data:`COMMANDS`, or ``""`` for none) only that subcommand gets
    its options, so that the modules of the others (which import torch) are not imported;
    ``None`` builds every subcommand in full.
    """
    from fedsgld.config import settings_text

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(
        prog="fedsgld",
        description=__doc__.split("\n\n")[0],
        epilog="Run `fedsgld COMMAND -h` for a command's options; `fedsgld config` (or\n"
        "`fedsgld simulate -h`) lists every config key with its default and meaning.",
        formatter_class=_PlainFormatter,
    )
    parser.add_argument("--version", action="version", version=_version_text())
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback of an error (allowed anywhere on the line)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, description: str | None = None, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=description or help[0].upper() + help[1:] + ".",
            formatter_class=_PlainFormatter,
            **kw,
        )

    sim = add(
        "simulate",
        "run a federation on this machine (in-process engine)",
        epilog=settings_text() if wanted("simulate") else None,
    )
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
    sim.set_defaults(func=_simulate)

    aud = add(
        "audit",
        "empirical privacy audit: a run with canaries, a lower bound on epsilon",
        description="Run the configured federation with m gradient canaries (each included "
        "with probability 1/2) and turn an attacker's guesses into lower bounds on epsilon "
        "(Steinke et al. 2023; f-DP, Mahloujifar et al. 2024), next to the accountant's "
        "epsilon. See docs/audit.md.",
    )
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
    aud.set_defaults(func=_audit)

    bench = add("benchmark", "several methods and seeds at the same (epsilon, delta)")
    bench.add_argument("config", help="TOML config with a [benchmark] table (see simulations/)")
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run setting")
    bench.add_argument(
        "--out", default=None, help="output directory (default: a new one under runs/)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=_benchmark)

    sweep = add(
        "sweep",
        "tune every method on validation splits over a grid, trials on Ray",
        description=None,
    )
    if wanted("sweep"):
        from fedsgld.studies import sweep as sweep_mod

        sweep.description = (
            sweep_mod.__doc__.split("\n\n")[0]
            + "\n\n"
            + "\n\n".join(sweep_mod.__doc__.split("\n\n")[1:3])
        )
        sweep_mod.add_arguments(sweep)
        sweep.set_defaults(func=sweep_mod.main)

    cfg = add("config", "list every config key with its default and meaning")
    cfg.add_argument(
        "--markdown", action="store_true", help="print docs/config.md (markdown tables)"
    )
    cfg.set_defaults(func=_config)

    cmp_ = add(
        "compare",
        "one figure comparing runs: reliability and confidence histogram side by side",
    )
    cmp_.add_argument("runs", nargs="+", metavar="RUN_DIR", help="result directories to compare")
    cmp_.add_argument("--out", required=True, help="PNG file to write")
    cmp_.add_argument(
        "--posterior", action="store_true", help="also draw each run's posterior average"
    )
    cmp_.set_defaults(func=_compare)

    priv = add("privacy", "epsilon of a DP-SGD / DP-SGLD schedule, or steps a budget allows")
    if wanted("privacy"):
        from fedsgld.cli import privacy as privacy_cli

        privacy_cli.add_arguments(priv)
        priv.set_defaults(func=privacy_cli.run)

    pate = add("pate", "PATE: teachers per site, noisy votes, a student")
    pate_an = add("pate-analysis", "epsilons of a saved PATE vote file")
    if wanted("pate") or wanted("pate-analysis"):
        from fedsgld.cli import pate as pate_cli

        pate_cli.add_pate_arguments(pate)
        pate.set_defaults(func=pate_cli.run_pate_command)
        pate_cli.add_analysis_arguments(pate_an)
        pate_an.set_defaults(func=pate_cli.run_analysis_command)

    from fedsgld.deploy import fast as deploy_fast

    deploy_fast.register(sub)  # supernode, superlink: Flower's, its fixed waits shortened
    from fedsgld.clients import approval

    approval.add_site_arguments(add("site", "a deployed site: approve the app bundles it runs"))
    return parser


def _command_of(argv: list[str]) -> str:
    """The subcommand named in ``argv`` ("" when none): the first argument not an option."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


class UserError(ValueError):
    """A mistake in how a command was called: reported in one line, never as a traceback."""


#: What a user's mistake raises (a setting out of range, a missing file, broken TOML, a
#: SuperLink that cannot be reached): reported as one or two lines, exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


class _NewDir:
    """A result directory a command is about to create: :meth:`discard` removes it again
    if the command fails before it has released anything.

    A directory that already existed is left alone, and so is one holding a ledger anywhere
    inside: a ledger records privacy that may have been spent, and it only grows (resume
    the run instead).
    """

    def __init__(self, out: Path) -> None:
        top: Path | None = out.absolute()  # the outermost directory the command would create
        if top.exists():
            top = None
        else:
            while not top.parent.exists():
                top = top.parent
        self.top = top

    def discard(self) -> None:
        top = self.top
        if top is not None and top.is_dir() and not any(top.rglob("ledger.json")):
            shutil.rmtree(top, ignore_errors=True)


@contextlib.contextmanager
def _removed_on_failure(out: Path):
    """Remove ``out`` (see :class:`_NewDir`) if the block raises."""
    new = _NewDir(out)
    try:
        yield
    except BaseException:
        new.discard()
        raise


#: Commands whose ``--out`` is a result directory (simulate guards its own, default included).
_RUN_DIR_COMMANDS = ("benchmark", "pate", "sweep")


def _user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS`, and a flwr release the fast deployment path does not support
    (its message says which releases it does, and what to use instead)."""
    from fedsgld.deploy.fast import UnsupportedFlower  # imported by build_parser already

    return (*USER_ERRORS, UnsupportedFlower)


def _error_lines(err: BaseException) -> str:
    """The error as at most two lines: its first line, then the rest joined into one."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    first, *rest = text.splitlines()
    rest = " ".join(line.strip() for line in rest if line.strip())
    return f"{first}\n{rest}" if rest else first


def main(argv: list[str] | None = None) -> int:
    """Run one ``fedsgld`` command. A user's mistake prints ``fedsgld COMMAND: error: ...``
    and returns 2 (``--debug`` anywhere on the line shows the traceback instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = _command_of(argv)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    prog = f"fedsgld {args.command}" if getattr(args, "command", None) else "fedsgld"
    out = getattr(args, "out", None)
    new_dir = (
        _NewDir(Path(out)) if out and getattr(args, "command", None) in _RUN_DIR_COMMANDS else None
    )
    try:
        status = int(args.func(args) or 0)
    except BaseException as err:
        if new_dir is not None:
            new_dir.discard()
        if debug or not isinstance(err, Exception):
            raise
        if isinstance(err, _user_errors()):
            print(f"{prog}: error: {_error_lines(err)}", file=sys.stderr)
            return 2
        print(
            f"{prog}: internal error: {type(err).__name__}: {_error_lines(err)}\n"
            f"{prog}: run again with --debug for the traceback, and report it",
            file=sys.stderr,
        )
        return 1
    if status == 2 and new_dir is not None:  # a mistake the command reported itself
        new_dir.discard()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
