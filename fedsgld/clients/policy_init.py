"""``fedsgld site init``: a new site's privacy policy, commented, with safe defaults.

The file it writes is a :class:`~fedsgld.clients.policy.SitePolicy` (every key explained
in place, docs/site-operators.md in full): a lifetime budget, the placements a site that
does not trust the server accepts (secure aggregation or its own noise), a floor on what
one release holds, noised evaluations, and the ledger beside the file. It refuses to
replace an existing policy (its ledger and approvals would be lost) unless told to.
"""

from __future__ import annotations

import math
from pathlib import Path

from fedsgld.clients.policy import DEPLOYED_PLACEMENTS, SitePolicy

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

# Bounds on every training request (refused outside them, before anything is charged).
min_expected_batch = {min_expected_batch}  # sample rate x this site's records, at least
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

# The app bundles this site runs: add them with `fedsgld site approve BUNDLE --policy FILE`.
"""


def policy_text(
    *,
    epsilon: float,
    delta: float = 1e-5,
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS,
    min_expected_batch: float = 16.0,
) -> str:
    """The commented policy file :func:`init_policy` writes."""
    return TEMPLATE.format(
        epsilon=repr(float(epsilon)),
        delta=repr(float(delta)),
        placements=", ".join(f'"{p}"' for p in placements),
        min_expected_batch=repr(float(min_expected_batch)),
    )


def init_policy(
    out: str | Path,
    *,
    epsilon: float,
    delta: float = 1e-5,
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS,
    min_expected_batch: float = 16.0,
    force: bool = False,
) -> SitePolicy:
    """Write a new site's policy to ``out`` and return it as the site will read it.

    ``ValueError`` (naming the setting) for an invalid value, or if ``out`` exists and not
    ``force``; nothing is written then."""
    path = Path(out).expanduser()
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"--epsilon must be a finite number > 0, got {epsilon!r}")
    if path.exists() and not force:
        raise ValueError(
            f"--out {str(path)!r} exists: a site's policy sits beside its ledger and approvals; "
            "pass --force to replace it"
        )
    text = policy_text(
        epsilon=epsilon, delta=delta, placements=placements, min_expected_batch=min_expected_batch
    )
    SitePolicy(  # every value checked before anything is written
        epsilon=float(epsilon),
        delta=float(delta),
        placements=tuple(placements),
        min_expected_batch=float(min_expected_batch),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return SitePolicy.from_file(path)


__all__ = ["init_policy", "policy_text"]
