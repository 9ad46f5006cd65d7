"""The installed-bundle shortcut of the fast path: a ClientApp forked from the warm site
takes an app bundle that Flower already installed here from its install directory,
instead of unpacking and verifying all of it again for every message."""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

from fedsgld.deploy.releases import BUNDLE_REUSE, release_mismatch

NO_BUNDLE_REUSE = "each task unpacks and verifies the app bundle (Flower's own install)"
INSTALLED_MARK = (
    ".fedsgld-installed-"  # + the bundle's full SHA-256, written after Flower's install
)


def reuse_installed_bundle(version: str | None = None, root: str | Path | None = None) -> bool:
    """ClientApps forked from this process take an app bundle that Flower already installed
    (and that this process marked, with the bundle's full SHA-256) from its install
    directory, instead of unpacking and verifying all of it again for every message.

    Flower's own ``install_from_fab`` returns that same directory when it exists, but only
    after unpacking the bundle into a temporary directory and checking every file's hash:
    about a third of a warm task's CPU. The shortcut applies only to bundles whose first
    install through Flower completed here; any other bundle goes through Flower's install.
    Returns whether it was applied (flwr releases in :data:`BUNDLE_REUSE`, files unchanged)."""
    why = release_mismatch(BUNDLE_REUSE, version, root)
    if why is not None:
        print(f"fedsgld: {NO_BUNDLE_REUSE}: {why}", file=sys.stderr, flush=True)
        return False
    from flwr.cli import install as flwr_install
    from flwr.supernode.runtime import run_clientapp

    if run_clientapp.install_from_fab is not flwr_install.install_from_fab:
        why = "flwr's run_clientapp does not call cli.install.install_from_fab as expected"
        print(f"fedsgld: {NO_BUNDLE_REUSE}: {why}", file=sys.stderr, flush=True)
        return False
    run_clientapp.install_from_fab = bundle_installer(flwr_install.install_from_fab)
    return True


def bundle_installer(original):
    """``install_from_fab`` that returns a marked install directory for a bundle already
    installed (by ``original``, Flower's) and marks what ``original`` installs.

    The marked directory is found by name, without reading the bundle's metadata (a
    twentieth of a task's CPU): Flower names it ``<publisher>.<app>.<version>.<first
    hex digits of the digest>`` under ``$FLWR_HOME/apps``, and only the directory Flower
    installed from bundle bytes with exactly this SHA-256 carries the mark."""
    from flwr.common.config import get_flwr_home
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION

    def install_from_fab(fab_file, install_dir=None, skip_prompt=False):
        if not isinstance(fab_file, bytes) or install_dir is not None or not skip_prompt:
            return original(fab_file, install_dir, skip_prompt)
        digest = hashlib.sha256(fab_file).hexdigest()
        apps = get_flwr_home() / APP_DIR
        with contextlib.suppress(OSError):
            for path in apps.glob(f"*.{digest[:FAB_HASH_TRUNCATION]}"):
                if (path / (INSTALLED_MARK + digest)).is_file():
                    return path
        installed = original(fab_file, install_dir, skip_prompt)
        with contextlib.suppress(OSError):
            (Path(installed) / (INSTALLED_MARK + digest)).touch()
        return installed

    return install_from_fab
