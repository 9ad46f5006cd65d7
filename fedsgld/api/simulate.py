"""``fedsgld.simulate``: a federation from Python objects, run by the in-process engine.

The same builder, lifecycle and engine as ``fedsgld simulate CONFIG`` (one training loop):
only where the model and the sites' records come from differs. A user's model factory is
called once under the run's seed (so its initial weights are reproducible) and its records
stay in the process, one :class:`~fedsgld.data.partition.SiteData` per site.
"""

from __future__ import annotations

import tempfile
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedsgld import engine
from fedsgld.api.configs import make_config
from fedsgld.api.describe import record_what_ran
from fedsgld.api.over_flower import check_transport, run_over_flower
from fedsgld.api.prepare import ModelArg, prepare, split_arguments
from fedsgld.api.result import Result
from fedsgld.config import Config
from fedsgld.deploy.ray_cluster import check_ray_address
from fedsgld.run.evaluation import RunResult
from fedsgld.run.progress import RoundInfo
from fedsgld.run.stops import RunInterrupted
from fedsgld.run.tracking import default_uri


def _trained_model(module: nn.Module, fm, theta: torch.Tensor) -> nn.Module:
    """``module`` holding ``theta`` (the mean mu for variational methods); ``fm`` its
    parameter view."""
    params = dict(module.named_parameters())
    flat = theta[: fm.theta_size].to(next(iter(params.values())).device)
    with torch.no_grad():
        for name, chunk in zip(fm.names, flat.split(fm.numels), strict=True):
            params[name].copy_(chunk.view_as(params[name]))
    return module


def _run_dir(out_dir: str | Path | None) -> tuple[Path, Any]:
    if out_dir is not None:
        return Path(out_dir).expanduser(), None
    tmp = tempfile.TemporaryDirectory(prefix="fedsgld-")
    return Path(tmp.name) / "run", tmp


def simulate(
    model: ModelArg = None,
    sites: Sequence[Any] | int | None = None,
    *,
    test_sites: Sequence[Any] | None = None,
    num_classes: int | None = None,
    config: str | Path | Config | Mapping[str, Any] | None = None,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    on_round: Callable[[RoundInfo], Any] | None = None,
    transport: str = "in-process",
    nodes: int | None = None,
    ray_address: str | None = None,
    plan: str | None = None,
    small_sites: str = "error",
    **settings: Any,
) -> Result:
    """Train one federation and return its :class:`Result`.

    ``model``: a function returning any ``nn.Module`` that maps a batch of records to
    logits (called once, under the run's seed), or a built-in model's name; None: the
    config's. ``sites``: one entry per site: a torch ``Dataset``, an ``(x, y)`` pair or a
    flwr-datasets partition; None (or a number of sites): the config's dataset, split into
    the config's sites.
    ``test_sites``: each site's test records (default: ``test_fraction`` of its own).
    Every record is checked first (finite, class indices, at least 10 records and 2 test
    records a site: ``small_sites="warn"`` to only warn); an error names site and index.
    ``settings``: any config key (``fedsgld config`` lists them), e.g. ``method="dpsgld",
    epsilon=4.0, noise_placement="sites", rounds=200, sample_rate=0.05, clip=1.0``; over
    ``config`` (a TOML file, a :class:`Config` or a dict). Privacy settings go to the
    accountant exactly as in a config file: every step is checked against
    ``epsilon`` at ``delta`` before its noise is drawn, and a plan that affords no step is a
    ValueError before anything is written. ``plan="fit"``: the temperature (dpsgld) or
    noise_multiplier (dpsgd, dpvi) that spends ``epsilon`` over ``rounds``
    (:func:`fedsgld.plan`); a run the budget stops early warns once (``BudgetWarning``).

    ``out_dir``: the run directory (default: a temporary one, removed with the result;
    :meth:`Result.save` copies it); ``resume``: continue the run in ``out_dir``.
    ``tracking="mlflow"`` logs the run to MLflow (``tracking_uri``: a server; default: a
    SQLite store beside ``out_dir``, or ``./runs/mlflow.db`` without one; docs/simulation.md).
    ``progress=False`` prints nothing. ``on_round(info)`` is called after every round.
    Ctrl-C raises :class:`~fedsgld.run.stops.RunInterrupted` (a KeyboardInterrupt) after
    checkpointing, in ``out_dir``, a run that released something (resume it with
    ``resume=True``); without ``out_dir`` nothing is kept.

    ``transport``: ``"in-process"`` (the engine), ``"flower"`` (the project's ServerApp and
    ClientApp exchanging Flower messages over Flower's Grid interface in this process) or
    ``"ray"`` (the same apps in Flower's Ray simulation, ``run_simulation``; the factory
    and records are pickled to its actors). Over Flower each of ``nodes`` nodes (default:
    one per site) builds its sites from the user's records of those sites and the factory
    under the run's seed; a seeded run gives the engine's numbers. ``ray_address``
    (``"ray"`` only): ``"local"``, a Ray of the run's own, or ``"HOST:PORT"`` of a running
    cluster's head, joined as one more driver and left running (default: ``RAY_ADDRESS`` if
    set, else ``"local"``; docs/simulation.md).

    Privacy caveat: a simulation seeds every party's noise from ``seed``; it is private only
    against parties who do not know the seed (see docs/privacy.md).
    """
    model, sites, settings = split_arguments(model, sites, settings)
    runtime = check_transport(transport)
    if ray_address is not None and runtime != "ray":
        raise ValueError(f"ray_address: only with transport='ray'; got transport={transport!r}")
    if ray_address is not None:
        check_ray_address(ray_address, "ray_address")  # its form, before any work
    cfg, sites_read = prepare(
        config, settings, model, sites, test_sites=test_sites, num_classes=num_classes,
        small_sites=small_sites, plan=plan, resume=resume,
    )  # fmt: skip
    data = None if sites_read is None else sites_read.sites
    out, tmp = _run_dir(out_dir)
    if tmp is not None and cfg.run.tracking != "none" and not cfg.run.tracking_uri:
        # a temporary run directory goes with the result: the store goes to ./runs instead
        cfg = Config.from_flat({**cfg.flat(), "tracking_uri": default_uri(Path("runs/run"))})
    log = print if progress else (lambda _line: None)
    if runtime is not None:
        flower = dict(nodes=nodes, log=log, on_round=on_round, ray_address=ray_address)
        return _over_flower(cfg, model, data, runtime, out, tmp, resume, flower)
    return _in_process(cfg, model, data, out, tmp, resume, progress, log, on_round)


