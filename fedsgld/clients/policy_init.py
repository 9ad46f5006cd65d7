"""``fedsgld site init``: a new site's privacy policy, commented, with safe defaults.

The file it writes is a :class:`~fedsgld.clients.policy.SitePolicy` (every key explained
in place, docs/site-operators.md in full): a lifetime budget, the placements a site that
does not trust the server accepts (secure aggregation or its own noise), the record counts
it publishes (none unless given: it then answers no training request), a floor on what
one release holds, noised evaluations, and the ledger beside the file. Beside it: the
site's long-term Ed25519 signing key (``site.key``, mode 0600, never leaves the site) and
its public key (``site.pub``), which the consortium collects into the key list every site
names as ``peers`` (``peers.toml``: with ``site_id``, started with this site's own line).
It refuses to replace an existing policy or key (its ledger and approvals would be lost)
unless told to.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fedsgld.clients.policy import DEPLOYED_PLACEMENTS, SitePolicy
from fedsgld.secagg import identity

TEMPLATE = """\
# fedsgld site policy: what this site answers, decided here (docs/site-operators.md).
# Every message the server sends passes this site's guard, which checks it against this
# file, charges the ledger beside it, and only then computes anything on the records.

# The site's LIFETIME privacy budget (epsilon, delta), for every round it answers in any
# placement, every noised evaluation and every PATE vote, across all runs: the ledger
# (fedsgld-site-<id>.json in state_dir) only grows. Raise it only knowingly.
epsilon = {epsilon}
delta = {delta}
accountant = "pld"

# Where the noise of a training round may be added:
#   "secure"  each site adds a share of the noise; the server learns only the secure sum
#   "sites"   this site adds all the noise to its own update
#   "server"  this site sends its clipped gradient sum and TRUSTS the server to add the
#             noise it promises (the server sees one site's exact clipped sum)
placements = [{placements}]

# The record counts this site publishes: the server plans with them (the expected batch
# q x records), and min_expected_batch is checked against them. The exact counts differ
# between this data set and the same one without one patient, so publish rounded figures
# (e.g. to the nearest hundred), or "exact" knowingly. Without public_records the site
# answers no training request; without public_test_records evaluations carry no exact count.
{public_records_line}
{public_test_records_line}

# Bounds on every training request (refused outside them, before anything is charged).
min_expected_batch = {min_expected_batch}  # sample rate x public_records, at least
max_sample_rate = 0.1
min_noise_multiplier = 0.5
max_clip = 10.0
max_local_steps = 10

# Evaluations of a server-chosen model on this site's records are queries: noised and
# charged to the budget above, at most max_evaluations per run.
evaluation = "dp"
evaluation_noise_multiplier = 5.0
max_evaluations = 20
max_models_per_evaluation = 32

# Secure aggregation: the rounds this site joins must plan for at least these many sites
# dropping out / colluding with the server (this site's noise share assumes them missing).
max_dropouts = 0
max_colluders = 0

# Never send predictions, labels or the label histogram; never accept a shared seed.
share_label_histogram = false
share_predictions = false
insecure_seeded_noise = false
allow_non_private = false

# The ledger's directory (relative to this file).
state_dir = "."

# Secure aggregation: this site's long-term signing key (never leaves the site), the
# consortium's public keys (one line `<site-id> = "<hex>"` per site, from each site's
# site.pub, exchanged outside the server), and the fewest authenticated sites a round may
# count on. A round naming a site or key not in `peers` is refused.
signing_key = "site.key"
{peers_line}
min_peers = {min_peers}

# The app bundles this site runs: add them with `fedsgld site approve BUNDLE --policy FILE`.
"""


def policy_text(
    *,
    epsilon: float,
    delta: float = 1e-5,
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS,
    min_expected_batch: float = 16.0,
    public_records: int | str | None = None,
    public_test_records: int | str | None = None,
    peers: bool = True,
    min_peers: int = 2,
) -> str:
    """The commented policy file :func:`init_policy` writes (``peers``: name peers.toml;
    a published count left None is written commented out)."""
    line = 'peers = "peers.toml"'

    def count(key: str, v: int | str | None, example: int) -> str:
        return f"# {key} = {example}" if v is None else f"{key} = {json.dumps(v)}"

    return TEMPLATE.format(
        public_records_line=count("public_records", public_records, 1000),
        public_test_records_line=count("public_test_records", public_test_records, 200),
        epsilon=repr(float(epsilon)),
        delta=repr(float(delta)),
        placements=", ".join(f'"{p}"' for p in placements),
        min_expected_batch=repr(float(min_expected_batch)),
        peers_line=line if peers else f"# {line}   (write peers.toml, then remove the #)",
        min_peers=int(min_peers),
    )


def init_policy(
    out: str | Path,
    *,
    epsilon: float,
    delta: float = 1e-5,
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS,
    min_expected_batch: float = 16.0,
    public_records: int | str | None = None,
    public_test_records: int | str | None = None,
    site_id: int | None = None,
    min_peers: int = 2,
    force: bool = False,
) -> tuple[SitePolicy, str]:
    """Write a new site's policy to ``out``, its signing key ``site.key`` and public key
    ``site.pub`` beside it (and, with ``site_id``, ``peers.toml`` holding this site's own
    line, for the consortium's other lines to be added). Returns the policy as the site will
    read it and the public key (hex).

    ``ValueError`` (naming the setting) for an invalid value, or if ``out`` or the key exists
    and not ``force``; nothing is written then."""
    path = Path(out).expanduser()
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"--epsilon must be a finite number > 0, got {epsilon!r}")
    if site_id is not None and (isinstance(site_id, bool) or not isinstance(site_id, int)
                                or site_id < 0):  # fmt: skip
        raise ValueError(f"--site-id must be an integer >= 0, got {site_id!r}")
    key, pub, peers = (path.parent / n for n in ("site.key", "site.pub", "peers.toml"))
    for f, what in ((path, "--out"), (key, "the signing key")):
        if f.exists() and not force:
            raise ValueError(
                f"{what} {str(f)!r} exists: a site's policy sits beside its ledger, key and "
                "approvals; pass --force to replace it"
            )
    text = policy_text(
        epsilon=epsilon,
        delta=delta,
        placements=placements,
        min_expected_batch=min_expected_batch,
        public_records=public_records,
        public_test_records=public_test_records,
        peers=site_id is not None,
        min_peers=min_peers,
    )
    SitePolicy(  # every value checked before anything is written
        epsilon=float(epsilon),
        delta=float(delta),
        placements=tuple(placements),
        min_expected_batch=float(min_expected_batch),
        public_records=public_records,
        public_test_records=public_test_records,
        min_peers=min_peers,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    public = identity.generate(key, overwrite=force)
    line = f'{site_id} = "{public}"\n' if site_id is not None else f"{public}\n"
    pub.write_text(line)
    if site_id is not None and (force or not peers.exists()):
        peers.write_text(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return SitePolicy.from_file(path), public


__all__ = ["init_policy", "policy_text"]
