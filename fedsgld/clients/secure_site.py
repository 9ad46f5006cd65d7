"""A site's part in a round of secure aggregation with distributed noise.

The guard's order, as on every other release path: the site checks the round's public
plan against its own assumptions (:func:`fedsgld.secagg.check_site_plan`: the dropouts and
colluders it assumes, the clip it applies, the noise multiplier of the round), charges
ITS OWN ledger with the round's
:class:`~fedsgld.privacy.events.DistributedDiscreteGaussianStep`
(:meth:`fedsgld.clients.site_ledger.SiteLedger.admit`, persisted before any noise exists), and
only then encodes its clipped sum with its discrete Gaussian share, drawn from the
operating system (:func:`fedsgld.secagg.encode`; in an in-process run of many sites,
in one of the run's :class:`~fedsgld.secagg.workers.EncodeWorkers`). The masking itself is the protocol's
:class:`~fedsgld.secagg.SiteParty`, which the transport plays with the site's
``credentials`` (its long-term signing key and key list: the roster it accepts).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.privacy.distributed import DDGParameters
from fedsgld.privacy.events import DistributedDiscreteGaussianStep
from fedsgld.secagg import Credentials, SecAggPlan, check_site_plan, encode
from fedsgld.secagg.crypto import os_randbytes
from fedsgld.secagg.workers import EncodeWorkers


class SecureSumSite:
    """One site's guard for secure sums: plan check, ledger charge, then its share."""

    def __init__(
        self,
        site_id: int,
        ledger: SiteLedger,
        *,
        clip: float,
        max_dropouts: int,
        max_colluders: int,
        credentials: Credentials,
        randbytes: Callable[[int], bytes] = os_randbytes,
    ) -> None:
        credentials.check_site(int(site_id))
        self.site_id = int(site_id)
        self.credentials = credentials
        self.ledger = ledger
        self.clip = clip
        self.max_dropouts, self.max_colluders = max_dropouts, max_colluders
        self.randbytes = randbytes
        self.workers: EncodeWorkers | None = None

    def use_workers(self, workers: EncodeWorkers | None) -> None:
        """Encode in ``workers`` from now on (None: in the calling thread). Only with the
        operating system's randomness: the children draw from their own, so a site given
        another source (a test's) keeps encoding here."""
        self.workers = workers if self.randbytes is os_randbytes else None

    def contribution(
        self,
        vector: np.ndarray,
        *,
        plan: SecAggPlan,
        params: DDGParameters,
        noise_multiplier: float,
        sample_rate: float,
        prenoise: float,
        round_of: tuple[str, int, int],
    ) -> np.ndarray:
        """The encoded, noised ``vector`` (this site's clipped sum of the round, pre-noise
        ``prenoise``) modulo 2^bits, or an exception having drawn nothing (a refused plan,
        the site's budget). The plan's mechanism, which its signed keys and masks bind, must
        be exactly these numbers (:func:`~fedsgld.secagg.check_site_plan`)."""
        check_site_plan(
            plan,
            params,
            clip=self.clip,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            prenoise=prenoise,
            max_dropouts=self.max_dropouts,
            max_colluders=self.max_colluders,
            peers=self.credentials.peers,
        )
        paid = self.ledger.admit(
            event=DistributedDiscreteGaussianStep(params, sample_rate), round_of=round_of
        )
        if self.workers is not None:
            return paid.draw(self.workers.encode, vector, params, plan.round_label)
        return paid.draw(encode, vector, params, plan.round_label, self.randbytes)
