"""The one function through which all differential-privacy noise is drawn, and where each
party's randomness comes from.

Every draw takes an explicit ``torch.Generator``. Which generator a party uses is decided
by its :class:`Randomness`:

* ``Randomness.seeded(seed, epoch)``: generators derived from (seed, key...), so a
  simulation is reproducible. Anyone who knows the seed can regenerate every draw, so this
  mode is for simulations on one machine only (in-process, LocalGrid, Ray).
* ``Randomness.system(secure=...)``: every generator's whole state comes fresh from the
  operating system (:mod:`secrets`) at the moment it is made, inside the party that adds
  the noise: on the CPU all 624 words of the Mersenne Twister (19,968 bits), on a GPU a
  63-bit Philox seed. No other party can know or derive it, and no two draws share a
  stream, so a replayed step never reuses noise. This is what deployments use.

Why not ``manual_seed(secrets.randbits(63))`` on the CPU: torch's CPU generator keeps only
the low 32 bits of a seed (``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give the same
numbers). A 32-bit stream can be found by brute force (2^32 candidates, each checked
against the noised update), and among n generators two share a stream with probability
about n^2 / 2^33: one in a hundred for 10,000 site-rounds. Seeded streams
(``seeded_generator``) have that limit too: they are for simulations, where whoever holds
the seed can regenerate every draw anyway, and the chance of a repeated stream within one
simulation is that birthday bound (about 2e-4 for the demo's 1,420 generators: 5 a round).

``secure=True`` hardens the Gaussian draws against floating-point attacks on the
Gaussian mechanism (Mironov 2012 for Laplace; the same concern for Gaussians): each
N(0, s^2) value is the sum of four float64 N(0, s^2) draws divided by 2 (again exactly
N(0, s^2)), rounded to the output dtype, so the low-order bits no longer reveal the draw.
It costs four float64 draws per value instead of one float32 draw (the server's noise is
one vector per round, a small share of a round).

Nothing here touches the global random state, so no other library can perturb (or
predict from) the noise stream.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from fedsgld.core.streams import EPOCH_TAG


def gaussian_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    std: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    secure: bool = False,
) -> torch.Tensor:
    """Draw N(0, std^2 I) of the given shape from ``generator``.

    ``std`` must be a finite number >= 0 (0 returns zeros, e.g. for non-private SGD).
    ``secure``: the hardened draw of the module docstring (same distribution).
    The draw is made on the generator's device (a CUDA generator draws on its GPU).
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError("gaussian_noise needs an explicit torch.Generator (generator=...)")
    std = float(std)
    if not (std >= 0.0 and std < float("inf")):
        raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
    if std == 0.0:
        return torch.zeros(shape, dtype=dtype, device=generator.device)
    if secure:
        total = torch.zeros(shape, dtype=torch.float64, device=generator.device)
        for _ in range(4):
            total.add_(
                torch.randn(
                    shape, generator=generator, dtype=torch.float64, device=generator.device
                )
            )
        return total.mul_(std / 2.0).to(dtype)
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device).mul_(std)


