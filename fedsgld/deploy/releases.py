"""Which flwr releases the fast path was checked against, file by file.

Each part of the fast path adjusts Flower internals that only some releases have; it
applies only where the installed flwr is one of the releases its table lists (or a patch
release of one) and every listed file is byte-identical to that release's (SHA-256).
:data:`ADJUSTED`: the waits (:mod:`fedsgld.deploy.waits`), the whole fast path;
:data:`BUNDLE_REUSE`: the installed-bundle shortcut (:mod:`fedsgld.deploy.bundles`);
:data:`DIRECT_LAUNCH`: the SuperExec's hand-off to the fork server
(:mod:`fedsgld.deploy.launch`). Standard library only (flwr is imported on first use).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# flwr releases this fast path was tested with: SHA-256 of each file whose waits it adjusts
_SUPERNODE = "d6342f743fdf768f63305b88414ae2654e9a21bda153739da19c608e8d375067"
_INFLATABLE = "077b26d921aa86389f0a9e16bab761bd10525ec66d6f175b56fdf4bac7872d40"
ADJUSTED = {
    "1.41.0": {
        "supernode/start_client_internal.py": _SUPERNODE,
        "supercore/inflatable/inflatable_utils.py": _INFLATABLE,
        "supercore/superexec/run_superexec.py": (
            "6b4855d76940ae0f257555b6e0e9894cc46b1ee9d5675092b0e16a5053e4b2fa"
        ),
    },
    "1.42.0": {
        "supernode/start_client_internal.py": _SUPERNODE,
        "supercore/inflatable/inflatable_utils.py": _INFLATABLE,
        "supercore/superexec/run_superexec.py": (
            "51cb82facb912f41320d002e1c862b3e5c712cbdf06736f527ede43cf4d207ea"
        ),
    },
}
SUPPORTED = tuple(ADJUSTED)

# flwr releases whose ClientApp install step was checked for the bundle reuse below
# (run_clientapp.py calls cli/install.py's install_from_fab, which unpacks and verifies the
# whole bundle and then returns the install directory if it already exists)
# (1.41.0 and 1.42.0 ship both files byte-identical: same SHA-256 in both releases' wheels)
_RUN_CLIENTAPP = "fa6612aaeda9cd398de69199b0cf264a38f72c1b9cfdc53644c8d6dab0b70eb6"
_INSTALL = "d09d889c176d3e661436b439618f67ac49bd9e72aa9db77dc25d6c4ed45ccc30"
BUNDLE_REUSE = {
    release: {"supernode/runtime/run_clientapp.py": _RUN_CLIENTAPP, "cli/install.py": _INSTALL}
    for release in ("1.41.0", "1.42.0")
}

# flwr releases whose SuperExec task launch was checked for the direct hand-off below
# (SubprocessExecutor.launch: ``subprocess.Popen([flwr-clientapp, ...])``, fire and forget)
# (1.41.0 and 1.42.0 ship the file byte-identical: same SHA-256 in both releases' wheels)
_SUBPROCESS_EXECUTOR = "8fca14d06c1531f0895952719e9194a3f62e9cd0de4148a6d2cdd5cdaf051f39"
DIRECT_LAUNCH = {
    release: {"supercore/superexec/executor/subprocess_executor.py": _SUBPROCESS_EXECUTOR}
    for release in ("1.41.0", "1.42.0")
}

STOCK = "use Flower's own flower-supernode / flower-superlink (the warm sites work with them)"


class UnsupportedFlower(RuntimeError):
    """The installed flwr is not one this fast path was tested with."""


def flower_version() -> str:
    """The installed flwr's version, as Flower itself reads it (package metadata)."""
    import importlib.metadata as md

    try:
        return md.version("flwr")
    except md.PackageNotFoundError as e:
        raise UnsupportedFlower(f"flwr is not installed: {STOCK}") from e


def _entry(table: dict[str, dict[str, str]], version: str) -> str | None:
    """The release of ``table`` whose files stand for flwr ``version``: the release itself,
    or, for a patch release, its feature release (``1.42.1`` -> ``1.42.0``), which holds
    only if the patch left every listed file byte-identical."""
    if version in table:
        return version
    parts = version.split(".")
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        base = f"{parts[0]}.{parts[1]}.0"
        if base in table:
            return base
    return None


def release_mismatch(
    table: dict[str, dict[str, str]], version: str | None = None, root: str | Path | None = None
) -> str | None:
    """Why flwr ``version`` (default: the installed one) under ``root`` (default: the flwr
    package) is not one that ``table`` lists, in one line; None when it is: the release,
    or a patch release of it, with every listed file's SHA-256 as recorded."""
    version = flower_version() if version is None else version
    release = _entry(table, version)
    if release is None:
        return f"the installed flwr is {version}, checked releases are {', '.join(table)}"
    if root is None:
        import flwr

        root = Path(flwr.__file__).parent
    for rel, want in table[release].items():
        p = Path(root) / rel
        try:
            got = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError as e:
            return f"flwr file {p} cannot be read ({e})"
        if got != want:
            return (
                f"flwr file {p} is not flwr {release}'s, which was checked "
                f"(sha256 {got[:12]}..., expected {want[:12]}...)"
            )
    return None


def check_flower(version: str | None = None, root: str | Path | None = None) -> None:
    """Refuse (:class:`UnsupportedFlower`) unless flwr ``version`` is one of
    :data:`SUPPORTED` (or a patch release of one) and the files it adjusts under ``root``
    (the flwr package) are that release's."""
    version = flower_version() if version is None else version
    why = release_mismatch(ADJUSTED, version, root)
    if why is None:
        return
    if _entry(ADJUSTED, version) is None:
        raise UnsupportedFlower(
            f"the fast path supports flwr {' and '.join(SUPPORTED)} only (it adjusts "
            f"internal waits of those releases); the installed flwr is {version}: {STOCK}"
        )
    raise UnsupportedFlower(f"{why}: {STOCK}")
