"""Secure aggregation with dropout recovery: the parties and their messages.

The protocol of Bonawitz et al. (CCS 2017, "Practical secure aggregation for privacy-
preserving machine learning"), with its signed keys and consistency check against an
actively malicious server, on modular vectors of ``length``
words modulo 2^bits. Every message is a plain dict of ints, bytes and lists/dicts of
them, so that a transport can carry it; the server object only ever holds what it
received (its ``transcript``).

1. advertise keys: site u sends two fresh X25519 public keys, c_u (for encrypting shares)
   and s_u (for agreeing pairwise masks), signed with its long-term Ed25519 key over the
   round's context (:mod:`.roster`). The server broadcasts the roster U1.
2. share keys: u verifies every roster entry against its key list (:mod:`.identity`) and
   refuses a roster with a site outside it, a bad signature, or fewer than ``min_peers``
   authenticated sites. It then draws a self-mask seed b_u (32 bytes, os.urandom) and
   splits b_u and its mask private key s_u^SK into Shamir shares (threshold t) for every v
   in U1, each pair of shares encrypted under HKDF(X25519(c_u, c_v)) with
   ChaCha20-Poly1305. The server relays the ciphertexts; U2 = the sites whose ciphertexts
   arrived.
3. masked input: u sends y_u = x_u + PRG(b_u) + sum_{v in U2, v > u} PRG(s_uv)
   - sum_{v in U2, v < u} PRG(s_uv)  (mod 2^bits), s_uv = HKDF(X25519(s_u, s_v)).
   U3 = the sites whose y arrived; the server announces U3.
4. consistency check: u checks U3 (a subset of U2 holding u, at least ``min_inputs``
   sites: else it refuses) and signs it; the server relays the signatures of U4, the
   survivors that answered.
5. unmask: u checks that the announced U3 is the one it signed and that at least t
   members of U3 signed that same U3 (else it refuses), decrypts the shares it holds and
   returns, for every v in U3, its share of b_v and, for every v in U2 \\ U3, its share of
   s_v^SK; never both for one v, and only once per round. With t such answers the server
   rebuilds every b_v (v in U3) and every dropped s_v^SK, removes the self masks and the
   dropped sites' pairwise masks, and holds sum_{u in U3} x_u mod 2^bits, and nothing else.

Thresholds: with K sites, ``max_dropouts`` and ``max_colluders``, t = K - max_dropouts
(enough sites remain to unmask whenever no more than ``max_dropouts`` drop) and t >
max_colluders (the colluding sites' shares, with the server's, never rebuild a surviving
site's s^SK). A round in which more than ``max_dropouts`` sites are missing ABORTS with
:class:`RoundAborted` at the server and is refused by every honest site: its noise share
was sized for K - max_dropouts - max_colluders honest contributions, and the sum is never
released with fewer.

Against an actively malicious server (docs/secure_aggregation.md): it cannot invent sites
(every roster entry is signed by a key of the site's own list) or replay a site's keys or
signatures into another round (they are bound to the round's context); a site releases
no unmasking share for a survivor set that fewer than t survivors signed. To collect both
a survivor's self-mask shares and its mask-key shares the server must show two groups
different survivor sets and gather t signatures for each; each honest site signs one set,
so that needs 2 (t - max_colluders) honest sites, which do not exist when
K > 2 max_dropouts + max_colluders (a plan with more dropouts planned is not protected
against that server).

One-shot rounds (``one_shot``, only with ``max_dropouts = 0``): after step 1 each site
gets the roster with its request for a masked input and answers y_u = x_u + sum_v
+-PRG(s_uv) at once, with no b_u and no shares (:meth:`SiteParty.one_shot_input`); the
server sums all K inputs (:meth:`~fedsgld.secagg.server.ServerParty.collect_one_shot`) or
aborts. With no dropouts planned the threshold above is K, so the full protocol never
rebuilds anyone's secrets either: steps 2, 4 and 5 protect nothing then (:mod:`.plan`).

Sparse neighbourhoods (SecAgg+, ``neighbours`` = k > 0): each site masks with and shares to
its k ring neighbours only, with the same guarantees (:mod:`.plan`).

Not covered: the key list itself (whoever writes it decides who counts as a peer), a
malicious site that sends an out-of-range input (it spoils the sum, learns nothing), and
denial of service (a site or the server can always make a round abort).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import crypto, identity, roster, shamir
from .identity import Credentials
from .plan import SecAggPlan

Message = dict  # plain dicts of ints, bytes, and lists / dicts of them


class RoundAborted(RuntimeError):
    """A secure-aggregation round stopped before anything was released; says why."""


def _aad(plan: SecAggPlan, sender: int, receiver: int) -> bytes:
    return plan.context + struct.pack(">II", sender, receiver)


def _pair_seed(own: X25519PrivateKey, peer_public: bytes, plan: SecAggPlan) -> bytes:
    return crypto.agree(own, peer_public, context=plan.context, purpose=b"pairwise mask")


def pack_words(words: np.ndarray, bits: int) -> bytes:
    """Words modulo 2^bits on the wire: 4 bytes each up to 32 bits, else 8 (little-endian)."""
    return words.astype("<u4" if bits <= 32 else "<u8").tobytes()


def unpack_words(data: bytes, plan: SecAggPlan) -> np.ndarray:
    """The inverse of :func:`pack_words`, checked against the plan's length (uint64)."""
    dtype = "<u4" if plan.bits <= 32 else "<u8"
    words = np.frombuffer(data, dtype=dtype)
    if words.shape[0] != plan.length:
        raise ValueError(f"a masked input has {words.shape[0]} words, expected {plan.length}")
    return words.astype(np.uint64)


