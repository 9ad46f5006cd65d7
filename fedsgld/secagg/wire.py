"""Protocol messages as flat records: what a transport with flat key-value records carries.

A protocol message (:mod:`.protocol`) is a dict of ints, bytes, lists of ints and nested
dicts whose keys are field names or site ids. :func:`flatten` writes it as one flat dict
of ``prefix + path`` keys, the path's parts joined by ``/`` (a site id as its decimal
digits), every value an int, bytes or a list of ints, so a Flower ``ConfigRecord`` holds it
without any re-encoding (a masked input travels as its own bytes). An empty dict is kept
as its path with a trailing ``/``. :func:`unflatten` is the inverse, and refuses anything
else: a value of another type, a path deeper than :data:`MAX_DEPTH`, a part that is
neither a field name nor a site id, more than :data:`MAX_KEYS` keys. It executes nothing
(no pickling): what a server sends a site is data only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 3
MAX_KEYS = 100_000
_FIELD = re.compile(r"[a-z][a-z0-9_]{0,31}")
_ID = re.compile(r"0|[1-9][0-9]{0,8}")


def flatten(message: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``message`` as ``{prefix + path: value}``."""
    out: dict[str, Any] = {}

    def walk(node: Mapping, parts: list[str]) -> None:
        if len(parts) >= MAX_DEPTH:
            raise ValueError(f"message nested deeper than {MAX_DEPTH}")
        if not node:
            out[prefix + "/".join(parts) + "/"] = 0
            return
        for k, v in node.items():
            part = str(k)
            ok_id = isinstance(k, int) and not isinstance(k, bool) and _ID.fullmatch(part)
            if not (ok_id or (isinstance(k, str) and _FIELD.fullmatch(part))):
                raise ValueError(f"message key {k!r} is neither a field name nor a site id")
            if isinstance(v, Mapping):
                walk(v, [*parts, part])
            else:
                out[prefix + "/".join([*parts, part])] = _value(part, v)

    walk(message, [])
    return out


def unflatten(record: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The message of the ``prefix`` keys of ``record`` (:func:`flatten`'s inverse);
    ``ValueError`` naming the first key that is not one."""
    keys = [k for k in record if isinstance(k, str) and k.startswith(prefix)]
    if len(keys) > MAX_KEYS:
        raise ValueError(f"message has {len(keys)} keys, more than {MAX_KEYS}")
    out: dict[Any, Any] = {}
    for key in sorted(keys):
        path, value = key[len(prefix) :], record[key]
        empty = path.endswith("/")
        parts = path.rstrip("/").split("/") if path.rstrip("/") else []
        if len(parts) > MAX_DEPTH or (not parts and not empty):
            raise ValueError(f"message key {key!r}: bad path")
        node = out
        for i, part in enumerate(parts):
            k: Any = int(part) if _ID.fullmatch(part) else part
            if not (_FIELD.fullmatch(part) or _ID.fullmatch(part)):
                raise ValueError(f"message key {key!r}: {part!r} is not a field or a site id")
            last = i == len(parts) - 1 and not empty
            if last:
                if k in node:
                    raise ValueError(f"message key {key!r} repeated")
                node[k] = _value(key, value)
            else:
                node = node.setdefault(k, {})
                if not isinstance(node, dict):
                    raise ValueError(f"message key {key!r} is under a value")
        if empty and parts == [] and value != 0:
            raise ValueError(f"message key {key!r}: bad empty marker")
    return out


def _value(key: str, value: Any) -> Any:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        return list(value)
    raise ValueError(f"message value at {key!r} is a {type(value).__name__}")
