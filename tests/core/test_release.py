"""The one release step: the ledger is charged (and persisted) before any noise exists."""

from __future__ import annotations

import pytest
import torch

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.config import PrivacySettings
from fedsgld.core import streams
from fedsgld.core.noise import Randomness
from fedsgld.core.release import Charged, charge
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.events import subsampled_steps
from fedsgld.strategies import LangevinServer


def _accountant(epsilon: float = 1e4) -> PrivacyAccountant:
    return PrivacyAccountant(delta=1e-5, epsilon_budget=epsilon, accountant="rdp")


def test_a_receipt_is_made_only_by_a_charge():
    with pytest.raises(TypeError, match="only by charge"):
        Charged(((0.1, 1.0),))


def test_the_ledger_holds_the_steps_when_it_is_persisted():
    acc, seen = _accountant(), []
    receipt = charge(
        acc, subsampled_steps([(0.1, 1.0), (0.1, 2.0)]), persist=lambda a: seen.append(a.steps)
    )
    assert seen == [2]  # persisted once, after both steps were recorded
    assert receipt.steps == ((0.1, 1.0), (0.1, 2.0))


def test_a_failed_persist_leaves_no_receipt_to_draw_with():
    acc = _accountant()

    def failing(_):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        charge(acc, subsampled_steps([(0.1, 1.0)]), persist=failing)
    assert acc.steps == 1  # the spend stays counted (conservative)


def test_an_exhausted_budget_leaves_no_receipt_and_persists_nothing():
    acc, seen = _accountant(epsilon=0.5), []
    with pytest.raises(BudgetExhausted):
        charge(acc, subsampled_steps([(1.0, 0.3)] * 10), persist=seen.append)
    assert seen == []


def test_the_receipts_noise_is_the_partys_stream_bit_for_bit():
    rnd = Randomness.seeded(7, epoch=2)
    value = torch.arange(6, dtype=torch.float64)
    key = streams.server_noise(3)
    receipt = charge(_accountant(), subsampled_steps([(0.1, 1.0)]))
    noisy = receipt.add_noise(value, Randomness.seeded(7, epoch=2), std=1.5, key=key)
    expected = value + rnd.gaussian(value.shape, std=1.5, key=key, dtype=torch.float64)
    assert noisy.dtype == torch.float64 and torch.equal(noisy, expected)


def _server(events: list, **privacy) -> LangevinServer:
    """A server over one site of 10 records whose ledger writes are logged in ``events``."""
    return LangevinServer(
        PrivacySettings(epsilon=1e4, sample_rate=0.1, clip=1.0, **privacy),
        theta=torch.zeros(4),
        site_sizes=[10],
        rounds=3,
        on_spend=lambda acc: events.append(f"persist {acc.steps}"),
    )


def test_the_servers_step_is_persisted_before_its_noise_is_drawn(monkeypatch):
    events: list[str] = []
    server = _server(events, method="dpsgd", lr=0.1)
    real = Randomness.gaussian

    def recording(self, shape, *, std, key, dtype=torch.float32):
        events.append(f"draw {key}")
        return real(self, shape, std=std, key=key, dtype=dtype)

    monkeypatch.setattr(Randomness, "gaussian", recording)
    server.mode.finish(server.plan(), [torch.ones(4)])
    server.mode.finish(server.plan(), [torch.ones(4)])
    assert events == ["persist 1", "draw (0, 0)", "persist 2", "draw (0, 1)"]


def test_a_local_round_is_charged_and_its_receipt_names_every_local_step():
    events: list[str] = []
    server = _server(events, method="dpsgld", noise_placement="sites", local_steps=3)
    receipt = server.mode.begin(server.plan())
    assert events == ["persist 3"]
    assert receipt.steps == tuple(server.schedule_point(i) for i in range(3))


def test_a_site_ledger_admits_with_a_receipt_and_refuses_without_one(tmp_path):
    pol = SitePolicy(epsilon=0.5, delta=1e-5, state_dir=str(tmp_path))
    ledger = SiteLedger(0, pol, state_path=tmp_path / "site-0.json")
    receipt = ledger.admit(event=subsampled_steps([(0.01, 5.0)]), round_of=("r", 0, 0))
    assert isinstance(receipt, Charged) and receipt.steps == ((0.01, 5.0),)
    assert SiteLedger(0, pol, state_path=tmp_path / "site-0.json").spent_steps == 1
    with pytest.raises(PolicyRefused):
        ledger.admit(event=subsampled_steps([(1.0, 0.3)] * 50), round_of=("r", 0, 1))


def test_a_sites_local_round_draws_through_the_receipt_it_is_given_and_not_without(
    monkeypatch, tmp_path
):
    """In a deployment the site's guard charges the site's ledger and hands the receipt to
    the handler, which passes it to the local round (``charged=``); the local round draws
    every step's noise through exactly that receipt. Without a receipt a noisy local round
    refuses to start and draws nothing."""
    from fedsgld.clients.site import Site
    from fedsgld.config import PrivacySettings
    from fedsgld.models import LogisticRegression

    priv = PrivacySettings(
        method="dpsgld", sample_rate=0.5, noise_placement="sites", local_steps=2, clip=1.0
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=gen), torch.randint(0, 2, (20,), generator=gen)
    site = Site(0, x, y, x, y, LogisticRegression(3, 2), seed=1)
    pol = SitePolicy(epsilon=50.0, delta=1e-5, state_dir=str(tmp_path))
    ledger = SiteLedger(0, pol, state_path=tmp_path / "site-0.json")
    paid = ledger.admit(
        event=subsampled_steps([(0.5, priv.sigma(t)) for t in range(2)]),
        round_of=("r", 0, 0),
    )
    used, real = [], Charged.add_noise

    def spy(self, value, randomness, **kw):
        used.append(self)
        return real(self, value, randomness, **kw)

    monkeypatch.setattr(Charged, "add_noise", spy)
    theta = torch.zeros(sum(p.numel() for p in LogisticRegression(3, 2).parameters()))
    site.local_round(theta, first_step=0, local_steps=2, privacy=priv, charged=paid)
    assert used == [paid, paid] and not hasattr(site, "paid")
    with pytest.raises(ValueError, match="only through the receipt"):
        site.local_round(theta, first_step=2, local_steps=2, privacy=priv)
    assert used == [paid, paid]
