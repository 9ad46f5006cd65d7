"""Run settings: privacy settings, performance settings and everything else, all frozen.

Only :class:`PrivacySettings` reaches the accountant and the result file's privacy block.
Every invalid value raises ``ValueError`` naming the setting and its valid range, before
any work starts. Config files are flat TOML tables whose keys are the field names below.

Every field carries a one-line ``help`` in its metadata; :func:`settings_reference` reads
them with the defaults, and ``fedsgld simulate -h``, ``fedsgld config`` and
``docs/config.md`` are generated from it. This module imports no torch, so that the
command-line help is fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from fedsgld.privacy.schedules import CyclicalSchedule, StepSchedule

PLACEMENTS = ("server", "sites")
METHODS = ("sgd", "dpsgd", "dpsgld", "dpvi", "vi")
OPTIMIZERS = ("sgd", "adam")
PARTITIONS = ("iid", "dirichlet", "quantity")
ACCOUNTANTS = ("pld", "rdp", "dp_accounting_pld")
MODELS = ("cnn", "mlp", "logreg", "timm_head")
RANDOMNESS = ("seeded", "os")
DEVICES = ("cpu", "cuda", "auto")  # fedsgld.core.device.DEVICES (kept here: no torch import)
SECURE_NOISE = ("auto", "on", "off")
LR_SCHEDULES = ("polynomial", "cyclical")


def setting(default: Any, help: str) -> Any:
    """A settings field: its default and the one-line meaning shown by ``fedsgld config``."""
    return field(default=default, metadata={"help": help})


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

    One config serves every method: settings that belong to another method are kept in
    the result file but do not apply (dpsgd: constant step size and sigma, no pre-noise,
    no temperature; sgd: no clipping, no noise; dpsgld: no noise_multiplier).
    """

    method: str = setting(
        "dpsgld",
        "sgd (no clipping, no noise, no guarantee) | dpsgd (constant sigma and step size) | dpsgld"
        " (sigma_t = sqrt(2 alpha_t tau), decaying alpha_t, pre-noise) | dpvi (DP variational "
        "inference) | vi (non-private variational inference)",
    )
    epsilon: float = setting(
        1.0, "privacy budget, > 0: training halts before a step that would exceed it"
    )
    delta: float = setting(1e-5, "delta of the (epsilon, delta) guarantee, in (0, 1)")
    sample_rate: float = setting(
        0.05, "Poisson sampling rate q of every site's records in each step, in (0, 1]"
    )
    clip: float = setting(1.0, "L2 clip bound C of each record's gradient, > 0")
    prenoise: float = setting(
        0.0,
        "std rho of the Gaussian pre-noise added to each record's gradient before clipping (dpsgld"
        " only), >= 0",
    )
    lr: float = setting(0.1, "step size alpha_0, > 0")
    temperature: float = setting(
        1.0, "temperature tau of dpsgld (sigma_t = sqrt(2 alpha_t tau)), > 0"
    )
    noise_multiplier: float = setting(1.0, "constant noise multiplier sigma of dpsgd and dpvi, > 0")
    decay_gamma: float = setting(
        0.0,
        "step-size decay alpha_t = lr (1 + t / decay_t0)^(-decay_gamma) of dpsgld and sgd, in [0, "
        "1]; 0: constant",
    )
    decay_t0: float = setting(100.0, "t0 of the step-size decay, > 0")
    accountant: str = setting(
        "pld",
        "rigorous accountant that enforces the budget: pld (FFT composition of every step) | rdp"
        " | dp_accounting_pld (the reference; slow without sigma_grid)",
    )
    sigma_grid: float = setting(
        0.0,
        "relative grid onto which sigma_t is rounded down for accounting, in [0, 0.5); 0: every"
        " sigma_t exactly",
    )
    noise_placement: str = setting(
        "server",
        "server (sites send clipped sums; the server adds the noise and takes one step per round) "
        "| sites (each site takes local_steps noisy steps per round, the server averages; sgd, "
        "dpsgd and dpsgld only)",
    )
    local_steps: int = setting(
        1,
        "local steps per round with noise_placement = sites, in [1, 10000]; must be 1 with server",
    )
    lr_schedule: str = setting(
        "polynomial",
        "polynomial (alpha_t = lr (1 + t / decay_t0)^(-decay_gamma)) | cyclical (cSGLD: cosine "
        "cycles of cycle_length steps from lr down to cycle_floor * lr); sgd and dpsgld only",
    )
    cycle_length: int = setting(100, "steps per cycle of the cyclical schedule, >= 1")
    cycle_floor: float = setting(
        0.1,
        "smallest step size of a cycle as a fraction of lr, in [0, 1); small values give tiny "
        "sigma_t under dpsgld, which cost much privacy",
    )
    recal_steps: int = setting(
        20, "noisy steps of private recalibration (when recal_fraction > 0), in [1, 100000]"
    )
    recal_sample_rate: float = setting(
        1.0, "Poisson sampling rate of the calibration split per recalibration step, in (0, 1]"
    )
    recal_noise_multiplier: float = setting(
        70.0,
        "noise multiplier of each recalibration step (std recal_noise_multiplier * recal_clip), > 0",
    )
    recal_clip: float = setting(
        1.0, "clip bound of each record's gradient with respect to log T, > 0"
    )

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
        from fedsgld.privacy.schedules import CyclicalSchedule, StepSchedule

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
        from fedsgld.privacy.schedules import sgld_noise_multiplier

        return sgld_noise_multiplier(self.step_size(t), self.temperature)

    @property
    def clip_bound(self) -> float | None:
        return self.clip if self.private else None


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

    def __post_init__(self) -> None:
        _int("chunk_size", self.chunk_size, 1)
        _int("threads", self.threads, 0, 256)
        _choice("device", self.device, DEVICES)

    def torch_device(self):
        """The torch.device to run on; ValueError for ``cuda`` on a machine without a GPU."""
        from fedsgld.core.device import resolve_device

        return resolve_device(self.device)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What to train on, how long, and what to keep."""

    dataset: str = setting(
        "mnist5k", "mnist5k | mnist | fashion_mnist | breast_cancer | pneumonia | synthetic"
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
        "how records are split over the sites: iid | dirichlet (label skew) | quantity (size skew)",
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
        "trainable dense layers)",
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
    recal_lr: float = setting(0.5, "step size on log T of private recalibration, > 0")
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

    def __post_init__(self) -> None:
        _int("sites", self.sites, 1, 10_000)
        m = self.min_sites
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.sites:
            raise ValueError(
                f"min_sites must be an integer in [0, sites = {self.sites}] (0: every site), "
                f"got {self.min_sites!r}"
            )
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
        _int("max_records", self.max_records, 0, 100_000_000)
        _num("validation_fraction", self.validation_fraction, 0.0, 1.0, hi_open=True)
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


@dataclass(frozen=True)
class SettingDoc:
    """One config key as the help shows it."""

    group: str
    name: str
    default: Any
    help: str


def settings_reference() -> list[tuple[str, str, list[SettingDoc]]]:
    """Every config key, group by group: (group, the group's summary, its settings).

    Read from the dataclass fields of :class:`Config`'s groups, so a new field appears in
    the help as soon as it exists; a field without ``help`` metadata shows an empty meaning
    (and fails the test suite).
    """
    out: list[tuple[str, str, list[SettingDoc]]] = []
    hints = typing.get_type_hints(Config)
    for group in fields(Config):
        cls_ = hints[group.name]
        summary = (cls_.__doc__ or "").strip().split("\n\n")[0]
        docs = [
            SettingDoc(
                group=group.name,
                name=f.name,
                default=f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                help=" ".join(str(f.metadata.get("help", "")).split()),
            )
            for f in fields(cls_)
        ]
        out.append((group.name, " ".join(summary.split()), docs))
    return out


def toml_value(v: Any) -> str:
    """A default as it is written in a TOML config or after ``--set KEY=``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def settings_text(width: int = 79) -> str:
    """Plain-text list of every config key with its default and meaning (``fedsgld config``)."""
    lines = [
        "config keys (set in the TOML config, or with --set KEY=VALUE; default after '='):",
    ]
    for group, summary, docs in settings_reference():
        lines += ["", f"{group}: {summary}"]
        for d in docs:
            lines.append(f"  {d.name} = {toml_value(d.default)}")
            # keep intervals such as [0, 0.5) on one line
            text = re.sub(r"([\[(][\d.e+-]+,) ", "\\1\xa0", d.help or "(no help)")
            wrapped = textwrap.wrap(
                text,
                width,
                initial_indent=" " * 6,
                subsequent_indent=" " * 6,
                break_long_words=False,
                break_on_hyphens=False,
            )
            lines += [w.replace("\xa0", " ") for w in wrapped]
    return "\n".join(lines) + "\n"


def settings_markdown() -> str:
    """``docs/config.md``: every config key with its default and meaning, as tables."""
    lines = [
        "# Config keys",
        "",
        "<!-- Generated from fedsgld/config.py by `fedsgld config --markdown > docs/config.md`;",
        "     tests/test_cli.py fails when this file and the generated text differ. -->",
        "",
        "Every key can be set in a run's TOML config (`fedsgld simulate CONFIG`, `fedsgld",
        "benchmark CONFIG`), overridden with `--set KEY=VALUE`, and passed to `flwr run .` in",
        "`--run-config` (whose defaults are in `pyproject.toml`). `fedsgld config` and",
        "`fedsgld simulate -h` print the same list. Values are TOML: strings are quoted.",
    ]
    for group, summary, docs in settings_reference():
        lines += [
            "",
            f"## {group}",
            "",
            summary,
            "",
            "| key | default | meaning |",
            "|---|---|---|",
        ]
        for d in docs:
            meaning = (d.help or "(no help)").replace("|", "\\|")
            lines.append(f"| `{d.name}` | `{toml_value(d.default)}` | {meaning} |")
    return "\n".join(lines) + "\n"


def unknown_settings_message(unknown: list[str], valid: typing.Iterable[str]) -> str:
    """One line naming each unknown key, with the nearest valid key where one is close
    ("did you mean"), and where the full list is (not the list itself)."""
    valid = sorted(valid)
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(k, valid, n=1, cutoff=0.6)
        parts.append(f"{k!r} (did you mean {near[0]!r}?)" if near else repr(k))
    noun = "setting" if len(unknown) == 1 else "settings"
    return f"unknown {noun} {', '.join(parts)}; `fedsgld config` lists every setting"


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
            raise ValueError(
                f"config file {str(p)!r} does not exist; pass a TOML file such as "
                "simulations/demo.toml"
            )
        try:
            with p.open("rb") as fh:
                raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"config file {str(p)!r} is not valid TOML: {err}; strings need quotes "
                '(dataset = "mnist5k"), one key = value per line'
            ) from err
        raw.pop("benchmark", None)  # read by `fedsgld benchmark`; one file serves both commands
        for k, v in raw.items():
            if isinstance(v, dict):
                values.update(v)
            else:
                values[k] = v
    values.update(overrides or {})
    return Config.from_flat(values)
