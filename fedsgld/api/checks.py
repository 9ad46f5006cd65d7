"""What the Python API checks before any budget is spent: the arguments, the records, the
model against the labels.

* :func:`check_ignored_settings`: a privacy setting passed by name that the method ignores
  (``epsilon`` with ``sgd``, ``temperature`` with ``dpsgd``, ...) is a ValueError saying
  so, rather than a silent no-op. Settings from a config file are not checked: one file
  may serve several methods.
* :func:`checked_sites`: every site's records as given (finite features, finite class
  indices, enough records to evaluate a site: :func:`fedsgld.data.user.read_user_sites`),
  each error naming the site and the record's index.
* :func:`checked_model`: the model's per-record gradients (:func:`check_model`); where it
  returns fewer classes than the labels imply, the error names the label (site, index,
  value) rather than the model's output shape.

Privacy caveat: these checks read the user's own records in the user's own process, before
any site exists; nothing here is released, and a deployed site makes its own checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from fedsgld.api.models import ClassCountError, check_model
from fedsgld.config import Config
from fedsgld.data.user import UserSites, read_user_sites

_NOISE = ("epsilon", "delta", "clip", "prenoise", "temperature", "noise_multiplier")
_NON_PRIVATE = "adds no noise and has no privacy budget"

#: method -> {setting: why the method ignores it}
IGNORED: dict[str, dict[str, str]] = {
    "sgd": dict.fromkeys((*_NOISE, "accountant", "sigma_grid"), _NON_PRIVATE),
    "vi": dict.fromkeys((*_NOISE, "accountant", "sigma_grid"), _NON_PRIVATE),
    "dpsgd": {
        "temperature": "uses a constant noise_multiplier (temperature is dpsgld's)",
        "prenoise": "adds no pre-noise (dpsgld only)",
        "decay_gamma": "keeps its step size constant",
    },
    "dpvi": {
        "temperature": "uses a constant noise_multiplier (temperature is dpsgld's)",
        "prenoise": "adds no pre-noise (dpsgld only)",
        "decay_gamma": "keeps its step size constant",
    },
    "dpsgld": {"noise_multiplier": "ties sigma_t to the step size: sqrt(2 lr_t temperature)"},
}
_USE_INSTEAD = {
    "sgd": "choose method='dpsgld' or 'dpsgd' for a guarantee",
    "vi": "choose method='dpvi' for a guarantee",
    "dpsgd": "set noise_multiplier (or choose method='dpsgld')",
    "dpvi": "set noise_multiplier",
    "dpsgld": "set temperature or lr (or choose method='dpsgd')",
}


def check_ignored_settings(cfg: Config, given: Mapping[str, Any]) -> None:
    """ValueError where a setting passed by name is one the run's method ignores."""
    method = cfg.privacy.method
    ignored = [k for k in given if k in IGNORED.get(method, {})]
    if ignored:
        why = IGNORED[method][ignored[0]]
        names = ", ".join(ignored)
        raise ValueError(
            f"{names}: method {method!r} {why}, so {'these are' if len(ignored) > 1 else 'it is'} "
            f"ignored; drop {names}, or {_USE_INSTEAD[method]}"
        )


def checked_sites(
    sites: Sequence[Any], test_sites: Sequence[Any] | None, cfg: Config, *,
    num_classes: int | None, small_sites: str,
) -> UserSites:  # fmt: skip
    """The user's sites, every record checked (:func:`read_user_sites`)."""
    return read_user_sites(
        sites,
        test_sites,
        test_fraction=cfg.run.test_fraction,
        num_classes=num_classes,
        seed=max(cfg.run.seed, 0),
        small=small_sites,
    )


def checked_model(
    model: Callable[[], nn.Module], data: UserSites, *, num_classes: int | None
) -> str:
    """:func:`check_model` on the first site's records; the per-record gradient path. A
    model returning fewer classes than the labels imply names the first such label."""
    d = data.sites[0]
    try:
        return check_model(model, d.x_train, d.y_train, d.num_classes)
    except ClassCountError as err:
        got = err.returned
        stray = data.stray_label(got) if got is not None and got < d.num_classes else None
        if stray is None:
            raise
        fix = "fix the label" if num_classes is None else f"check num_classes={num_classes}"
        raise ValueError(
            f"{stray.text(got)}, but the model returns {got} classes (labels 0 to "
            f"{got - 1}); {fix}, or make the model return {d.num_classes} logits"
        ) from None


__all__ = ["IGNORED", "check_ignored_settings", "checked_model", "checked_sites"]
