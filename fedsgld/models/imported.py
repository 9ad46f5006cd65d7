"""A user's model factory named by its import path, ``model = "package.module:function"``.

A deployment cannot carry a Python object from the user's program to the ServerApp and to
every site's ClientApp: each imports the factory by its path instead (the module must be
installed, or on ``PYTHONPATH``, where the app runs) and calls it with no argument, as
``fedsgld.simulate(model=function)`` does, under the run's seed
(:func:`fedsgld.federation.seeded_model`). Every party must import the same code: the
sites check the parameter count of what the server sends against their own module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from fedsgld.config.checks import is_import_path


def load_factory(path: str) -> Callable[[], nn.Module]:
    """The function ``path`` (``"package.module:function"``) names; ValueError in one line
    naming the setting when it cannot be imported or is not callable."""
    if not is_import_path(path):
        raise ValueError(f"model: {path!r} is not an import path 'package.module:function'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - reported in one line
        first = (str(err).splitlines() or [""])[0]
        raise ValueError(
            f"model: cannot import module {module_name!r} of the factory {path!r} "
            f"({type(err).__name__}: {first}); install it or put it on PYTHONPATH where "
            "the app runs"
        ) from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model: {module_name!r} has no function {attr!r} (from {path!r})")
    return factory


def build_imported(path: str) -> nn.Module:
    """``load_factory(path)()``, checked to be an ``nn.Module``."""
    model = load_factory(path)()
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model: the factory {path!r} must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


__all__ = ["build_imported", "is_import_path", "load_factory"]
