"""The run around the maths, shared by the in-process engine and the Flower ServerApp.

A transport (the engine's loop over :class:`~fedsgld.clients.Site` objects, or Flower
messages to SuperNodes) only moves parameters and sums; everything else a run does lives
here, once:

* **The result directory.** A new run refuses a directory that already holds one; a
  resume refuses a directory that holds none.
* **The ledger first.** ``ledger.json`` holds the accountant's ledger and the run's
  lifecycle record (run key, epoch, config, seed). It is written, fsynced (file and
  directory), BEFORE the noise of the step it accounts for is drawn, and before any
  round of a resumed run is sent.
* **A ledger that never resets.** A resume takes the larger of ``ledger.json`` and the
  copy inside ``checkpoint.pt`` (a ledger only grows, so the larger one is the newer one)
  and refuses, naming both files, when neither can be read. A run that crashed before its
  first checkpoint resumes from theta_0 with its ledger: the spent budget stays spent.
* **A ledger that cannot be shortened unseen.** Every write of ``ledger.json`` is also a
  line of the append-only, hash-chained ``ledger.chain`` (:mod:`fedsgld.privacy.ledger_chain`).
  A resume refuses (:class:`ResumeError`) a ``ledger.json`` that is unreadable,
  truncated, edited or older than the chain's last line, a missing or broken chain, and
  a ledger rebuilt from the checkpoint that counts fewer steps than the chain.
* **No replay.** Every start of a run has an epoch (0, then 1, 2, ... per resume),
  persisted before anything is sent. Seeded simulations key every stream by the epoch
  after a resume, so replayed rounds draw different noise; system randomness is fresh on
  every draw anyway. Rounds released before a crash stay in the ledger (spending a
  little twice is the conservative direction; reusing noise is not).
* **Checkpoints, the evaluation schedule, the progress display, and results.json** in
  one layout whatever the transport.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsgld import __version__
from fedsgld.config import Config
from fedsgld.core.noise import Randomness, os_seed
from fedsgld.posteriors import RECAL, SWAG, iterate_average
from fedsgld.privacy import ledger_chain

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RESULTS = "results.json"
LIFECYCLE_VERSION = 2  # 2: ledger.json carries its place in ledger.chain
SWAG_STREAM = 0x5A4A  # key of the SWAG draws (post-processing, not privacy noise)

# Evaluation groups: name -> the report of the mean softmax over that group's parameters
Evaluate = Callable[[dict[str, list[torch.Tensor]]], dict[str, dict[str, Any]] | None]


class ResumeError(ValueError):
    """A run directory cannot be resumed safely (the message names the files)."""


# -- durable files -----------------------------------------------------------------------


_fsync_dir = ledger_chain.fsync_dir


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary file, fsync it, rename it over ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: Path, obj: Any) -> None:
    """Write strict JSON durably (non-finite floats as null)."""

    def _w(p: Path) -> None:
        with p.open("w") as fh:
            json.dump(_finite(obj), fh, indent=2, default=_json_default, allow_nan=False)

    atomic_write(path, _w)


def new_run_dir(base: str | Path = "runs", tag: str = "run") -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(base) / f"{stamp}-{tag}"
    i = 1
    while d.exists():
        d = Path(base) / f"{stamp}-{tag}-{i}"
        i += 1
    return d


def ckpt_config(config: Config) -> dict[str, Any]:
    """The settings a resume must repeat (performance settings and min_sites may change)."""
    return {k: v for k, v in config.flat().items() if k not in ("threads", "min_sites")}


def round_time_summary(round_times: list[float]) -> dict[str, Any]:
    """Wall time of the training rounds; the first includes warm-up (first calls, caches)."""
    n = len(round_times)
    return {
        "count": n,
        "mean": sum(round_times) / n if n else None,
        "first": round_times[0] if n else None,
        "mean_after_first": sum(round_times[1:]) / (n - 1) if n > 1 else None,
    }


def metrics_block(server, last: dict[str, Any], post: dict[str, Any] | None) -> dict[str, Any]:
    """results.json's ``metrics``: the last iterate's and the kept iterates' average's reports.

    The average sits under ``posterior`` for every method; its ``kind``, ``suffix`` and
    ``label`` name it honestly (a posterior average only for Langevin methods, an iterate
    average otherwise: :func:`fedsgld.posteriors.iterate_average`).
    """
    return {
        "pooled": last["pooled"],
        "sites": last["sites"],
        "posterior": None
        if post is None
        else {
            **iterate_average(server.privacy.method),
            "pooled": post["pooled"],
            "sites": post["sites"],
            "samples": len(server.posterior),
            "sample_steps": list(server.posterior.steps),
        },
    }


def swag_block(server, ev: dict[str, Any], samples: int) -> dict[str, Any]:
    """results.json's ``metrics.swag``: the +swag model's reports and what SWAG was fitted to."""
    swag = server.posterior.swag
    return {
        **SWAG,
        "pooled": ev["pooled"],
        "sites": ev["sites"],
        "samples": samples,
        **swag.describe(),
        "note": f"SWAG: a Gaussian fitted to the {len(swag)} iterates kept after burn_in (every "
        f"thin-th), diagonal plus the deviations of the last {swag.used_rank}; the softmax "
        f"averaged over {samples} draws. Post-processing: no privacy cost",
    }


def validation_block(ev: dict[str, Any], ev_recal: dict[str, Any] | None) -> dict[str, Any]:
    """results.json's ``validation``: each model's reports on the sites' validation splits
    (held out of training; ``fedsgld sweep`` selects hyper-parameters on these, never on
    the test split), keyed like ``metrics``: ``last``, ``posterior``, ``swag``, ``recal``."""
    out = {k: {"pooled": v["pooled"], "sites": v["sites"]} for k, v in ev.items()}
    if ev_recal is not None:
        out["recal"] = {"pooled": ev_recal["pooled"], "sites": ev_recal["sites"]}
    out["note"] = (
        "every model evaluated on the validation splits the sites held out of training "
        "(validation_fraction); select hyper-parameters on these, report the test metrics"
    )
    return out


def recal_block(state: dict[str, Any], last: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``metrics.recal``: the temperature-scaled last iterate's reports and
    ECE (and NLL) before and after, per site and pooled."""
    return {
        **RECAL,
        "temperature": state["temperature"],
        "steps": state["steps"],
        "pooled": ev["pooled"],
        "sites": ev["sites"],
        "before_after": {
            "pooled": {
                k: {"before": last["pooled"][k], "after": ev["pooled"][k]} for k in ("ece", "nll")
            },
            "sites": {
                s: {
                    k: {"before": last["sites"][s][k], "after": ev["sites"][s][k]}
                    for k in ("ece", "nll")
                }
                for s in ev["sites"]
            },
        },
        "note": f"private recalibration: the last iterate's logits divided by the temperature "
        f"{state['temperature']:.4g}, fitted by {state['steps']} noisy clipped-gradient steps "
        "on log T over the sites' calibration splits (held out of training); its epsilon is "
        "in privacy.recalibration",
    }


