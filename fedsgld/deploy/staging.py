"""A staged app directory: only what a bundle of the project holds, so that ``flwr run``
builds the same bytes without walking the rest of the project (its ``.venv`` alone holds
tens of thousands of files)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from fedsgld.clients.approve import build_bundle


def stage_app(directory: str | Path, dest: str | Path) -> Path:
    """Copy into ``dest`` (a new or empty directory) only what a bundle of ``directory``
    holds, with the files its build reads (``pyproject.toml``, ``.gitignore``): ``flwr run
    DEST`` then builds the same bundle bytes without walking the rest of the project (a
    ``.venv``, result directories). Returns ``dest``."""
    root, out = Path(directory).expanduser().resolve(), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(build_bundle(root))) as z:
        inside = {n for n in z.namelist() if not n.startswith(".info/")}
    for rel in sorted(inside | {"pyproject.toml", ".gitignore"}):
        src = root / rel
        if src.is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(src.read_bytes())
    return out
