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

The parts it drives live beside it (see :mod:`fedsgld.run`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedsgld.calibration.recal import RecalPlan
from fedsgld.config import Config
from fedsgld.core.noise import Randomness
from fedsgld.files import atomic_write, strict_json, write_json
from fedsgld.run.blocks import (
    Evaluate,
    budget_accounting,
    history_row,
    note_contributors,
    randomness_block,
)
from fedsgld.run.evaluation import Evaluation, Evaluations, RunResult
from fedsgld.run.layout import (
    CHECKPOINT,
    LEDGER,
    LIFECYCLE_VERSION,
    ckpt_config,
    new_run_dir,
)
from fedsgld.run.progress import Progress, RoundInfo
from fedsgld.run.recalibration import (
    fit_site_calibration,
    fit_temperature,
    reserve_recalibration,
)
from fedsgld.run.resume import open_run_dir, resolve_seed, restore_ledger
from fedsgld.run.stops import (
    RunInterrupted,
    discard_unreleased,
    refuse_empty_plan,
    released_nothing,
)
from fedsgld.run.tracking import tracker_for


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
        if config.privacy.standardize_stats:
            raise ValueError(
                "standardize_stats is what a Flower run's server sends its sites after the "
                "pooled standardisation's release; a run's config leaves it empty"
            )
        self.t_start = time.perf_counter()
        self.transport = transport
        self.log = log
        self.user_config = config
        out = Path(out).expanduser() if out else new_run_dir(tag=tag or config.privacy.method)
        self.out = out
        self.tracker = tracker_for(config, out)  # the experiment tracker (run/tracking.py)
        self.created = not out.exists()  # removed again if interrupted before any release
        self.saved = open_run_dir(out, config, resume=resume, log=log)
        self.ckpt, self.ledger_file = self.saved.ckpt, self.saved.ledger_file
        self.chain = self.saved.chain
        meta = self.saved.meta
        self.run_key: str = meta.get("run_key") or secrets.token_hex(8)
        self.epoch: int = int(meta.get("epoch", 0))
        self.config, self.seed, self.seed_source = resolve_seed(config, meta)
        self.history: list[dict[str, Any]] = list((self.ckpt or {}).get("history", []))
        self.round_times: list[float] = []
        self.extra_state: dict[str, Any] = dict((self.ckpt or {}).get("extra", {}))
        self.contributors: list[dict[str, Any]] = list(
            (self.ckpt or {}).get("round_contributors") or []
        )
        self.server = None
        self.evaluations: Evaluations = {}  # the final evaluation, by group
        self.recal: dict[str, Any] | None = None  # the recalibration's state, once run

    # -- randomness ------------------------------------------------------------------------
    def _randomness(self) -> Randomness:
        run = self.config.run
        seeded = run.randomness != "os"
        return Randomness.chosen(seeded=seeded, seed=self.seed, epoch=self.epoch, secure=run.secure)

    def server_randomness(self) -> Randomness:
        """The server's own noise (seeded: keyed by the epoch, so a resume never replays)."""
        return self._randomness()

    def site_randomness(self) -> Randomness:
        """A simulated site's randomness (in-process engine): seeded like the server's, or
        its own system randomness."""
        return self._randomness()

    def randomness_record(self) -> dict[str, Any]:
        """results.json's ``privacy.randomness``."""
        return randomness_block(self.config, epoch=self.epoch, run_key=self.run_key)

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
        sealed, link = self.chain.seal(strict_json(state), epoch=self.epoch)
        self.out.mkdir(parents=True, exist_ok=True)  # a new run's directory: its first write
        write_json(self.out / LEDGER, sealed)
        self.chain.append(link)  # after ledger.json: a crash between them is completed on resume

    def attach(self, server) -> None:
        """Restore ``server`` from the checkpoint and the larger ledger, hook the ledger
        write in front of every noise draw, and persist the new epoch before anything runs.

        A new run whose budget affords no round is refused here
        (:class:`~fedsgld.run.stops.NothingToSpend`), before its directory exists."""
        self.server = server
        server.on_spend = self.persist_ledger
        if self.ckpt is not None:
            server.load_state_dict(self.ckpt["server"])
        if self.ckpt is not None or self.ledger_file is not None:
            restore_ledger(server, self.saved, out=self.out, config=self.config, log=self.log)
            acc = server.accountant
            where = f"round {server.t}" if self.ckpt is not None else "round 0 (no checkpoint)"
            self.log(
                f"resumed at {where}, epoch {self.epoch}; the ledger holds "
                f"{acc.steps if acc is not None else 0} steps (fresh noise from here on)"
            )
        else:
            refuse_empty_plan(self.config, server)
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
        progress: bool | str = True,
        on_checkpoint: Callable[[], dict[str, Any]] | None = None,
        checkpoint_on: tuple[type[BaseException], ...] = (),
        contributors: Callable[[], list[int]] | None = None,
        on_round: Callable[[RoundInfo], Any] | None = None,
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
        ``on_round(info)``: called after every round (:class:`~fedsgld.run.progress.RoundInfo`).
        ``progress``: True, a progress bar; ``"log"``, a line every few seconds; False,
        nothing per round (:class:`~fedsgld.run.progress.Progress`).
        Ctrl-C raises :class:`~fedsgld.run.stops.RunInterrupted` (see :meth:`_interrupted`).
        """
        server = self.server
        extra = on_checkpoint or (lambda: {})
        fresh = self.ckpt is None and self.ledger_file is None
        try:  # the rounds cut so that recalibration fits
            reserved = reserve_recalibration(
                server,
                self.config,
                done=bool(self.extra_state.get("recal")),
                fresh=fresh,
                log=self.log,
            )
        except ValueError:  # a new run whose recalibration cannot fit: refused, nothing kept
            if fresh and released_nothing(server):
                discard_unreleased(self.out, created=self.created)
            raise
        bar = self._progress(enabled=progress)
        self.tracker.start(self)
        last_plan = None
        try:
            while True:
                t0 = time.perf_counter()
                plan = round_fn()
                if plan is None:
                    break
                last_plan = plan
                note_contributors(
                    self.contributors,
                    plan.round,
                    contributors() if contributors else list(range(self.config.run.sites)),
                )
                acc = self._after_round(plan, evaluate, extra)
                self.round_times.append(time.perf_counter() - t0)
                bar.update(server, evaluated=acc)
                if on_round is not None:
                    on_round(RoundInfo(server.t, bar.total, bar.eps, acc, server.theta))
        except KeyboardInterrupt:
            bar.close()
            self.tracker.stop("KILLED")
            raise self._interrupted(extra) from None
        except checkpoint_on:
            bar.close()
            self.tracker.stop("FAILED")
            self.checkpoint(**extra())
            raise
        except BaseException:
            bar.close()
            self.tracker.stop("FAILED")
            raise
        bar.close()
        self._stop(reserved, last_plan, evaluate, extra)

    def _interrupted(self, extra) -> RunInterrupted:
        """Ctrl-C during training: a run that released nothing leaves no run files (and no
        directory it created); any other is checkpointed, resumable."""
        server = self.server
        if released_nothing(server) and self.ckpt is None and self.ledger_file is None:
            discard_unreleased(self.out, created=self.created)
            return RunInterrupted(0, None)
        self.checkpoint(**extra())
        return RunInterrupted(server.t, self.out)

    def _progress(self, *, enabled: bool | str) -> Progress:
        """Log what the budget allows; the progress display over the affordable rounds."""
        server, run = self.server, self.config.run
        affordable = server.affordable_rounds()
        if server.accountant is not None:
            self.log(
                f"budget epsilon={self.config.privacy.epsilon:g} at delta="
                f"{self.config.privacy.delta:g} ({budget_accounting(server)}) allows "
                f"{affordable} of the remaining {run.rounds - server.t} rounds"
            )
        return Progress(
            enabled=enabled,
            total=server.t + affordable,
            initial=server.t,
            desc=self.config.privacy.method,
            log=self.log,
        )

    def _after_round(self, plan, evaluate: Evaluate, extra) -> float | None:
        """The evaluation and the checkpoint due after the round just taken."""
        run, t = self.config.run, self.server.t
        acc = None
        if run.eval_every and (t % run.eval_every == 0 or t == run.rounds):
            acc = self._record(evaluate, plan)
        if run.checkpoint_every and t % run.checkpoint_every == 0:
            self.checkpoint(**extra())
        return acc

    def _stop(self, reserved, last_plan, evaluate: Evaluate, extra) -> None:
        """Say why training stopped, evaluate where it stopped, checkpoint."""
        server, run = self.server, self.config.run
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

    # -- recalibration -----------------------------------------------------------------
    def recalibrate(
        self,
        site_sums: Callable[..., list[torch.Tensor]],
        *,
        calibration_sizes: list[int],
    ) -> dict[str, Any] | None:
        """Fit the last iterate's temperature privately (:mod:`fedsgld.calibration.recal`;
        ``recal_scope = "site"``: each site's own, :func:`fit_site_calibration`).

        ``site_sums(log_t, j)`` returns every site's clipped gradient sum of step j (the
        transport moves them; site scope: ``site_sums(params, j, receipt)``, noised). Each step is checked against the budget, recorded in the
        ledger and persisted BEFORE the server draws its noise (``server.noise``), like a
        training step. The fitted log T is the mean of the last half of the iterates
        (:func:`~fedsgld.calibration.recal.tail_average`, post-processing). A resumed run
        whose recalibration finished reuses its temperature.
        Returns the recalibration's state (None when ``recal_fraction`` is 0).
        """
        plan = RecalPlan.from_config(self.config)
        if plan is None:
            return None
        done = self.extra_state.get("recal")
        if done:
            self.log("resume: recalibration done before; its fitted values are kept")
            self.recal = done
            return done
        site_scope = self.config.run.recal_scope == "site"
        state = (fit_site_calibration if site_scope else fit_temperature)(
            self.server,
            plan,
            site_sums,
            calibration_sizes=calibration_sizes,
            epsilon_budget=self.config.privacy.epsilon,
            persist=self.persist_ledger,
            log=self.log,
        )
        self.recal = state
        self.checkpoint(recal=state)
        return state

    def _record(self, evaluate: Evaluate, plan) -> float | None:
        """Evaluate the last iterate into ``history``; its pooled test accuracy."""
        server = self.server
        ev = evaluate({"last": [server.theta]})
        if ev is None:
            return None
        pooled = ev["last"].pooled
        self.history.append(history_row(server, plan, pooled))
        self.tracker.round(self, ev["last"])
        return pooled["accuracy"]

    # -- results ---------------------------------------------------------------------------
    def finish(
        self,
        evaluate: Evaluate,
        *,
        sites: list[dict[str, Any]],
        config_source: str | None,
        transport_info: Callable[[], dict[str, Any]] | None = None,
        evaluate_recal: Callable[[float], Evaluation] | None = None,
        validate: Evaluate | None = None,
        validate_recal: Callable[[float], Evaluation] | None = None,
    ) -> RunResult:
        """The final evaluation (last iterate; posterior average) and the result directory.

        ``validate`` / ``validate_recal``: the same evaluations on the sites' validation
        splits (results.json's ``validation``: what hyper-parameters are chosen on).

        ``transport_info()`` (called after the final evaluation) gives the transport's own
        block of results.json (e.g. ``flower``: nodes, dropped replies). Returns the
        :class:`~fedsgld.run.evaluation.RunResult` (results.json's document, the run
        directory, the final evaluations: ``last``, ``posterior``, ``swag``, ``recal``).
        """
        # local: the result files need matplotlib (about a second to import), which a
        # site's process, importing the engine and so this module, never uses
        # (tests/run/test_run_files.py)
        from fedsgld.run import outputs

        groups = outputs.final_groups(self)
        ev = evaluate(groups)
        if ev is None:
            raise RuntimeError("final evaluation: every site failed (see the logged reasons)")
        last, post = ev["last"], ev.get("posterior")
        metrics, curves, self.evaluations = outputs.final_metrics(self, ev, evaluate_recal)
        results = outputs.results_document(self, metrics, sites=sites, config_source=config_source)
        if validate is not None:
            results["validation"] = outputs.validation(self, groups, validate, validate_recal)
        if transport_info is not None:
            results[self.transport] = transport_info()
        outputs.write_outputs(self.out, results, last=last, posterior=post, extra=curves)
        self.log(f"results in {self.out}")
        self.tracker.finish(self, results)
        return RunResult(results, self.out, self.evaluations)


__all__ = ["RunLifecycle"]
