"""A whole run's settings: :class:`Config` groups the privacy settings with the
performance settings (:class:`PerfSettings`: speed and memory, never results) and the rest
(:class:`RunSettings`: data, model, length, what to keep).

All are frozen dataclasses whose fields carry their one-line help; every invalid value
raises ``ValueError`` naming the setting and its valid range, before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from fedsgld.config.checks import (
    DEVICES,
    MODELS,
    OPTIMIZERS,
    PARTITIONS,
    RANDOMNESS,
    RECAL_SCOPES,
    SECURE_NOISE,
    TRACKERS,
    _choice,
    _int,
    _num,
    check_centres,
    check_neighbours,
    is_import_path,
    plain_model_name,
    setting,
    unknown_settings_message,
)
from fedsgld.config.privacy_settings import PrivacySettings

SITE_PASSES = ("auto", "per_site", "batched")
#: ``site_pass = "auto"`` batches the sites' per-record pass from this many sites up
BATCHED_FROM_SITES = 8
SECAGG_ENCODERS = ("auto", "threads", "processes")
ENCODE_PROCESSES_FROM_SITES = 8


@dataclass(frozen=True, kw_only=True)
class PerfSettings:
    """Settings that change speed and memory, never results or privacy."""

    chunk_size: int = setting(
        256, "records per vectorised per-record-gradient call (memory against speed), >= 1"
    )
    threads: int = setting(0, "torch CPU threads, in [0, 256]; 0: torch's default")
    device: str = setting(
        "cpu",
        "where the site step, the server update and evaluation run: cpu | cuda | auto (cuda "
        "when a GPU is visible, else cpu)",
    )

    site_pass: str = setting(
        "auto",
        "in-process rounds: per_site (each site's own per-record pass) | batched (one pass "
        f"over all sites' records, per-site sums; equal to float rounding) | auto (batched "
        f"from {BATCHED_FROM_SITES} sites up)",
    )

    secagg_encoders: str = setting(
        "auto",
        "in-process secure rounds: threads (the sites' encodings on the round's threads) | "
        "processes (on child processes, one per torch thread: outside the interpreter lock) "
        f"| auto (processes from {ENCODE_PROCESSES_FROM_SITES} sites up when torch has 2 or "
        "more threads)",
    )

    def __post_init__(self) -> None:
        _int("chunk_size", self.chunk_size, 1)
        _choice("site_pass", self.site_pass, SITE_PASSES)
        _choice("secagg_encoders", self.secagg_encoders, SECAGG_ENCODERS)
        _int("threads", self.threads, 0, 256)
        _choice("device", self.device, DEVICES)

    def batched_sites(self, sites: int) -> bool:
        """Whether an in-process round over ``sites`` sites takes one per-record pass."""
        if self.site_pass == "auto":
            return sites >= BATCHED_FROM_SITES
        return self.site_pass == "batched"

    def encode_processes(self, sites: int, threads: int) -> int:
        """How many child processes encode an in-process secure round's contributions over
        ``sites`` sites on ``threads`` torch threads (0: none, the round's threads do)."""
        if self.secagg_encoders == "auto":
            use = sites >= ENCODE_PROCESSES_FROM_SITES and threads >= 2
        else:
            use = self.secagg_encoders == "processes"
        return max(1, threads) if use else 0

    def torch_device(self):
        """The torch.device to run on; ValueError for ``cuda`` on a machine without a GPU."""
        # torch, imported on first use: `fedsgld --help` and `fedsgld config` must not import
        # it (tests/test_cli.py test_help_imports_no_torch)
        from fedsgld.config.device import resolve_device

        return resolve_device(self.device)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What to train on, how long, and what to keep."""

    dataset: str = setting(
        "mnist5k",
        "mnist5k | mnist | fashion_mnist | breast_cancer | pneumonia | synthetic | "
        "heart_disease (four real centres, FLamby's Fed-Heart-Disease: partition = 'centres', "
        "sites = 4)",
    )
    data_path: str = setting(
        "",
        "the dataset's local file or directory (mnist, fashion_mnist: IDX files; pneumonia: a "
        "MedMNIST .npz); empty: the dataset's default",
    )
    sites: int = setting(4, "number of sites (hospitals), in [1, 10000]")
    min_sites: int = setting(
        0,
        "fewest sites whose replies a training round needs; a round answered by fewer fails the "
        "run (naming the round, the sites that answered and why the others did not), in [0, "
        "sites]; 0: every site that joined the run",
    )
    partition: str = setting(
        "iid",
        "how records are split over the sites: iid | dirichlet (label skew) | quantity (size "
        "skew) | centres (a dataset's own real centres: heart_disease)",
    )
    dirichlet_alpha: float = setting(
        0.5, "concentration of the dirichlet and quantity partitions (smaller: more skew), > 0"
    )
    test_fraction: float = setting(
        0.2, "share of each site's records held out as its test split, in (0, 1)"
    )
    model: str = setting(
        "cnn",
        "cnn (the paper's CNN) | mlp | logreg | timm_head (a frozen timm backbone and two "
        "trainable dense layers) | package.module:function (a factory returning an "
        "nn.Module, imported where the model is built)",
    )
    backbone: str = setting(
        "efficientnet_b1", "timm model name of the frozen backbone (model timm_head)"
    )
    backbone_weights: str = setting(
        "", "local weights file of the backbone; empty: random initialisation (warned)"
    )
    image_size: int = setting(
        64, "images are resized to this for the backbone (model timm_head), in [8, 1024]"
    )
    hidden: int = setting(64, "hidden width of the mlp and timm_head models, in [1, 100000]")
    rounds: int = setting(200, "most rounds to run (the budget may halt training earlier), >= 1")
    seed: int = setting(
        0,
        "seed of the split, the initialisation and every draw, >= 0; -1: drawn from the operating "
        "system (recorded in results.json)",
    )
    weight_decay: float = setting(0.0, "L2 term lambda theta added to the averaged gradient, >= 0")
    eval_every: int = setting(
        25,
        "evaluate on the test splits every this many rounds (history.png), >= 0; 0: only at the "
        "end",
    )
    burn_in: int = setting(50, "steps before posterior samples are kept, >= 0")
    thin: int = setting(10, "keep every thin-th iterate after burn_in as a posterior sample, >= 1")
    max_samples: int = setting(
        20, "most posterior samples kept (the latest), >= 0; 0: no posterior average"
    )
    checkpoint_every: int = setting(
        50, "also write checkpoint.pt every this many rounds (for resume), >= 0; 0: only at the end"
    )
    optimizer: str = setting(
        "sgd", "update rule of dpvi and vi on the variational parameters: sgd | adam"
    )
    prior_std: float = setting(
        1.0, "std of the Gaussian prior N(0, prior_std^2 I) in the KL term (dpvi, vi), > 0"
    )
    vi_init_std: float = setting(
        0.001, "initial std of the variational posterior q (dpvi, vi), > 0"
    )
    vi_samples: int = setting(20, "draws from q averaged for predictions (dpvi, vi), in [1, 10000]")
    randomness: str = setting(
        "seeded",
        "where each party's noise and Poisson samples come from: seeded (simulations: derived "
        "from seed, reproducible, not private against anyone who knows it) | os (deployments: "
        "each party's own operating-system entropy)",
    )
    secure_noise: str = setting(
        "auto", "hardened Gaussian draws: auto (on with os randomness) | on | off"
    )
    swag_rank: int = setting(
        10,
        "SWAG (+swag): deviations of the last swag_rank kept iterates (low-rank part), in [0, "
        "1000]; 0: diagonal only",
    )
    swag_samples: int = setting(
        20, "SWAG draws averaged for the +swag model, in [0, 10000]; 0: no SWAG"
    )
    recal_fraction: float = setting(
        0.0,
        "private recalibration (+recal): share of each site's training split held out as its "
        "calibration split, in [0, 1); 0: off",
    )
    recal_lr: float = setting(1.0, "step size on log T of private recalibration, > 0")
    recal_scope: str = setting(
        "federation",
        "private recalibration: federation (one temperature over all sites' calibration "
        "splits) | site (each site its own temperature and, for two classes, bias, fitted on "
        "its own calibration split)",
    )
    max_records: int = setting(
        0,
        "use a random subset of this many of the dataset's records (drawn with the seed, "
        "before the sites split them), in [0, 100000000]; 0: every record",
    )
    validation_fraction: float = setting(
        0.0,
        "share of each site's training split held out as its validation split (every model "
        "is also evaluated there: results.json 'validation', what fedsgld sweep selects on), "
        "in [0, 1); 0: none",
    )
    tracking: str = setting(
        "none",
        "experiment tracker the run (or sweep) logs to: none | mlflow (config, per-round "
        "metrics and epsilon, halt reason, result files; pip install 'fedsgld[tracking]')",
    )
    tracking_uri: str = setting(
        "",
        "MLflow tracking URI (a server you run, http://HOST:5000, or sqlite:///PATH.db); "
        "empty: sqlite:///<the run directory's parent>/mlflow.db (nothing to start)",
    )
    tracking_experiment: str = setting("fedsgld", "MLflow experiment the runs are logged under")

    def __post_init__(self) -> None:
        _int("sites", self.sites, 1, 10_000)
        m = self.min_sites
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.sites:
            raise ValueError(
                f"min_sites must be an integer in [0, sites = {self.sites}] (0: every site), "
                f"got {self.min_sites!r}"
            )
        _choice("partition", self.partition, PARTITIONS)
        check_centres(self.dataset, self.partition, self.sites)
        _num("dirichlet_alpha", self.dirichlet_alpha, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("test_fraction", self.test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if not is_import_path(self.model):  # else a factory, imported where it is built
            _choice("model", self.model, MODELS)
        plain_model_name("backbone", self.backbone)  # read by timm: a name, never a path
        _int("image_size", self.image_size, 8, 1024)
        _int("hidden", self.hidden, 1, 100_000)
        _int("rounds", self.rounds, 1)
        _int("seed", self.seed, -1)
        _num("weight_decay", self.weight_decay, 0.0, math.inf, hi_open=True)
        _int("eval_every", self.eval_every, 0)
        _int("burn_in", self.burn_in, 0)
        _int("thin", self.thin, 1)
        _int("max_samples", self.max_samples, 0)
        _int("checkpoint_every", self.checkpoint_every, 0)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _num("prior_std", self.prior_std, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("vi_init_std", self.vi_init_std, 0.0, math.inf, lo_open=True, hi_open=True)
        _int("vi_samples", self.vi_samples, 1, 10_000)
        _choice("randomness", self.randomness, RANDOMNESS)
        _choice("secure_noise", self.secure_noise, SECURE_NOISE)
        _int("swag_rank", self.swag_rank, 0, 1000)
        _int("swag_samples", self.swag_samples, 0, 10_000)
        _num("recal_fraction", self.recal_fraction, 0.0, 1.0, hi_open=True)
        _num("recal_lr", self.recal_lr, 0.0, math.inf, lo_open=True, hi_open=True)
        _choice("recal_scope", self.recal_scope, RECAL_SCOPES)
        _int("max_records", self.max_records, 0, 100_000_000)
        _num("validation_fraction", self.validation_fraction, 0.0, 1.0, hi_open=True)
        _choice("tracking", self.tracking, TRACKERS)
        if not isinstance(self.tracking_experiment, str) or not self.tracking_experiment.strip():
            raise ValueError(
                f"tracking_experiment must be a non-empty name, got {self.tracking_experiment!r}"
            )
        if self.validation_fraction + self.recal_fraction >= 1.0:
            raise ValueError(
                f"validation_fraction + recal_fraction must be < 1 (both are held out of each "
                f"site's training split); got {self.validation_fraction:g} + "
                f"{self.recal_fraction:g}"
            )

    @property
    def secure(self) -> bool:
        """Whether DP noise is drawn with the hardened sampler."""
        if self.secure_noise == "auto":
            return self.randomness == "os"
        return self.secure_noise == "on"


@dataclass(frozen=True)
class Config:
    """A whole run: ``privacy``, ``perf`` and ``run`` settings."""

    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    perf: PerfSettings = field(default_factory=PerfSettings)
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        if self.run.recal_fraction > 0:
            if self.privacy.variational:
                raise ValueError(
                    "recal_fraction > 0 (private recalibration) needs method sgd, dpsgd or "
                    f"dpsgld, got method {self.privacy.method!r}; set recal_fraction = 0"
                )
            if self.privacy.noise_placement != "server":
                raise ValueError(
                    "recal_fraction > 0 (private recalibration) needs noise_placement = "
                    "'server'; set recal_fraction = 0 or noise_placement = 'server'"
                )

        if self.privacy.secure_aggregation:
            p, k = self.privacy, self.run.sites
            if k - p.max_dropouts - p.max_colluders < 1:
                raise ValueError(
                    "secure_aggregation = true needs max_dropouts + max_colluders in [0, sites - "
                    f"1 = {k - 1}] (at least one honest noise share), got max_dropouts = "
                    f"{p.max_dropouts}, max_colluders = {p.max_colluders}"
                )
            check_neighbours("secagg_neighbours", p.secagg_neighbours, k, p.max_dropouts,
                             p.max_colluders)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "privacy": dataclasses.asdict(self.privacy),
            "perf": dataclasses.asdict(self.perf),
            "run": dataclasses.asdict(self.run),
        }

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.to_dict().values():
            out.update(part)
        return out

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> Config:
        """Build from one flat mapping of setting names; unknown names are an error."""
        groups: dict[type, dict[str, Any]] = {
            PrivacySettings: {},
            PerfSettings: {},
            RunSettings: {},
        }
        owner = {f.name: g for g in groups for f in fields(g)}
        unknown = sorted(k for k in values if k not in owner)
        if unknown:
            raise ValueError(unknown_settings_message(unknown, owner))
        for k, v in values.items():
            cls_ = owner[k]
            ftype = next(f.type for f in fields(cls_) if f.name == k)
            if ftype == "float" and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            groups[cls_][k] = v
        return cls(
            privacy=PrivacySettings(**groups[PrivacySettings]),
            perf=PerfSettings(**groups[PerfSettings]),
            run=RunSettings(**groups[RunSettings]),
        )
