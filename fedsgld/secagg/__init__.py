"""Secure aggregation with distributed discrete Gaussian noise (docs/secure_aggregation.md).

* :mod:`.plan`: a round's public plan (sites, thresholds, sparse neighbourhoods);
* :mod:`.protocol` / :mod:`.server`: the pairwise-masking protocol with dropout recovery
  (Bonawitz et al. 2017) as explicit parties exchanging plain messages;
* :mod:`.identity` / :mod:`.roster`: the sites' long-term Ed25519 keys and their key list,
  the signed roster and the consistency check (against an actively malicious server);
* :mod:`.ddg`: the distributed discrete Gaussian mechanism (Kairouz, Liu & Steinke 2021):
  rotation, scaling, randomised rounding, each site's exact discrete Gaussian share,
  modular arithmetic, and the server's decoding;
* :mod:`.driver`: one whole round in one process (what a transport will call);
* accounting: :mod:`fedsgld.privacy.distributed`.
"""

from __future__ import annotations

from ..privacy.distributed import DDGParameters, choose_ddg, ddg_epsilon
from .ddg import decode, encode
from .driver import RoundResult, check_site_plan, message_bytes, run_round
from .identity import Consortium, Credentials, ephemeral_credentials
from .plan import Mechanism
from .protocol import RoundAborted, SecAggPlan, SiteParty
from .server import ServerParty

__all__ = [
    "Consortium",
    "Credentials",
    "DDGParameters",
    "Mechanism",
    "RoundAborted",
    "RoundResult",
    "SecAggPlan",
    "ServerParty",
    "SiteParty",
    "check_site_plan",
    "choose_ddg",
    "ddg_epsilon",
    "decode",
    "encode",
    "ephemeral_credentials",
    "message_bytes",
    "run_round",
]
