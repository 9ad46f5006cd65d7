"""The public plan of a secure-aggregation round (:mod:`fedsgld.secagg.protocol` for the
steps), the same at every party.

With ``neighbours`` = k > 0 (SecAgg+) each site masks and shares with its k neighbours
in the Harary graph H_{k,K}, a function of the plan alone, and the plan requires
k >= 2 max_dropouts + max_colluders + 1; ``one_shot`` (max_dropouts = 0 only) is
``advertise_keys`` and one ``masked_input`` carrying the roster; the mechanism
(:class:`Mechanism`) is in the plan's context, so every signature, mask seed and share
encryption is bound to the numbers each site checked. Why these give the complete
graph's guarantees, and why a server showing sites different numbers gets nothing
decodable: docs/architecture.md, "Design notes".
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cached_property

from ..config.checks import check_neighbours
from ..privacy.distributed import DDGParameters, choose_ddg


@dataclass(frozen=True)
class Mechanism:
    """What every site of a round computes and draws (all public): the noise multiplier
    sigma_t of the step, the sample rate q, the pre-noise std, the norm bound
    ``signal_norm`` of the sum that the bits are chosen for, and the distributed discrete
    Gaussian ``params`` (clip C, grid step gamma, dimension d, share variance s^2, sites K,
    honest shares K_eff, bits). :meth:`encoded` is its canonical bytes in the context."""

    params: DDGParameters
    noise_multiplier: float
    sample_rate: float
    prenoise: float
    signal_norm: float

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "sample_rate", "prenoise", "signal_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"mechanism {name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not (self.noise_multiplier > 0 and 0 < self.sample_rate <= 1):
            raise ValueError("mechanism: noise_multiplier must be > 0 and sample_rate in (0, 1]")
        if self.prenoise < 0 or self.signal_norm < 0:
            raise ValueError("mechanism: prenoise and signal_norm must be >= 0")

    @classmethod
    def derive(
        cls, *, noise_multiplier: float, clip: float, sample_rate: float, prenoise: float,
        signal_norm: float, dim: int, sites: int, max_dropouts: int, max_colluders: int,
    ) -> Mechanism:  # fmt: skip
        """The round's mechanism from its public numbers
        (:func:`~fedsgld.privacy.distributed.choose_ddg`: every party derives the same)."""
        params = choose_ddg(noise_multiplier=noise_multiplier, clip=clip, dim=dim, sites=sites,
                            max_dropouts=max_dropouts, max_colluders=max_colluders,
                            signal_norm=signal_norm)  # fmt: skip
        return cls(params, noise_multiplier, sample_rate, prenoise, signal_norm)

    def encoded(self) -> bytes:
        """Canonical bytes: floats by their exact IEEE 754 binary64 bits, fixed-width ints,
        s^2 (unbounded) length-prefixed; one layout, so equal bytes mean equal numbers."""
        p = self.params
        share = p.share_variance.to_bytes((p.share_variance.bit_length() + 7) // 8, "big")
        floats = struct.pack(">6d", self.noise_multiplier, self.sample_rate, self.prenoise,
                             self.signal_norm, p.clip, p.gamma)  # fmt: skip
        ints = struct.pack(">QIIB", p.dim, p.sites, p.honest, p.bits)
        return b"ddg1" + floats + ints + struct.pack(">H", len(share)) + share


@dataclass(frozen=True)
class SecAggPlan:
    """The public parameters of one round, the same at every party.

    ``round_label``: bytes naming the round uniquely (run key and round number); every
    key and mask is bound to it. ``sites``: the site ids (distinct ints >= 0).
    """

    round_label: bytes
    sites: tuple[int, ...]
    length: int
    bits: int
    max_dropouts: int = 0
    max_colluders: int = 0
    neighbours: int = 0  # 0: the complete graph; else k, even (module docstring)
    one_shot: bool = False  # masked_input with the roster, no shares (module docstring)
    # the numbers every site computes and draws with (module docstring); None: a bare
    # masking plan, which no site's guard accepts (``check_site_plan``)
    mechanism: Mechanism | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(sorted(int(s) for s in self.sites)))
        if len(set(self.sites)) != len(self.sites) or any(s < 0 for s in self.sites):
            raise ValueError(f"sites must be distinct integers >= 0, got {self.sites}")
        if not (1 <= self.bits <= 64):
            raise ValueError(f"bits must be in [1, 64], got {self.bits}")
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        if self.max_dropouts < 0 or self.max_colluders < 0:
            raise ValueError("max_dropouts and max_colluders must be >= 0")
        check_neighbours("neighbours", self.neighbours, len(self.sites), self.max_dropouts,
                         self.max_colluders)  # fmt: skip
        if self.one_shot and self.max_dropouts:
            raise ValueError(
                f"a one-shot round plans no dropouts, got max_dropouts = {self.max_dropouts}: "
                "recovering a dropped site needs the full protocol's shares"
            )
        m = self.mechanism
        ours = (len(self.sites), self.length, self.bits)
        if m is not None and (m.params.sites, m.params.dim, m.params.bits) != ours:
            raise ValueError(
                "the mechanism's sites, dimension or bits differ from the plan's: "
                f"({m.params.sites}, {m.params.dim}, {m.params.bits}) against {ours}"
            )
        if self.threshold <= self.max_colluders:
            raise ValueError(
                f"sites ({len(self.sites)}) - max_dropouts ({self.max_dropouts}) must exceed "
                f"max_colluders ({self.max_colluders}): the colluders' shares must never "
                "reach the reconstruction threshold"
            )

    @property
    def threshold(self) -> int:
        """Shares needed to rebuild a secret: K - max_dropouts, or with sparse
        neighbourhoods k + 1 - max_dropouts (of a site's k + 1 holders)."""
        holders = self.neighbours + 1 if self.neighbours else len(self.sites)
        return holders - self.max_dropouts

    def neighbourhood(self, site: int) -> tuple[int, ...]:
        """The sites ``site`` masks with and shares its secrets with (itself excluded):
        every other site, or its k ring neighbours (Harary graph H_{k,K})."""
        return self._graph[site]

    def holders(self, site: int) -> frozenset[int]:
        """The sites that hold shares of ``site``'s secrets: its neighbourhood and itself."""
        return frozenset((site, *self._graph[site]))

    @cached_property
    def _graph(self) -> dict[int, tuple[int, ...]]:
        n, half = len(self.sites), self.neighbours // 2
        if not self.neighbours:
            return {u: tuple(v for v in self.sites if v != u) for u in self.sites}
        return {
            u: tuple(sorted({self.sites[(i + j) % n] for j in range(-half, half + 1) if j}))
            for i, u in enumerate(self.sites)
        }

    @property
    def min_inputs(self) -> int:
        """The fewest masked inputs a released sum may hold (K - max_dropouts)."""
        return len(self.sites) - self.max_dropouts

    @cached_property  # built once per plan: every key agreement and signature binds it
    def context(self) -> bytes:
        """The canonical bytes that every signature, pairwise seed and share encryption of
        the round is derived from: the version and kind, the fixed-width numbers (length,
        label length, bits, dropouts, colluders, neighbours), the label, the sorted site
        ids (count-prefixed) and the :class:`Mechanism` (``-`` for none). v4 binds the
        mechanism; a v3 party's signatures do not verify against it, so mixed versions
        refuse the roster instead of summing masks that do not cancel."""
        ids = struct.pack(">I", len(self.sites)) + b"".join(struct.pack(">I", s)
                                                             for s in self.sites)  # fmt: skip
        head = struct.pack(">IIBIII", self.length, len(self.round_label), self.bits,
                           self.max_dropouts, self.max_colluders, self.neighbours)  # fmt: skip
        kind = b"-1shot" if self.one_shot else b"-full"  # keys of one kind refused by the other
        mech = b"-" if self.mechanism is None else self.mechanism.encoded()
        return (
            b"fedsgld-secagg-v4" + kind + b"|" + head + self.round_label + b"|" + ids + b"|" + mech
        )

    def point(self, site: int) -> int:
        """The Shamir evaluation point of ``site`` (its id + 1)."""
        return site + 1
