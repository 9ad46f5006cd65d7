"""``fedsgld.simulate(..., transport="flower" | "ray")``: the same objects over Flower.

The user's model factory and per-site records drive the project's ServerApp and ClientApp
(:mod:`fedsgld.apps.user_apps`): every message, reply check, site guard and handler of a
Flower run, with each node building its sites from the user's records of those sites and
the user's factory under the run's seed. With the same seed and objects the numbers are
the in-process engine's (tests/api/test_over_flower.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fedsgld.api.models import check_model
from fedsgld.config import Config
from fedsgld.core.mechanism import FlatModel
from fedsgld.data.partition import SiteData
from fedsgld.federation import resolve_seed, seeded_model, split_data, variational_view
from fedsgld.run.evaluation import RunResult
from fedsgld.run.progress import RoundInfo

#: transport -> the Flower runtime of :func:`fedsgld.apps.user_apps.run_user_apps`
TRANSPORTS = {"in-process": None, "flower": "local", "ray": "ray"}


def check_transport(transport: str) -> str | None:
    """The Flower runtime of ``transport`` (None: the in-process engine)."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(TRANSPORTS)} (in-process: the engine; "
            f"flower: the ServerApp and ClientApp over Flower's Grid in this process; ray: "
            f"Flower's Ray simulation); got {transport!r}"
        )
    return TRANSPORTS[transport]


def run_over_flower(
    cfg: Config,
    model_fn: Callable[[], nn.Module] | None,
    data: list[SiteData] | None,
    *,
    runtime: str,
    out: Path,
    resume: bool,
    nodes: int | None,
    log: Callable[[str], None],
    on_round: Callable[[RoundInfo], Any] | None,
    ray_address: str | None = None,
) -> tuple[RunResult, Any, nn.Module, FlatModel, str]:
    """One run over Flower: its result, its server, the user's module and its parameter
    view (for :class:`~fedsgld.api.result.Result`) and the per-record gradient path.
    Without ``data`` the config's dataset is split here as the engine splits it (a
    seed of -1 is resolved first, so the split and the run share it) and carried to the
    nodes as the user's records are."""
    from fedsgld.apps.user_apps import run_user_apps  # Flower, imported for these runs only

    if data is None:
        seed, _ = resolve_seed(cfg)
        cfg = Config.from_flat({**cfg.flat(), "seed": seed})
        data = split_data(cfg, seed=seed, log=log).site_data
    run_config = {**cfg.flat(), "out": str(out.expanduser().resolve()), "resume": resume}
    res, server = run_user_apps(
        run_config,
        model_fn=model_fn,
        site_data=data,
        runtime=runtime,
        nodes=nodes,
        log=log,
        on_round=on_round,
        ray_address=ray_address,
    )
    d = data[0]
    shape = tuple(d.x_train.shape[1:])
    model = seeded_model(cfg, shape, d.num_classes, seed=max(cfg.run.seed, 0), model_fn=model_fn)
    fm = variational_view(cfg, model) or FlatModel(model)
    grad_path = check_model(lambda: model, d.x_train, d.y_train, d.num_classes)
    return res, server, model, fm, grad_path


__all__ = ["TRANSPORTS", "check_transport", "run_over_flower"]
