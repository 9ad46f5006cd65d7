"""A server's own ServerApp against four stock SuperNodes on loopback: floating point,
server-named code and a split mechanism (issue 54; in process: tests/privacy/
test_floating_point.py, test_site_code_paths_sizes.py and test_secagg_mechanism.py).

Site 0 holds D (a target record whose feature 0 is 3.14159, every other record's in
[-2, 2]), site 1 holds D' (D without that record), sites 2 and 3 other records; each
publishes the same count (120), signs with its own key and knows the others'. The
attacker's ServerApp (written below into its own app directory, next to fedsgld's
ClientApp) sends:

(a) the overflow theta of logistic regression (every entry finite: W[0, 0] = fmax / (2 t),
    b[0] = fmax / 2, so class 0's logit overflows for exactly the records with x_0 > t) in
    ``train`` requests at the ``sites`` placement and in ``evaluate`` requests for t on
    both sides of the target's feature: D and D' answer the same requests, every reply
    finite.
(b) PATE with ``student_model = "tempfile:mkdtemp"`` (and a module that is not installed):
    refused, no directory made in the site's temporary directory, one reply for both.
(c) a secure one-shot round showing site 0 sigma 8 and the others sigma 1, site 0's signal
    norm picked so that every site uses the same bits: refused by every site, no ledger
    moves; the control (one plan for all, the overflow theta) is answered and decodes.

No refusal names a path of a site's files.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flower_support import flower_env, flwr

from fedsgld.deploy.loopback import Loopback
from fedsgld.secagg import identity

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

D_IN, K, N_TRAIN, N_TEST = 4, 3, 120, 60
TARGET_X = 3.14159
RUN = {
    "dataset": "synthetic",
    "model": "logreg",
    "sites": 4,
    "sample_rate": 0.5,
    "lr": 0.2,
    "temperature": 0.5,
    "decay_gamma": 0.5,
    "decay_t0": 5.0,
    "prenoise": 0.01,
    "epsilon": 50.0,
    "randomness": "os",
    "seed": 1,
    "noise_placement": "sites",
    "local_steps": 1,
    "max_dropouts": 0,
}

ATTACKER_APP = '''
"""The attacker's ServerApp: crafted messages, every reply recorded."""
import json, math, time
from dataclasses import replace
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from fedsgld.config import Config
from fedsgld.core.plan import TrainPlan
from fedsgld.flower.protocol import SECAGG, pack_vector, plan_record, run_record
from fedsgld.flower.secure_protocol import SecureStep, encode_secure, secagg_label
from fedsgld.pate.flower import pate_config_from_run_config, pate_record
from fedsgld.privacy.distributed import choose_ddg, padded_dimension
from fedsgld.secagg import SecAggPlan
from fedsgld.secagg.crypto import modulus_mask
from fedsgld.secagg.wire import unflatten

app = ServerApp()
BASE = json.loads({base!r})
D_IN, K, P = {d_in}, {k}, {d_in} * {k} + {k}
FMAX = float(np.finfo(np.float32).max)


def overflow_theta(t):
    theta = np.zeros(P, np.float32)
    theta[0], theta[K * D_IN] = FMAX / (2.0 * t), FMAX / 2.0
    return theta


def ask(grid, pairs):
    msgs = [Message(rec, node, kind, group_id=f"attack-{{i}}")
            for i, (node, kind, rec) in enumerate(pairs)]
    out = {{}}
    for r in grid.send_and_receive(msgs, timeout=300):
        out[r.metadata.group_id] = r
    return [out.get(f"attack-{{i}}") for i in range(len(msgs))]


def status(r):
    if r is None:
        return "no reply"
    return "refused: " + str(r.error.reason)[-700:] if r.has_error() else "answered"


def finite_train(r):
    if r is None or r.has_error():
        return None
    return bool(np.isfinite(np.frombuffer(r.content["theta"]["theta"], "<f4")).all())


