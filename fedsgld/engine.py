"""The in-process engine: K sites and the server on one machine, same maths as Flower.

``run(config)`` loads the data, splits it into hospital-style sites, and runs rounds of
``LangevinServer.plan`` -> ``Site.clipped_sum`` (every site) -> ``LangevinServer.apply``
until the round limit or the privacy budget stops it. Everything around the maths (the
result directory, the ledger written before each step's noise is drawn, checkpoints,
resume with fresh noise, the evaluation schedule, results.json) is
:class:`fedsgld.run.lifecycle.RunLifecycle`, which the Flower ServerApp drives too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedsgld.calibration import calibration_report
from fedsgld.clients.site import Site
from fedsgld.config import Config
from fedsgld.core.noise import Randomness, os_seed
from fedsgld.data import describe_sites, load_dataset, make_sites
from fedsgld.data.datasets import subsample
from fedsgld.models import build_model
from fedsgld.run.lifecycle import (  # noqa: F401 - re-exported for older imports
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
from fedsgld.strategies import LangevinServer, PosteriorSamples


def variational_view(config: Config, model: torch.nn.Module):
    """For VI methods the sites' parameter view phi = [mu, rho] over ``model``; else None
    (the plain view theta). The engine and the Flower apps both build sites with it."""
    if not config.privacy.variational:
        return None
    from fedsgld.vi import VariationalModel

    run = config.run
    return VariationalModel(model, init_std=run.vi_init_std, predict_samples=run.vi_samples)


def posterior_samples(config: Config) -> PosteriorSamples:
    """The server's collector of kept iterates, fitting SWAG too where it applies (not for
    variational methods, whose iterates are the parameters of a distribution)."""
    run = config.run
    swag = run.swag_rank if run.swag_samples > 0 and not config.privacy.variational else None
    return PosteriorSamples(
        burn_in=run.burn_in, thin=run.thin, max_samples=run.max_samples, swag_rank=swag
    )


#: key of the validation split's permutation (beside the calibration split's RECAL_STREAM)
VALIDATION_STREAM = 0x7A1


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
        if run.max_records:
            ds = subsample(ds, run.max_records, seed=self.seed)
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
        # held out of each site's training split: a validation split for hyper-parameter
        # selection (carved first, so a run with and without recalibration validates alike),
        # then a calibration split for private recalibration
        from fedsgld.calibration.recal import RECAL_STREAM

        self.val_data = self._hold_out("validation_fraction", VALIDATION_STREAM, "validation", log)
        self.cal_data = self._hold_out("recal_fraction", RECAL_STREAM, "calibration", log)
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

    def _hold_out(
        self, setting: str, stream: int, name: str, log: Callable[[str], None]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Move ``setting`` (a fraction) of every site's training records to a held-out
        split, chosen by a permutation keyed by (seed, ``stream``, site); returns the
        splits' (records, labels), [] when the fraction is 0."""
        from dataclasses import replace

        from fedsgld.calibration.recal import carve_split

        fraction = getattr(self.config.run, setting)
        if fraction == 0:
            return []
        held, kept = [], []
        for d in self.site_data:
            keep, out = carve_split(
                int(d.x_train.shape[0]), fraction, seed=self.seed, site_id=d.site_id,
                stream=stream, setting=setting,
            )  # fmt: skip
            held.append((d.x_train[out], d.y_train[out]))
            kept.append(replace(d, x_train=d.x_train[keep], y_train=d.y_train[keep]))
        self.site_data = kept
        log(
            f"{name} splits (held out of training): "
            + ", ".join(
                f"site {d.site_id}: {int(y.shape[0])}" for d, (_, y) in zip(kept, held, strict=True)
            )
        )
        return held

    def _split(self, site: Site, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(records, labels) of one site's ``test`` or ``validation`` split."""
        if split == "test":
            return site.x_test, site.y_test
        if split == "validation" and self.val_data:
            return self.val_data[self.sites.index(site)]
        raise ValueError(f"no {split!r} split (validation needs validation_fraction > 0)")

    @torch.no_grad()
    def _logits(self, site: Site, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([site.fm.logits(theta, xb) for xb in x.split(2048)])

    def calibration_logits(self, theta: torch.Tensor) -> list[torch.Tensor]:
        """Every site's logits of its calibration split at ``theta`` (they stay at the site)."""
        return [
            self._logits(s, theta, x) for s, (x, _) in zip(self.sites, self.cal_data, strict=True)
        ]

    def evaluate_temperature(
        self, theta: torch.Tensor, temperature: float, split: str = "test"
    ) -> dict[str, Any]:
        """calibration_report per site and pooled of softmax(logits(theta) / temperature)."""
        return self._report(
            lambda s, x: torch.softmax(self._logits(s, theta, x).double() / temperature, -1),
            split,
        )

    def _report(self, predict, split: str) -> dict[str, Any]:
        per_site, all_p, all_y = {}, [], []
        for s in self.sites:
            x, y = self._split(s, split)
            p = predict(s, x)
            per_site[str(s.site_id)] = calibration_report(p.numpy(), y.numpy())
            p = p.float()
            all_p.append(p)
            all_y.append(y)
        probs, labels = torch.cat(all_p), torch.cat(all_y)
        return {
            "pooled": calibration_report(probs.numpy(), labels.numpy()),
            "sites": per_site,
            "_probs": probs,
            "_labels": labels,
            "_site_probs": {
                s.site_id: (p, y) for s, p, y in zip(self.sites, all_p, all_y, strict=False)
            },
        }

    def _backbone_features(self, d):
        """Replace a site's images by frozen-backbone features (computed once, cached on disk)."""
        from dataclasses import replace

        from fedsgld.models.backbone import cached_features

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
            posterior=posterior_samples(self.config),
            on_spend=on_spend,
            prior_std=run.prior_std,
            optimizer=run.optimizer,
            randomness=randomness,
        )

    def evaluate(self, thetas: list[torch.Tensor], split: str = "test") -> dict[str, Any]:
        """calibration_report per site and pooled for the mean softmax over ``thetas``, on
        the sites' ``test`` (default) or ``validation`` splits."""
        return self._report(lambda s, x: s.predict(thetas, x=x), split)

    def site_table(self) -> list[dict[str, Any]]:
        rows = [
            {
                "site": d.site_id,
                "n_train": int(d.x_train.shape[0]),
                "n_test": int(d.x_test.shape[0]),
                "label_histogram": d.label_histogram("train"),
            }
            for d in self.site_data
        ]
        for row, (_, y) in zip(rows, self.cal_data, strict=False):
            row["n_calibration"] = int(y.shape[0])
        for row, (_, y) in zip(rows, self.val_data, strict=False):
            row["n_validation"] = int(y.shape[0])
        return rows


def recalibrate(lc: RunLifecycle, fed: Federation, server: LangevinServer) -> None:
    """Private temperature scaling of the last iterate over the sites' calibration splits
    (:mod:`fedsgld.calibration.recal`); the lifecycle keeps the ledger and draws the noise."""
    from fedsgld.calibration.recal import RECAL_STREAM, RecalPlan, site_temperature_sum

    plan = RecalPlan.from_config(lc.config)
    logits: list[torch.Tensor] = []

    def site_sums(log_t: float, j: int) -> list[torch.Tensor]:
        if not logits:  # the final model's logits, computed once per site
            logits.extend(fed.calibration_logits(server.theta))
        return [
            site_temperature_sum(
                z,
                y,
                log_t=log_t,
                sample_rate=plan.sample_rate,
                clip=plan.clip,
                generator=s.randomness.generator(1 + s.site_id, RECAL_STREAM, j, 0),
            )
            for s, z, (_, y) in zip(fed.sites, logits, fed.cal_data, strict=True)
        ]

    lc.recalibrate(site_sums, calibration_sizes=[int(y.shape[0]) for _, y in fed.cal_data])


def run(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    config_source: str | None = None,
    audit=None,
) -> dict[str, Any]:
    """Run one federation in-process and write its result directory. Returns results.json's dict
    (plus ``out_dir`` and the in-memory evaluations under ``_eval``). ``audit``: a
    :class:`fedsgld.studies.audit.CanaryAudit`, which adds its canaries and sees every release."""
    lc = RunLifecycle(config, out=out_dir, resume=resume, transport="in-process", log=log)
    fed = Federation(lc.config, log=log, randomness=lc.site_randomness)
    server = fed.make_server(randomness=lc.server_randomness())
    lc.attach(server)
    config = lc.config
    if audit is not None:
        audit.attach(fed, server)

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
            if audit is not None:
                audit.released(plan, server, [th for _, th in thetas])
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
            if audit is not None:
                audit.released(plan, server)
        return plan

    def evaluate(groups: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, Any]]:
        return {name: fed.evaluate(thetas) for name, thetas in groups.items()}

    lc.train(one_round, evaluate, progress=progress)
    evaluate_recal = validate_recal = validate = None
    if fed.cal_data:
        recalibrate(lc, fed, server)
        evaluate_recal = lambda temperature: fed.evaluate_temperature(server.theta, temperature)  # noqa: E731
    if fed.val_data:

        def validate(groups: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, Any]]:
            return {name: fed.evaluate(thetas, "validation") for name, thetas in groups.items()}

        if fed.cal_data:
            validate_recal = lambda t: fed.evaluate_temperature(server.theta, t, "validation")  # noqa: E731
    results, last, post = lc.finish(
        evaluate,
        sites=fed.site_table(),
        config_source=config_source,
        evaluate_recal=evaluate_recal,
        validate=validate,
        validate_recal=validate_recal,
    )
    # in-memory predictions (not in the file): "last", "posterior" and the derived models
    results["_eval"] = {"posterior": post, **lc.evaluations, "last": last}
    return results
