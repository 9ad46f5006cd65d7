"""Approving a bundle: what ``fedsgld site approve`` prints and appends to a policy.

Builds a project directory's bundle as ``flwr run`` does (:func:`build_bundle`), names it
(:func:`describe`) and appends its ``[[approved_apps]]`` entry to the site's policy
(:func:`approve`). The check at the site's door is :mod:`fedsgld.clients.approval`.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedsgld.clients.approval import BundleInfo, bundle_info, parse_approved_apps, policy_toml


def app_files(directory: str | Path) -> dict[str, Path]:
    """The files of ``directory`` that Flower's build considers, as Flower's own
    ``collect_files`` finds them (relative POSIX path -> path; symlinks and paths that
    resolve outside skipped), without walking the directories its built-in rules always
    leave out of a bundle: ``__pycache__`` anywhere and, at the top, a virtual environment
    (``.venv``, ``venv``, ...), ``build``, ``lib`` and the others of
    ``flwr.common.constant.FAB_EXCLUDE_PATTERNS``. A project's ``.venv`` holds tens of
    thousands of files, which Flower's walk reads on every build (seconds)."""
    from flwr.common.constant import FAB_EXCLUDE_PATTERNS

    top = {p[:-3] for p in FAB_EXCLUDE_PATTERNS if p.endswith("/**") and p.count("/") == 1}
    top = {d for d in top if "*" not in d}
    root = Path(directory).expanduser().resolve()
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        at_top = here == root
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (at_top and d in top)]
        for name in filenames:
            path = here / name
            if path.is_symlink() or not path.resolve().is_relative_to(root):
                continue
            files[path.relative_to(root).as_posix()] = path
    return files


def build_bundle(directory: str | Path) -> bytes:
    """The bundle ``flwr run DIRECTORY`` submits: Flower's own build
    (``build_fab_from_files``, the same rules and bytes as ``build_fab_from_disk``) of
    :func:`app_files`."""
    from flwr.cli.build import build_fab_from_files

    return build_fab_from_files(app_files(directory))[0]


def approval_entry(info: BundleInfo) -> str:
    return (
        f'\n[[approved_apps]]\nsha256 = "{info.sha256}"\n'
        f'name = "{info.name}"\nversion = "{info.version}"\n'
    )


def describe(info: BundleInfo, source: str) -> str:
    lines = [
        f"app bundle {info.fab_id} {info.version} ({source})",
        f"sha256 {info.sha256}",
        f"content sha256 {info.content_sha256} (of its file list below, independent of "
        "compression)",
        f"{len(info.files)} files, {sum(n for _, _, n in info.files)} bytes "
        "(sha256, bytes, path); every one runs or is read at the site:",
    ]
    lines += [f"  {d}  {n:>8}  {p}" for p, d, n in info.files]
    return "\n".join(lines)


def approve(bundle: str | Path, policy: str | Path | None = None) -> tuple[BundleInfo, str]:
    """The bundle at ``bundle`` (a .fab file or a project directory) and what to print;
    with ``policy``, append it to that file's ``approved_apps`` (keeping its text)."""
    src = Path(bundle).expanduser()
    if not src.exists():
        raise ValueError(f"{src}: no such app bundle (.fab file) or project directory")
    if src.is_dir():
        data = build_bundle(src)
        source = f"built from {src.resolve()} as `flwr run` builds it"
    else:
        data = src.read_bytes()
        source = str(src)
    try:
        info = bundle_info(data)
    except ValueError as e:
        raise ValueError(f"{src}: {e}") from None
    text = describe(info, source)
    if policy is None:
        return info, text
    p = Path(policy).expanduser()
    old = p.read_text() if p.exists() else ""
    approved = parse_approved_apps(
        policy_toml(old, p).get("approved_apps", []), f"privacy policy {str(p)!r}"
    )
    if any(a.sha256 == info.sha256 for a in approved):
        return info, text + f"\nalready approved in {p}"
    new = old + ("" if not old or old.endswith("\n") else "\n") + approval_entry(info)
    parse_approved_apps(policy_toml(new, p).get("approved_apps"), f"privacy policy {str(p)!r}")
    tmp = p.with_name(f".{p.name}.{os.getpid()}")
    tmp.write_text(new)
    if p.exists():
        os.chmod(tmp, p.stat().st_mode & 0o7777)
    os.replace(tmp, p)
    return info, text + f"\napproved in {p}: {info.name} {info.version}"
