"""The ``fedsgld`` command line: :func:`main` (run, simulate, compare, ...) and its
``privacy`` and ``pate`` subcommands."""

from fedsgld.cli.commands import main

__all__ = ["main"]