def _in_process(cfg, model, data, out, tmp, resume, progress, log, on_round) -> Result:
    """The run on the in-process engine, and its :class:`Result`."""
    built: dict[str, Any] = {}
    with warnings.catch_warnings():
        # the per-record gradient path in use is part of the result (Result.grad_path)
        warnings.filterwarnings("ignore", message="per-record gradients fall back")
        try:
            res = engine.run(
                cfg, out_dir=out, resume=resume, progress=progress, log=log,
                config_source="python", model_fn=model, site_data=data, on_round=on_round,
                built=built,
            )  # fmt: skip
        except RunInterrupted as err:
            if tmp is None:
                raise
            # a temporary directory goes with this call: nothing is kept to resume
            raise RunInterrupted(err.rounds, None) from None
    fed = built["federation"]
    return _result(
        res, built["server"], fed.model, fed.sites[0].fm, fed.sites[0].fm.grad_path, out, tmp,
        user_model=model is not None, user_data=data,
    )  # fmt: skip


def _over_flower(cfg, model, data, runtime, out, tmp, resume, flower: dict) -> Result:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="per-record gradients fall back")
        try:
            res, server, module, fm, path = run_over_flower(
                cfg, model, data, runtime=runtime, out=out, resume=resume, **flower
            )
        except RunInterrupted as err:
            if tmp is None:
                raise
            raise RunInterrupted(err.rounds, None) from None
    return _result(
        res, server, module, fm, path, out, tmp,
        user_model=model is not None, user_data=data,
    )  # fmt: skip


def _result(
    run: RunResult, server, module: nn.Module, fm, grad_path: str, out: Path, tmp, *,
    user_model: bool, user_data: list | None,
) -> Result:  # fmt: skip
    """The :class:`Result`; results.json and report.md say what model and records ran."""
    res = run.results
    record_what_ran(res, out, module, user_model=user_model, user_data=user_data)
    theta = server.theta.detach().cpu().clone()
    result = Result(
        results=res,
        directory=out,
        model=_trained_model(module, fm, theta),
        theta=theta,
        samples=[t.detach().cpu().clone() for t in server.posterior.samples],
        grad_path=grad_path,
        _flat=fm,
        _keep=tmp,
    )
    if tmp is not None:
        weakref.finalize(result, tmp.cleanup)
    return result


__all__ = ["make_config", "simulate"]