def finite_eval(r):
    """Every statistic the site releases of the model, and its report's (the undefined
    ones of a noised release, such as the AUC, aside), finite."""
    if r is None or r.has_error():
        return None
    stats = json.loads(r.content["stats"]["json"])["m"]
    report = json.loads(r.content["reports"]["json"])["m"]
    vals = [stats["nll_sum"], stats["brier_sum"], *stats["bin_conf"]]
    vals += [report[k] for k in ("accuracy", "nll", "brier", "ece")]
    return all(math.isfinite(v) for v in vals)


def secure(node, cfg, site, rnd, step, body, sigma=1.0, norm=None, theta=None):
    sp = SecAggPlan(round_label=secagg_label("secure", 0, rnd), sites=(0, 1, 2, 3),
                    length=padded_dimension(P), bits=BITS, one_shot=True)
    plan = TrainPlan(round=rnd, epoch=0, run_key="secure", sample_rate=0.5, sigma=sigma,
                     prenoise=0.01, clip=1.0, config=cfg, theta=theta, site_id=site)
    step = SecureStep(plan, step, sp, signal_norm=NORM if norm is None else norm, message=body)
    return (node, SECAGG, encode_secure(step))


NORM = 1.0 * 4 * {n_train}  # C x the counts the sites publish
BITS = choose_ddg(noise_multiplier=1.0, clip=1.0, dim=P, sites=4, signal_norm=NORM).bits


def split_sigma():
    """Site 0's sigma x 8 and a signal norm that keeps the others' bits."""
    high = choose_ddg(noise_multiplier=8.0, clip=1.0, dim=P, sites=4, signal_norm=0.0)
    spread = 4 + 8.0 * math.sqrt(4 * high.share_variance + 1.0)
    norm = (1.5 * 2.0 ** (BITS - 2) - spread) * high.gamma
    assert norm > 0 and choose_ddg(noise_multiplier=8.0, clip=1.0, dim=P, sites=4,
                                   signal_norm=norm).bits == BITS
    return {{"sigma": 8.0, "norm": norm}}


def secure_round(grid, cfg, node_of, rnd, site0, theta):
    keys, seen = {{}}, {{}}
    adv = ask(grid, [secure(node_of[v], cfg, v, rnd, "advertise_keys", {{}},
                            **(site0 if v == 0 else {{}})) for v in range(4)])
    seen["advertise"] = [status(r) for r in adv]
    for v, r in enumerate(adv):
        if r is not None and not r.has_error():
            m = unflatten(r.content["secagg"], "")
            keys[v] = {{k: m[k] for k in ("enc_pk", "mask_pk", "sig")}}
    got = ask(grid, [secure(node_of[v], cfg, v, rnd, "masked_input", {{"keys": keys}},
                            theta=pack_vector(theta), **(site0 if v == 0 else {{}}))
                     for v in range(4)])
    seen["masked"] = [status(r) for r in got]
    if all(r is not None and not r.has_error() for r in got):
        ys = [np.frombuffer(unflatten(r.content["secagg"], "")["y"], "<u4").astype(np.uint64)
              for r in got]
        total = sum(ys) & modulus_mask(BITS)
        seen["decoded_std"] = float(((total.astype(np.float64) / 2**BITS + 0.5) % 1.0 - 0.5).std())
    return seen


