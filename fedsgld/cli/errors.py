"""How a ``fedsgld`` command fails: a user's mistake in one or two lines (never a
traceback), and a result directory the command created removed again when it fails
before it has released anything."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from fedsgld.deploy.fast import UnsupportedFlower


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


def _user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS`, and a flwr release the fast deployment path does not support
    (its message says which releases it does, and what to use instead)."""
    return (*USER_ERRORS, UnsupportedFlower)


def _error_lines(err: BaseException) -> str:
    """The error as at most two lines: its first line, then the rest joined into one."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    first, *rest = text.splitlines()
    rest = " ".join(line.strip() for line in rest if line.strip())
    return f"{first}\n{rest}" if rest else first
