"""Two ways a run ends before its work: a plan that can spend nothing, and Ctrl-C.

* :func:`refuse_empty_plan`: a new run whose budget affords not one round along its
  schedule is a mistake in its settings, not a run. It raises :class:`NothingToSpend` (a
  ``ValueError``, so the command line exits 2) before the run directory exists, in one
  line that names the settings to change and what they would afford.
* :class:`RunInterrupted` (a ``KeyboardInterrupt``): raised by the lifecycle when the user
  interrupts training, carrying the rounds taken and the directory to resume, or None when
  nothing was released and the directory was removed (:func:`discard_unreleased`).

Privacy caveat: a directory is removed only while its ledger records no step (the ledger
is written before the noise of the step it accounts for is drawn, so a ledger without a
step means that nothing was released); a ledger with a step is never removed.
"""

from __future__ import annotations

from pathlib import Path

from fedsgld.privacy import ledger_chain
from fedsgld.run.layout import CHECKPOINT, LEDGER


class NothingToSpend(ValueError):
    """The run's budget affords no round along its schedule (the message says what would)."""


class RunInterrupted(KeyboardInterrupt):
    """Training interrupted (Ctrl-C) after ``rounds`` rounds; ``out`` is the directory to
    resume, or None when nothing had been released and no directory was kept."""

    def __init__(self, rounds: int, out: Path | None) -> None:
        self.rounds = rounds
        self.out = out
        kept = f"resumable run in {out}" if out is not None else "nothing released, no directory"
        super().__init__(f"interrupted after {rounds} rounds ({kept})")


#: Factors tried on the noise multiplier sigma when proposing noisier settings.
_SIGMA_FACTORS = tuple(2 ** (k / 2) for k in range(1, 17))


def _afford(server, factor: float) -> int:
    """Rounds the budget allows with every sigma_t scaled by ``factor`` (same q)."""
    e, start = server.local_steps, server.t * server.local_steps
    remaining = server.rounds - server.t

    def point(i: int) -> tuple[float, float]:
        q, sigma = server.schedule_point(start + i)
        return q, sigma * factor

    return server.accountant.max_steps(point, limit=remaining * e) // e


def _noise_setting(privacy, factor: float) -> str:
    """The setting that scales sigma by ``factor``: DP-SGLD's temperature (sigma_t =
    sqrt(2 lr_t tau), so tau * factor^2), else the constant noise_multiplier."""
    if privacy.method in ("dpsgd", "dpvi"):
        return f"noise_multiplier={privacy.noise_multiplier * factor:.3g}"
    return f"temperature={privacy.temperature * factor**2:.3g}"


def _offers(config, server) -> list[str]:
    """Settings that would afford rounds: the epsilon all planned rounds need, and the
    smallest noise scalings (by factors of sqrt 2) that afford some and all rounds."""
    p, rounds, acc = config.privacy, server.rounds - server.t, server.accountant
    need = acc.rigorous_epsilon(
        acc.ledger_after(server.schedule_point, rounds * server.local_steps)
    )
    offers = [f"epsilon={need:.3g} affords all {rounds} rounds"]
    some = next((f for f in _SIGMA_FACTORS if _afford(server, f) > 0), None)
    if some is not None:
        n = _afford(server, some)
        offers.append(f"{_noise_setting(p, some)} affords {'all ' if n >= rounds else ''}{n}")
        full = next((f for f in _SIGMA_FACTORS if f >= some and _afford(server, f) >= rounds), None)
        if full is not None and n < rounds:
            offers.append(f"{_noise_setting(p, full)} affords all {rounds}")
    return offers


def empty_plan_message(config, server) -> str:
    """One line: why the plan affords nothing, and settings that would afford rounds."""
    p, rounds, acc = config.privacy, server.rounds - server.t, server.accountant
    q, sigma = server.schedule_point(server.t * server.local_steps)
    try:
        offers = _offers(config, server)
    except Exception:  # noqa: BLE001 - the refusal stands without its suggestions
        offers = []
    noise = "noise_multiplier" if p.method in ("dpsgd", "dpvi") else "temperature or lr"
    return (
        f"the privacy budget affords 0 of the {rounds} rounds: epsilon={p.epsilon:g} at "
        f"delta={p.delta:g} ({acc.rigorous_name}) does not cover step 1 of {p.method} "
        f"(sample_rate={q:g}, sigma={sigma:.3g}); raise epsilon or {noise}, or lower "
        f"sample_rate" + (f": {', '.join(offers)}" if offers else "")
    )


def refuse_empty_plan(config, server) -> None:
    """Raise :class:`NothingToSpend` if a new run's budget affords no round."""
    if server.accountant is None or server.rounds <= server.t:
        return
    if server.affordable_rounds() == 0:
        raise NothingToSpend(empty_plan_message(config, server))


def released_nothing(server) -> bool:
    """Whether no step has been recorded (so none released) and no round taken."""
    acc = server.accountant
    return server.t == 0 and (acc is None or acc.steps == 0)


def discard_unreleased(out: Path, *, created: bool) -> bool:
    """Remove the run files of a run that released nothing, and ``out`` itself if this run
    created it and it is then empty. Returns whether the run's files were removed."""
    for name in (LEDGER, ledger_chain.CHAIN, CHECKPOINT):
        (out / name).unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass  # something else lives there: left alone
    return True


__all__ = [
    "NothingToSpend",
    "RunInterrupted",
    "discard_unreleased",
    "empty_plan_message",
    "refuse_empty_plan",
    "released_nothing",
]
