"""The ServerApp's round loop: discovery, DP-SGLD rounds, checkpoints, resume, results.

``serve(grid, run_config)`` is what ``@app.main()`` runs. It works on any Flower ``Grid``
(Flower's simulation, a real SuperLink, or :class:`fedsgld.apps.local_grid.LocalGrid`):

1. Discovery: waits until every site 0..K-1 has a connected node (``wait-for-sites``
   seconds), asks each node which sites it hosts and their public sizes N_k.
2. The server: the model is built exactly as the engine builds it (same seed), and
   :class:`~fedsgld.strategies.LangevinServer` gets the same arguments as
   ``Federation.make_server`` gives it.
3. Rounds (:class:`~fedsgld.strategies.flower.LangevinStrategy`): plan (budget check),
   train messages, checked replies ordered by site id, ``LangevinServer.apply``; the
   ledger is written to ``ledger.json`` BEFORE each step's noise is drawn; evaluation
   every ``eval_every`` rounds; ``checkpoint.pt`` every ``checkpoint_every`` rounds.
4. The result directory of the in-process engine (``results.json``, ``report.md``,
   plots), with ``"engine": "flower"`` and a ``flower`` block (dropped replies, nodes).

Resume (``resume = true`` with the same ``out``) restores parameters, posterior samples
and history from ``checkpoint.pt`` and the ledger from ``ledger.json``, exactly as the
engine does: steps whose output was lost stay counted, so budget is never spent twice.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from .. import __version__
from ..config import Config
from ..core.mechanism import FlatModel
from ..engine import (
    CHECKPOINT,
    LEDGER,
    _atomic_write,
    _privacy_block,
    metrics_block,
    new_run_dir,
    round_time_summary,
    write_json,
)
from ..privacy.noise import os_seed
from ..strategies import LangevinServer, PosteriorSamples
from ..strategies.flower import AllSitesFailed, LangevinStrategy, SiteEntry
from .protocol import QUERY, run_record, split_run_config

_log = logging.getLogger("fedsgld")

DISCOVERY_POLL_S = 0.5


class SitesUnavailable(RuntimeError):
    """Not every site had a connected node before ``wait-for-sites`` ran out."""


def _ckpt_config(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config.flat().items() if k not in ("threads",)}


def exchange(grid: Grid, messages: list[Message], *, timeout: float, poll: float) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` s have passed.

    The same as ``Grid.send_and_receive`` but polling every ``poll`` seconds: Flower's
    deployment grid sleeps 3 s between polls, a large share of a round on loopback.
    """
    ids = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while ids:
        got = list(grid.pull_messages(ids))
        replies.extend(got)
        ids.difference_update(m.metadata.reply_to_message_id for m in got)
        if not ids or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    return replies


def discover(
    grid: Grid,
    *,
    sites: int,
    message: Callable[[int], Message],
    entries: Callable[[Message], list[tuple[int, Any]]],
    timeout: float,
    poll: float,
    log: Callable[[str], None],
) -> dict[int, tuple[int, Any]]:
    """Ask every connected node which sites it hosts until sites 0..sites-1 are all found.

    ``message(node_id)`` builds the question; ``entries(reply)`` parses an answer into
    (site, entry) pairs (``KeyError``/``TypeError``/``ValueError`` for a bad answer, which is
    logged against its node). Returns site -> (node id, entry), by site. A site claimed by
    two nodes is an error; sites still missing after ``timeout`` raise
    :class:`SitesUnavailable` naming every node's problem.
    """
    want = set(range(sites))
    deadline = time.monotonic() + timeout
    asked: set[int] = set()
    found: dict[int, tuple[int, Any]] = {}
    errors: dict[int, str] = {}
    while True:
        new = sorted(set(grid.get_node_ids()) - asked)
        if new:
            left = max(deadline - time.monotonic(), 1.0)
            replies = exchange(grid, [message(n) for n in new], timeout=left, poll=poll)
            asked.update(new)
            for r in replies:
                node = int(r.metadata.src_node_id)
                if r.has_error():
                    errors[node] = str(r.error.reason or "")[-500:]
                    log(f"node {node} could not prepare its sites: {errors[node]}")
                    continue
                try:
                    pairs = entries(r)
                    for site, _ in pairs:
                        if site not in want:
                            raise ValueError(f"site {site} is not in 0..{sites - 1}")
                except (KeyError, TypeError, ValueError) as err:
                    errors[node] = f"bad query reply: {err}"
                    log(f"node {node}: {errors[node]}")
                    continue
                for site, entry in pairs:
                    if site in found:
                        raise ValueError(
                            f"site {site} is hosted by nodes {found[site][0]} and {node}; "
                            "each site must have exactly one node"
                        )
                    found[site] = (node, entry)
        if set(found) == want:
            return dict(sorted(found.items()))
        if time.monotonic() >= deadline:
            missing = sorted(want - set(found))
            detail = "; ".join(f"node {n}: {e}" for n, e in errors.items())
            raise SitesUnavailable(
                f"sites {missing} had no working node after {timeout:g} s "
                f"({len(asked)} node(s) answered){'; ' + detail if detail else ''}"
            )
        time.sleep(DISCOVERY_POLL_S)


