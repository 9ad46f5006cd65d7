"""The in-process engine: K sites and the server on one machine, same maths as Flower.

``run(config)`` loads the data, splits it into hospital-style sites, and runs rounds of
``LangevinServer.plan`` -> ``Site.clipped_sum`` (every site) -> ``LangevinServer.apply``
until the round limit or the privacy budget stops it. Everything around the maths (the
result directory, the ledger written before each step's noise is drawn, checkpoints,
resume with fresh noise, the evaluation schedule, results.json) is
:class:`fedsgld.lifecycle.RunLifecycle`, which the Flower ServerApp drives too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .calibration import calibration_report
from .clients import Site
from .config import Config
from .data import describe_sites, load_dataset, make_sites
from .lifecycle import (  # noqa: F401 - re-exported for older imports
    CHECKPOINT,
    LEDGER,
    RESULTS,
    RunLifecycle,
    atomic_write,
    metrics_block,
    new_run_dir,
    round_time_summary,
    write_json,
)
from .models import build_model
from .privacy.noise import Randomness, os_seed
from .strategies import LangevinServer, PosteriorSamples


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

    def __init__(
        self,
        config: Config,
        *,
        log: Callable[[str], None] = print,
        randomness: Callable[[], Randomness] | None = None,
    ) -> None:
        """``randomness()`` gives each site its own :class:`Randomness` (default: seeded
        from the config's seed, a simulation)."""
        self.config = config
        run, perf = config.run, config.perf
        if perf.threads:
            torch.set_num_threads(perf.threads)
        # the sites compute on this device (variational models stay on the CPU); the
        # server's update is one vector per round and stays on the CPU
        self.device = perf.torch_device()
        if config.privacy.variational and self.device.type != "cpu":
            log(f"device {self.device}: variational methods run on the CPU")
            self.device = torch.device("cpu")
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
                randomness=randomness() if randomness is not None else None,
                device=self.device,
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

    def make_server(self, on_spend=None, randomness: Randomness | None = None) -> LangevinServer:
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
            randomness=randomness,
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


def run(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    config_source: str | None = None,
) -> dict[str, Any]:
    """Run one federation in-process and write its result directory. Returns results.json's dict
    (plus ``out_dir`` and the in-memory evaluations under ``_eval``)."""
    lc = RunLifecycle(config, out=out_dir, resume=resume, transport="in-process", log=log)
    fed = Federation(lc.config, log=log, randomness=lc.site_randomness)
    server = fed.make_server(randomness=lc.server_randomness())
    lc.attach(server)
    config = lc.config

    def one_round():
        plan = server.plan()
        if plan is None:
            return None
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
                        weight_decay=config.run.weight_decay,
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
        return plan

    def evaluate(groups: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, Any]]:
        return {name: fed.evaluate(thetas) for name, thetas in groups.items()}

    lc.train(one_round, evaluate, progress=progress)
    results, last, post = lc.finish(evaluate, sites=fed.site_table(), config_source=config_source)
    results["_eval"] = {"last": last, "posterior": post}  # in-memory predictions, not in the file
    return results