@app.main()
def main(grid: Grid, context) -> None:
    out = context.run_config["out"]
    end = time.monotonic() + 300
    while len(grid.get_node_ids()) < 4 and time.monotonic() < end:
        time.sleep(0.5)
    cfg = Config.from_flat(BASE)
    secure_cfg = Config.from_flat({{**BASE, "secure_aggregation": True}})
    nodes = sorted(grid.get_node_ids())
    node_of, seen = {{}}, {{}}
    for r in ask(grid, [(n, "query", RecordDict({{"run": run_record(cfg)}})) for n in nodes]):
        (e,) = json.loads(str(r.content["sites"]["json"]))
        node_of[e["site"]] = r.metadata.src_node_id
    # (a) the overflow theta: train at the sites placement, and evaluations over t
    def train(site, rnd):
        rec = {{"site-id": site, "round": rnd, "epoch": 0, "run-key": "overflow",
               "sample-rate": 0.5, "sigma": 1.0, "prenoise": 0.01, "clip": 1.0,
               "local-steps": 1, "first-step": rnd, "theta": pack_vector(overflow_theta(3.0))}}
        return (node_of[site], "train", RecordDict({{"plan": plan_record(rec, run_record(cfg))}}))
    got = ask(grid, [train(s, 0) for s in (0, 1)])
    seen["train"] = {{s: [(status(r), finite_train(r)) for r in got[i::2]] for i, s in enumerate((0, 1))}}
    ts = [2.5, 3.0, 3.3]  # the grid a search over t would probe (the target: 3.14159)
    def evaluate(site, t):
        ev = ConfigRecord({{"site-id": site, "run-key": "search", "groups": json.dumps({{"m": [0]}})}})
        rec = {{"thetas": ArrayRecord({{"0": Array(overflow_theta(t))}}), "eval": ev,
               "run": run_record(cfg)}}
        return (node_of[site], "evaluate", RecordDict(rec))
    got = ask(grid, [evaluate(s, t) for t in ts for s in (0, 1)])
    seen["evaluate"] = {{s: [(status(r), finite_eval(r)) for r in got[i::2]] for i, s in enumerate((0, 1))}}
    # (b) PATE naming a function of an installed module, and a module not installed
    pate = pate_config_from_run_config(json.loads({pate!r}))
    def pate_ask(site, name):
        rec = pate_record(replace(pate, student_model=name))
        return (node_of[site], "query.pate", RecordDict({{"pate": rec}}))
    got = ask(grid, [pate_ask(s, n) for s in (2, 3) for n in ("tempfile:mkdtemp", "fedsgld_missing54:make")])
    seen["pate"] = [status(r) for r in got]
    # (c) split sigma in a one-shot secure round, then the control: one plan for all
    seen["split"] = secure_round(grid, secure_cfg, node_of, 5, split_sigma(), overflow_theta(3.0))
    seen["control"] = secure_round(grid, secure_cfg, node_of, 6, {{}}, overflow_theta(3.0))
    with open(out, "w") as fh:
        json.dump(seen, fh)
