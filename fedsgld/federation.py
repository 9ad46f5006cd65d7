"""The federation builder: what both transports build from one :class:`~fedsgld.config.Config`:
the sites' records (validation and calibration splits held out), the seeded model, the
parameter view, the sites and the server. The engine builds it whole (:class:`Federation`);
over Flower each SuperNode builds its own sites and the ServerApp the server, from the same
functions, so a seeded Flower run and the engine see the same records and updates.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedsgld.calibration import recal
from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.secure_site import SecureSumSite
from fedsgld.clients.site import Site
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.config import Config
from fedsgld.core import streams
from fedsgld.core.mechanism import FlatModel
from fedsgld.core.noise import Randomness, os_seed
from fedsgld.data import SiteData, describe_sites, load_dataset, make_sites
from fedsgld.data.centres import centre_sites
from fedsgld.data.datasets import ArrayDataset, subsample
from fedsgld.data.standardize import released_standardize, site_standardize
from fedsgld.models import build_model
from fedsgld.models.backbone import cached_features
from fedsgld.secagg.identity import ephemeral_credentials
from fedsgld.secagg.workers import EncodeWorkers
from fedsgld.strategies import LangevinServer, PosteriorSamples
from fedsgld.vi import VariationalModel

Log = Callable[[str], None]

# -- the model and the parameter view ----------------------------------------------------


ModelFactory = Callable[[], torch.nn.Module]


def seeded_model(
    config: Config,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    seed: int,
    model_fn: ModelFactory | None = None,
) -> torch.nn.Module:
    """The run's model, its initial weights drawn from ``seed`` (the same in every process):
    ``model_fn()`` (a user's own module) or the built-in model the config names.

    Only the CPU generator is seeded (the model is built on the CPU), inside a fork of the
    random state, so the caller's own random draws are untouched; seeding every
    accelerator's generator too would cost a share of each site task's start."""
    run = config.run
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        if model_fn is not None:
            model = model_fn()
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"model: the factory must return a torch.nn.Module, got {type(model).__name__}"
                )
            return model
        return build_model(
            run.model, input_shape=input_shape, num_classes=num_classes, hidden=run.hidden
        )


def variational_view(config: Config, model: torch.nn.Module) -> VariationalModel | None:
    """For VI methods the sites' parameter view phi = [mu, rho] over ``model``; else None
    (the plain view theta)."""
    if not config.privacy.variational:
        return None
    run = config.run
    return VariationalModel(model, init_std=run.vi_init_std, predict_samples=run.vi_samples)


def initial_theta(
    config: Config,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    model_fn: ModelFactory | None = None,
) -> torch.Tensor:
    """theta_0 (phi_0 for VI): the seeded model's parameters in the sites' view, as the
    server starts from them (on the CPU); ``model_fn``: a user's model factory."""
    model = seeded_model(config, input_shape, num_classes, seed=config.run.seed, model_fn=model_fn)
    return (variational_view(config, model) or FlatModel(model)).flatten()


# -- the sites ---------------------------------------------------------------------------


def site_device(config: Config) -> torch.device:
    """Where a site computes: the ``device`` setting; variational models stay on the CPU
    (without looking for a GPU)."""
    if config.privacy.variational:
        return torch.device("cpu")
    return config.perf.torch_device()


def build_site(
    config: Config,
    data: Any,
    model: torch.nn.Module,
    *,
    seed: int,
    device: torch.device,
    randomness: Randomness | None = None,
) -> Site:
    """A site over ``data`` (its ``site_id`` and train/test records) computing in the
    run's parameter view of ``model``; ``randomness`` None: seeded from ``seed``."""
    return Site.from_site_data(
        data,
        model,
        seed=seed,
        chunk_size=config.perf.chunk_size,
        flat_model=variational_view(config, model),
        randomness=randomness,
        device=device,
    )


def backbone_features(config: Config, data: Any) -> Any:
    """``data`` (a site's records) with its images replaced by frozen-backbone features
    (computed once, cached on disk): the inputs of the ``timm_head`` model."""
    run = config.run
    kw = dict(name=run.backbone, weights=run.backbone_weights or None, image_size=run.image_size)
    return replace(
        data,
        x_train=cached_features(data.x_train, **kw),
        x_test=cached_features(data.x_test, **kw),
    )


# -- the data split ----------------------------------------------------------------------


Split = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DataSplit:
    """A run's records as the sites hold them: each site's training records (less the
    held-out splits) and test records, and every site's held-out (records, labels) for
    validation and calibration ([] when their fraction is 0)."""

    site_data: list[SiteData]
    num_classes: int
    val_data: Split
    cal_data: Split


def hold_out(
    config: Config, site_data: list[SiteData], *, seed: int, setting: str, log: Log
) -> tuple[list[SiteData], Split]:
    """Move ``setting`` (``validation_fraction`` or ``recal_fraction``) of every site's
    training records to a held-out split, chosen by a permutation keyed by (seed, the
    split's stream, site); returns the sites' remaining records and the splits' (records,
    labels), [] (nothing moved) when the fraction is 0."""
    fraction = getattr(config.run, setting)
    if fraction == 0:
        return site_data, []
    stream, name = {
        "validation_fraction": (streams.VALIDATION_STREAM, "validation"),
        "recal_fraction": (streams.RECAL_STREAM, "calibration"),
    }[setting]
    held, kept = [], []
    for d in site_data:
        keep, out = recal.carve_split(
            int(d.x_train.shape[0]), fraction, seed=seed, site_id=d.site_id,
            stream=stream, setting=setting,
        )  # fmt: skip
        held.append((d.x_train[out], d.y_train[out]))
        kept.append(replace(d, x_train=d.x_train[keep], y_train=d.y_train[keep]))
    log(
        f"{name} splits (held out of training): "
        + ", ".join(
            f"site {d.site_id}: {int(y.shape[0])}" for d, (_, y) in zip(kept, held, strict=True)
        )
    )
    return kept, held


def run_dataset(config: Config, *, seed: int) -> ArrayDataset:
    """The run's dataset as the sites split it: loaded from ``seed`` (local files only),
    subsampled to ``max_records`` where set."""
    run = config.run
    ds = load_dataset(run.dataset, path=run.data_path or None, seed=seed)
    if run.max_records:
        ds = subsample(ds, run.max_records, seed=seed)
    return ds


def split_data(
    config: Config,
    *,
    seed: int,
    log: Log,
    only: Collection[int] | None = None,
    dataset: ArrayDataset | None = None,
) -> DataSplit:
    """Load the run's dataset and split it into sites, all from ``seed``: the same split on
    every machine that has the dataset.

    The validation split is carved first, then the calibration split, so a run with and
    without recalibration validates alike. ``only``: just these sites (a node's), with the
    same records as in the whole split (the partition is drawn over the whole dataset; the
    other sites' shards are neither split, copied nor featurised). ``dataset``: the
    run's dataset already loaded (:func:`run_dataset`)."""
    run = config.run
    if run.partition == "centres":  # the dataset's own centres and split
        site_data = centre_sites(run.dataset, only=only)
        num_classes = site_data[0].num_classes
    else:
        ds = run_dataset(config, seed=seed) if dataset is None else dataset
        num_classes = ds.num_classes
        site_data = make_sites(
            ds,
            sites=run.sites,
            scheme=run.partition,
            alpha=run.dirichlet_alpha,
            test_fraction=run.test_fraction,
            seed=seed,
            only=only,
        )
    log(describe_sites(site_data))
    if run.model == "timm_head":
        site_data = [backbone_features(config, d) for d in site_data]
    site_data = standardize_at_sites(config, site_data, log=log)
    site_data, val_data = hold_out(
        config, site_data, seed=seed, setting="validation_fraction", log=log
    )
    site_data, cal_data = hold_out(config, site_data, seed=seed, setting="recal_fraction", log=log)
    return DataSplit(site_data, num_classes, val_data, cal_data)


def standardize_at_sites(config: Config, site_data: list[Any], *, log: Log) -> list[Any]:
    """``standardize = "site"``: every site's records standardised by its own training
    records' mean and std (:func:`fedsgld.data.standardize.site_standardize`, at the site,
    nothing released); the other settings leave the records as they are (``pooled`` is a
    release the run makes once its ledger exists: :mod:`fedsgld.run.standardization`; a
    Flower run's sites apply the statistics its server released, ``standardize_stats``)."""
    p = config.privacy
    if p.standardize == "pooled":
        return with_released_statistics(config, site_data)
    if p.standardize != "site":
        return site_data
    log("standardize = 'site': each site's features by its own training mean and std")
    return [site_standardize(d) for d in site_data]


def with_released_statistics(config: Config, site_data: list[Any]) -> list[Any]:
    """``site_data`` standardised by the pooled statistics a Flower run's server released
    (``standardize_stats``); as they are before the release (or without ``pooled``)."""
    stats = config.privacy.standardize_stats
    if config.privacy.standardize != "pooled" or not stats:
        return site_data
    return [released_standardize(d, stats) for d in site_data]


def user_split(config: Config, site_data: list[SiteData], *, seed: int, log: Log) -> DataSplit:
    """A :class:`DataSplit` over sites a user built (:func:`fedsgld.data.user.user_sites`),
    with the validation and calibration splits held out as for a built-in dataset."""
    log(describe_sites(site_data))
    site_data = standardize_at_sites(config, site_data, log=log)
    site_data, val_data = hold_out(
        config, site_data, seed=seed, setting="validation_fraction", log=log
    )
    site_data, cal_data = hold_out(config, site_data, seed=seed, setting="recal_fraction", log=log)
    return DataSplit(site_data, site_data[0].num_classes, val_data, cal_data)


def resolve_seed(config: Config) -> tuple[int, str]:
    """The run's seed and where it came from: the config's, or (seed -1) fresh entropy."""
    if config.run.seed == -1:
        return os_seed(), "os"
    return config.run.seed, "config"


# -- the server --------------------------------------------------------------------------


def posterior_samples(config: Config) -> PosteriorSamples:
    """The server's collector of kept iterates, fitting SWAG too where it applies (not for
    variational methods, whose iterates are the parameters of a distribution)."""
    run = config.run
    swag = run.swag_rank if run.swag_samples > 0 and not config.privacy.variational else None
    return PosteriorSamples(
        burn_in=run.burn_in, thin=run.thin, max_samples=run.max_samples, swag_rank=swag
    )


def make_server(
    config: Config,
    *,
    theta: torch.Tensor,
    site_sizes: list[int],
    seed: int,
    randomness: Randomness | None = None,
    on_spend: Callable[..., Any] | None = None,
    run_key: str = "",
) -> LangevinServer:
    """The run's server, starting at ``theta`` for sites of ``site_sizes`` (their public
    N_k); ``randomness`` None: its noise seeded from ``seed``. Its round mode (where the
    noise is added) is chosen from the placement, once (:mod:`fedsgld.strategies.placement`);
    ``run_key``: the run's public name (it labels secure-sum rounds)."""
    run = config.run
    return LangevinServer(
        config.privacy,
        theta=theta,
        site_sizes=site_sizes,
        seed=seed,
        rounds=run.rounds,
        weight_decay=run.weight_decay,
        posterior=posterior_samples(config),
        on_spend=on_spend,
        prior_std=run.prior_std,
        optimizer=run.optimizer,
        randomness=randomness,
        run_key=run_key,
    )


# -- the whole federation in one process -------------------------------------------------


class Federation:
    """Sites + server built from a :class:`Config` in one process (the in-process engine;
    a simulated Flower node builds its sites with it too)."""

    def __init__(
        self,
        config: Config,
        *,
        log: Log = print,
        randomness: Callable[[], Randomness] | None = None,
        model_fn: ModelFactory | None = None,
        site_data: list[SiteData] | None = None,
    ) -> None:
        """``randomness()`` gives each site its own :class:`Randomness` (default: seeded
        from the config's seed, a simulation). ``model_fn`` and ``site_data``: a user's own
        model and sites (the Python API) instead of the config's model and dataset; the
        config's ``sites`` must then equal ``len(site_data)``."""
        self.config = config
        if config.perf.threads:
            torch.set_num_threads(config.perf.threads)
        # the sites compute on this device (variational models stay on the CPU); the
        # server's update is one vector per round and stays on the CPU
        self.device = site_device(config)
        if config.privacy.variational:
            requested = config.perf.torch_device()  # checked all the same
            if requested.type != "cpu":
                log(f"device {requested}: variational methods run on the CPU")
        self.seed, self.seed_source = resolve_seed(config)
        if site_data is not None:
            if len(site_data) != config.run.sites:
                raise ValueError(f"sites: {config.run.sites} in the config, {len(site_data)} given")
            split = user_split(config, site_data, seed=self.seed, log=log)
        else:
            split = split_data(config, seed=self.seed, log=log)
        self.site_data, self.num_classes = split.site_data, split.num_classes
        self.val_data, self.cal_data = split.val_data, split.cal_data
        input_shape = tuple(self.site_data[0].x_train.shape[1:])
        self.model = seeded_model(
            config, input_shape, self.num_classes, seed=self.seed, model_fn=model_fn
        )
        self.sites = [
            build_site(
                config,
                d,
                self.model,
                seed=self.seed,
                device=self.device,
                randomness=randomness() if randomness is not None else None,
            )
            for d in self.site_data
        ]
        #: the run's child processes for the sites' secure-sum encodings (None: encoded on
        #: the round's threads); the engine sets and closes them (:func:`fedsgld.engine.run`)
        self.encode_workers: EncodeWorkers | None = None

    def make_server(
        self, on_spend=None, randomness: Randomness | None = None, run_key: str = ""
    ) -> LangevinServer:
        """The server for these sites, starting from the seeded model's parameters."""
        return make_server(
            self.config,
            theta=self.sites[0].fm.flatten(),
            site_sizes=[s.num_train for s in self.sites],
            seed=self.seed,
            randomness=randomness,
            on_spend=on_spend,
            run_key=run_key,
        )

    def secure_sites(self) -> list[SecureSumSite]:
        """Each site's guard for secure sums (``secure_aggregation = true``), built once: a
        simulated site's ledger (budget: the run's epsilon) and the run's plan bounds as its
        policy's; its shares from the operating system; fresh long-term keys for the run
        (one party plays every site, so they authenticate nobody); their encodings in
        ``encode_workers`` while the run has them."""
        if not hasattr(self, "_secure_sites"):
            p = self.config.privacy
            policy = SitePolicy.simulation(epsilon=p.epsilon, delta=p.delta)
            keys = ephemeral_credentials([s.site_id for s in self.sites])
            self._secure_sites = [
                SecureSumSite(
                    s.site_id,
                    SiteLedger(s.site_id, policy),
                    clip=p.clip,
                    max_dropouts=p.max_dropouts,
                    max_colluders=p.max_colluders,
                    credentials=keys[s.site_id],
                )
                for s in self.sites
            ]
        for guard in self._secure_sites:
            guard.use_workers(self.encode_workers)
        return self._secure_sites

    def site_table(self) -> list[dict[str, Any]]:
        """What results.json says of each site: its sizes and label histogram."""
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


__all__ = [
    "DataSplit",
    "Federation",
    "backbone_features",
    "build_site",
    "hold_out",
    "initial_theta",
    "make_server",
    "posterior_samples",
    "resolve_seed",
    "run_dataset",
    "seeded_model",
    "site_device",
    "split_data",
    "standardize_at_sites",
    "with_released_statistics",
    "user_split",
    "variational_view",
]
