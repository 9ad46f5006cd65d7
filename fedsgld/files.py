"""Durable files: atomic writes and strict JSON, for every file fedsgld keeps.

A run's ``ledger.json``, ``checkpoint.pt`` and ``results.json``, a site's ledger and a
PATE run's results are all written the same way: to a temporary file, fsynced, renamed
over the target, and the directory fsynced (:func:`atomic_write`), so a crash leaves
either the old file or the new one, never half of one. JSON is strict (:func:`write_json`):
non-finite floats become null, and :func:`json_default` turns arrays, tensors, numpy
scalars and paths into JSON.

The bottom layer of the package: it imports nothing of fedsgld, and no torch (a tensor
is recognised only when torch has been imported by someone else).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or a new file in it survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary file, fsync it, rename it over ``path``, fsync the directory
    (the temporary file is removed when any of it fails or is interrupted)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # a failed or interrupted write leaves the old file, and no .tmp
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def finite(obj: Any) -> Any:
    """Strict JSON: non-finite floats become null (e.g. SGD's epsilon, an undefined AUC)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return finite(obj.item())
    return obj


def json_default(o: Any) -> Any:
    """``json.dump``'s ``default``: numpy scalars and arrays, torch tensors, paths."""
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    torch = sys.modules.get("torch")  # no tensor exists unless torch was imported
    if torch is not None and isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def strict_json(obj: Any) -> Any:
    """``obj`` as it reads back from a file :func:`write_json` wrote (e.g. to digest it)."""
    return json.loads(json.dumps(finite(obj), default=json_default, allow_nan=False))


def write_json(path: Path, obj: Any) -> None:
    """Write strict JSON durably (non-finite floats as null)."""

    def _w(p: Path) -> None:
        with p.open("w") as fh:
            json.dump(finite(obj), fh, indent=2, default=json_default, allow_nan=False)

    atomic_write(path, _w)
