"""The fast path's support tables against the Flower releases that pyproject.toml allows.

Every feature release the dependency range admits must be in every table
(:data:`fedsgld.deploy.fast.ADJUSTED`, ``BUNDLE_REUSE``, ``DIRECT_LAUNCH``), so that widening
the range without checking the new release's files fails here, not in a deployment. On the
installed release every part of the fast path must apply: a file that changed under a
listed release makes these tests fail instead of a deployment silently running slower.
No processes are started.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from fedsgld.deploy import fast

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"ADJUSTED": fast.ADJUSTED, "BUNDLE_REUSE": fast.BUNDLE_REUSE}
TABLES["DIRECT_LAUNCH"] = fast.DIRECT_LAUNCH


def flower_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "flwr"]
    return req


def allowed_feature_releases(req: Requirement) -> list[str]:
    """The ``1.M.0`` releases (every Flower feature release is one) that ``req`` admits."""
    return [f"1.{m}.0" for m in range(200) if req.specifier.contains(f"1.{m}.0")]


def test_every_flower_release_pyproject_allows_is_in_every_table():
    req = flower_requirement()
    allowed = allowed_feature_releases(req)
    assert allowed, f"pyproject.toml's {req} admits no 1.M.0 release"
    # an upper bound: a release nobody has checked cannot be resolved by a fresh install
    assert not req.specifier.contains("1.200.0") and not req.specifier.contains("2.0.0"), req
    for name, table in TABLES.items():
        missing = [v for v in allowed if v not in table]
        assert not missing, (
            f"pyproject.toml allows flwr {', '.join(missing)} ({req.specifier}), which "
            f"fedsgld.deploy.fast.{name} does not list: check that release's files and add "
            "their SHA-256, or narrow the range"
        )
    assert set(fast.SUPPORTED) == set(fast.ADJUSTED)


def test_the_coverage_check_fails_on_a_range_the_tables_do_not_cover():
    wider = Requirement("flwr[simulation]>=1.41.0,<1.44")
    assert "1.43.0" in allowed_feature_releases(wider)
    assert "1.43.0" not in fast.ADJUSTED


def test_each_table_entry_lists_sha256_digests_of_flower_files():
    for name, table in TABLES.items():
        for release, files in table.items():
            assert re.fullmatch(r"1\.\d+\.0", release), (name, release)
            for rel, digest in files.items():
                assert re.fullmatch(r"[0-9a-f]{64}", digest), (name, release, rel)
                assert not rel.startswith("/") and rel.endswith(".py"), (name, rel)


def test_on_the_installed_flower_every_part_of_the_fast_path_applies():
    version = fast.flower_version()
    assert flower_requirement().specifier.contains(version), (
        f"flwr {version} is installed, outside pyproject.toml's range"
    )
    assert fast.support() == {"waits": None, "bundle_reuse": None, "direct_launch": None}
    fast.check_flower()


def test_a_patch_release_counts_only_with_its_feature_release_files(tmp_path):
    import flwr

    version = fast.flower_version()
    release = ".".join(version.split(".")[:2]) + ".0"
    for rel in {r for t in TABLES.values() for r in t.get(release, {})}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((Path(flwr.__file__).parent / rel).read_bytes())
    patch = str(Version(release)).rsplit(".", 1)[0] + ".7"
    assert fast.support(patch, tmp_path) == {k: None for k in fast.support(patch, tmp_path)}
    f = tmp_path / "supercore" / "superexec" / "executor" / "subprocess_executor.py"
    f.write_bytes(f.read_bytes() + b"\n# changed in a patch release\n")
    got = fast.support(patch, tmp_path)
    assert got["waits"] is None and got["bundle_reuse"] is None
    assert "subprocess_executor.py" in got["direct_launch"]
    assert hashlib.sha256(f.read_bytes()).hexdigest()[:12] in got["direct_launch"]
    assert "checked releases are" in fast.support("1.40.0", tmp_path)["direct_launch"]


def test_a_part_that_does_not_apply_says_why_in_one_line(capsys):
    assert fast.direct_launch(version="1.40.0") is False
    assert fast.reuse_installed_bundle(version="1.40.0") is False
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"fedsgld: {fast.NO_DIRECT_LAUNCH}: the installed flwr is 1.40.0")
    assert lines[1].startswith(f"fedsgld: {fast.NO_BUNDLE_REUSE}: the installed flwr is 1.40.0")


@pytest.mark.parametrize("version", ["1.40.0", "1.43.0", "2.0.0"])
def test_the_fast_path_refuses_releases_outside_the_tables(version, tmp_path):
    with pytest.raises(fast.UnsupportedFlower, match=f"installed flwr is {re.escape(version)}"):
        fast.check_flower(version, tmp_path)
