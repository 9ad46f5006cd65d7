"""The ServerApp's round loop: discovery, DP-SGLD rounds, checkpoints, resume, results.

``serve(grid, run_config)`` is what ``@app.main()`` runs. It works on any Flower ``Grid``
(Flower's simulation, a real SuperLink, or :class:`fedsgld.flower.local_grid.LocalGrid`):

1. Discovery: waits until every site 0..K-1 has a connected node (``wait-for-sites``
   seconds), asks each node which sites it hosts and their public sizes N_k.
2. The server: built by :mod:`fedsgld.federation` as the engine builds it (the same
   seeded model, :func:`~fedsgld.federation.make_server`).
3. Rounds: the server's plan (budget check), then its round mode
   (:mod:`fedsgld.strategies.modes`) charges, asks the sites through :class:`_Exchanges`
   (train messages and checked replies ordered by site id,
   :class:`~fedsgld.flower.strategy.LangevinStrategy`, where fewer than ``min_sites`` good
   replies fail the run: :class:`~fedsgld.flower.strategy.TooFewSites`; or, for a secure
   sum, five ``train.secagg`` exchanges, :mod:`fedsgld.flower.secure_rounds`) and steps;
   the ledger is written to ``ledger.json`` BEFORE each step's noise is drawn; evaluation
   every ``eval_every`` rounds; ``checkpoint.pt`` every ``checkpoint_every`` rounds.
4. The result directory of the in-process engine (``results.json``, ``report.md``,
   plots), with ``"engine": "flower"`` and a ``flower`` block (dropped replies, nodes).

Everything around the rounds (the ledger before the noise, checkpoints, resume with a
new epoch and fresh noise, the evaluation schedule, results.json) is
:class:`fedsgld.run.lifecycle.RunLifecycle`, exactly as in the in-process engine. The
server's noise comes from its own randomness (``randomness = "os"`` in deployments);
nothing that decides it is in any message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from fedsgld.config import Config
from fedsgld.core.plan import RoundPlan
from fedsgld.core.release import Charged
from fedsgld.federation import ModelFactory, initial_theta, make_server
from fedsgld.flower.directory import (  # noqa: F401 - PlacementRefused: importable here
    PlacementRefused,
    discover_sites,
    rejoin_sites,
)
from fedsgld.flower.exchange import (
    ReplyPacer,
    exchange,
    polls_are_requests,
)
from fedsgld.flower.protocol import run_record, split_run_config
from fedsgld.flower.secure_rounds import SecureRounds
from fedsgld.flower.standardize import release_over_flower
from fedsgld.flower.strategy import LangevinStrategy, SiteEntry, TooFewSites
from fedsgld.privacy.distributed import DDGParameters
from fedsgld.run.evaluation import Evaluations, RunResult
from fedsgld.run.lifecycle import RunLifecycle
from fedsgld.run.progress import RoundInfo
from fedsgld.secagg import RoundAborted
from fedsgld.strategies import LangevinServer

_log = logging.getLogger("fedsgld")


def _evaluate(
    grid: Grid,
    strategy: LangevinStrategy,
    rnd: int,
    groups: dict[str, list[torch.Tensor]],
    timeout: float,
    poll: float,
) -> Evaluations | None:
    # one model (group) per message: a site's guard answers one evaluation per message
    evaluation: Evaluations = {}
    for name, thetas in groups.items():
        arrays = {str(i): Array(th.detach().float().numpy()) for i, th in enumerate(thetas)}
        keys = {name: list(range(len(thetas)))}
        msgs = strategy.configure_evaluate(
            rnd, ArrayRecord(arrays), ConfigRecord({"groups": json.dumps(keys)}), grid
        )
        replies = exchange(grid, list(msgs), timeout=timeout, poll=poll)
        strategy.aggregate_evaluate(rnd, replies)
        evaluation.update(strategy.evaluation or {})
    return evaluation if "last" in evaluation else None


class _Exchanges:
    """The server's messages of one run over ``grid``: training rounds and evaluations.
    The Flower transport of a round (:class:`fedsgld.strategies.modes.Transport`): the
    server's round mode asks the sites through it."""

    def __init__(
        self, grid: Grid, strategy: LangevinStrategy, opts: dict[str, Any], pacer, config: Config
    ) -> None:
        self.grid, self.strategy, self.pacer, self.config = grid, strategy, pacer, config
        self.rejoined: list[dict[str, int]] = []  # sites bound to a new node after a crash
        self._asked: dict[int, int] = {}  # node new to the run -> times asked (rejoin_sites)
        self.server = strategy.server
        self.timeout, self.poll = opts["round-timeout"], opts["poll-interval"]
        self.secure = SecureRounds(
            strategy,
            lambda msgs: exchange(grid, msgs, timeout=self.timeout, poll=self.poll),
            pipeline=opts["secagg-pipeline"],
        )

    def one_round(self) -> RoundPlan | None:
        """One training round; the plan it ran, or None (no round left)."""
        server = self.server
        self.rejoined += rejoin_sites(
            self.grid, self.config, self.strategy, self._asked,
            timeout=self.timeout, poll=self.poll, log=self.strategy.log,
        )  # fmt: skip
        self.strategy.plan = plan = server.plan()
        if plan is None:
            return None
        server.mode.round(self, plan)
        return plan

    def _train(self, plan: RoundPlan, key: str) -> dict[int, torch.Tensor]:
        """One train message per site; the checked answers (``key``) by site id."""
        server, strategy = self.server, self.strategy
        arrays = ArrayRecord({"theta": Array(server.theta.numpy())})
        msgs = list(strategy.configure_train(server.t + 1, arrays, ConfigRecord(), self.grid))
        replies = exchange(self.grid, msgs, timeout=self.timeout, poll=self.poll, pacer=self.pacer)
        strategy.aggregate_train(server.t + 1, replies, key=key)
        return strategy.answers

    def clipped_sums(self, plan: RoundPlan) -> list[torch.Tensor]:
        return list(self._train(plan, "sum").values())

    def local_rounds(self, plan: RoundPlan, paid: Charged) -> list[tuple[int, torch.Tensor]]:
        """The sites' parameters after their local steps, weighted by their public N_k
        (each site draws its own noise; ``paid`` is the server's copy of the charge)."""
        answers = self._train(plan, "theta")
        return [(self.strategy.directory[k].n_train, th) for k, th in answers.items()]

    def secure_sum(self, plan: RoundPlan, params: DDGParameters) -> torch.Tensor:
        return self.secure.secure_sum(plan, params)

    def evaluate(self, groups: dict[str, list[torch.Tensor]]):
        return _evaluate(self.grid, self.strategy, self.server.t, groups, self.timeout, self.poll)


