"""A deployment's noise streams, attacked as a party that collects many of them would.

torch's CPU generator keeps only the low 32 bits of ``manual_seed``'s argument, so a
generator seeded with 63 OS bits is still one of 2^32 streams: brute-forceable, and among n
generators two repeat a stream with probability about n^2 / 2^33. ``Randomness.system``
therefore fills the whole Mersenne Twister state from the OS. The attack here: collect the
first 64-bit output of many generators, as an observer of many rounds' noise could, and
look for a repeated stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsgld.core import noise
from fedsgld.core.noise import MT19937_WORDS, Randomness, os_seed


def _first_outputs(make, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        out[i] = int(torch.randint(-(2**63), 2**63 - 1, (1,), generator=make()))
    return out


def _repeats(first: np.ndarray) -> int:
    return len(first) - len(np.unique(first))


def test_the_attack_finds_repeated_streams_among_63_bit_seeded_generators():
    """The attack's power: 400,000 generators seeded the naive way repeat a stream about
    400000^2 / 2^33 = 18.6 times (P(no repeat) = 1e-8)."""

    def naive() -> torch.Generator:
        return torch.Generator().manual_seed(os_seed())

    assert _repeats(_first_outputs(naive, 400_000)) >= 1
    s = os_seed() | (1 << 62)  # the high bits are dropped: the same stream
    a, b = torch.Generator().manual_seed(s), torch.Generator().manual_seed(s & (2**32 - 1))
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))


@pytest.mark.slow  # 7-16 s
def test_deployment_generators_never_repeat_a_stream():
    """250,000 ``Randomness.system`` generators: with 32-bit streams about 7.3 repeats
    would be expected (P(none) = 7e-4); with 19,968 bits, none."""
    r = Randomness.system(secure=False)
    assert _repeats(_first_outputs(r.generator, 250_000)) == 0


def test_a_deployment_generator_is_not_the_expansion_of_any_32_bit_seed():
    """Whoever knows torch's seeding expands a 32-bit seed into the 624 state words by
    x[i] = 1812433253 * (x[i-1] ^ (x[i-1] >> 30)) + i. A deployment generator's words are
    independent: no seed reproduces them, and nothing of them is reported."""
    g = Randomness.system(secure=False).generator()
    off = noise._OFF_WORDS
    words = g.get_state().numpy()[off : off + 8 * MT19937_WORDS].view("<u8").astype(np.uint64)
    assert np.all(words < 2**32) and len(np.unique(words)) > 600
    x = int(words[0])
    expanded = [(1812433253 * (x ^ (x >> 30)) + 1) & 0xFFFFFFFF]
    assert int(words[1]) != expanded[0]
    assert g.initial_seed() == 0
    seeded = torch.Generator().manual_seed(x)  # the only seed that gives word 0
    assert not torch.equal(torch.randn(64, generator=g), torch.randn(64, generator=seeded))
    z = torch.randn(200_000, generator=Randomness.system(secure=False).generator())
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1.0) < 0.02


def test_an_unexpected_generator_layout_is_refused(monkeypatch):
    monkeypatch.setattr(noise, "_state_template", None)
    monkeypatch.setattr(noise, "_STATE_BYTES", 5057)
    with pytest.raises(RuntimeError, match="not laid out as fedsgld expects"):
        noise.os_cpu_generator()
