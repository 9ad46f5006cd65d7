"""Reading a run's settings: a flat TOML config file and ``--set KEY=VALUE`` overrides."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedsgld.config.checks import CENTRES
from fedsgld.config.settings import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_value(text: str) -> Any:
    """Parse a ``--set`` value as a TOML value (numbers, booleans, quoted strings), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def flatten_tables(raw: dict[str, Any]) -> dict[str, Any]:
    """A config file's settings as one flat mapping: a table's keys join the top level's."""
    values: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            values.update(v)
        else:
            values[k] = v
    return values


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a flat TOML config (nested tables are flattened) and apply overrides. A dataset
    of real centres (``heart_disease``) takes ``partition = "centres"`` and one site per
    centre where neither is set; a value set otherwise is an error naming the centres."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"config file {str(p)!r} does not exist; pass a TOML file such as "
                "simulations/demo.toml"
            )
        try:
            with p.open("rb") as fh:
                raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"config file {str(p)!r} is not valid TOML: {err}; strings need quotes "
                '(dataset = "mnist5k"), one key = value per line'
            ) from err
        raw.pop("benchmark", None)  # read by `fedsgld benchmark`; one file serves both commands
        values = flatten_tables(raw)
    values.update(overrides or {})
    centres = CENTRES.get(values.get("dataset"))  # type: ignore[arg-type]
    if centres is not None:  # a dataset of real centres: its own sites unless set otherwise
        values.setdefault("partition", "centres")
        values.setdefault("sites", len(centres))
    return Config.from_flat(values)


class _SetKey(argparse.Action):
    """``--tracking mlflow`` is ``--set tracking=mlflow`` (the config key it names)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        key = self.dest.removeprefix("key_")
        namespace.set = [*(getattr(namespace, "set", None) or []), f"{key}={values}"]


def tracking_options(p: argparse.ArgumentParser) -> None:
    """``--tracking`` and ``--tracking-uri``: the config keys, as options."""
    p.add_argument(
        "--tracking",
        dest="key_tracking",
        action=_SetKey,
        choices=("none", "mlflow"),
        help="log the run to an experiment tracker (mlflow: pip install 'fedsgld[tracking]'); "
        "the config key tracking",
    )
    p.add_argument(
        "--tracking-uri",
        dest="key_tracking_uri",
        action=_SetKey,
        metavar="URI",
        help="MLflow tracking URI (default: sqlite:///<the run's parent folder>/mlflow.db)",
    )