def privacy_block(server, config: Config, randomness: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``privacy``: settings, ledger, epsilons, halting, and the randomness."""
    p = config.privacy
    block: dict[str, Any] = {
        "method": p.method,
        "settings": dict(config.to_dict()["privacy"]),
        "delta": p.delta,
        "budget": p.epsilon if p.private else None,
        "steps": server.t,
        "noise_placement": p.noise_placement,
        "local_steps": server.local_steps,
        "halted": bool(server.halt_reason and server.halt_reason.startswith("privacy budget")),
        "halt_reason": server.halt_reason,
        "randomness": randomness,
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
            f"'{acc.rigorous_name}'. "
            + (
                f"Sigma is rounded down to a {p.sigma_grid:g} relative grid for accounting "
                "(conservative). "
                if p.sigma_grid
                else "Every sigma_t is accounted exactly. "
            )
            + "ledger_steps can exceed steps after a resume: "
            "steps whose output was lost in a crash stay counted."
            + (
                f" Noise at the sites: 'steps' counts rounds of {server.local_steps} local steps; "
                "the ledger is each site's own (every site uses the same q and sigma_t, so it "
                "is also the worst site's)."
                if server.local
                else ""
            )
            + (
                " Randomness 'seeded': every stream derives from the config's seed, so this "
                "run is reproducible and private only against parties who do not know the "
                "seed (a simulation)."
                if randomness.get("mode") == "seeded"
                else " Randomness 'os': each party drew its noise from its own operating "
                "system's entropy."
            )
        ),
    )
    return block


def _read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.is_file():
        return None, "missing"
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"unreadable ({err})"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    return obj, None


class _Progress:
    """A progress display that is true every round: the rounds the budget allows as the
    total, the epsilon spent so far from the ledger (recomputed at most as often as it is
    cheap), and the last evaluation's test accuracy, labelled as such."""

    def __init__(
        self, *, enabled: bool, total: int, initial: int, desc: str, log: Callable[[str], None]
    ) -> None:
        self.log = log
        self.bar = None
        self.total = total
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc)
        self.eps: float | None = None
        self.eps_round = 0
        self.eps_cost = 0.0
        self.eps_at = -math.inf
        self.acc: tuple[int, float] | None = None
        self.last_log = time.monotonic()

    def epsilon(self, server, *, force: bool = False) -> float | None:
        acc = server.accountant
        if acc is None:
            return None
        now = time.monotonic()
        # recompute when forced, or when the last computation was < 5 % of the time since
        if force or now - self.eps_at >= 20 * self.eps_cost:
            t0 = time.perf_counter()
            self.eps = acc.rigorous_epsilon()
            self.eps_cost = time.perf_counter() - t0
            self.eps_at = time.monotonic()
            self.eps_round = server.t
        return self.eps

    def update(self, server, *, evaluated: float | None = None, force_log: bool = False) -> None:
        if evaluated is not None:
            self.acc = (server.t, evaluated)
        eps = self.epsilon(server, force=evaluated is not None)
        parts = {}
        if eps is not None:
            parts["eps"] = f"{eps:.3f}" + (
                "" if self.eps_round == server.t else f"@{self.eps_round}"
            )
        if self.acc is not None:
            parts["test_acc"] = f"{self.acc[1]:.3f}@{self.acc[0]}"
        if self.bar is not None:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
        elif force_log or time.monotonic() - self.last_log >= 5.0:
            self.last_log = time.monotonic()
            info = ", ".join(f"{k} {v}" for k, v in parts.items())
            self.log(f"round {server.t}/{self.total}" + (f": {info}" if info else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLifecycle:
    """One run's directory, ledger, checkpoints, randomness, loop and results.

    ``transport`` names what moves the data ("in-process" or "flower"); it is written to
    results.json and report.md. Use: ``lc = RunLifecycle(config, out=..., resume=...)``,
    build the server with ``randomness=lc.server_randomness()``, ``lc.attach(server)``,
    ``lc.train(server, round_fn, evaluate)``, ``lc.finish(...)``.
    """

    def __init__(
        self,
        config: Config,
        *,
        out: str | Path | None,
        resume: bool,
        transport: str,
        tag: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.t_start = time.perf_counter()
        self.transport = transport
        self.log = log
        self.user_config = config
        out = Path(out).expanduser() if out else new_run_dir(tag=tag or config.privacy.method)
        self.out = out
        ckpt_path, ledger_path = out / CHECKPOINT, out / LEDGER
        held = (ckpt_path, ledger_path, out / ledger_chain.CHAIN)
        if not resume and any(p.exists() for p in held):
            raise ValueError(
                f"output directory {str(out)!r} already holds a run; resume it (--resume / "
                "resume=true) or choose another output directory"
            )
        if resume and not (ckpt_path.exists() or ledger_path.exists()):
            raise ResumeError(f"resume: {str(out)!r} holds no {CHECKPOINT} and no {LEDGER}")
        self.ckpt: dict[str, Any] | None = None
        self.ledger_file: dict[str, Any] | None = None
        self.chain = ledger_chain.LedgerChain(out)
        self.chain_steps = 0  # the steps ledger.chain recorded before this start
        meta: dict[str, Any] = {}
        if resume:
            problems = []
            if ckpt_path.exists():
                try:
                    self.ckpt = torch.load(ckpt_path, weights_only=False)
                except Exception as err:  # noqa: BLE001 - reported below
                    problems.append(f"{CHECKPOINT}: unreadable ({err})")
            self.ledger_file, why = _read_json(ledger_path)
            self._verify_chain(out, why)
            if why is not None:
                problems.append(f"{LEDGER}: {why}")
            if self.ckpt is None and self.ledger_file is None:
                raise ResumeError(
                    f"resume: cannot read the run in {str(out)!r} ({'; '.join(problems)})"
                )
            for p in problems:
                log(f"resume: {p}; using what the other file holds")
            metas = [
                m
                for m in (
                    (self.ckpt or {}).get("lifecycle"),
                    (self.ledger_file or {}).get("lifecycle"),
                )
                if isinstance(m, dict)
            ]
            saved_config = (self.ckpt or {}).get("config") or next(
                (m.get("config") for m in metas if m.get("config")), None
            )
            if saved_config is not None and saved_config != ckpt_config(config):
                diff = sorted(
                    k
                    for k in set(saved_config) | set(ckpt_config(config))
                    if saved_config.get(k) != ckpt_config(config).get(k)
                )
                raise ValueError(
                    "resume: the config differs from the saved run's "
                    f"({', '.join(diff)}); resume with the same config"
                )
            meta = {
                "run_key": next((m["run_key"] for m in metas if m.get("run_key")), None),
                "epoch": max([int(m.get("epoch", 0)) for m in metas] or [0]) + 1,
                "seed": (self.ckpt or {}).get("seed", next((m.get("seed") for m in metas), None)),
            }
        out.mkdir(parents=True, exist_ok=True)
        self.run_key: str = meta.get("run_key") or secrets.token_hex(8)
        self.epoch: int = int(meta.get("epoch", 0))
        run = config.run
        if run.seed == -1:
            seed = meta.get("seed")
            self.seed = int(seed) if seed is not None else os_seed()
            self.seed_source = "os"
            config = Config.from_flat({**config.flat(), "seed": self.seed})
        else:
            self.seed, self.seed_source = run.seed, "config"
        self.config = config
        self.history: list[dict[str, Any]] = list((self.ckpt or {}).get("history", []))
        self.round_times: list[float] = []
        self.extra_state: dict[str, Any] = dict((self.ckpt or {}).get("extra", {}))
        self.contributors: list[dict[str, Any]] = list(
            (self.ckpt or {}).get("round_contributors") or []
        )
        self.server = None
        self.evaluations: dict[str, dict[str, Any]] = {}  # the final evaluation, by group
        self.recal: dict[str, Any] | None = None  # the recalibration's state, once run

    def _verify_chain(self, out: Path, ledger_problem: str | None) -> None:
        """Check ledger.json and the checkpoint against ledger.chain before a resume."""
        try:
            self.chain = ledger_chain.verify(
                out, self.ledger_file, ledger_problem, (self.ckpt or {}).get("ledger_record")
            )
        except ledger_chain.ChainError as err:
            hint = (
                f" If {LEDGER} alone is damaged and {CHECKPOINT} is intact, remove {LEDGER}: "
                f"the resume then counts the checkpoint's ledger plus the rounds that may have "
                f"run after it as spent, and still refuses if that is below what "
                f"{ledger_chain.CHAIN} recorded."
                if str(err).startswith(LEDGER) and self.ckpt is not None
                else ""
            )
            raise ResumeError(
                f"resume: refusing the run in {str(out)!r}: {err}; a resume must never count "
                f"fewer privacy steps than were taken.{hint}"
            ) from None
        self.chain_steps = self.chain.head.steps if self.chain.head else 0

    # -- randomness ------------------------------------------------------------------------
    def _randomness(self) -> Randomness:
        run = self.config.run
        if run.randomness == "os":
            return Randomness.system(secure=run.secure)
        return Randomness.seeded(self.seed, epoch=self.epoch, secure=run.secure)

    def server_randomness(self) -> Randomness:
        """The server's own noise (seeded: keyed by the epoch, so a resume never replays)."""
        return self._randomness()

    def site_randomness(self) -> Randomness:
        """A simulated site's randomness (in-process engine): seeded like the server's, or
        its own system randomness."""
        return self._randomness()

    def randomness_record(self) -> dict[str, Any]:
        run = self.config.run
        rec = {
            "mode": run.randomness,
            "secure_noise": run.secure,
            "epoch": self.epoch,
            "run_key": self.run_key,
        }
        rec["note"] = (
            "simulation: every party's noise and Poisson samples derive from the seed"
            if run.randomness == "seeded"
            else "each party draws its noise and samples from its own operating system's entropy"
        )
        return rec

    # -- the ledger ------------------------------------------------------------------------
    def _lifecycle_record(self) -> dict[str, Any]:
        return {
            "version": LIFECYCLE_VERSION,
            "run_key": self.run_key,
            "epoch": self.epoch,
            "seed": self.seed,
            "config": ckpt_config(self.user_config),
            "transport": self.transport,
        }

    def persist_ledger(self, accountant=None) -> None:
        """Write ledger.json durably: the accountant's state and the lifecycle record."""
        acc = accountant if accountant is not None else getattr(self.server, "accountant", None)
        state: dict[str, Any] = acc.state_dict() if acc is not None else {"ledger": None}
        state["lifecycle"] = self._lifecycle_record()
        # the object as it reads back from the file, so that its digest can be checked
        state = json.loads(json.dumps(_finite(state), default=_json_default, allow_nan=False))
        sealed, link = self.chain.seal(state, epoch=self.epoch)
        write_json(self.out / LEDGER, sealed)
        self.chain.append(link)  # after ledger.json: a crash between them is completed on resume

    def _restore_ledger(self, server) -> None:
        acc = server.accountant
        if acc is None:
            return
        candidates: list[tuple[int, str, dict[str, Any]]] = []
        for name, state in (
            (LEDGER, self.ledger_file),
            (CHECKPOINT, (self.ckpt or {}).get("ledger")),
        ):
            if not isinstance(state, dict) or state.get("ledger") is None:
                continue
            try:
                steps = sum(int(c) for _, _, c in state["ledger"])
            except (TypeError, ValueError):
                self.log(f"resume: the ledger in {name} is malformed; ignoring it")
                continue
            candidates.append((steps, name, state))
        if not candidates:
            raise ResumeError(
                f"resume: no readable privacy ledger in {str(self.out)!r} (neither {LEDGER} "
                f"nor the copy in {CHECKPOINT}); refusing to resume with an empty ledger, "
                "which would under-report the epsilon already spent"
            )
        steps, name, state = max(candidates, key=lambda c: c[0])
        if name == CHECKPOINT:
            # ledger.json is written before every step, so it is never behind a healthy
            # checkpoint: it was lost or replaced. Rounds after the checkpoint may have been
            # released (up to checkpoint_every of them, the last one possibly unsaved):
            # count them as spent along the schedule, so the ledger is never below the truth.
            run = self.config.run
            left = run.rounds - server.t
            pad_rounds = min(run.checkpoint_every or left, left)
            start = server.t * server.local_steps
            extra = [
                [*server.schedule_point(start + i), 1]
                for i in range(pad_rounds * server.local_steps)
            ]
            state = dict(state, ledger=[list(e) for e in state["ledger"]] + extra)
            self.log(
                f"resume: {LEDGER} is missing or behind the checkpoint; using the checkpoint's "
                f"ledger ({steps} steps) plus {len(extra)} steps that may have run after it "
                "(counted as spent)"
            )
        elif len(candidates) > 1 and candidates[0][0] != candidates[1][0]:
            self.log(f"resume: using the larger ledger ({name}, {steps} steps)")
        total = sum(int(c) for _, _, c in state["ledger"])
        if total < self.chain_steps:
            raise ResumeError(
                f"resume: refusing the run in {str(self.out)!r}: the ledger it would resume "
                f"from ({name}: {total} steps, counting those that may have run after it) is "
                f"below the {self.chain_steps} steps {ledger_chain.CHAIN} recorded; a resume "
                "must never count fewer privacy steps than were taken"
            )
        acc.load_state_dict(state)

    def attach(self, server) -> None:
        """Restore ``server`` from the checkpoint and the larger ledger, hook the ledger
        write in front of every noise draw, and persist the new epoch before anything runs."""
        self.server = server
        server.on_spend = self.persist_ledger
        if self.ckpt is not None:
            server.load_state_dict(self.ckpt["server"])
        if self.ckpt is not None or self.ledger_file is not None:
            self._restore_ledger(server)
            acc = server.accountant
            where = f"round {server.t}" if self.ckpt is not None else "round 0 (no checkpoint)"
            self.log(
                f"resumed at {where}, epoch {self.epoch}; the ledger holds "
                f"{acc.steps if acc is not None else 0} steps (fresh noise from here on)"
            )
        self.persist_ledger()

    def checkpoint(self, **extra: Any) -> None:
        server = self.server
        self.extra_state.update(extra)
        state = {
            "config": ckpt_config(self.user_config),
            "seed": self.seed,
            "server": server.state_dict(),
            "history": self.history,
            "ledger": server.accountant.state_dict() if server.accountant else None,
            "lifecycle": self._lifecycle_record(),
            "ledger_record": self.chain.head.record() if self.chain.head else None,
            "round_contributors": self.contributors,
            "extra": self.extra_state,
        }
        atomic_write(self.out / CHECKPOINT, lambda p: torch.save(state, p))

    # -- the loop --------------------------------------------------------------------------
    def train(
        self,
        round_fn: Callable[[], Any],
        evaluate: Evaluate,
        *,
        progress: bool = True,
        on_checkpoint: Callable[[], dict[str, Any]] | None = None,
        checkpoint_on: tuple[type[BaseException], ...] = (),
        contributors: Callable[[], list[int]] | None = None,
    ) -> None:
        """Run rounds until ``round_fn()`` returns None (the server's plan was None).

        ``round_fn`` takes one round on its transport and returns the plan it ran.
        Evaluation every ``eval_every`` rounds (and at the end); checkpoints every
        ``checkpoint_every`` rounds, at the end, and when the run is interrupted (Ctrl-C) or
        a round raises one of ``checkpoint_on`` (the ledger is already on disk either way).
        A hard crash loses the rounds since the last checkpoint: a resume repeats them
        with fresh noise, and the ledger keeps counting their first release.
        ``contributors()``: the sites whose replies the round just taken used (default:
        every site, as in the in-process engine); results.json's ``round_contributors``.
        """
        server, run = self.server, self.config.run
        extra = on_checkpoint or (lambda: {})
        reserved = self._reserve_recalibration()
        affordable = server.affordable_rounds()
        if server.accountant is not None:
            self.log(
                f"budget epsilon={self.config.privacy.epsilon:g} at delta="
                f"{self.config.privacy.delta:g} ({server.accountant.rigorous_name}) allows "
                f"{affordable} of the remaining {run.rounds - server.t} rounds"
            )
        bar = _Progress(
            enabled=progress,
            total=server.t + affordable,
            initial=server.t,
            desc=self.config.privacy.method,
            log=self.log,
        )
        last_plan = None
        try:
            while True:
                t0 = time.perf_counter()
                plan = round_fn()
                if plan is None:
                    break
                last_plan = plan
                self._note_contributors(
                    plan.round,
                    contributors() if contributors else list(range(self.config.run.sites)),
                )
                t = server.t
                acc = None
                if run.eval_every and (t % run.eval_every == 0 or t == run.rounds):
                    acc = self._record(evaluate, plan)
                if run.checkpoint_every and t % run.checkpoint_every == 0:
                    self.checkpoint(**extra())
                self.round_times.append(time.perf_counter() - t0)
                bar.update(server, evaluated=acc)
        except (KeyboardInterrupt, *checkpoint_on):
            bar.close()
            self.checkpoint(**extra())
            raise
        except BaseException:
            bar.close()
            raise
        bar.close()
        if reserved and server.halt_reason == f"completed {server.rounds} rounds":
            q, sigma, count = reserved
            server.halt_reason = (
                f"privacy budget: round {server.t + 1} would leave too little of epsilon "
                f"{self.config.privacy.epsilon:g} at delta={self.config.privacy.delta:g} for "
                f"the {count} reserved recalibration steps (q={q:g}, sigma={sigma:g})"
            )
        if (
            run.eval_every
            and last_plan is not None
            and (not self.history or self.history[-1]["round"] != server.t)
        ):
            self._record(evaluate, last_plan)  # where the budget (or the round limit) ended it
        self.log(f"stopped after {server.t} rounds: {server.halt_reason}")
        self.checkpoint(**extra())

    def _note_contributors(self, rnd: int, sites: list[int]) -> None:
        """Run-length encoded: ``{"rounds": [first, last], "sites": [...]}`` per stretch of
        consecutive rounds with the same sites (a replay after a resume starts a new one)."""
        sites = sorted(int(k) for k in sites)
        last = self.contributors[-1] if self.contributors else None
        if last is not None and last["sites"] == sites and last["rounds"][1] + 1 == rnd:
            last["rounds"][1] = rnd
        else:
            self.contributors.append({"rounds": [rnd, rnd], "sites": sites})

    # -- recalibration -----------------------------------------------------------------
    def _reserve_recalibration(self) -> tuple[float, float, int] | None:
        """Plan training so that the recalibration steps still fit in the one budget.

        Composition is commutative, so the most training rounds T that leave room for the
        R recalibration steps is the accountant's ``max_steps`` along the schedule "R
        recalibration steps, then the training steps" minus R. The server's round limit
        becomes T (training halts there, saying why). Returns the reserved (q, sigma, R)
        when it cut the rounds, else None.
        """
        from fedsgld.calibration.recal import RecalPlan

        server, acc = self.server, self.server.accountant
        plan = RecalPlan.from_config(self.config)
        if plan is None or acc is None or not plan.ledger() or self.extra_state.get("recal"):
            return None
        q, sigma, count = plan.ledger()[0]
        e, start = server.local_steps, server.t * server.local_steps
        remaining = max(server.rounds - server.t, 0)
        n = acc.max_steps(
            lambda i: (q, sigma) if i < count else server.schedule_point(start + i - count),
            limit=count + remaining * e,
        )
        if n < count:
            what = (
                f"the {count} recalibration steps (recal_steps, q={q:g}, "
                f"recal_noise_multiplier={sigma:g}) alone would take epsilon past the budget "
                f"{self.config.privacy.epsilon:g} at delta={self.config.privacy.delta:g}"
            )
            if self.ckpt is None and self.ledger_file is None:
                raise ValueError(
                    f"{what}; raise recal_noise_multiplier, lower recal_steps or "
                    "recal_sample_rate, or set recal_fraction = 0"
                )
            self.log(f"resume: {what} after the spent ledger; recalibration will be refused")
            return None
        rounds = server.t + (n - count) // e
        if rounds >= server.rounds:
            return None
        self.log(
            f"reserving {count} recalibration steps (q={q:g}, sigma={sigma:g}) in the budget: "
            f"training stops after round {rounds} of {server.rounds}"
        )
        server.rounds = rounds
        return q, sigma, count

    def recalibrate(
        self,
        site_sums: Callable[[float, int], list[torch.Tensor]],
        *,
        calibration_sizes: list[int],
    ) -> dict[str, Any] | None:
        """Fit the last iterate's temperature privately (:mod:`fedsgld.calibration.recal`).

        ``site_sums(log_t, j)`` returns every site's clipped gradient sum of step j (the
        transport moves them). Each step is checked against the budget, recorded in the
        ledger and persisted BEFORE the server draws its noise (``server.noise``), like a
        training step. The fitted log T is the mean of the last half of the iterates
        (:func:`~fedsgld.calibration.recal.tail_average`, post-processing). A resumed run
        whose recalibration finished reuses its temperature.
        Returns the recalibration's state (None when ``recal_fraction`` is 0).
        """
        from fedsgld.calibration.recal import (
            RECAL_STREAM,
            RecalPlan,
            tail_average,
            temperature_step,
        )
        from fedsgld.strategies.server import SERVER_STREAM

        plan = RecalPlan.from_config(self.config)
        if plan is None:
            return None
        done = self.extra_state.get("recal")
        if done:
            self.log(f"resume: recalibration done before, temperature {done['temperature']:.4g}")
            self.recal = done
            return done
        server, acc = self.server, self.server.accountant
        before = [list(e) for e in acc.ledger] if acc is not None else []
        expected = plan.sample_rate * sum(calibration_sizes)
        if plan.clip is not None and plan.noise_multiplier * plan.clip / expected > plan.clip / 2:
            self.log(
                f"warning: recalibration on {sum(calibration_sizes)} calibration records at "
                f"recal_noise_multiplier {plan.noise_multiplier:g}: each step's noise exceeds "
                "half the clip bound, so the fitted temperature is dominated by noise; "
                "raise recal_fraction or lower recal_noise_multiplier (more epsilon)"
            )
        log_t, taken = 0.0, 0
        reason = f"completed {plan.steps} steps"
        trace = [log_t]
        for j in range(plan.steps):
            if acc is not None and not acc.check(plan.sample_rate, plan.noise_multiplier):
                reason = (
                    f"privacy budget: recalibration step {j + 1} (q={plan.sample_rate:g}, "
                    f"sigma={plan.noise_multiplier:g}) would take epsilon past "
                    f"{self.config.privacy.epsilon:g}; spent {acc.rigorous_epsilon():.4f}"
                )
                break
            total = torch.stack([s.reshape(-1).double() for s in site_sums(log_t, j)]).sum(0)
            std = 0.0
            if acc is not None:
                acc.step(plan.sample_rate, plan.noise_multiplier)
                self.persist_ledger()  # the ledger first, then the noise
                std = plan.noise_multiplier * plan.clip
            noisy = total + server.noise.gaussian(
                total.shape, std=std, key=(SERVER_STREAM, RECAL_STREAM, j, 0), dtype=torch.float64
            )
            log_t = temperature_step(log_t, noisy, lr=plan.lr, expected_batch=expected)
            trace.append(log_t)
            taken += 1
        log_t = tail_average(trace[1:])
        state = {
            "temperature": math.exp(log_t),
            "log_temperature": log_t,
            "steps": taken,
            "halt_reason": reason,
            "log_temperature_trace": trace,
            "ledger_before": before,
            "plan": plan.to_dict(),
            "calibration_sizes": list(calibration_sizes),
        }
        self.log(f"recalibration: {reason}; temperature {state['temperature']:.4g}")
        self.recal = state
        self.checkpoint(recal=state)
        return state

    def _recal_privacy(self) -> dict[str, Any]:
        """privacy.recalibration of results.json: the split of epsilon and its composition."""
        acc, st, p = self.server.accountant, self.recal, self.config.privacy
        block: dict[str, Any] = {
            **st["plan"],
            "steps_taken": st["steps"],
            "noise_per_step": None
            if st["plan"]["noise_multiplier"] is None
            else st["plan"]["noise_multiplier"]
            * st["plan"]["clip"]
            / (st["plan"]["sample_rate"] * sum(st["calibration_sizes"])),
            "halt_reason": st["halt_reason"],
            "calibration_sizes": st["calibration_sizes"],
        }
        if acc is None:
            block["note"] = "no noise: the method has no privacy guarantee"
            return block
        sigma = acc.bucket(st["plan"]["noise_multiplier"])
        recal_ledger = [(st["plan"]["sample_rate"], sigma, st["steps"])]
        block.update(
            epsilon_training=acc.epsilon(ledger=st["ledger_before"]),
            epsilon_recalibration=acc.epsilon(ledger=recal_ledger),
            epsilon_total=acc.epsilon(),
            budget=p.epsilon,
            note=(
                "The calibration records are training records of the same patients, so "
                "recalibration and training compose in one ledger: epsilon_total is the "
                "whole ledger's (training, then recalibration), and it is what the budget "
                "bounds; epsilon_training is the ledger before recalibration (on a resume it "
                "also counts steps of an interrupted earlier recalibration), "
                "epsilon_recalibration the recalibration steps alone."
            ),
        )
        return block

    def _record(self, evaluate: Evaluate, plan) -> float | None:
        server = self.server
        ev = evaluate({"last": [server.theta]})
        if ev is None:
            return None
        pooled = ev["last"]["pooled"]
        self.history.append(
            {
                "round": server.t,
                "step_size": plan.step_size,
                "sigma": plan.sigma,
                "epsilon": server.accountant.rigorous_epsilon()
                if server.accountant
                else float("inf"),
                "test_nll": pooled["nll"],
                "test_accuracy": pooled["accuracy"],
                "test_ece": pooled["ece"],
            }
        )
        return pooled["accuracy"]

    # -- results ---------------------------------------------------------------------------
    def finish(
        self,
        evaluate: Evaluate,
        *,
        sites: list[dict[str, Any]],
        config_source: str | None,
        transport_info: Callable[[], dict[str, Any]] | None = None,
        evaluate_recal: Callable[[float], dict[str, Any]] | None = None,
        validate: Evaluate | None = None,
        validate_recal: Callable[[float], dict[str, Any]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """The final evaluation (last iterate; posterior average) and the result directory.

        ``validate`` / ``validate_recal``: the same evaluations on the sites' validation
        splits (results.json's ``validation``: what hyper-parameters are chosen on).

        ``transport_info()`` (called after the final evaluation) gives the transport's own
        block of results.json (e.g. ``flower``: nodes, dropped replies). Returns (results.json's dict, the last iterate's evaluation, the posterior's or None).
        """
        from fedsgld.run.results import write_outputs

        server = self.server
        groups = {"last": [server.theta]}
        if len(server.posterior):
            groups["posterior"] = list(server.posterior.samples)
        swag, swag_samples = server.posterior.swag, self.config.run.swag_samples
        if swag is not None and len(swag) >= 2 and swag_samples > 0:
            # the draws' generator: a key no privacy stream uses (one part, plus the epoch)
            groups["swag"] = swag.sample(
                swag_samples, generator=self._randomness().generator(SWAG_STREAM)
            )
        ev = evaluate(groups)
        if ev is None:
            raise RuntimeError("final evaluation: every site failed (see the logged reasons)")
        last, post = ev["last"], ev.get("posterior")
        metrics = metrics_block(server, last, post)
        extra_curves: dict[str, dict[str, Any]] = {}
        if "swag" in ev:
            metrics["swag"] = swag_block(server, ev["swag"], swag_samples)
            extra_curves[SWAG["label"]] = ev["swag"]
        if self.recal is not None and evaluate_recal is not None:
            ev_r = evaluate_recal(self.recal["temperature"])
            ev = {**ev, "recal": ev_r}
            metrics["recal"] = recal_block(self.recal, last, ev_r)
            extra_curves[RECAL["label"]] = ev_r
        results: dict[str, Any] = {
            "fedsgld_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "config_source": config_source,
            "config": self.user_config.flat(),
            "seed": self.seed,
            "seed_source": self.seed_source,
            "engine": self.transport,
            "device": {
                "setting": self.config.perf.device,
                "note": "where the sites computed (the server's update runs on the CPU)",
            },
            "privacy": privacy_block(server, self.config, self.randomness_record()),
            "sites": sites,
            "round_contributors": self.contributors,
            "history": self.history,
            "metrics": metrics,
            "wall_time_s": time.perf_counter() - self.t_start,
            "round_wall_time_s": round_time_summary(self.round_times),
        }
        if self.recal is not None:
            results["privacy"]["recalibration"] = self._recal_privacy()
        if self.chain.head is not None:
            results["privacy"]["ledger_record"] = self.chain.head.record()
        if validate is not None:
            results["validation"] = validation_block(
                validate(groups),
                validate_recal(self.recal["temperature"])
                if validate_recal is not None and self.recal is not None
                else None,
            )
        if transport_info is not None:
            results[self.transport] = transport_info()
        write_outputs(self.out, results, last=last, posterior=post, extra=extra_curves)
        self.evaluations = ev
        self.log(f"results in {self.out}")
        results["out_dir"] = str(self.out)
        return results, last, post
