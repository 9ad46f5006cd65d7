"""The engine's rounds with one per-record pass over all sites against each site's own.

``site_pass`` changes only the order of float additions: the same run (seed, sites,
ledger) ends at the same parameters to float rounding with either pass.
"""

from __future__ import annotations

import pytest
import torch

from fedsgld import engine
from fedsgld.config import load_config

MANY = {
    "dataset": "synthetic",
    "model": "mlp",
    "sites": 8,
    "rounds": 3,
    "sample_rate": 0.2,
    "lr": 0.2,
    "prenoise": 0.01,
    "epsilon": 30.0,
    "eval_every": 0,
    "checkpoint_every": 0,
    "burn_in": 1,
    "max_samples": 1,
    "seed": 3,
}


def _final(tmp_path, site_pass: str) -> tuple[torch.Tensor, dict]:
    cfg = load_config(None, {**MANY, "site_pass": site_pass})
    built: dict = {}
    res = engine.run(
        cfg, out_dir=tmp_path / site_pass, progress=False, log=lambda s: None, built=built
    )
    return built["server"].theta.clone(), res["privacy"]


@pytest.mark.slow  # 7-16 s
def test_batched_rounds_end_where_per_site_rounds_end(tmp_path):
    ref, ref_privacy = _final(tmp_path, "per_site")
    got, got_privacy = _final(tmp_path, "auto")  # 8 sites: batched
    assert got_privacy["epsilon"] == ref_privacy["epsilon"]
    assert got_privacy["steps"] == ref_privacy["steps"] == 3
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    start = load_config(None, MANY)
    assert start.perf.batched_sites(8)


@pytest.mark.slow  # 7-16 s
def test_noise_at_the_sites_shares_the_first_steps_pass_and_ends_in_the_same_place(
    tmp_path, monkeypatch
):
    """noise_placement = "sites": every site's first local step starts from the server's
    parameters, so the batched pass computes it for all sites at once (each from the site's
    own stream of that step); with one and with two local steps the run ends where the
    per-site run ends, with the same ledger."""
    import fedsgld.clients.site as site_module

    passes = []
    real = site_module.site_sums

    def counted(*a, **kw):
        passes.append(len(a[2]))  # the sites' samples in the one pass
        return real(*a, **kw)

    monkeypatch.setattr(site_module, "site_sums", counted)
    for steps in (1, 2):
        over = {**MANY, "noise_placement": "sites", "local_steps": steps}
        runs = {}
        for site_pass in ("per_site", "batched"):
            passes.clear()
            cfg = load_config(None, {**over, "site_pass": site_pass})
            built: dict = {}
            res = engine.run(cfg, out_dir=tmp_path / f"{site_pass}{steps}", progress=False,
                             log=lambda s: None, built=built)  # fmt: skip
            runs[site_pass] = (built["server"].theta.clone(), res["privacy"], list(passes))
        (ref, ref_p, none), (got, got_p, batched) = runs["per_site"], runs["batched"]
        assert none == [] and batched == [8] * 3  # one pass over the 8 sites per round
        assert got_p["epsilon"] == ref_p["epsilon"] and got_p["ledger"] == ref_p["ledger"]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
