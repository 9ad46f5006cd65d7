"""A site runs only the app bundles its policy approves: a real loopback deployment.

Three SuperNodes on the fast path (``python -m fedsgld.deploy supernode``), sharing one
policy file that approves bundle A (approved with ``fedsgld site approve``, as a hospital
would); site 0 starts its ClientApps cold (``--no-warm``: the shim's checked launch of
Flower's ``flwr-clientapp``), sites 1 and 2 warm (forked by the fork server). A runs.
Bundle B is A with one line changed; that line writes a marker file when the module is
imported, so a marker proves that B's code ran. The server submits B, as an attacker
controlling the server would: every site refuses it before any of its code runs (no
marker), logs why, and the refusal reaches the ServerApp as an error reply naming the site.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flower_support import ROOT, flower_env, flwr, free_port, run_config_arg
from test_approval import app_copy
from test_fast_deploy import _wait_serving
from test_flower_deploy import RUN, SITES, _site_files

from fedsgld.clients.approve import build_bundle
from fedsgld.deploy import fast, shim
from fedsgld.deploy.loopback import write_connection

# one line of the ClientApp's module: it marks every process that imports the bundle
# (named: bundle, node's FLWR_HOME, the fork server's pid or "cold", the process's pid)
MARK = (
    'import os as _o; _m = _o.environ.get("FEDSGLD_TEST_MARKS"); _m and open(_o.path.join(_m, '
    '"{kind} %s %s %d" % (_o.path.basename(_o.environ["FLWR_HOME"]), '
    '_o.environ.get("FEDSGLD_WARM_SITE", "cold"), _o.getpid())), "w").close()'
)


def _env(root: Path, name: str, **extra: str) -> dict[str, str]:
    env = flower_env(root / name, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.deploy
@pytest.mark.slow  # about 100 s
def test_a_site_runs_the_bundle_it_approved_and_refuses_one_changed_line(flower_tmp):
    root, procs = flower_tmp
    if fast.support()["waits"] is not None:
        pytest.skip("the fast path does not support the installed flwr")
    approved = app_copy(root / "a" / "fedsgld", extra_line=MARK.format(kind="approved"))
    changed = app_copy(root / "b" / "fedsgld", extra_line=MARK.format(kind="changed"))
    digest_a = hashlib.sha256(build_bundle(approved)).hexdigest()
    digest_b = hashlib.sha256(build_bundle(changed)).hexdigest()
    assert digest_a != digest_b
    policy = root / "policy.toml"
    policy.write_text(
        "# the hospitals' policy\nepsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\nmax_sample_rate = 0.5\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "fedsgld", "site", "approve", str(approved), "--policy", str(policy)],
        env=_env(root, "home-approve"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0 and f"sha256 {digest_a}" in res.stdout, res.stdout + res.stderr

    files = _site_files(root)
    port = free_port()
    procs.start(
        "superlink",
        [sys.executable, "-m", "fedsgld.deploy", "superlink", "--", "--insecure",
         "--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation"],
        _env(root, "home-link"),
    )  # fmt: skip
    procs.wait_listening("superlink", port)
    marks = root / "marks"
    marks.mkdir()
    sockets = []
    for k, f in enumerate(files):
        sock = Path(shim.private_dir(str(root / f"warm{k}"))) / "fork.sock"
        if k > 0:
            sockets.append(sock)
        procs.start(
            f"supernode-{k}",
            [sys.executable, "-m", "fedsgld.deploy", "supernode", *(["--no-warm"] if k == 0 else []),
             "--", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
             "--node-config", f"site-id={k} site-data='{f}' privacy-policy='{policy}'"],
            _env(root, f"home-node{k}", FEDSGLD_TEST_MARKS=str(marks),
                 FEDSGLD_WARM_SOCKET=str(sock)),
        )  # fmt: skip
    _wait_serving(sockets)
    cli_home = root / "home-cli"
    write_connection(cli_home, "loop", port)
    cli_env = _env(root, "home-cli")

    def run(app: Path, out: Path, **cfg) -> tuple[subprocess.CompletedProcess, str]:
        res = flwr(
            ["run", str(app), "loop", "--stream", "--run-config",
             run_config_arg({**RUN, "rounds": 1, "out": str(out), **cfg})],
            cli_env, timeout=600,
        )  # fmt: skip
        text = res.stdout + res.stderr
        (root / f"flwr-run-{out.name}.log").write_text(text)
        return res, text

    # the approved bundle runs, at every site, warm and cold
    res, text = run(approved, root / "out-a")
    assert res.returncode == 0 and (root / "out-a" / "results.json").is_file(), text[-3000:]
    r = json.loads((root / "out-a" / "results.json").read_text())
    assert sorted(r["metrics"]["sites"]) == [str(k) for k in range(SITES)]
    ran = [p.name.split() for p in marks.iterdir()]
    assert {kind for kind, *_ in ran} == {"approved"}, ran
    for k in range(SITES):
        how = [warm for _, home, warm, _ in ran if home == f"home-node{k}"]
        assert len(how) >= 2, ran  # the query, then one round
        # site 0 starts every ClientApp cold (the shim's checked launch), the others warm
        assert all(w == "cold" for w in how) if k == 0 else all(w.isdigit() for w in how), ran
        log = procs.log(f"supernode-{k}")
        assert f"site {k} runs app bundle fedsgld 0.1.0 (sha256 {digest_a})" in log, log[-3000:]

    # one changed line: refused before any of its code runs, an error reply naming the site
    res, text = run(changed, root / "out-b", **{"wait-for-sites": 20.0})
    assert not [p.name for p in marks.iterdir() if p.name.startswith("changed")]  # never ran
    assert not (root / "out-b" / "results.json").exists(), text[-3000:]
    server_saw = text + procs.log("superlink")
    for k in range(SITES):
        refusal = f"site {k} refuses app bundle sha256 {digest_b}"
        assert refusal in procs.log(f"supernode-{k}"), procs.log(f"supernode-{k}")[-3000:]
        assert "not in approved_apps" in procs.log(f"supernode-{k}")
        # what the ServerApp logged: the error reply Flower made of the refusal
        assert refusal in server_saw, server_saw[-5000:]
    assert "had no working node" in server_saw, server_saw[-5000:]
    installed = list((root / "home-node1" / "apps").glob(f"*.{digest_b[:8]}"))
    assert installed == [], installed  # never even unpacked
