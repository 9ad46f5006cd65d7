"""Shared test set-up: a deployed site's default ledger directory lives in the tests' tmp."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _site_state_dir(tmp_path_factory):
    """A deployed site without a policy file keeps its ledger in ``$FEDSGLD_STATE_DIR``
    (else under the user's home, which tests must not touch); the Flower processes the
    tests start inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSGLD_STATE_DIR", str(tmp_path_factory.mktemp("site-state")))
        yield
