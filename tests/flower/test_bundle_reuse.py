"""The fast path's bundle reuse: a bundle Flower installed is not unpacked again, any other
bundle goes through Flower's own install (no processes started)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from fedsgld.deploy.fast import INSTALLED_MARK, bundle_installer, reuse_installed_bundle

ROOT = Path(__file__).resolve().parents[2]


def fab(version: str = "0.1.0", extra: bytes = b"") -> bytes:
    text = (
        (ROOT / "pyproject.toml")
        .read_text()
        .replace('version = "0.1.0"', f'version = "{version}"', 1)
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pyproject.toml", text)
        z.writestr("fedsgld/__init__.py", extra)
    return buf.getvalue()


def test_installed_bundles_are_reused_and_others_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    calls = []

    def flower_install(content, install_dir=None, skip_prompt=False):  # stands in for Flower's
        calls.append(content)
        import hashlib

        from flwr.cli.config_utils import get_fab_metadata
        from flwr.common.config import get_project_dir

        path = get_project_dir(*get_fab_metadata(content), hashlib.sha256(content).hexdigest())
        path.mkdir(parents=True, exist_ok=True)
        return path

    install = bundle_installer(flower_install)
    a, b = fab(extra=b"a = 1"), fab(extra=b"b = 2")
    first = install(a, skip_prompt=True)
    assert len(calls) == 1 and any(p.name.startswith(INSTALLED_MARK) for p in first.iterdir())
    assert install(a, skip_prompt=True) == first and len(calls) == 1  # reused, not unpacked
    second = install(b, skip_prompt=True)  # another bundle: Flower's install
    assert len(calls) == 2 and second != first
    (first / (INSTALLED_MARK + __import__("hashlib").sha256(a).hexdigest())).unlink()
    install(a, skip_prompt=True)  # no mark (e.g. an install that did not finish): Flower's
    assert len(calls) == 3
    install(a)  # Flower's prompt path is never short-cut
    assert len(calls) == 4
    # found by name, trusted only with the full digest: a directory named like bundle c's
    # but marked for another bundle is not c's install
    c = fab(extra=b"c = 3")
    digest_a, digest_c = (__import__("hashlib").sha256(x).hexdigest() for x in (a, c))
    decoy = tmp_path / "apps" / f"someone.else.0.1.0.{digest_c[:8]}"
    decoy.mkdir(parents=True)
    (decoy / (INSTALLED_MARK + digest_a)).touch()
    (decoy / (INSTALLED_MARK + digest_c[:8])).touch()
    assert install(c, skip_prompt=True) != decoy and len(calls) == 5
    with pytest.raises(zipfile.BadZipFile):  # a bundle Flower would reject still reaches it
        bundle_installer(lambda c, d=None, s=False: zipfile.ZipFile(io.BytesIO(c)))(
            b"junk", None, True
        )


def test_reuse_only_on_checked_flower_releases():
    assert reuse_installed_bundle(version="1.40.0") is False  # not checked: Flower's install
    assert reuse_installed_bundle(version="1.41.0", root="/nonexistent") is False


def test_direct_hand_off_only_on_checked_flower_releases_and_to_a_serving_fork_server(
    tmp_path, monkeypatch
):
    from fedsgld.deploy import fast, shim

    assert fast.direct_launch(version="1.40.0") is False  # not checked: through the shim
    assert fast.direct_launch(version="1.42.0", root="/nonexistent") is False
    args = ["--runtime-api-address", "127.0.0.1:1", "--token", "t"]
    monkeypatch.delenv(shim.ENV_SOCKET, raising=False)
    assert fast.hand_to_fork_server(args) is None  # not under `fedsgld supernode`
    d = shim.private_dir(str(tmp_path / "warm"))
    monkeypatch.setenv(shim.ENV_SOCKET, f"{d}/fork.sock")
    assert fast.hand_to_fork_server(args) is None  # nothing serving: Popen (the shim)
    monkeypatch.setenv(shim.ENV_MODE, "off")
    assert fast.hand_to_fork_server(args) is None
