"""The ``fedsgld`` command line, the top layer: :func:`main`.

:mod:`~fedsgld.cli.commands` builds the parser from a table of subcommands, each naming
the module that adds its options and the one that runs it (imported only when used, so
that help starts fast); :mod:`~fedsgld.cli.options` holds the options of the commands
fedsgld implements itself, :mod:`~fedsgld.cli.runs` simulate and compare,
:mod:`~fedsgld.cli.pate` the PATE commands, :mod:`~fedsgld.cli.privacy` the accountant,
:mod:`~fedsgld.cli.site` ``fedsgld site approve``, and :mod:`~fedsgld.cli.errors` how a
command fails.
"""

from fedsgld.cli.commands import main

__all__ = ["main"]
