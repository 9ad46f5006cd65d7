"""The in-process engine: K sites and the server on one machine, same maths as Flower.

``run(config)`` loads the data, splits it into hospital-style sites, and runs rounds of
``LangevinServer.plan`` -> ``Site.clipped_sum`` (every site) -> ``LangevinServer.apply``
until the round limit or the privacy budget stops it. It writes one result directory:
``results.json``, ``report.md``, PNG plots, ``checkpoint.pt`` and ``ledger.json``.

Crash safety: ``ledger.json`` (the accountant's ledger) is written BEFORE each step's noise
is drawn, and survives the checkpoint it may be ahead of. ``resume=True`` restarts from the
last checkpoint with the ledger from ``ledger.json``, so steps taken after that checkpoint
stay counted: a resumed run never spends the same budget twice (it may spend a little on
steps whose output was lost, which is the conservative direction).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import __version__
from .calibration import calibration_report
from .clients import Site
from .config import Config
from .data import describe_sites, load_dataset, make_sites
from .models import build_model
from .privacy import PrivacyAccountant
from .privacy.noise import os_seed
from .strategies import LangevinServer, PosteriorSamples

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RESULTS = "results.json"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _finite(obj: Any) -> Any:
    """Strict JSON: non-finite floats become null (e.g. SGD's epsilon, an undefined AUC)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def write_json(path: Path, obj: Any) -> None:
    """Write strict JSON atomically (non-finite floats as null)."""

    def _w(p: Path) -> None:
        with p.open("w") as fh:
            json.dump(_finite(obj), fh, indent=2, default=_json_default, allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())

    _atomic_write(path, _w)


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def new_run_dir(base: str | Path = "runs", tag: str = "run") -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(base) / f"{stamp}-{tag}"
    i = 1
    while d.exists():
        d = Path(base) / f"{stamp}-{tag}-{i}"
        i += 1
    return d


def variational_view(config: Config, model: torch.nn.Module):
    """For VI methods the sites' parameter view phi = [mu, rho] over ``model``; else None
    (the plain view theta). The engine and the Flower apps both build sites with it."""
    if not config.privacy.variational:
        return None
    from .vi import VariationalModel

    run = config.run
    return VariationalModel(model, init_std=run.vi_init_std, predict_samples=run.vi_samples)


class Federation:
    """Sites + server built from a :class:`Config` (shared by the engine and the Flower apps)."""

    def __init__(self, config: Config, *, log: Callable[[str], None] = print) -> None:
        self.config = config
        run, perf = config.run, config.perf
        if perf.threads:
            torch.set_num_threads(perf.threads)
        if run.seed == -1:
            self.seed, self.seed_source = os_seed(), "os"
        else:
            self.seed, self.seed_source = run.seed, "config"
        ds = load_dataset(run.dataset, path=run.data_path or None, seed=self.seed)
        self.num_classes = ds.num_classes
        self.site_data = make_sites(
            ds,
            sites=run.sites,
            scheme=run.partition,
            alpha=run.dirichlet_alpha,
            test_fraction=run.test_fraction,
            seed=self.seed,
        )
        log(describe_sites(self.site_data))
        if run.model == "timm_head":
            self.site_data = [self._backbone_features(d) for d in self.site_data]
        input_shape = tuple(self.site_data[0].x_train.shape[1:])
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            self.model = build_model(
                run.model, input_shape=input_shape, num_classes=ds.num_classes, hidden=run.hidden
            )
        self.sites = [
            Site.from_site_data(
                d,
                self.model,
                seed=self.seed,
                chunk_size=perf.chunk_size,
                flat_model=self.flat_model(),
            )
            for d in self.site_data
        ]

    def flat_model(self):
        """The parameter view each site computes gradients in: theta, or phi = [mu, rho] for VI."""
        return variational_view(self.config, self.model)

    def _backbone_features(self, d):
        """Replace a site's images by frozen-backbone features (computed once, cached on disk)."""
        from dataclasses import replace

        from .models.backbone import cached_features

        run = self.config.run
        kw = dict(
            name=run.backbone, weights=run.backbone_weights or None, image_size=run.image_size
        )
        return replace(
            d, x_train=cached_features(d.x_train, **kw), x_test=cached_features(d.x_test, **kw)
        )

    def make_server(self, on_spend=None) -> LangevinServer:
        run = self.config.run
        return LangevinServer(
            self.config.privacy,
            theta=self.sites[0].fm.flatten(),
            site_sizes=[s.num_train for s in self.sites],
            seed=self.seed,
            rounds=run.rounds,
            weight_decay=run.weight_decay,
            posterior=PosteriorSamples(
                burn_in=run.burn_in, thin=run.thin, max_samples=run.max_samples
            ),
            on_spend=on_spend,
            prior_std=run.prior_std,
            optimizer=run.optimizer,
        )

    def evaluate(self, thetas: list[torch.Tensor]) -> dict[str, Any]:
        """calibration_report per site and pooled for the mean softmax over ``thetas``."""
        per_site, all_p, all_y = {}, [], []
        for s in self.sites:
            p = s.predict(thetas)
            per_site[str(s.site_id)] = calibration_report(p.numpy(), s.y_test.numpy())
            all_p.append(p)
            all_y.append(s.y_test)
        probs, labels = torch.cat(all_p), torch.cat(all_y)
        return {
            "pooled": calibration_report(probs.numpy(), labels.numpy()),
            "sites": per_site,
            "_probs": probs,
            "_labels": labels,
            "_site_probs": {
                s.site_id: (p, s.y_test) for s, p in zip(self.sites, all_p, strict=False)
            },
        }

    def site_table(self) -> list[dict[str, Any]]:
        return [
            {
                "site": d.site_id,
                "n_train": int(d.x_train.shape[0]),
                "n_test": int(d.x_test.shape[0]),
                "label_histogram": d.label_histogram("train"),
            }
            for d in self.site_data
        ]


def metrics_block(
    server: LangevinServer, last: dict[str, Any], post: dict[str, Any] | None
) -> dict[str, Any]:
    """results.json's ``metrics``: the last iterate's and the posterior average's reports."""
    return {
        "pooled": last["pooled"],
        "sites": last["sites"],
        "posterior": None
        if post is None
        else {
            "pooled": post["pooled"],
            "sites": post["sites"],
            "samples": len(server.posterior),
            "sample_steps": list(server.posterior.steps),
        },
    }


def round_time_summary(round_times: list[float]) -> dict[str, Any]:
    """Wall time of the training rounds; the first includes warm-up (first calls, caches)."""
    n = len(round_times)
    return {
        "count": n,
        "mean": sum(round_times) / n if n else None,
        "first": round_times[0] if n else None,
        "mean_after_first": sum(round_times[1:]) / (n - 1) if n > 1 else None,
    }


def _privacy_block(server: LangevinServer, config: Config) -> dict[str, Any]:
    p = config.privacy
    block: dict[str, Any] = {
        "method": p.method,
        "settings": {k: v for k, v in config.to_dict()["privacy"].items()},
        "delta": p.delta,
        "budget": p.epsilon if p.private else None,
        "steps": server.t,
        "noise_placement": p.noise_placement,
        "local_steps": server.local_steps,
        "halted": bool(server.halt_reason and server.halt_reason.startswith("privacy budget")),
        "halt_reason": server.halt_reason,
    }
    if server.accountant is None:
        block.update(
            ledger=[],
            epsilon={"gdp": float("inf"), "pld": float("inf"), "rdp": float("inf")},
            note=f"method '{p.method}' adds no noise and has no privacy guarantee",
        )
        return block
    acc = server.accountant
    block.update(
        ledger=[list(e) for e in acc.ledger],
        ledger_steps=acc.steps,
        epsilon=acc.epsilon(),
        rigorous_accountant=acc.rigorous_name,
        note=(
            "epsilon['gdp'] is the Gaussian-DP CLT of the paper: asymptotic, it can "
            "under-estimate epsilon; the budget is checked with the rigorous accountant "
            f"'{acc.rigorous_name}'. Sigma is rounded down to a {p.sigma_grid:g} relative grid "
            "for accounting (conservative). ledger_steps can exceed steps after a resume: "
            "steps whose output was lost in a crash stay counted."
            + (
                f" Noise at the sites: 'steps' counts rounds of {server.local_steps} local steps; "
                "the ledger is each site's own (every site uses the same q and sigma_t, so it "
                "is also the worst site's)."
                if server.local
                else ""
            )
        ),
    )
    return block


def run(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    config_source: str | None = None,
) -> dict[str, Any]:
    """Run one federation in-process and write its result directory. Returns results.json's dict."""
    from tqdm.auto import tqdm

    from .results import write_outputs

    t_start = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else new_run_dir(tag=config.privacy.method)
    if resume:
        if not (out / CHECKPOINT).is_file():
            raise ValueError(f"resume: no {CHECKPOINT} in {str(out)!r}")
    elif (out / CHECKPOINT).exists() or (out / LEDGER).exists():
        raise ValueError(
            f"output directory {str(out)!r} already holds a run; pass resume (--resume) or "
            "choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)

    ckpt = None
    if resume:
        ckpt = torch.load(out / CHECKPOINT, weights_only=False)
        if ckpt["config"] != {k: v for k, v in config.flat().items() if k not in ("threads",)}:
            raise ValueError(
                "resume: the config differs from the checkpoint's; resume with the same config"
            )
        if config.run.seed == -1:  # keep the OS-drawn seed of the original run
            config = Config.from_flat({**config.flat(), "seed": int(ckpt["seed"])})

    fed = Federation(config, log=log)
    ledger_path = out / LEDGER

    def persist_ledger(acc: PrivacyAccountant) -> None:
        write_json(ledger_path, acc.state_dict())

    server = fed.make_server(on_spend=persist_ledger)
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        server.load_state_dict(ckpt["server"])
        history = ckpt["history"]
        if server.accountant is not None and ledger_path.is_file():
            server.accountant.load_state_dict(json.loads(ledger_path.read_text()))
        log(
            f"resumed at round {server.t}; ledger holds {server.accountant.steps if server.accountant else 0} steps"
        )

    def checkpoint() -> None:
        state = {
            "config": {k: v for k, v in config.flat().items() if k not in ("threads",)},
            "seed": fed.seed,
            "server": server.state_dict(),
            "history": history,
            "ledger": server.accountant.state_dict() if server.accountant else None,
        }
        _atomic_write(out / CHECKPOINT, lambda p: torch.save(state, p))

    affordable = server.affordable_rounds()
    if server.accountant is not None:
        log(
            f"budget epsilon={config.privacy.epsilon:g} at delta={config.privacy.delta:g} "
            f"({server.accountant.rigorous_name}) allows {affordable} of the remaining "
            f"{config.run.rounds - server.t} rounds"
        )
    run_cfg = config.run
    bar = tqdm(
        total=run_cfg.rounds, initial=server.t, disable=not progress, desc=config.privacy.method
    )
    last_eps, last_loss = 0.0, float("nan")
    last_plan = None

    def record(t: int, plan) -> tuple[float, float]:
        ev = fed.evaluate([server.theta])["pooled"]
        eps = server.accountant.rigorous_epsilon() if server.accountant else float("inf")
        history.append(
            {
                "round": t,
                "step_size": plan.step_size,
                "sigma": plan.sigma,
                "epsilon": eps,
                "test_nll": ev["nll"],
                "test_accuracy": ev["accuracy"],
                "test_ece": ev["ece"],
            }
        )
        return eps, ev["nll"]

    round_times: list[float] = []
    while (plan := server.plan()) is not None:
        t_round = time.perf_counter()
        if server.local:  # noise at the sites: local steps, then the average
            server.begin_local_round(plan)  # the ledger first: the sites release noisy iterates
            thetas = [
                (
                    s.num_train,
                    s.local_round(
                        server.theta,
                        first_step=plan.first_step,
                        local_steps=plan.local_steps,
                        privacy=config.privacy,
                        weight_decay=run_cfg.weight_decay,
                    ),
                )
                for s in fed.sites
            ]
            server.finish_local_round(plan, thetas)
        else:
            sums = [
                s.clipped_sum(
                    server.theta,
                    round=plan.round,
                    sample_rate=plan.sample_rate,
                    clip=plan.clip,
                    prenoise=plan.prenoise,
                )
                for s in fed.sites
            ]
            server.apply(plan, sums)
        t = server.t
        last_plan = plan
        if run_cfg.eval_every and (t % run_cfg.eval_every == 0 or t == run_cfg.rounds):
            last_eps, last_loss = record(t, plan)
        if run_cfg.checkpoint_every and t % run_cfg.checkpoint_every == 0:
            checkpoint()
        round_times.append(time.perf_counter() - t_round)
        bar.set_postfix(eps=f"{last_eps:.3f}", loss=f"{last_loss:.3f}", refresh=False)
        bar.update(1)
    bar.close()
    if (
        run_cfg.eval_every
        and last_plan is not None
        and (not history or history[-1]["round"] != server.t)
    ):
        record(server.t, last_plan)  # the point where the budget (or a crash-resume) ended it
    log(f"stopped after {server.t} rounds: {server.halt_reason}")
    checkpoint()

    last = fed.evaluate([server.theta])
    post = fed.evaluate(list(server.posterior.samples)) if len(server.posterior) else None
    results = {
        "fedsgld_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config_source": config_source,
        "config": config.flat(),
        "seed": fed.seed,
        "seed_source": fed.seed_source,
        "engine": "in-process",
        "privacy": _privacy_block(server, config),
        "sites": fed.site_table(),
        "history": history,
        "metrics": metrics_block(server, last, post),
        "wall_time_s": time.perf_counter() - t_start,
        "round_wall_time_s": round_time_summary(round_times),
    }
    write_outputs(out, results, last=last, posterior=post)
    log(f"results in {out}")
    results["out_dir"] = str(out)
    results["_eval"] = {"last": last, "posterior": post}  # in-memory predictions, not in the file
    return results
