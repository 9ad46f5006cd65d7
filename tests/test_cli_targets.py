"""Every ``"module:function"`` target of the ``fedsgld`` command resolves to a callable.

``fedsgld/cli/commands.py`` imports the module behind a subcommand only when it is used
(``importlib``), so import-linter cannot see these imports and a renamed function would
fail only when a user types the command. Here each target is imported and looked up.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from fedsgld.cli import commands

SOURCE = Path(commands.__file__).read_text()
TARGET = re.compile(r"\"(fedsgld(?:\.\w+)+:\w+)\"")


def _targets() -> list[str]:
    specs = (*commands.SUBCOMMANDS, commands.DEPLOY, commands.SITE)
    out = []
    for spec in specs:
        out.append(spec.options)
        if spec.run is not None:
            out.append(spec.run)
    return out


def test_every_target_in_the_source_is_a_declared_subcommand_target():
    """The list below is complete: no ``"module:function"`` string in commands.py is left out."""
    written = set(TARGET.findall(SOURCE))
    assert written, "no target found in fedsgld/cli/commands.py"
    assert written == set(_targets())


@pytest.mark.parametrize("target", sorted(set(_targets())))
def test_cli_target_imports_and_is_callable(target):
    module, sep, name = target.partition(":")
    assert sep and module and name, f"{target!r} is not 'module:function'"
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"{module} has no {name}"
    assert callable(getattr(mod, name)), f"{target} is not callable"
    assert commands._load(target) is getattr(mod, name)