def seeded_generator(*key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from a tuple of non-negative ints, e.g. (seed, site, round).

    The tuple is mixed with a fixed 64-bit hash so (1, 2) and (2, 1) give unrelated streams.
    ``device`` is where the generator draws (a CUDA generator is a different algorithm, so
    the same key gives different, equally reproducible, numbers on a GPU).
    """
    h = 0x9E3779B97F4A7C15
    for k in key:
        if k < 0:
            raise ValueError(f"generator key parts must be >= 0, got {key}")
        h ^= (int(k) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    g = torch.Generator(device=device)
    g.manual_seed(h & 0x7FFFFFFFFFFFFFFF)
    return g


def os_seed() -> int:
    """A 63-bit seed from the operating system's randomness (for deployments)."""
    return secrets.randbits(63)


MT19937_WORDS = 624  # the Mersenne Twister's state: 624 words of 32 bits
# torch's CPU generator state (CPUGeneratorImplState, 5,056 bytes): the initial seed
# (uint64), left and seeded (int32), next (uint64), the 624 state words (each as a
# uint64), then the cached normal samples. The offsets are checked against a generator
# seeded through torch in _check_state_layout() before the first use.
_STATE_BYTES = 5056
_OFF_LEFT, _OFF_NEXT, _OFF_WORDS = 8, 16, 24
_state_template: torch.Tensor | None = None


def _check_state_layout() -> torch.Tensor:
    global _state_template
    if _state_template is None:
        probe = torch.Generator()
        probe.manual_seed(0x1234_5678_9ABC_DEF0)
        st = probe.get_state()
        a = st.numpy()
        ok = (
            st.numel() == _STATE_BYTES
            and int(a[_OFF_WORDS : _OFF_WORDS + 8].view("<u8")[0]) == 0x9ABC_DEF0
            and tuple(a[_OFF_LEFT : _OFF_LEFT + 8].view("<i4")) == (1, 1)
        )
        if not ok:
            raise RuntimeError(
                f"torch {torch.__version__}: the CPU generator's state is not laid out as "
                "fedsgld expects; refusing to draw privacy noise from a 32-bit seed"
            )
        _state_template = torch.Generator().get_state()
    return _state_template


def os_cpu_generator() -> torch.Generator:
    """A CPU generator whose whole Mersenne Twister state (624 x 32 bits) is fresh OS
    entropy, for one use by the party that makes it."""
    return cpu_generator_from_bytes(secrets.token_bytes(4 * MT19937_WORDS))


def cpu_generator_from_bytes(state_bytes: bytes) -> torch.Generator:
    """A CPU generator whose whole Mersenne Twister state is ``state_bytes`` (624 x 32 bits,
    little-endian words; not all zero), twisted before its first number."""
    if len(state_bytes) != 4 * MT19937_WORDS:
        raise ValueError(f"a Mersenne Twister state is {4 * MT19937_WORDS} bytes")
    state = _check_state_layout().clone()
    a = state.numpy()
    words = np.frombuffer(state_bytes, dtype="<u4")
    a[_OFF_WORDS : _OFF_WORDS + 8 * MT19937_WORDS].view("<u8")[:] = words
    a[0:8].view("<u8")[0] = 0  # initial_seed(): no seed made this stream
    a[_OFF_LEFT : _OFF_LEFT + 8].view("<i4")[:] = (1, 1)  # twist before the first number
    a[_OFF_NEXT : _OFF_NEXT + 8].view("<u8")[0] = 0
    g = torch.Generator()
    g.set_state(state)
    return g


RANDOMNESS_MODES = ("seeded", "os")


class Randomness:
    """Where one party's privacy randomness (noise, Poisson samples) comes from.

    ``generator(*key)`` returns the generator for one use, named by ``key`` (e.g.
    (stream, round)). Seeded: derived from (seed, *key), plus (EPOCH_TAG, epoch) when
    ``epoch`` >= 1, so a resumed run (epoch = number of resumes) never replays the streams
    of an earlier start. System: fresh OS entropy on every call; the key is ignored.

    A ``Randomness`` never leaves its party: it is not serialisable on purpose, and a
    system one holds no state that could be sent anywhere.
    """

    def __init__(
        self, mode: str, *, seed: int | None = None, epoch: int = 0, secure: bool = False
    ) -> None:
        if mode not in RANDOMNESS_MODES:
            raise ValueError(
                f"randomness must be one of {', '.join(RANDOMNESS_MODES)}; got {mode!r}"
            )
        if mode == "seeded" and (seed is None or int(seed) < 0):
            raise ValueError(f"seeded randomness needs a seed >= 0, got {seed!r}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.mode = mode
        self._seed = None if mode == "os" else int(seed)  # type: ignore[arg-type]
        self.epoch = epoch
        self.secure = bool(secure)

    @classmethod
    def seeded(cls, seed: int, *, epoch: int = 0, secure: bool = False) -> Randomness:
        """Reproducible streams from ``seed`` (simulations only)."""
        return cls("seeded", seed=seed, epoch=epoch, secure=secure)

    @classmethod
    def system(cls, *, secure: bool = True) -> Randomness:
        """Fresh operating-system entropy for every generator (deployments)."""
        return cls("os", secure=secure)

    @classmethod
    def chosen(cls, *, seeded: bool, seed: int, epoch: int = 0, secure: bool) -> Randomness:
        """The one choice of a party's randomness: streams of ``seed`` (and ``epoch``) where
        the party accepts a seed (a simulation), else fresh operating-system entropy."""
        if seeded:
            return cls.seeded(seed, epoch=epoch, secure=secure)
        return cls.system(secure=secure)

    def generator(self, *key: int, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator for the use named by ``key``, drawing on ``device``."""
        if self.mode == "os":
            if torch.device(device).type == "cpu":
                return os_cpu_generator()
            g = torch.Generator(device=device)
            g.manual_seed(os_seed())  # Philox: the whole 64-bit seed is its key
            return g
        assert self._seed is not None
        if self.epoch:
            return seeded_generator(self._seed, *key, EPOCH_TAG, self.epoch, device=device)
        return seeded_generator(self._seed, *key, device=device)

    def gaussian(
        self,
        shape: torch.Size | tuple[int, ...],
        *,
        std: float,
        key: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """N(0, std^2 I) from ``generator(*key)`` on ``device`` (hardened when ``secure``)."""
        return gaussian_noise(
            shape,
            std=std,
            generator=self.generator(*key, device=device),
            dtype=dtype,
            secure=self.secure,
        )

    def describe(self) -> dict[str, object]:
        """For the result file: the mode, whether the noise is hardened, the epoch (never a seed)."""
        return {"mode": self.mode, "secure": self.secure, "epoch": self.epoch}

    def __repr__(self) -> str:
        return f"Randomness({self.mode!r}, epoch={self.epoch}, secure={self.secure})"

    def __reduce__(self):  # noqa: D105 - a party's randomness is never serialised
        raise TypeError("a Randomness stays with its party and cannot be pickled")