'''

PATE = {
    "pate.dataset": "synthetic",
    "pate.sites": 4,
    "pate.teachers_per_site": 2,
    "pate.queries": 20,
    "pate.threads": 1,
}


def _records(seed: int, target: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for split, n, at in (("train", N_TRAIN, 7), ("test", N_TEST, 3)):
        x = rng.standard_normal((n, D_IN)).astype(np.float32)
        x[:, 0] = np.clip(x[:, 0], -2.0, 2.0)
        if target:
            x[at, 0] = TARGET_X
        y = (np.arange(n) % K).astype(np.int64)
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


def _site_files(root: Path) -> list[Path]:
    """D, D' (D without its two target records), and two other sites' records."""
    d = _records(0, True)
    without = {k: v for k, v in d.items()}
    for split, at in (("train", 7), ("test", 3)):
        keep = np.arange(d[f"x_{split}"].shape[0]) != at
        without[f"x_{split}"], without[f"y_{split}"] = d[f"x_{split}"][keep], d[f"y_{split}"][keep]
    files = []
    for k, arrays in enumerate((d, without, _records(2, False), _records(3, False))):
        p = root / "data" / f"site-{k}.npz"
        p.parent.mkdir(parents=True, exist_ok=True)
        np.savez(p, **arrays, num_classes=np.int64(K))
        files.append(p)
    return files


def _attacker_dir(root: Path) -> Path:
    d = root / "attacker"
    d.mkdir()
    text = ATTACKER_APP.format(base=json.dumps(RUN), pate=json.dumps(PATE), d_in=D_IN, k=K,
                               n_train=N_TRAIN)  # fmt: skip
    (d / "attacker_app.py").write_text(textwrap.dedent(text))
    (d / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "attacker"
            version = "1.0.0"
            dependencies = []

            [tool.flwr.app]
            publisher = "attacker"

            [tool.flwr.app.components]
            serverapp = "attacker_app:app"
            clientapp = "fedsgld.apps.client_app:app"

            [tool.flwr.app.config]
            out = ""
            """
        )
    )
    return d


class _Sites(Loopback):
    """The loopback deployment, each SuperNode's temporary directory its own (TMPDIR)."""

    def _node_env(self, k, extra, shims):
        tmp = self.root / f"node-tmp{k}"
        tmp.mkdir(exist_ok=True)
        return {**super()._node_env(k, extra, shims), "TMPDIR": str(tmp)}


def _nodes(root: Path) -> tuple[list[str], list[Path]]:
    files = _site_files(root)
    public = {k: identity.generate(root / f"site{k}" / "site.key") for k in range(4)}
    peers = "".join(f'{k} = "{h}"\n' for k, h in public.items())
    nodes, paths = [], []
    for k, data in enumerate(files):
        d = root / f"site{k}"
        (d / "peers.toml").write_text(peers)
        (d / "policy.toml").write_text(
            "epsilon = 50.0\nplacements = ['sites', 'secure']\nmax_sample_rate = 0.5\n"
            f"public_records = {N_TRAIN}\npublic_test_records = {N_TEST}\n"
            'signing_key = "site.key"\npeers = "peers.toml"\n'
        )
        nodes.append(f"site-id={k} site-data='{data}' privacy-policy='{d / 'policy.toml'}'")
        paths += [data, data.parent, d, d / "policy.toml", d / "peers.toml", d / "site.key"]
    return nodes, paths


def _ddg_rounds(root: Path, k: int) -> int:
    f = root / f"site{k}" / f"fedsgld-site-{k}.json"
    led = json.loads(f.read_text())["ledger"] if f.is_file() else {}
    return sum(int(c) for *_, c in led.get("ddg", []))


def test_an_attackers_serverapp_gets_no_record_through_floating_point_code_or_sigma(flower_tmp):
    root, _ = flower_tmp
    nodes, paths = _nodes(root)
    app = _attacker_dir(root)
    seen_file = root / "seen.json"
    with _Sites(root / "deploy") as lo:
        lo.start(nodes)
        res = flwr(
            ["run", ".", "loop", "--stream", "--run-config", f"out='{seen_file}'"],
            flower_env(lo.root / "home-cli"),
            timeout=600,
            cwd=app,
        )
        assert seen_file.is_file(), (res.stdout + res.stderr)[-3000:]
        tmp_dirs = [lo.root / f"node-tmp{k}" for k in range(4)]
    seen = json.loads(seen_file.read_text())
    # (a) D and D' answer the same requests, every reply finite
    assert seen["train"]["0"] == seen["train"]["1"] == [["answered", True]], seen["train"]
    assert seen["evaluate"]["0"] == seen["evaluate"]["1"] == [["answered", True]] * 3, seen[
        "evaluate"
    ]
    # (b) PATE's model names: refused before anything is imported or called, one reply
    # whatever is installed, and no directory made at the site
    texts = [r.replace("tempfile:mkdtemp", "NAME").replace("fedsgld_missing54:make", "NAME")
             for r in seen["pate"]]  # fmt: skip
    assert all(t.startswith("refused") and "pate.student_model" in t for t in texts), texts
    assert all("No module" not in t and "install" not in t for t in texts), texts
    assert len({t.splitlines()[-1] for t in texts}) == 1, texts
    made = [p for d in tmp_dirs for p in d.iterdir() if p.is_dir() and p.name.startswith("tmp")]
    assert not made, made
    # (c) split sigma: every site refuses the masked input, no ledger moves; the control
    # (one plan for all, the overflow theta) is answered, decodes, and is charged once
    split, control = seen["split"], seen["control"]
    assert all(s.startswith("refused") for s in split["masked"]), split
    assert all("not signed by its key" in s for s in split["masked"]), split
    assert "decoded_std" not in split
    assert control["masked"] == ["answered"] * 4, control
    assert control["decoded_std"] < 0.1  # masks that do not cancel: uniform, std 0.29
    assert [_ddg_rounds(root, k) for k in range(4)] == [1] * 4
    # no refusal carries a path of a site's files
    refusals = [s for s in [*seen["pate"], *split["advertise"], *split["masked"]]
                if s.startswith("refused")]  # fmt: skip
    named = {str(p) for p in paths} | {str(p.resolve()) for p in paths}
    assert refusals and not [(p, r) for r in refusals for p in named if p in r]
