"""Run settings: privacy settings, performance settings and everything else, all frozen.

Only :class:`PrivacySettings` reaches the accountant and the result file's privacy block.
Every invalid value raises ``ValueError`` naming the setting and its valid range, before
any work starts. Config files are flat TOML tables whose keys are the field names below.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .core.schedules import CyclicalSchedule, StepSchedule, sgld_noise_multiplier

PLACEMENTS = ("server", "sites")
METHODS = ("sgd", "dpsgd", "dpsgld", "dpvi", "vi")
OPTIMIZERS = ("sgd", "adam")
PARTITIONS = ("iid", "dirichlet", "quantity")
ACCOUNTANTS = ("pld", "rdp", "dp_accounting_pld")
MODELS = ("cnn", "mlp", "logreg", "timm_head")
RANDOMNESS = ("seeded", "os")
SECURE_NOISE = ("auto", "on", "off")
LR_SCHEDULES = ("polynomial", "cyclical")


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


def _choice(name: str, v: Any, options: tuple[str, ...]) -> None:
    if v not in options:
        raise ValueError(f"{name} must be one of {', '.join(options)}; got {v!r}")


@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """Everything that determines the privacy guarantee.

    method      sgd (no clipping, no noise, no guarantee) | dpsgd (constant sigma and
                step size) | dpsgld (sigma_t = sqrt(2 alpha_t tau), decaying alpha_t,
                pre-noise rho) | dpvi (DP variational inference: clipped per-record ELBO
                gradients, constant sigma) | vi (non-private variational inference)
    epsilon     the budget; training halts before a step that would exceed it
    delta       target delta of the (epsilon, delta) guarantee, in (0, 1)
    sample_rate Poisson sampling rate q of every site, in (0, 1]
    clip        L2 clip bound C of each record's gradient, > 0
    prenoise    std rho of the per-record pre-noise added before clipping (dpsgld), >= 0
    lr          step size alpha_0
    temperature tau of DP-SGLD, > 0
    noise_multiplier  constant sigma of DP-SGD, > 0
    decay_gamma, decay_t0  alpha_t = alpha_0 (1 + t / t0) ** (-gamma) for dpsgld (and sgd)

    One config serves every method: settings that belong to another method are kept in
    the result file but do not apply (dpsgd: constant step size and sigma, no pre-noise,
    no temperature; sgd: no clipping, no noise; dpsgld: no noise_multiplier).
    accountant  rigorous accountant for the budget check: pld (FFT composition, default) |
                rdp | dp_accounting_pld (the reference; slow without sigma_grid)
    sigma_grid  relative grid on which sigma_t is rounded DOWN for accounting, [0, 0.5);
                0 (default): every sigma_t exactly
    noise_placement  server (default: sites send clipped sums, the server adds the noise
                and takes one step per round) | sites (each site takes local_steps noisy
                steps on its own records per round, the server averages; sgd, dpsgd and
                dpsgld only)
    local_steps local steps per round with noise_placement = sites, >= 1 (must be 1 with
                server placement)
    lr_schedule polynomial (default: the decay above; decay_gamma = 0 is constant) |
                cyclical (cSGLD, Zhang et al. 2020: cosine cycles of cycle_length steps
                from lr down towards cycle_floor * lr); sgd and dpsgld only, dpsgd keeps
                its step size constant. DP-SGLD's sigma_t = sqrt(2 alpha_t tau) follows
                either schedule, and the accountant composes whatever sigma_t it gives
    cycle_length steps per cycle of the cyclical schedule, >= 1
    cycle_floor  smallest step size of a cycle as a fraction of lr, [0, 1); 0 is Zhang et
                al.'s schedule, whose last steps of a cycle have a tiny sigma_t under
                DP-SGLD and cost much privacy
    recal_steps, recal_sample_rate, recal_noise_multiplier, recal_clip  private
                recalibration (on when the run setting recal_fraction > 0): that many
                noisy steps on the log temperature, each a Poisson-subsampled (rate
                recal_sample_rate, (0, 1]) sum of per-record gradients clipped to
                recal_clip (> 0) plus Gaussian noise recal_noise_multiplier * recal_clip
                (> 0); recal_steps in [1, 100000]. They enter the run's one ledger, and
                training is planned so that they fit in the budget
    """

    method: str = "dpsgld"
    epsilon: float = 1.0
    delta: float = 1e-5
    sample_rate: float = 0.05
    clip: float = 1.0
    prenoise: float = 0.0
    lr: float = 0.1
    temperature: float = 1.0
    noise_multiplier: float = 1.0
    decay_gamma: float = 0.0
    decay_t0: float = 100.0
    accountant: str = "pld"
    sigma_grid: float = 0.0
    noise_placement: str = "server"
    local_steps: int = 1
    lr_schedule: str = "polynomial"
    cycle_length: int = 100
    cycle_floor: float = 0.1
    recal_steps: int = 20
    recal_sample_rate: float = 1.0
    recal_noise_multiplier: float = 70.0
    recal_clip: float = 1.0

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _num("epsilon", self.epsilon, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        _num("sample_rate", self.sample_rate, 0.0, 1.0, lo_open=True)
        _num("clip", self.clip, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("prenoise", self.prenoise, 0.0, math.inf, hi_open=True)
        _num("lr", self.lr, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("temperature", self.temperature, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("noise_multiplier", self.noise_multiplier, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("decay_gamma", self.decay_gamma, 0.0, 1.0)
        _num("decay_t0", self.decay_t0, 0.0, math.inf, lo_open=True, hi_open=True)
        _choice("accountant", self.accountant, ACCOUNTANTS)
        _num("sigma_grid", self.sigma_grid, 0.0, 0.5, hi_open=True)
        _choice("noise_placement", self.noise_placement, PLACEMENTS)
        _int("local_steps", self.local_steps, 1, 10_000)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _int("cycle_length", self.cycle_length, 1, 10**9)
        _num("cycle_floor", self.cycle_floor, 0.0, 1.0, hi_open=True)
        _int("recal_steps", self.recal_steps, 1, 100_000)
        _num("recal_sample_rate", self.recal_sample_rate, 0.0, 1.0, lo_open=True)
        _num(
            "recal_noise_multiplier",
            self.recal_noise_multiplier,
            0.0,
            math.inf,
            lo_open=True,
            hi_open=True,
        )
        _num("recal_clip", self.recal_clip, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.noise_placement == "server" and self.local_steps != 1:
            raise ValueError(
                f"local_steps must be 1 with noise_placement = 'server' (one step per round), "
                f"got {self.local_steps}; set noise_placement = 'sites' for local steps"
            )
        if self.noise_placement == "sites" and self.variational:
            raise ValueError(
                f"noise_placement = 'sites' supports methods sgd, dpsgd and dpsgld, got "
                f"method {self.method!r}; use noise_placement = 'server'"
            )

    @property
    def private(self) -> bool:
        return self.method not in ("sgd", "vi")

    @property
    def variational(self) -> bool:
        return self.method in ("dpvi", "vi")

    @property
    def schedule(self) -> StepSchedule | CyclicalSchedule:
        """DP-SGD (and DPVI) keep their step size constant; SGD and DP-SGLD follow
        ``lr_schedule`` (the polynomial decay, or cosine cycles)."""
        if self.method not in ("sgd", "dpsgld"):
            return StepSchedule(self.lr, 0.0, self.decay_t0)
        if self.lr_schedule == "cyclical":
            return CyclicalSchedule(self.lr, self.cycle_length, self.cycle_floor)
        return StepSchedule(self.lr, self.decay_gamma, self.decay_t0)

    @property
    def applied_prenoise(self) -> float:
        """Pre-noise is part of DP-SGLD only."""
        return self.prenoise if self.method == "dpsgld" else 0.0

    def step_size(self, t: int) -> float:
        return self.schedule(t)

    def sigma(self, t: int) -> float:
        """Noise multiplier of step t (0 for sgd)."""
        if not self.private:
            return 0.0
        if self.method in ("dpsgd", "dpvi"):
            return self.noise_multiplier
        return sgld_noise_multiplier(self.step_size(t), self.temperature)

    @property
    def clip_bound(self) -> float | None:
        return self.clip if self.private else None


@dataclass(frozen=True, kw_only=True)
class PerfSettings:
    """Settings that change speed and memory, never results or privacy."""

    chunk_size: int = 256
    threads: int = 0  # 0: leave torch's default

    def __post_init__(self) -> None:
        _int("chunk_size", self.chunk_size, 1)
        _int("threads", self.threads, 0, 256)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What to train on, how long, and what to keep."""

    dataset: str = "mnist5k"
    data_path: str = ""
    sites: int = 4
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    test_fraction: float = 0.2
    model: str = "cnn"
    backbone: str = "efficientnet_b1"  # model "timm_head": frozen timm backbone + two dense layers
    backbone_weights: str = ""  # local weights file; empty: random initialisation (warned)
    image_size: int = 64  # images are resized to this for the backbone
    hidden: int = 64  # hidden width of the mlp and timm_head models
    rounds: int = 200
    seed: int = 0
    weight_decay: float = 0.0
    eval_every: int = 25
    burn_in: int = 50
    thin: int = 10
    max_samples: int = 20
    checkpoint_every: int = 50
    # variational inference (methods dpvi and vi); the optimiser is post-processing
    optimizer: str = "sgd"  # sgd | adam
    prior_std: float = 1.0  # Gaussian prior N(0, prior_std^2 I) of the KL term
    vi_init_std: float = 0.001  # initial std of q
    vi_samples: int = 20  # Monte-Carlo draws from q for predictions
    # where each party's privacy randomness comes from: seeded (simulations: every stream
    # derived from seed, reproducible, NOT private against anyone who knows the seed) | os
    # (deployments: each party draws fresh operating-system entropy that never leaves it)
    randomness: str = "seeded"
    secure_noise: str = "auto"  # hardened Gaussian draws: auto (on with os randomness) | on | off
    # SWAG (+swag): a Gaussian fitted to every kept iterate (burn_in, thin), sampled at the
    # end for model averaging; post-processing, no privacy cost (sgd, dpsgd, dpsgld only)
    swag_rank: int = 10  # deviations of the last swag_rank iterates (low-rank part); 0: diagonal
    swag_samples: int = 20  # draws averaged for the +swag model; 0: no SWAG
    # private recalibration (+recal; sgd, dpsgd, dpsgld with noise_placement "server", the
    # in-process engine): each site holds this share of its TRAINING split out of training
    # as its calibration split, on which the last iterate's temperature is fitted; 0: off
    recal_fraction: float = 0.0  # in [0, 1)
    recal_lr: float = 0.5  # step size on log T (post-processing), > 0

    def __post_init__(self) -> None:
        _int("sites", self.sites, 1, 10_000)
        _choice("partition", self.partition, PARTITIONS)
        _num("dirichlet_alpha", self.dirichlet_alpha, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("test_fraction", self.test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        _choice("model", self.model, MODELS)
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
            raise ValueError(
                f"unknown setting(s) {', '.join(unknown)}; valid settings: {', '.join(sorted(owner))}"
            )
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


def parse_value(text: str) -> Any:
    """Parse a ``--set`` value as a TOML value (numbers, booleans, quoted strings), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a flat TOML config (nested tables are flattened) and apply overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
        raw.pop("benchmark", None)  # read by `fedsgld benchmark`; one file serves both commands
        for k, v in raw.items():
            if isinstance(v, dict):
                values.update(v)
            else:
                values[k] = v
    values.update(overrides or {})
    return Config.from_flat(values)
