"""The fedsgld command: federated DP-SGLD runs, benchmarks, privacy accounting and PATE.

fedsgld simulate CONFIG [--set key=value ...] [--out DIR] [--resume]
fedsgld benchmark CONFIG [--set key=value ...] [--out DIR]
fedsgld sweep CONFIG --grid [METHOD.]KEY=V1,V2,... [--seeds S ...] [--recal F] [--out DIR]
fedsgld audit CONFIG [--set key=value ...] [--canaries M] [--confidence C] [--json] [--out DIR]
fedsgld config [--markdown]
fedsgld compare RUN_DIR [RUN_DIR ...] [--out FILE]
fedsgld privacy --sample-rate Q (--steps T | --epsilon E) --delta D
                (--noise-multiplier S | --lr A0 --temperature TAU [--decay-gamma G --decay-t0 T0])
fedsgld deploy run APP CONNECTION [flwr run options]
fedsgld deploy export-sites [CONFIG] [--set key=value ...] --out DIR
fedsgld supernode|superlink ...
fedsgld site init --epsilon E --out FILE [--site-id K] [--placements P,...]
fedsgld site ledger FILE
fedsgld site new-key POLICY
fedsgld site approve BUNDLE_OR_DIR [--policy FILE]

Help (-h) and --version import neither torch nor the accountants: :data:`SUBCOMMANDS`
names, for each subcommand, the module that adds its options and the one that runs it,
and each is imported only when that subcommand runs (or prints its own help).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import shlex
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from fedsgld.cli.deploy import split_passthrough
from fedsgld.cli.errors import (
    _error_lines,
    _NewDir,
    _removed_on_failure,  # noqa: F401 - for tests/test_errors.py
    _user_errors,
)
from fedsgld.config import settings_markdown, settings_text
from fedsgld.deploy import fast as deploy_fast
from fedsgld.version import __version__

__all__ = ["COMMANDS", "SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    """One subcommand of ``fedsgld`` and where it is implemented.

    ``options`` and ``run`` are ``"module:function"``: the first adds the subcommand's
    options to its parser, the second runs it with the parsed arguments (None: the options
    set ``func`` themselves, per sub-subcommand). Each module is imported only when it is
    needed, so that ``fedsgld --help`` imports none of them.
    """

    name: str
    help: str
    options: str
    run: str | None = None
    description: str | None = None


SUBCOMMANDS = (
    Subcommand(
        "simulate",
        "run a federation on this machine (in-process engine)",
        "fedsgld.cli.options:simulate",
        "fedsgld.cli.runs:simulate",
    ),
    Subcommand(
        "audit",
        "empirical privacy audit: a run with canaries, a lower bound on epsilon",
        "fedsgld.cli.options:audit",
        "fedsgld.studies.audit_cli:main_audit",
        description="Run the configured federation with m gradient canaries (each included "
        "with probability 1/2) and turn an attacker's guesses into lower bounds on epsilon "
        "(Steinke et al. 2023; f-DP, Mahloujifar et al. 2024), next to the accountant's "
        "epsilon. See docs/audit.md.",
    ),
    Subcommand(
        "benchmark",
        "several methods and seeds at the same (epsilon, delta)",
        "fedsgld.cli.options:benchmark",
        "fedsgld.studies.benchmark:main_benchmark",
    ),
    Subcommand(
        "sweep",
        "tune every method on validation splits over a grid, trials on Ray",
        "fedsgld.studies.sweep_options:add_arguments",
        "fedsgld.studies.sweep:main",
    ),
    Subcommand(
        "config",
        "list every config key with its default and meaning",
        "fedsgld.cli.options:config",
        "fedsgld.cli.commands:_config",
    ),
    Subcommand(
        "compare",
        "one figure comparing runs: reliability and confidence histogram side by side",
        "fedsgld.cli.options:compare",
        "fedsgld.cli.runs:compare",
    ),
    Subcommand(
        "privacy",
        "epsilon of a DP-SGD / DP-SGLD schedule, or steps a budget allows",
        "fedsgld.cli.privacy:add_arguments",
        "fedsgld.cli.privacy:run",
    ),
    Subcommand(
        "pate",
        "PATE: teachers per site, noisy votes, a student",
        "fedsgld.cli.options:pate",
        "fedsgld.cli.pate:run_pate_command",
    ),
    Subcommand(
        "pate-analysis",
        "epsilons of a saved PATE vote file",
        "fedsgld.cli.options:pate_analysis",
        "fedsgld.cli.pate:run_analysis_command",
    ),
)
#: Registered after SUBCOMMANDS, in this order, by :func:`fedsgld.deploy.fast.register`.
FAST_PATH = ("supernode", "superlink")
DEPLOY = Subcommand(
    "deploy",
    "deployment helpers: flwr run with the run's outcome, each site's records to a file",
    "fedsgld.cli.deploy:add_arguments",
)
SITE = Subcommand(
    "site",
    "a deployed site: write its privacy policy, approve the app bundles it runs",
    "fedsgld.cli.site:add_site_arguments",
)
COMMANDS = (*(c.name for c in SUBCOMMANDS), *FAST_PATH, DEPLOY.name, SITE.name)


def _load(target: str):
    """The function that ``"module:function"`` names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _runner(target: str):
    """Runs the function ``target`` names with the parsed arguments, imported on use."""

    def run(args: argparse.Namespace) -> int:
        return _load(target)(args)

    return run


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


