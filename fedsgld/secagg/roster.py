"""The authenticated roster and the consistency check of a secure-aggregation round.

Bonawitz et al. (CCS 2017), the variant against an actively malicious server: every
message a site signs is bound to the round's whole public plan (``SecAggPlan.context``:
the round label, the sites, the length, the bits, the dropouts and colluders planned, the
kind of round and the mechanism: sigma, clip, q, pre-noise, grid and share variance) and
to a purpose, so a signature can be neither replayed into another round nor read as
another statement.

* ``advertise``: site u signs (context, u, c_u, s_u), its two fresh X25519 public keys;
  :func:`check_roster` verifies every roster entry against the site's key list and refuses
  a roster with a site outside it, a bad signature, or fewer than ``min_peers``
  authenticated sites, before anything secret leaves the site.
* ``survivors``: after the masked inputs, every survivor signs the survivor set U3 it was
  shown; :func:`check_consistency` releases no unmasking share unless at least t
  (K - max_dropouts, the complete graph's Shamir threshold) valid signatures over the SAME
  U3 by members of U3 arrive. Two
  honest sites shown different survivor sets therefore both refuse, unless the server
  holds t signatures over each, which needs 2 (t - max_colluders) honest signers: more
  than the K - max_colluders honest sites whenever K > 2 max_dropouts + max_colluders.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

from . import identity
from .identity import Credentials
from .plan import SecAggPlan


class RosterRefused(RuntimeError):
    """A site refused a roster or a survivor set; the message says why (the site's party,
    :class:`~fedsgld.secagg.protocol.SiteParty`, raises it as ``RoundAborted``)."""


def _statement(plan: SecAggPlan, purpose: bytes, body: bytes) -> bytes:
    return plan.context + b"|" + purpose + b"|" + body


def advertised(plan: SecAggPlan, site: int, enc_pk: bytes, mask_pk: bytes) -> bytes:
    """What site ``site`` signs with its keys of the round: (context, site, enc_pk, mask_pk)."""
    return _statement(plan, b"advertise", struct.pack(">I", site) + enc_pk + mask_pk)


def survivors(plan: SecAggPlan, u3: Iterable[int]) -> bytes:
    """What a survivor signs at the consistency check: (context, sorted U3)."""
    return _statement(plan, b"survivors", b"".join(struct.pack(">I", v) for v in sorted(u3)))


def check_roster(
    plan: SecAggPlan, site: int, roster: Mapping[int, Mapping[str, Any]], creds: Credentials
) -> dict[int, tuple[bytes, bytes]]:
    """The roster's {v: (enc_pk, mask_pk)}, every entry authenticated; else
    :class:`RosterRefused` naming the first site outside the key list, the first bad
    signature, or too few authenticated sites (``min_peers``, this site included)."""
    unknown = sorted(v for v in roster if v not in creds.peers)
    if unknown:
        raise RosterRefused(
            f"site {site}: the roster holds site(s) {unknown} outside its key list; "
            "refusing before any share leaves"
        )
    keys = {}
    for v in sorted(roster):
        e, m = roster[v]["enc_pk"], roster[v]["mask_pk"]
        sig = roster[v].get("sig")
        if not identity.verify(creds.peers.key(v), sig, advertised(plan, v, e, m)):
            raise RosterRefused(
                f"site {site}: site {v}'s round keys are not signed by its key in the key list "
                "(forged, or signed for another round or other mechanism parameters); "
                "refusing before any share leaves"
            )
        keys[v] = (e, m)
    if len(keys) < creds.min_peers:
        raise RosterRefused(
            f"site {site}: {len(keys)} authenticated site(s) in the roster, fewer than its "
            f"policy's min_peers = {creds.min_peers}"
        )
    return keys


def check_consistency(
    plan: SecAggPlan,
    site: int,
    u3: Iterable[int],
    signatures: Mapping[int, Any],
    creds: Credentials,
) -> int:
    """How many members of U3 signed U3 (``signatures``: {v: signature}); at least
    K - max_dropouts, or :class:`RosterRefused`. A signature by a site outside U3, or one that
    does not verify over this U3, is a refusal too: the server relayed it."""
    u3 = sorted(set(u3))
    statement = survivors(plan, u3)
    for v, sig in signatures.items():
        if v not in u3:
            raise RosterRefused(f"site {site}: a survivor-set signature from site {v}, not in U3")
        if not identity.verify(creds.peers.key(v), sig, statement):
            raise RosterRefused(
                f"site {site}: site {v} did not sign the survivor set {u3} this site was shown "
                "(different lists were announced, or the signature is of another round); "
                "refusing to unmask"
            )
    if len(signatures) < plan.min_inputs:
        raise RosterRefused(
            f"site {site}: {len(signatures)} survivors signed the survivor set {u3}, fewer "
            f"than t = {plan.min_inputs}; refusing to unmask"
        )
    return len(signatures)