def _refuse_engine_only_settings(config: Config) -> None:
    """Held-out splits exist in the in-process engine only."""
    if config.run.recal_fraction > 0:
        raise ValueError(
            "recal_fraction > 0: private recalibration runs in the in-process engine "
            "(fedsgld simulate) only; set recal_fraction = 0 for a Flower run"
        )
    if config.run.validation_fraction > 0:
        raise ValueError(
            "validation_fraction > 0: validation splits (for fedsgld sweep) exist in the "
            "in-process engine (fedsgld simulate) only; set validation_fraction = 0 for a "
            "Flower run"
        )


def _finish(
    lc: RunLifecycle,
    exchanges: _Exchanges,
    directory: dict[int, SiteEntry],
    all_drops: Callable[[], list[dict[str, Any]]],
) -> RunResult:
    """The final evaluation and the result directory, with results.json's ``flower`` block."""
    sites = [
        {"site": k, "n_train": e.n_train, "n_test": e.n_test, "label_histogram": e.label_histogram}
        for k, e in directory.items()
    ]
    holder: dict[str, Any] = {}

    def final_evaluate(groups):
        ev = exchanges.evaluate(groups)
        if ev is not None:
            holder["missing"] = ev["last"].missing_sites
            holder["pooled_from"] = ev["last"].pooled_from
        return ev

    return lc.finish(
        final_evaluate,
        sites=sites,
        config_source="flower run config",
        transport_info=lambda: {
            "nodes": {str(k): e.node_id for k, e in exchanges.strategy.directory.items()},
            "rejoined": exchanges.rejoined,
            "dropped_replies": all_drops(),
            "evaluation_missing_sites": holder.get("missing"),
            "pooled_metrics_from": holder.get("pooled_from"),
            **exchanges.server.mode.transport_info(exchanges.secure.summary),
        },
    )


def serve(
    grid: Grid,
    run_config: dict[str, Any],
    *,
    log: Callable[[str], None] | None = None,
    on_server: Callable[[LangevinServer], None] | None = None,
    model_fn: ModelFactory | None = None,
    on_round: Callable[[RoundInfo], Any] | None = None,
) -> RunResult:
    """Run one DP-SGLD federation over ``grid``; write its result directory and return its
    :class:`~fedsgld.run.evaluation.RunResult`.
    ``on_server``: called with the server before the first round (an audit reads its
    releases there: :mod:`fedsgld.studies.audit_flower`). ``model_fn``: a user's model
    factory (the Python API; the sites build theirs from the same one), whose seeded
    parameters are theta_0; ``on_round``: called after every round."""
    log = log or _log.info
    config, opts = split_run_config(run_config)
    _refuse_engine_only_settings(config)
    lc = RunLifecycle(
        config,
        out=Path(opts["out"]).expanduser().resolve() if opts["out"] else None,
        resume=opts["resume"],
        transport="flower",
        tag=f"flower-{config.privacy.method}",
        log=log,
    )
    config = lc.config  # seed resolved
    directory = discover_sites(
        grid, config, timeout=opts["wait-for-sites"], log=log, poll=opts["poll-interval"]
    )
    first = next(iter(directory.values()))
    server = make_server(
        config,
        theta=initial_theta(config, first.input_shape, first.num_classes, model_fn=model_fn),
        site_sizes=[e.n_train for e in directory.values()],
        seed=lc.seed,
        randomness=lc.server_randomness(),
        run_key=lc.run_key,
    )
    lc.attach(server)
    if on_server is not None:
        on_server(server)
    strategy = LangevinStrategy(
        server,
        directory,
        run_record(config),
        log=log,
        run_key=lc.run_key,
        epoch=lc.epoch,
        min_sites=config.run.min_sites,
    )
    release_over_flower(  # the pooled standardisation's one release, before any round
        lc, grid, strategy, config,
        timeout=opts["round-timeout"], poll=opts["poll-interval"], log=log,
    )  # fmt: skip
    drops_before: list[dict[str, Any]] = list(lc.extra_state.get("flower_drops", []))

    def all_drops() -> list[dict[str, Any]]:
        return drops_before + [d.to_dict() for d in strategy.drops]

    pacer = ReplyPacer() if polls_are_requests(grid) else None
    exchanges = _Exchanges(grid, strategy, opts, pacer, config)
    lc.train(
        exchanges.one_round,
        exchanges.evaluate,
        progress="log",  # a line every few seconds in the server's log
        on_checkpoint=lambda: {"flower_drops": all_drops()},
        checkpoint_on=(TooFewSites, RoundAborted),
        contributors=lambda: strategy.last_train_sites,
        on_round=on_round,
    )
    strategy.summary()
    return _finish(lc, exchanges, directory, all_drops)
