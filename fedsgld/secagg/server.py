"""The server's side of secure aggregation (:mod:`fedsgld.secagg.protocol` for the steps).

:class:`ServerParty` holds only what it receives: each step's messages go into its
``transcript`` and it computes nothing from anything else. It learns the modular sum of
the surviving sites' inputs; every single input it holds stays masked by pairwise masks
whose seeds it can rebuild only for sites that dropped before sending one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import crypto, shamir
from .protocol import Message, RoundAborted, SecAggPlan, pairwise_masks, unpack_words


class ServerParty:
    """The aggregator of one round. Call the five steps in order with the messages that
    arrived (a site missing from a step's messages has dropped)."""

    def __init__(self, plan: SecAggPlan) -> None:
        self.plan = plan
        self.transcript: list[tuple[str, list[Message]]] = []
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._u2: set[int] = set()
        self._inputs: dict[int, np.ndarray] = {}
        self._u4: set[int] = set()  # the survivors that signed U3
        self._stage = 0

    def _receive(self, step: int, name: str, messages: Sequence[Message], among: set[int]) -> dict:
        if self._stage != step:
            raise RoundAborted("server: protocol step out of order")
        self._stage += 1
        self.transcript.append((name, list(messages)))
        by_site = {}
        for m in messages:
            v = int(m["site"])
            if v not in among or v in by_site:
                raise RoundAborted(f"server: unexpected or repeated {name} message from site {v}")
            by_site[v] = m
        if len(by_site) < self.plan.min_inputs:
            raise RoundAborted(
                f"server: {len(by_site)} sites answered {name}, fewer than "
                f"K - max_dropouts = {self.plan.min_inputs}; the round is aborted"
            )
        return by_site

    def collect_keys(self, messages: Sequence[Message]) -> Message:
        """Step 1: the roster U1 to broadcast to its members."""
        got = self._receive(0, "advertise_keys", messages, set(self.plan.sites))
        self._keys = {v: (m["enc_pk"], m["mask_pk"]) for v, m in got.items()}
        return {
            "keys": {
                v: {"enc_pk": m["enc_pk"], "mask_pk": m["mask_pk"], "sig": m["sig"]}
                for v, m in got.items()
            }
        }

    def route_shares(self, messages: Sequence[Message]) -> dict[int, Message]:
        """Step 2: each member of U2 gets the ciphertexts addressed to it by the others."""
        if self.plan.one_shot:
            raise RoundAborted("server: a one-shot round has no shares to route")
        got = self._receive(1, "share_keys", messages, set(self._keys))
        self._u2 = set(got)
        inboxes: dict[int, Message] = {v: {"shares": {}} for v in self._u2}
        for u, m in got.items():
            for v, ct in m["shares"].items():
                if int(v) in self._u2:
                    inboxes[int(v)]["shares"][u] = ct
        return inboxes

    def collect_masked(self, messages: Sequence[Message]) -> Message:
        """Step 3: U3, the sites whose masked input arrived (to announce to them)."""
        got = self._receive(2, "masked_input", messages, self._u2)
        self._inputs = {v: unpack_words(m["y"], self.plan) for v, m in got.items()}
        return {"survivors": sorted(self._inputs)}

    def collect_one_shot(self, messages: Sequence[Message]) -> np.ndarray:
        """A one-shot round's second and last step (:attr:`SecAggPlan.one_shot`): the
        masked inputs of every site of the roster, which must be every site of the plan;
        their sum mod 2^bits (uint64), in which every pairwise mask cancels."""
        if not self.plan.one_shot:
            raise RoundAborted("server: a full round has no one-shot step")
        got = self._receive(1, "masked_input", messages, set(self._keys))
        if sorted(got) != list(self.plan.sites):  # min_inputs = K: never reached
            raise RoundAborted("server: a one-shot round needs every site's masked input")
        self._stage = 5
        self._inputs = {v: unpack_words(m["y"], self.plan) for v, m in got.items()}
        total = np.zeros(self.plan.length, dtype=np.uint64)
        for y in self._inputs.values():
            total += y
        return total & crypto.modulus_mask(self.plan.bits)

    def collect_signatures(self, messages: Sequence[Message]) -> Message:
        """Step 4 (consistency check): U3 with the signatures of U3 by the survivors that
        answered (U4), to relay to them."""
        got = self._receive(3, "consistency", messages, set(self._inputs))
        self._u4 = set(got)
        return {
            "survivors": sorted(self._inputs),
            "signatures": {v: m["sig"] for v, m in got.items()},
        }

    def finish(self, messages: Sequence[Message]) -> np.ndarray:
        """Step 5: sum_{u in U3} x_u mod 2^bits (uint64) from >= t unmasking answers."""
        got = self._receive(4, "unmask", messages, self._u4)
        plan = self.plan
        if len(got) < plan.min_inputs:
            raise RoundAborted(f"server: {len(got)} unmasking answers, fewer than "
                               f"K - max_dropouts = {plan.min_inputs}")  # fmt: skip
        u3 = set(self._inputs)
        total = np.zeros(plan.length, dtype=np.uint64)
        for y in self._inputs.values():
            total = total + y
        for v in sorted(u3):
            seed = self._rebuild(got, "self_mask_shares", v)
            total = total - crypto.mask(seed, plan.length, plan.bits)
        for v in sorted(self._u2 - u3):  # dropped after sharing keys: cancel its pairwise masks
            key = X25519PrivateKey.from_private_bytes(self._rebuild(got, "mask_key_shares", v))
            peers = {u: self._keys[u][1] for u in u3 & set(plan.neighbourhood(v))}
            # survivor u added +-PRG(s_uv) with the sign seen from u; v's view has the
            # opposite sign, so adding v's pairwise total cancels them
            total = total + pairwise_masks(plan, v, key, peers)
        return total & crypto.modulus_mask(plan.bits)

    def _rebuild(self, answers: dict[int, Message], field: str, v: int) -> bytes:
        shares = {self.plan.point(u): m[field][v] for u, m in answers.items() if v in m[field]}
        if len(shares) < self.plan.threshold:
            raise RoundAborted(f"server: {len(shares)} shares of site {v}'s {field}, need "
                               f"{self.plan.threshold}")  # fmt: skip
        return shamir.combine(shares, self.plan.threshold)