def discover_sites(
    grid: Grid, config: Config, *, timeout: float, log: Callable[[str], None], poll: float = 0.2
) -> dict[int, SiteEntry]:
    """The DP-SGLD sites: their nodes and public sizes (:func:`discover` with ``query``)."""
    run = run_record(config)

    def entries(r: Message) -> list[tuple[int, SiteEntry]]:
        out = []
        for e in json.loads(str(r.content["sites"]["json"])):
            entry = SiteEntry(
                site=int(e["site"]),
                node_id=int(r.metadata.src_node_id),
                n_train=int(e["n_train"]),
                n_test=int(e["n_test"]),
                num_classes=int(e["num_classes"]),
                input_shape=tuple(int(s) for s in e["input_shape"]),
                label_histogram=[int(v) for v in e["label_histogram"]],
            )
            out.append((entry.site, entry))
        return out

    found = discover(
        grid,
        sites=config.run.sites,
        message=lambda n: Message(RecordDict({"run": run}), n, QUERY, group_id="discovery"),
        entries=entries,
        timeout=timeout,
        poll=poll,
        log=log,
    )
    directory = {k: entry for k, (_, entry) in found.items()}
    shapes = {(e.num_classes, e.input_shape) for e in directory.values()}
    if len(shapes) != 1:
        raise ValueError(f"sites disagree on (num_classes, input_shape): {sorted(shapes)}")
    log(
        "sites: "
        + ", ".join(
            f"{k}@node {e.node_id} ({e.n_train} train, {e.n_test} test)"
            for k, e in directory.items()
        )
    )
    return directory


def initial_theta(config: Config, entry: SiteEntry) -> torch.Tensor:
    """theta_0: the model the engine builds (``torch.manual_seed(seed)`` then build_model)."""
    from ..models import build_model

    with torch.random.fork_rng():
        torch.manual_seed(config.run.seed)
        model = build_model(
            config.run.model,
            input_shape=entry.input_shape,
            num_classes=entry.num_classes,
            hidden=config.run.hidden,
        )
    from ..engine import variational_view

    return (variational_view(config, model) or FlatModel(model)).flatten()


def _evaluate(
    grid: Grid,
    strategy: LangevinStrategy,
    rnd: int,
    groups: dict[str, list[torch.Tensor]],
    timeout: float,
    poll: float,
) -> dict[str, dict[str, Any]] | None:
    arrays: dict[str, Array] = {}
    keys: dict[str, list[int]] = {}
    for name, thetas in groups.items():
        keys[name] = []
        for th in thetas:
            i = len(arrays)
            arrays[str(i)] = Array(th.detach().float().numpy())
            keys[name].append(i)
    msgs = strategy.configure_evaluate(
        rnd, ArrayRecord(arrays), ConfigRecord({"groups": json.dumps(keys)}), grid
    )
    replies = exchange(grid, list(msgs), timeout=timeout, poll=poll)
    strategy.aggregate_evaluate(rnd, replies)
    return strategy.evaluation