def _config(args: argparse.Namespace) -> int:
    sys.stdout.write(settings_markdown() if args.markdown else settings_text())
    return 0


def _add(sub, spec: Subcommand, full: bool) -> argparse.ArgumentParser:
    """Add ``spec`` to the subparsers ``sub``; ``full``: with its options (which imports
    the module that defines them) and what runs it."""
    p = sub.add_parser(
        spec.name,
        help=spec.help,
        description=spec.description or spec.help[0].upper() + spec.help[1:] + ".",
        formatter_class=_PlainFormatter,
    )
    if full:
        _load(spec.options)(p)
        if spec.run is not None:
            p.set_defaults(func=_runner(spec.run))
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``fedsgld`` parser.

    With ``command`` (one of :data:`COMMANDS`, or ``""`` for none) only that subcommand gets
    its options, so that the modules of the others (which import torch) are not imported;
    ``None`` builds every subcommand in full.
    """
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
    for spec in SUBCOMMANDS:
        _add(sub, spec, command is None or command == spec.name)
    deploy_fast.register(sub)  # supernode, superlink: Flower's, its fixed waits shortened
    _add(sub, DEPLOY, command is None or command == DEPLOY.name)
    _add(sub, SITE, True)
    return parser


def _command_of(argv: list[str]) -> str:
    """The subcommand named in ``argv`` ("" when none): the first argument not an option."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


#: Commands whose ``--out`` is a result directory (simulate guards its own, default included).
_RUN_DIR_COMMANDS = ("benchmark", "pate", "sweep")


#: Commands whose start imports torch (and often flwr): tens of seconds on a cold disk.
_HEAVY = ("simulate", "audit", "benchmark", "sweep", "compare", "pate")


def _unknown_command(argv: list[str]) -> str | None:
    """The error line for a first word that is no command (None: it is one, or an option)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in COMMANDS:
        return None
    near = difflib.get_close_matches(first, COMMANDS, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"fedsgld: error: unknown command {first!r}; {hint}`fedsgld -h` lists the commands"


def _resume_line(argv: list[str], out: Path) -> str:
    """The command that resumes the interrupted run in ``out``: the same line with
    ``--out OUT --resume``."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif a != "--resume" and not a.startswith("--out="):
            kept.append(a)
    return shlex.join(["fedsgld", *kept, "--out", str(out), "--resume"])


def _interrupted(prog: str, err: KeyboardInterrupt, argv: list[str]) -> str:
    """One line for Ctrl-C: the rounds taken and how to resume, or that nothing was kept."""
    rounds, out = getattr(err, "rounds", None), getattr(err, "out", None)
    if out is not None:
        return f"{prog}: interrupted after {rounds} rounds; resume with: {_resume_line(argv, out)}"
    if rounds is not None:
        return f"{prog}: interrupted after 0 rounds: nothing was released and no run directory kept"
    return f"{prog}: interrupted"


def main(argv: list[str] | None = None) -> int:
    """Run one ``fedsgld`` command. A user's mistake prints ``fedsgld COMMAND: error: ...``
    and returns 2 (``--debug`` anywhere on the line shows the traceback too); Ctrl-C prints
    one line (how to resume) and returns 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    unknown = _unknown_command(argv)
    if unknown is not None:
        print(unknown, file=sys.stderr)
        return 2
    command = _command_of(argv)
    parser = build_parser(command)
    if not argv:  # no command: list them
        parser.print_help()
        return 0
    own, passthrough = split_passthrough(argv)
    args = parser.parse_args(own)
    if passthrough is not None:  # flwr run's arguments, as given
        args.flwr_args = passthrough
    prog = f"fedsgld {args.command}" if getattr(args, "command", None) else "fedsgld"
    out = getattr(args, "out", None)
    new_dir = (
        _NewDir(Path(out)) if out and getattr(args, "command", None) in _RUN_DIR_COMMANDS else None
    )
    try:
        if (
            command in _HEAVY
            and sys.stderr.isatty()
            and not any(a in ("-h", "--help") for a in argv)
        ):
            # someone is waiting at a terminal: say why nothing happens for a while
            sys.stderr.write(f"{prog}: loading torch and the federation code ...\n")  # one write
            sys.stderr.flush()
        status = int(args.func(args) or 0)
    except KeyboardInterrupt as err:
        if new_dir is not None:
            new_dir.discard()
        if debug:
            traceback.print_exc()
        print(_interrupted(prog, err, argv), file=sys.stderr)
        return 130
    except BaseException as err:
        if new_dir is not None:
            new_dir.discard()
        if not isinstance(err, Exception):
            raise
        if debug:
            traceback.print_exc()
        if isinstance(err, _user_errors()):
            print(f"{prog}: error: {_error_lines(err)}", file=sys.stderr)
            return 2
        print(
            f"{prog}: internal error: {type(err).__name__}: {_error_lines(err)}"
            + (
                ""
                if debug
                else f"\n{prog}: run again with --debug for the traceback, and report it"
            ),
            file=sys.stderr,
        )
        return 1
    if status == 2 and new_dir is not None:  # a mistake the command reported itself
        new_dir.discard()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