def pairwise_masks(
    plan: SecAggPlan, own_site: int, own_key: X25519PrivateKey, peers: Mapping[int, bytes]
) -> np.ndarray:
    """sum over peers v (id -> mask public key) of +PRG(s_uv) (v > u) or -PRG(s_uv)
    (v < u), mod 2^bits, u = ``own_site``: the masks cancel in the sum over all sites."""
    # in place, in the keystream's own words (uint32 up to 32 bits, else uint64): they wrap
    # modulo 2^32 or 2^64, multiples of 2^bits, so one reduction at the end suffices
    total = np.zeros(plan.length, dtype=np.uint32 if plan.bits <= 32 else np.uint64)
    for v, pk in peers.items():
        m = crypto.mask_words(_pair_seed(own_key, pk, plan), plan.length, plan.bits)
        if v > own_site:
            total += m
        else:
            total -= m
    return total.astype(np.uint64) & crypto.modulus_mask(plan.bits)


class SiteParty:
    """One site's side of one round. Its secrets (two X25519 keys, b_u) come from
    :func:`os.urandom` and never leave it except as encrypted Shamir shares; its long-term
    signing key and key list come with ``credentials`` (:mod:`.identity`) and are never
    part of its :meth:`state`."""

    def __init__(self, site: int, plan: SecAggPlan, credentials: Credentials) -> None:
        if site not in plan.sites:
            raise ValueError(f"site {site} is not in the round's sites {plan.sites}")
        credentials.check_site(site)
        self.site, self.plan, self.credentials = site, plan, credentials
        self._enc_key = crypto.new_private_key()
        self._mask_key = crypto.new_private_key()
        self._self_seed = crypto.os_secret()
        self._roster: dict[int, tuple[bytes, bytes]] = {}  # U1, every entry authenticated
        self._inbox: dict[int, bytes] = {}
        self._u2: set[int] = set()  # the sites whose shares arrived (at masked_input)
        self._u3: list[int] = []  # the survivor set this site signed (at consistency)
        self._stage = 0
        # the share-transport keys agreed at share_keys, for opening the same peers'
        # shares at unmask (in memory only: a restored party agrees them again)
        self._transport: dict[int, bytes] = {}

    def state(self) -> Message:
        """Everything this party holds between two steps (its round secrets included, its
        long-term key not), for a transport whose site process does not live from one
        message to the next: it is kept on the site's machine (a Flower node's
        ``context.state``), never sent."""
        return {
            "site": self.site,
            "label": self.plan.round_label,
            "context": self.plan.context,  # the mechanism and roster its keys were signed for
            "stage": self._stage,
            "enc_sk": crypto.private_bytes(self._enc_key),
            "mask_sk": crypto.private_bytes(self._mask_key),
            "self_seed": self._self_seed,
            "roster": {v: {"enc_pk": e, "mask_pk": m} for v, (e, m) in self._roster.items()},
            "inbox": dict(self._inbox),
            "u2": sorted(self._u2),
            "u3": list(self._u3),
        }

    @classmethod
    def restore(cls, plan: SecAggPlan, state: Mapping, credentials: Credentials) -> SiteParty:
        """The party of :meth:`state`, for the same ``plan`` only: the whole context its
        keys were signed for (round, sites, kind and mechanism: :mod:`.plan`). A party
        never draws or masks under numbers other than those it advertised keys for."""
        if state["label"] != plan.round_label:
            raise RoundAborted("the kept secure-aggregation state is of another round")
        if state.get("context") != plan.context:
            raise RoundAborted(
                "the round's plan (its sites, kind or mechanism: sigma, clip, q, pre-noise, "
                "bits, dimension, share variance) is not the one this site signed its keys for"
            )
        party = cls.__new__(cls)
        party.site, party.plan = int(state["site"]), plan
        if party.site not in plan.sites:
            raise RoundAborted(f"site {party.site} is not in the round's sites {plan.sites}")
        credentials.check_site(party.site)
        party.credentials = credentials
        party._enc_key = X25519PrivateKey.from_private_bytes(state["enc_sk"])
        party._mask_key = X25519PrivateKey.from_private_bytes(state["mask_sk"])
        party._self_seed = bytes(state["self_seed"])
        party._roster = {
            int(v): (k["enc_pk"], k["mask_pk"]) for v, k in state.get("roster", {}).items()
        }
        party._inbox = {int(v): bytes(c) for v, c in state.get("inbox", {}).items()}
        party._stage = int(state["stage"])
        party._u2 = {int(v) for v in state.get("u2", [])}
        party._u3 = [int(v) for v in state.get("u3", [])]
        party._transport = {}
        return party

    def _advance(self, expected: int) -> None:
        if self._stage != expected:
            raise self._abort(f"site {self.site}: protocol step out of order")
        self._stage += 1

    def _abort(self, why: str) -> RoundAborted:
        """A refusal: the party answers no further step of this round."""
        self._stage = -1
        return RoundAborted(why)

    def advertise_keys(self) -> Message:
        """This round's public keys, signed with the site's long-term key."""
        self._advance(0)
        enc, mask = crypto.public_bytes(self._enc_key), crypto.public_bytes(self._mask_key)
        statement = roster.advertised(self.plan, self.site, enc, mask)
        sig = identity.sign(self.credentials.signing_key, statement)
        return {"site": self.site, "enc_pk": enc, "mask_pk": mask, "sig": sig}

    def share_keys(self, announced: Message) -> Message:
        """``announced``: {"keys": {v: {"enc_pk", "mask_pk", "sig"}}} (U1). Refused, before
        anything is drawn or encrypted, unless every entry is authenticated
        (:func:`.roster.check_roster`)."""
        self._kind(one_shot=False)
        self._advance(1)
        keys = self._roster = self._authenticated(announced)
        holders = sorted(self.plan.holders(self.site) & set(keys))
        t = self.plan.threshold
        if len(holders) < t:  # sparse neighbourhoods: more than max_dropouts neighbours gone
            raise self._abort(f"site {self.site}: {len(holders)} of its neighbours and itself "
                               f"advertised keys, fewer than t = {t}")  # fmt: skip
        points = [self.plan.point(v) for v in holders]
        s_shares = shamir.split(crypto.private_bytes(self._mask_key), points, t)
        b_shares = shamir.split(self._self_seed, points, t)
        out = {}
        for v in holders:
            p = self.plan.point(v)
            plaintext = struct.pack(">II", self.site, v) + s_shares[p] + b_shares[p]
            if v == self.site:
                self._inbox[v] = plaintext  # its own shares stay here, unencrypted
                continue
            key = self._transport_key(v)
            out[v] = crypto.seal(key, plaintext, _aad(self.plan, self.site, v))
        return {"site": self.site, "shares": out}

    def _kind(self, *, one_shot: bool) -> None:
        """Refuses a step of the other kind of round (:attr:`SecAggPlan.one_shot`)."""
        if self.plan.one_shot != one_shot:
            kind = "a one-shot" if self.plan.one_shot else "a full"
            raise self._abort(f"site {self.site}: that step is not part of {kind} round")

    def _authenticated(self, announced: Message) -> dict[int, tuple[bytes, bytes]]:
        """The roster U1 of ``announced`` ({"keys": ...}) once every entry is authenticated
        (:func:`.roster.check_roster`), it holds this site's own keys and at least
        ``min_inputs`` sites; a refusal (the round ends here) otherwise."""
        try:
            keys = roster.check_roster(self.plan, self.site, announced["keys"], self.credentials)
        except roster.RosterRefused as err:
            raise self._abort(str(err)) from None
        own = (crypto.public_bytes(self._enc_key), crypto.public_bytes(self._mask_key))
        if keys.get(self.site) != own or not set(keys) <= set(self.plan.sites):
            raise self._abort(f"site {self.site}: the roster does not hold this site's keys")
        if len(keys) < self.plan.min_inputs:
            raise self._abort(f"site {self.site}: {len(keys)} sites advertised keys, "
                               f"fewer than {self.plan.min_inputs}")  # fmt: skip
        return keys

    def _checked_input(self, encoded: np.ndarray) -> np.ndarray:
        x = np.asarray(encoded, dtype=np.uint64)
        if x.shape != (self.plan.length,) or np.any(x > crypto.modulus_mask(self.plan.bits)):
            raise ValueError(
                f"the encoded input must be {self.plan.length} words < 2^{self.plan.bits}"
            )
        return x

    def one_shot_input(
        self, announced: Message, encoded: np.ndarray | Callable[[], np.ndarray]
    ) -> Message:
        """A one-shot round's masked input (:attr:`SecAggPlan.one_shot`: no dropouts
        planned), its only step after :meth:`advertise_keys`. ``announced``: the roster U1
        ({"keys": ...}), refused unless every entry is authenticated and it holds every
        site of the plan; ``encoded``: this site's vector modulo 2^bits, or the function
        that makes it (called only once the roster is accepted, so that a refused roster
        costs no draw). Then y_u = x_u +
        sum_v +-PRG(s_uv) over its neighbourhood, with no self-mask and no shares: nothing
        of this round is ever unmasked (a sum missing any site aborts). The party answers
        no further step."""
        self._kind(one_shot=True)
        self._advance(1)
        keys = self._authenticated(announced)  # K - max_dropouts = K: every site
        x = self._checked_input(encoded() if callable(encoded) else encoded)
        self._stage = -1  # one masked input per party, ever
        peers = {v: keys[v][1] for v in self.plan.neighbourhood(self.site)}
        y = (x + pairwise_masks(self.plan, self.site, self._mask_key, peers)) & crypto.modulus_mask(
            self.plan.bits
        )
        return {"site": self.site, "y": pack_words(y, self.plan.bits)}

    def masked_input(self, inbox: Message, encoded: np.ndarray) -> Message:
        """``inbox``: {"shares": {v: ciphertext from v for this site}} (defines U2);
        ``encoded``: this site's vector modulo 2^bits (e.g. :func:`fedsgld.secagg.ddg.encode`)."""
        self._kind(one_shot=False)
        self._advance(2)
        senders = {int(v) for v in inbox["shares"]} | {self.site}
        # shares come from this site's holders (every site, or its neighbours); each one
        # missing is a dropout, and at most max_dropouts may be
        holders = self.plan.holders(self.site) & set(self._roster)
        if not senders <= holders or len(senders) < self.plan.threshold:
            raise self._abort(f"site {self.site}: shares from {sorted(senders)} do not allow "
                               f"{self.plan.threshold} holders")  # fmt: skip
        for v, ct in inbox["shares"].items():
            self._inbox[int(v)] = ct
        self._u2 = senders
        x = self._checked_input(encoded)
        peers = {v: self._roster[v][1] for v in senders if v != self.site}
        y = x + crypto.mask(self._self_seed, self.plan.length, self.plan.bits)
        pair = pairwise_masks(self.plan, self.site, self._mask_key, peers)
        y = (y + pair) & crypto.modulus_mask(self.plan.bits)
        return {"site": self.site, "y": pack_words(y, self.plan.bits)}

    def _transport_key(self, v: int) -> bytes:
        """The key this site and v share for v's shares (X25519 of their roster keys)."""
        if v not in self._transport:
            self._transport[v] = crypto.agree(self._enc_key, self._roster[v][0],
                                              context=self.plan.context,
                                              purpose=b"share transport")  # fmt: skip
        return self._transport[v]

    def _open(self, v: int) -> tuple[bytes, bytes]:
        """(share of s_v^SK, share of b_v) that v sent this site."""
        if v == self.site:
            plaintext = self._inbox[v]
        else:
            key = self._transport_key(v)
            try:
                plaintext = crypto.open_sealed(key, self._inbox[v], _aad(self.plan, v, self.site))
            except InvalidTag:
                raise self._abort(f"site {self.site}: the shares relayed from site {v} "
                                   "do not authenticate") from None  # fmt: skip
        if struct.unpack(">II", plaintext[:8]) != (v, self.site):
            raise self._abort(f"site {self.site}: shares from site {v} are mislabelled")
        n = shamir.SHARE_BYTES
        return plaintext[8 : 8 + n], plaintext[8 + n : 8 + 2 * n]

    def consistency(self, announcement: Message) -> Message:
        """``announcement``: {"survivors": U3, the sites whose masked input the server
        holds}. Checked (a subset of U2 holding this site, at least ``min_inputs``), then
        signed: the only survivor set this site will unmask for."""
        self._advance(3)
        u3 = {int(v) for v in announcement["survivors"]}
        # of this site's holders, only those whose shares it holds (U2) can have survived
        mine = u3 & self.plan.holders(self.site)
        if not u3 <= set(self._roster) or not mine <= self._u2 or self.site not in u3:
            raise self._abort(f"site {self.site}: the announced survivors are inconsistent")
        if len(u3) < self.plan.min_inputs:
            raise self._abort(
                f"site {self.site} refuses to unmask: {len(u3)} inputs < {self.plan.min_inputs} "
                f"(more than max_dropouts={self.plan.max_dropouts} sites missing: the sum "
                "would carry too little noise)"
            )
        self._u3 = sorted(u3)
        sig = identity.sign(self.credentials.signing_key, roster.survivors(self.plan, u3))
        return {"site": self.site, "sig": sig}

    def unmask(self, announcement: Message) -> Message:
        """``announcement``: {"survivors": U3, "signatures": {v: v's signature of U3}}.
        Refused unless U3 is the set this site signed and at least K - max_dropouts
        members of U3 signed it (:func:`.roster.check_consistency`); then this site's
        unmasking shares."""
        self._advance(4)
        if sorted({int(v) for v in announcement["survivors"]}) != self._u3:
            raise self._abort(f"site {self.site}: the survivors announced for unmasking are "
                               "not the set it signed; refusing to unmask")  # fmt: skip
        signatures = {int(v): s for v, s in announcement["signatures"].items()}
        try:
            roster.check_consistency(self.plan, self.site, self._u3, signatures, self.credentials)
        except roster.RosterRefused as err:
            raise self._abort(str(err)) from None
        u3 = set(self._u3)
        self_shares, key_shares = {}, {}
        for v in sorted(self._u2):
            s_share, b_share = self._open(v)
            if v in u3:
                self_shares[v] = b_share
            else:
                key_shares[v] = s_share
        return {"site": self.site, "self_mask_shares": self_shares, "mask_key_shares": key_shares}
