"""The codecs of the training messages: what the server encodes is what a site decodes, and a
malformed record is refused with a reason that names the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedsgld.config import Config
from fedsgld.core.plan import RoundPlan, TrainPlan
from fedsgld.flower.protocol import (
    decode_evaluate,
    decode_train,
    encode_evaluate,
    encode_train,
    pack_vector,
    run_record,
)
from fedsgld.flower.secure_protocol import SecureStep, decode_secure, encode_secure, secagg_label
from fedsgld.secagg import Mechanism, SecAggPlan

CONFIG = Config.from_flat({"dataset": "synthetic", "model": "mlp", "sites": 3, "seed": 5})
LOCAL = Config.from_flat({**CONFIG.flat(), "noise_placement": "sites", "local_steps": 2})
THETA = pack_vector(np.arange(6, dtype=np.float32))


def _round(local: bool) -> RoundPlan:
    return RoundPlan(
        round=3, step_size=0.1, sigma=1.2, sample_rate=0.05, clip=0.7, prenoise=0.01,
        local_steps=2 if local else 1, first_step=6 if local else None,
    )  # fmt: skip


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("site_id", [None, 2])
def test_a_train_plan_decodes_to_what_was_encoded(local, site_id):
    config = LOCAL if local else CONFIG
    plan = TrainPlan.of(
        _round(local), run_key="k", epoch=1, config=config, theta=THETA, site_id=site_id
    )
    content = encode_train(plan)
    assert list(content.keys()) == ["plan"]
    fields = [k for k in content["plan"].keys() if not k.startswith("run.")]
    expected = ["round", "epoch", "run-key", "sample-rate", "sigma", "prenoise", "clip"]
    expected = (["site-id"] if site_id is not None else []) + expected
    expected += ["local-steps", "first-step"] if local else []
    assert fields == [*expected, "theta"]
    back = decode_train(content)
    assert back == plan and back.round_of == ("k", 1, 3)
    np.testing.assert_array_equal(back.theta_vector(6), np.arange(6, dtype=np.float32))
    assert (back.local_steps, back.first_step) == ((2, 6) if local else (None, None))


def _record(**fields) -> RecordDict:
    content = encode_train(TrainPlan.of(_round(False), run_key="k", epoch=0, config=CONFIG,
                                        theta=THETA))  # fmt: skip
    rec = dict(content["plan"].items())
    for k, v in fields.items():
        if v is None:
            del rec[k]
        else:
            rec[k] = v
    return RecordDict({"plan": ConfigRecord(rec)})


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"round": -1}, "round is -1, expected an integer >= 0"),
        ({"epoch": 0.5}, "epoch is 0.5"),
        ({"run-key": ""}, "no run key"),
        ({"sigma": "1.0"}, "sigma is '1.0', expected a number"),
        ({"sample-rate": True}, "sample-rate is True"),
        ({"sigma": None}, "sigma is None"),
        ({"theta": "abc"}, "theta is a str"),
        ({"site-id": "0"}, "site-id is '0'"),
        ({"seed": 3}, "fields no site reads: ['seed']"),
        ({"secagg-step": "unmask"}, "fields no site reads: ['secagg-step']"),
        ({"run.sites": "three"}, "sites"),
    ],
)
def test_a_malformed_train_plan_is_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError) as err:
        decode_train(_record(**fields))
    assert words in str(err.value)


def test_the_numbers_are_decoded_as_sent_for_the_sites_policy_to_judge():
    """NaN, infinities and negative numbers are well-formed: the site's guard refuses them
    by its policy, naming the limit (tests/privacy/test_site_guard.py)."""
    plan = decode_train(_record(sigma=math.nan, clip=-1.0, prenoise=math.inf))
    assert math.isnan(plan.sigma) and plan.clip == -1.0 and plan.prenoise == math.inf
    assert decode_train(_record(clip=None)).clip is None  # no clipping: a non-private method
    with pytest.raises(ValueError, match="theta has 8 bytes"):
        decode_train(_record(theta=b"\0" * 8)).theta_vector(6)
    with pytest.raises(ValueError, match="no ConfigRecord 'plan'"):
        decode_train(RecordDict({}))


def test_a_secure_step_decodes_to_what_was_encoded():
    train = TrainPlan.of(_round(False), run_key="k", epoch=2, config=CONFIG, theta=None,
                         site_id=1)  # fmt: skip
    # the decoded plan binds the mechanism the request's own numbers make
    m = Mechanism.derive(noise_multiplier=1.2, clip=0.7, sample_rate=0.05, prenoise=0.01,
                         signal_norm=12.5, dim=8, sites=3, max_dropouts=1, max_colluders=0)  # fmt: skip
    sp = SecAggPlan(round_label=secagg_label("k", 2, 3), sites=(0, 1, 2), length=8,
                    bits=m.params.bits, max_dropouts=1, max_colluders=0, mechanism=m)  # fmt: skip
    body = {"survivors": [0, 1], "signatures": {0: b"\1" * 64, 1: b"\2" * 64}}
    step = SecureStep(train, "unmask", sp, signal_norm=12.5, message=body)
    back = decode_secure(encode_secure(step))
    assert back == step
    rec = dict(encode_secure(step)["plan"].items())
    with pytest.raises(ValueError, match="dimension or bits differ from the plan's"):
        decode_secure(RecordDict({"plan": ConfigRecord({**rec, "secagg-bits": m.params.bits + 1})}))
    other = decode_secure(RecordDict({"plan": ConfigRecord({**rec, "sigma": 1.2000000001})}))
    assert other.secagg.context != back.secagg.context  # the 10th digit: another context
    with pytest.raises(ValueError, match="secagg-step 'leak' refused"):
        decode_secure(RecordDict({"plan": ConfigRecord({**rec, "secagg-step": "leak"})}))
    with pytest.raises(TypeError, match="must be integers"):
        decode_secure(RecordDict({"plan": ConfigRecord({**rec, "secagg-bits": 2.5})}))
    with pytest.raises(ValueError, match="fields no site reads"):
        decode_secure(RecordDict({"plan": ConfigRecord({**rec, "noise-seed": 1})}))


def test_an_evaluation_request_decodes_to_what_was_encoded():
    thetas = ArrayRecord({str(i): Array(np.full(6, i, np.float32)) for i in range(2)})
    content = encode_evaluate(
        site_id=1, run_key="k", groups={"posterior": [0, 1]}, thetas=thetas,
        run=run_record(CONFIG),
    )  # fmt: skip
    got = decode_evaluate(content)
    assert (got.site_id, got.run_key, got.groups) == (1, "k", {"posterior": [0, 1]})
    assert got.config == CONFIG
    assert [got.thetas[str(i)].numpy().tolist() for i in range(2)] == [[0.0] * 6, [1.0] * 6]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: c.pop("thetas"), "no ArrayRecord 'thetas'"),
        (lambda c: c.__setitem__("eval", ArrayRecord()), "no ConfigRecord 'eval'"),
        (lambda c: c["eval"].__setitem__("groups", "[0, 1]"), "groups must be a JSON object"),
    ],
)
def test_a_malformed_evaluation_request_is_refused_naming_the_part(change, words):
    thetas = ArrayRecord({"0": Array(np.zeros(6, np.float32))})
    content = encode_evaluate(
        site_id=0, run_key="k", groups={"last": [0]}, thetas=thetas, run=run_record(CONFIG)
    )
    change(content)
    with pytest.raises(ValueError, match=words):
        decode_evaluate(content)
