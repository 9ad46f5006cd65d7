"""The round mode: the placement chosen once, and each mode's round asks the sites one way.

A transport only implements the three ways of asking the sites; these tests give a mode a
transport that records what it was asked, and check that the ledger is charged before the
sites are asked wherever the sites draw noise, that only the server placement draws the
server's noise, and that a secure sum's step is exactly the update on the decoded sum.
"""

from __future__ import annotations

import pytest
import torch

from fedsgld.config import PrivacySettings
from fedsgld.core.noise import Randomness
from fedsgld.strategies import LangevinServer, SecureSum, ServerNoise, SiteNoise

BASE = dict(method="dpsgd", epsilon=1e4, sample_rate=0.1, clip=1.0, noise_multiplier=1.0, lr=0.1)
PLACEMENTS = [
    ({}, ServerNoise, "server"),
    ({"noise_placement": "sites", "local_steps": 3}, SiteNoise, "sites"),
    ({"noise_placement": "sites", "secure_aggregation": True}, SecureSum, "secure"),
]


def _server(**over) -> LangevinServer:
    return LangevinServer(
        PrivacySettings(**{**BASE, **over}), theta=torch.zeros(4), site_sizes=[10, 30], rounds=2
    )


class Recording:
    """A transport that answers with fixed values and records what it was asked, and how
    many ledger steps were charged when it was asked."""

    def __init__(self, server: LangevinServer) -> None:
        self.server, self.asked = server, []

    def _note(self, what: str) -> None:
        self.asked.append((what, self.server.accountant.steps))

    def clipped_sums(self, plan):
        self._note("clipped_sums")
        return [torch.ones(4), torch.ones(4)]

    def local_rounds(self, plan, paid):
        self._note("local_rounds")
        return [(10, torch.ones(4)), (30, torch.full((4,), 5.0))]

    def secure_sum(self, plan, params):
        self._note("secure_sum")
        return torch.full((4,), 2.0)


@pytest.mark.parametrize(("over", "mode", "placement"), PLACEMENTS)
def test_the_placement_chooses_one_mode(over, mode, placement):
    server = _server(**over)
    assert type(server.mode) is mode and server.mode.placement == placement
    assert server.local_steps == (3 if mode is SiteNoise else 1)


def test_each_mode_asks_the_sites_one_way_and_charges_first_where_they_draw(monkeypatch):
    asked = {}
    for over, mode, _ in PLACEMENTS:
        server = _server(**over)
        t = Recording(server)
        server.mode.round(t, server.plan())
        asked[mode] = t.asked
        assert server.t == 1
    # server noise: nothing charged before the sums arrive (a failed round spends nothing)
    assert asked[ServerNoise] == [("clipped_sums", 0)]
    # the sites draw noise: their local steps, or their shares, are charged before
    assert asked[SiteNoise] == [("local_rounds", 3)]
    assert asked[SecureSum] == [("secure_sum", 1)]


@pytest.mark.parametrize(("over", "mode", "placement"), PLACEMENTS[1:])
def test_only_the_server_placement_draws_the_servers_noise(monkeypatch, over, mode, placement):
    """With the noise at the sites the server's round draws nothing (a draw would fail
    here); the site mode's step is the N_k-weighted average, the secure sum's the DP-SGD
    update on the decoded sum, theta - alpha total / (q sum_k N_k)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the server drew noise")

    monkeypatch.setattr(Randomness, "gaussian", refuse)
    server = _server(**over)
    after = server.mode.round(Recording(server), server.plan())
    expected = 4.0 if mode is SiteNoise else -0.1 * 2.0 / (0.1 * 40)
    torch.testing.assert_close(after, torch.full((4,), expected))
    assert not hasattr(server.mode, "clipped_sums") and not isinstance(server.mode, ServerNoise)


def test_the_server_placement_draws_its_noise_after_the_charge(monkeypatch):
    server = _server()
    seen = []
    real = Randomness.gaussian

    def recording(self, *args, **kwargs):
        seen.append(server.accountant.steps)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Randomness, "gaussian", recording)
    server.mode.round(Recording(server), server.plan())
    assert seen == [1]
