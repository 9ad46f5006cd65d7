"""The checks every setting goes through, and the messages they give.

:func:`setting` declares a field with its one-line help; :func:`_num`, :func:`_int` and
:func:`_choice` raise ``ValueError`` naming the setting and its valid range; the tuples
below are the valid choices of the string settings. Standard library only.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import typing
from dataclasses import field
from typing import Any

PLACEMENTS = ("server", "sites")
METHODS = ("sgd", "dpsgd", "dpsgld", "dpvi", "vi")
OPTIMIZERS = ("sgd", "adam")
PARTITIONS = ("iid", "dirichlet", "quantity", "centres")
STANDARDIZE = ("none", "site", "pooled")
RECAL_SCOPES = ("federation", "site")
#: Datasets whose sites are fixed real centres (partition = "centres"), in site order.
CENTRES: dict[str, tuple[str, ...]] = {
    "heart_disease": ("Cleveland", "Hungary", "Switzerland", "Long Beach"),
}


def check_centres(dataset: str, partition: str, sites: int) -> None:
    """A fixed-centre dataset needs partition = "centres" and one site per centre; the
    "centres" partition needs such a dataset. ValueError naming the centres otherwise."""
    names = CENTRES.get(dataset)
    if names is None:
        if partition == "centres":
            raise ValueError(
                f"partition = 'centres' needs a dataset whose sites are real centres "
                f"({', '.join(CENTRES)}), got dataset {dataset!r}; use iid, dirichlet or quantity"
            )
        return
    if partition != "centres" or sites != len(names):
        raise ValueError(
            f"dataset {dataset!r} is split by its {len(names)} centres ("
            + ", ".join(f"site {k}: {n}" for k, n in enumerate(names))
            + f"): set partition = 'centres' and sites = {len(names)}; got partition = "
            f"{partition!r}, sites = {sites}"
        )


ACCOUNTANTS = ("pld", "rdp", "dp_accounting_pld")
MODELS = ("cnn", "mlp", "logreg", "timm_head")
# or a user's model factory by its import path, "package.module:function" (fedsgld.models.imported)
_IMPORT_PATH = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
)


def is_import_path(name: object) -> bool:
    """Whether ``name`` has the form ``"package.module:function"`` (a model factory)."""
    return isinstance(name, str) and _IMPORT_PATH.fullmatch(name) is not None


# a timm model name, optionally with its pretrained tag ("resnet18.a1_in1k"): never a path,
# "local-dir:" or "hf-hub:" source, which timm would read from disk or the network
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_]{1,100}(\.[A-Za-z0-9_]{1,100})?")


def plain_model_name(name: str, v: Any) -> None:
    """``ValueError`` unless ``v`` is a plain model name (letters, digits, _ and one
    optional .tag). The message does not repeat ``v``: it may name a path."""
    if not (isinstance(v, str) and _PLAIN_NAME.fullmatch(v)):
        raise ValueError(
            f"{name} must be a plain timm model name (letters, digits and _, with one optional "
            ".tag); a path, 'local-dir:' or 'hf-hub:' name is refused"
        )


# The absolute ranges of the numbers a mechanism consumes, checked by every party (a run's
# config here, a site's guard against every request): past them float32 noise, sums and
# parameters overflow, or the accountant's arithmetic does (a noise multiplier of 1e300
# turns its privacy-loss grid into NaN).
MAX_NOISE_MULTIPLIER = 1e6
MAX_CLIP = 1e6
MAX_PRENOISE = 1e6
MIN_SAMPLE_RATE = 1e-9
MAX_STEP_SIZE = 1e6

RANDOMNESS = ("seeded", "os")
DEVICES = ("cpu", "cuda", "auto")  # resolved to a torch device by fedsgld.config.device
SECURE_NOISE = ("auto", "on", "off")
TRACKERS = ("none", "mlflow")  # experiment trackers (fedsgld.run.tracking)
LR_SCHEDULES = ("polynomial", "cyclical")


def setting(default: Any, help: str) -> Any:
    """A settings field: its default and the one-line meaning shown by ``fedsgld config``."""
    return field(default=default, metadata={"help": help})


def _num(
    name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{name} must be a number in {lb}{lo}, {hi}{rb}, got {v!r}")


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {rng}, got {v!r}")


#: Values of a setting that name another command: what to run instead.
_OTHER_COMMANDS = {("method", "pate"): "PATE is its own command: fedsgld pate CONFIG"}


def _choice(name: str, v: Any, options: tuple[str, ...]) -> None:
    if v not in options:
        hint = _OTHER_COMMANDS.get((name, v))
        if hint is None and isinstance(v, str):
            near = difflib.get_close_matches(v, options, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else None
        raise ValueError(
            f"{name} must be one of {', '.join(options)}; got {v!r}"
            + (f" ({hint})" if hint else "")
        )


def check_neighbours(name: str, k: int, sites: int, max_dropouts: int, max_colluders: int) -> None:
    """Secure aggregation's sparse neighbourhoods (:mod:`fedsgld.secagg.plan`): ``k`` is 0
    (every pair of sites) or even in [2 max_dropouts + max_colluders + 1, sites - 2], the
    range in which the sparse graph keeps the complete graph's guarantees; else
    ``ValueError`` naming ``name`` and the range."""
    low = 2 * max_dropouts + max_colluders + 1
    low += low % 2
    if k and not (k % 2 == 0 and low <= k <= sites - 2):
        raise ValueError(
            f"{name} must be 0 (every pair of sites) or even in [{low}, sites - 2 = "
            f"{sites - 2}] (at least 2 max_dropouts + max_colluders + 1, so that the sparse "
            f"graph keeps the complete graph's guarantees), got {k}"
        )


def unknown_settings_message(unknown: list[str], valid: typing.Iterable[str]) -> str:
    """One line naming each unknown key, with the nearest valid key where one is close
    ("did you mean"), and where the full list is (not the list itself)."""
    valid = sorted(valid)
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(k, valid, n=1, cutoff=0.6)
        parts.append(f"{k!r} (did you mean {near[0]!r}?)" if near else repr(k))
    noun = "setting" if len(unknown) == 1 else "settings"
    return f"unknown {noun} {', '.join(parts)}; `fedsgld config` lists every setting"


#: The largest |mean|, std and 1 / std that ``standardize_stats`` may carry.
MAX_STAT = 1e12


def encode_stats(mean: list[float], std: list[float]) -> str:
    """The pooled (mean, std) as ``standardize_stats`` carries them (JSON; every float64
    exactly, as Python's ``repr``)."""
    return json.dumps({"mean": [float(v) for v in mean], "std": [float(v) for v in std]})


def decode_stats(text: str) -> tuple[list[float], list[float]]:
    """``standardize_stats`` as (mean, std), each a list of finite floats of one length,
    |mean| <= 1e12 and 1e-12 <= std <= 1e12; else ``ValueError`` naming the setting."""
    try:
        obj = json.loads(text)
        mean, std = obj["mean"], obj["std"]
        ok = isinstance(mean, list) and isinstance(std, list) and 0 < len(mean) == len(std)
        ok = ok and set(obj) == {"mean", "std"}
    except (ValueError, TypeError, KeyError):
        ok = False
    if ok:
        ok = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in (*mean, *std)
        )
    if ok:
        ok = all(abs(m) <= MAX_STAT for m in mean) and all(
            1.0 / MAX_STAT <= s <= MAX_STAT for s in std
        )
    if not ok:
        raise ValueError(
            'standardize_stats must be the JSON {"mean": [...], "std": [...]} of one length, '
            f"finite, |mean| <= {MAX_STAT:g}, std in [{1 / MAX_STAT:g}, {MAX_STAT:g}]"
        )
    return [float(v) for v in mean], [float(v) for v in std]