def serve(
    grid: Grid,
    run_config: dict[str, Any],
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one DP-SGLD federation over ``grid``; write and return results.json's dict."""
    from ..results import write_outputs

    log = log or _log.info
    t_start = time.perf_counter()
    config, opts = split_run_config(run_config)
    resume = opts["resume"]
    out = (
        Path(opts["out"]).expanduser()
        if opts["out"]
        else new_run_dir(tag=f"flower-{config.privacy.method}")
    )
    out = out.resolve()
    if resume:
        if not (out / CHECKPOINT).is_file():
            raise ValueError(f"resume: no {CHECKPOINT} in {str(out)!r}")
    elif (out / CHECKPOINT).exists() or (out / LEDGER).exists():
        raise ValueError(
            f"output directory {str(out)!r} already holds a run; set resume=true or choose another out"
        )
    out.mkdir(parents=True, exist_ok=True)

    user_config = config  # as given (seed -1: drawn from the OS below)
    ckpt = None
    if resume:
        ckpt = torch.load(out / CHECKPOINT, weights_only=False)
        if ckpt["config"] != _ckpt_config(user_config):
            raise ValueError(
                "resume: the config differs from the checkpoint's; resume with the same config"
            )
    if config.run.seed == -1:
        seed, seed_source = (int(ckpt["seed"]) if ckpt is not None else os_seed()), "os"
        config = Config.from_flat({**config.flat(), "seed": seed})
    else:
        seed, seed_source = config.run.seed, "config"

    poll = opts["poll-interval"]
    directory = discover_sites(grid, config, timeout=opts["wait-for-sites"], log=log, poll=poll)
    first = next(iter(directory.values()))
    ledger_path = out / LEDGER

    def persist_ledger(acc) -> None:
        write_json(ledger_path, acc.state_dict())

    run_cfg = config.run
    server = LangevinServer(
        config.privacy,
        theta=initial_theta(config, first),
        site_sizes=[e.n_train for e in directory.values()],
        seed=seed,
        rounds=run_cfg.rounds,
        weight_decay=run_cfg.weight_decay,
        posterior=PosteriorSamples(
            burn_in=run_cfg.burn_in, thin=run_cfg.thin, max_samples=run_cfg.max_samples
        ),
        on_spend=persist_ledger,
        prior_std=run_cfg.prior_std,
        optimizer=run_cfg.optimizer,
    )
    strategy = LangevinStrategy(server, directory, run_record(config), log=log)
    history: list[dict[str, Any]] = []
    drops_before: list[dict[str, Any]] = []
    if ckpt is not None:
        server.load_state_dict(ckpt["server"])
        history = ckpt["history"]
        drops_before = ckpt.get("flower_drops", [])
        if server.accountant is not None and ledger_path.is_file():
            server.accountant.load_state_dict(json.loads(ledger_path.read_text()))
        log(
            f"resumed at round {server.t}; ledger holds "
            f"{server.accountant.steps if server.accountant else 0} steps"
        )

    def all_drops() -> list[dict[str, Any]]:
        return drops_before + [d.to_dict() for d in strategy.drops]

    def checkpoint() -> None:
        state = {
            "config": _ckpt_config(user_config),
            "seed": seed,
            "server": server.state_dict(),
            "history": history,
            "ledger": server.accountant.state_dict() if server.accountant else None,
            "flower_drops": all_drops(),
        }
        _atomic_write(out / CHECKPOINT, lambda p: torch.save(state, p))

    affordable = server.affordable_rounds()
    if server.accountant is not None:
        log(
            f"budget epsilon={config.privacy.epsilon:g} at delta={config.privacy.delta:g} "
            f"({server.accountant.rigorous_name}) allows {affordable} of the remaining "
            f"{run_cfg.rounds - server.t} rounds"
        )
    timeout = opts["round-timeout"]
    round_times: list[float] = []
    while True:
        t0 = time.perf_counter()
        arrays = ArrayRecord({"theta": Array(server.theta.numpy())})
        msgs = list(strategy.configure_train(server.t + 1, arrays, ConfigRecord(), grid))
        if not msgs:
            break
        plan = strategy.plan
        replies = exchange(grid, msgs, timeout=timeout, poll=poll)
        try:
            strategy.aggregate_train(server.t + 1, replies)
        except AllSitesFailed:
            checkpoint()
            raise
        t = server.t
        if run_cfg.eval_every and (t % run_cfg.eval_every == 0 or t == run_cfg.rounds):
            ev = _evaluate(grid, strategy, t, {"last": [server.theta]}, timeout, poll)
            if ev is not None:
                pooled = ev["last"]["pooled"]
                history.append(
                    {
                        "round": t,
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
                log(f"round {t}: pooled accuracy {pooled['accuracy']:.4f}, NLL {pooled['nll']:.4f}")
        if run_cfg.checkpoint_every and t % run_cfg.checkpoint_every == 0:
            checkpoint()
        round_times.append(time.perf_counter() - t0)
    log(f"stopped after {server.t} rounds: {server.halt_reason}")
    strategy.summary()
    checkpoint()

    groups = {"last": [server.theta]}
    if len(server.posterior):
        groups["posterior"] = list(server.posterior.samples)
    ev = _evaluate(grid, strategy, server.t, groups, timeout, poll)
    if ev is None:
        raise RuntimeError("final evaluation: every site failed (see the logged reasons)")
    last, post = ev["last"], ev.get("posterior")
    results = {
        "fedsgld_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config_source": "flower run config",
        "config": user_config.flat(),
        "seed": seed,
        "seed_source": seed_source,
        "engine": "flower",
        "privacy": _privacy_block(server, config),
        "sites": [
            {
                "site": k,
                "n_train": e.n_train,
                "n_test": e.n_test,
                "label_histogram": e.label_histogram,
            }
            for k, e in directory.items()
        ],
        "history": history,
        "metrics": metrics_block(server, last, post),
        "flower": {
            "nodes": {str(k): e.node_id for k, e in directory.items()},
            "dropped_replies": all_drops(),
            "evaluation_missing_sites": last["_missing_sites"],
            "round_wall_time_s": round_time_summary(round_times),
        },
        "wall_time_s": time.perf_counter() - t_start,
    }
    write_outputs(out, results, last=last, posterior=post)
    log(f"results in {out}")
    results["out_dir"] = str(out)
    return results
