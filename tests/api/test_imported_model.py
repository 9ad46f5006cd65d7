"""``model = "package.module:function"``: a user's factory by its import path, as a
deployment names it (the ServerApp and every site import it), refused in one line when it
cannot be imported, and built by a deployed site only when its node config names it."""

from __future__ import annotations

import textwrap

import pytest
import torch

import fedsgld
from fedsgld.config import load_config
from fedsgld.flower.user_sites import check_site_model

SETTINGS = {"rounds": 4, "sample_rate": 0.3, "lr": 0.2, "temperature": 2.0, "epsilon": 30.0,
            "eval_every": 0, "seed": 3}  # fmt: skip

FACTORY = """
from torch import nn


def make_net():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


NOT_A_FUNCTION = 3
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "hospital_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import hospital_models

    return hospital_models


def _sites():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        y = torch.randint(0, 2, (40,), generator=g)
        x = torch.randn(40, 4, generator=g)
        x[:, 0] += 2 * y
        out.append((x, y))
    return out


def test_an_import_path_gives_the_factory_s_run_on_both_transports(factory_module):
    sites = _sites()
    ref = fedsgld.simulate(factory_module.make_net, sites, progress=False, **SETTINGS)
    by_path = fedsgld.simulate(
        "hospital_models:make_net", sites, progress=False, transport="flower", **SETTINGS
    )
    assert ref.steps == by_path.steps > 0
    assert torch.equal(ref.theta, by_path.theta)
    assert by_path.results["config"]["model"] == "hospital_models:make_net"


def test_an_import_path_that_does_not_import_is_refused_in_one_line(factory_module):
    with pytest.raises(ValueError, match="cannot import module 'no_such_models'.*PYTHONPATH"):
        fedsgld.simulate("no_such_models:make_net", _sites(), progress=False, **SETTINGS)
    with pytest.raises(ValueError, match="'hospital_models' has no function 'NOT_A_FUNCTION'"):
        fedsgld.simulate("hospital_models:NOT_A_FUNCTION", _sites(), progress=False, **SETTINGS)
    with pytest.raises(ValueError, match="model must be one of"):
        load_config(None, {"model": "hospital models:make"})


def test_a_deployed_site_builds_only_the_factory_its_node_config_names():
    cfg = load_config(None, {"model": "hospital_models:make_net"})
    check_site_model(cfg, {"site-id": 0, "model": "hospital_models:make_net"})
    refusal = "refused: a site builds an imported model only when its own node config names"
    with pytest.raises(ValueError, match=refusal) as none:
        check_site_model(cfg, {"site-id": 0})
    with pytest.raises(ValueError, match=refusal) as other:
        check_site_model(cfg, {"site-id": 0, "model": "other:fn"})
    assert str(none.value) == str(other.value)  # nothing of what the site's node config names
    check_site_model(load_config(None, {"model": "mlp"}), {"site-id": 0})  # built-in: no check
