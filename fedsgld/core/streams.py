"""The keys of every random stream: which generator a draw comes from, in one place.

A :class:`~fedsgld.core.noise.Randomness` makes one generator per use, named by a key (a
tuple of non-negative ints); a seeded one derives it from (seed, *key), so two uses with
different keys never share a stream. The first part names the party: 0 the server,
``1 + k`` site k. The rest names the use:

* ``server_noise(t)``: the server's noise of step t (``(0, t)``);
* ``site_round(k, t)``: site k's Poisson sample and pre-noise of round or step t;
* ``site_local_noise(k, t)``: site k's own noise of local step t (``sites`` placement);
* ``recal_server_noise(j)`` / ``recal_site(k, j)``: recalibration step j. The 4-part key
  ending in 0 is never a training key (those have 2 or 3 parts, or end in a resume epoch
  >= 1);
* ``SWAG_STREAM``: the draws from the SWAG Gaussian (post-processing, not privacy noise);
* ``SITE_RELEASE``: a site's noise of one release it noises itself (evaluation statistics,
  vote counts; always drawn from fresh OS entropy, so the key only names the use);
* PATE (seeded from the PATE config's seed): ``PATE_TEACHER`` (a teacher's minibatches,
  then the teacher id), ``PATE_AGGREGATOR`` (the noisy aggregation of mechanism i),
  ``PATE_STUDENT`` (the student's minibatches of mechanism i);
* the privacy audit's own generators: ``AUDIT_DIRECTION``, ``AUDIT_INCLUSION``,
  ``AUDIT_SAMPLE``.

``EPOCH_TAG`` separates the streams of a resumed run: a seeded ``Randomness`` of epoch
>= 1 appends ``(EPOCH_TAG, epoch)`` to every key. ``RECAL_STREAM`` and
``VALIDATION_STREAM`` also key the permutations that carve a site's calibration and
validation splits. Torch-free: keys are plain ints.
"""

from __future__ import annotations

SERVER_STREAM = 0  # the server's key part; site k's is 1 + k (site_party)
LOCAL_NOISE_STREAM = 1  # extra key part of a site's own noise (sites placement)
RECAL_STREAM = 0x7EC  # recalibration, at the position of a round or step index
VALIDATION_STREAM = 0x7A1  # the validation split's permutation (beside RECAL_STREAM's)
SWAG_STREAM = 0x5A4A  # the SWAG draws (one part, plus the epoch)
STANDARDIZE_STREAM = 0x57D  # the pooled standardisation's one release (server's or a site's)
EPOCH_TAG = 0xE90C4  # key part that separates the streams of a resumed run (epoch >= 1)
SITE_RELEASE = (0,)  # the key of a site's release noise (fresh OS entropy: names the use)
PATE_TEACHER, PATE_AGGREGATOR, PATE_STUDENT = 1, 2, 3  # then the teacher / mechanism index
AUDIT_DIRECTION, AUDIT_INCLUSION, AUDIT_SAMPLE = 0xA0D1, 0xA0D2, 0xA0D3  # the audit's


def site_party(site_id: int) -> int:
    """Site k's first key part (the server's is ``SERVER_STREAM``)."""
    return 1 + site_id


def server_noise(step: int) -> tuple[int, int]:
    """The server's noise of step ``step``."""
    return (SERVER_STREAM, step)


def site_round(site_id: int, step: int) -> tuple[int, int]:
    """Site ``site_id``'s Poisson sample and pre-noise of round (or local step) ``step``."""
    return (site_party(site_id), step)


def site_local_noise(site_id: int, step: int) -> tuple[int, int, int]:
    """Site ``site_id``'s own noise of local step ``step`` (noise placement ``sites``)."""
    return (site_party(site_id), step, LOCAL_NOISE_STREAM)


def recal_server_noise(step: int) -> tuple[int, int, int, int]:
    """The server's noise of recalibration step ``step``."""
    return (SERVER_STREAM, RECAL_STREAM, step, 0)


def recal_site_noise(site_id: int, step: int) -> tuple[int, int, int, int]:
    """Site ``site_id``'s own noise of per-site recalibration step ``step``."""
    return (site_party(site_id), RECAL_STREAM, step, LOCAL_NOISE_STREAM)


def recal_site(site_id: int, step: int) -> tuple[int, int, int, int]:
    """Site ``site_id``'s Poisson sample of recalibration step ``step``."""
    return (site_party(site_id), RECAL_STREAM, step, 0)
