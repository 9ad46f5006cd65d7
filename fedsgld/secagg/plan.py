"""The public plan of a secure-aggregation round (:mod:`fedsgld.secagg.protocol` for the
steps), the same at every party.

**Sparse neighbourhoods** (``neighbours`` = k > 0; SecAgg+, Bell et al., CCS 2020): each
site agrees masks with, and secret-shares b_u and s_u^SK to, only its k neighbours, the
sites at ring distance 1..k/2 on either side in the sorted site list (the Harary graph
H_{k,K}, a function of the public plan alone: neither the server nor any site chooses it).
Step 3's sums run over u's neighbours in U2, the Shamir threshold is t_n = k + 1 -
max_dropouts among u's k + 1 holders (its neighbours and itself), and the server rebuilds
each b_v or s_v^SK from v's holders. The plan requires k >= 2 max_dropouts + max_colluders
+ 1, which gives the same guarantees as the complete graph against the worst case, not
only with high probability over a random graph:

* H_{k,K} is k-vertex-connected (Harary 1962), and the server can remove at most
  max_colluders + max_dropouts sites from the honest survivors' graph (colluders know
  their pairwise seeds; a site is counted out of U3 only up to max_dropouts), fewer than
  k: the honest survivors stay connected, so their masks cancel only in the whole sum;
* t_n > max_colluders: u's colluding holders never rebuild its secrets alone;
* an honest holder of u releases either its share of b_u or of s_u^SK, so both need
  2 (t_n - max_colluders) honest holders, more than the k + 1 - max_colluders there are.

The consistency check and the roster are unchanged and global (every site verifies every
roster entry: a site cannot count an unauthenticated site towards the noise). A site's
cost in masks, key agreements and shares is then k instead of K - 1.

**One-shot rounds** (``one_shot = True``, only with ``max_dropouts = 0``): the round is
``advertise_keys`` and one ``masked_input`` that carries the roster, y_u = x_u + sum_v
+-PRG(s_uv) with no self-mask and no Shamir shares (:meth:`SiteParty.one_shot_input
<fedsgld.secagg.protocol.SiteParty.one_shot_input>`). With no dropouts planned the full
protocol's threshold is K: a round missing any site aborts, so no secret of a site is ever
rebuilt, and the self-masks, the shares and the consistency check (which exist to recover
dropped sites without exposing the late ones) protect nothing. The sum of every site's
input is all the server can learn: an honest site's pairwise masks with the other honest
sites cancel only in the sum over all of them (the graph minus the colluders stays
connected, as above). ``one_shot`` is in the context, so keys signed for one kind of
round are refused in the other.

**The mechanism is in the context** (:class:`Mechanism`: sigma_t, clip, sample rate,
pre-noise, the norm bound the bits are chosen for, and the distributed discrete Gaussian
each site draws: grid step, share variance s^2, dimension, bits, K and the honest shares).
Every signature (round keys, survivor set), every pairwise mask seed and every share's
encryption is derived from :attr:`SecAggPlan.context`, so two sites shown different
numbers sign different statements and agree different seeds. A site's accountant charges
each round as one of K_eff *equal* shares of N_Z(0, s^2) on the grid gamma; that is true by
construction, not by trust in the server:

1. a site draws its share only under the mechanism it builds itself from the checked
   request (its guard: ``check_site_plan`` holds ``plan.mechanism`` to it, and the ledger
   charges exactly those parameters), and only in the round context under which it signed
   its round keys (its party keeps that context and refuses any other);
2. before its share is drawn it has verified every roster entry's signature over ITS
   context (``share_keys`` in a full round, the one-shot request's roster otherwise): each
   other site of the roster advertised its keys for the same sigma, clip, q, pre-noise,
   s^2, gamma, bits and dimension, and (by 1, if honest) draws under them only;
3. so a server that shows sites different parameters gets refused rosters (at
   ``share_keys``, before the consistency step, in a full round; at the one-shot request,
   before the charge), and even where a site were fooled, its masks (seeded from its
   context) would not cancel against the others': nothing decodable, never a sum of
   unequal shares. The masked input itself carries no extra signature: no honest site
   produces one before step 2, so a signature over it would only let a third party audit
   the transcript, and adds nothing against the server.
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
