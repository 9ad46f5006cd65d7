"""A site's approved app bundles (``fedsgld.clients.approval``), without deployments: the
digest (stable across ``flwr build`` runs of the same tree), the policy's
``approved_apps``, the check a ClientApp process makes before Flower installs a bundle,
``fedsgld site approve`` and the fast path's refusal to start without a policy."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from flower_support import BIN, ROOT, flower_env

from fedsgld.clients import approval
from fedsgld.clients.approval import (
    ApprovedApp,
    NotApproved,
    bundle_info,
    check_bundle,
    parse_approved_apps,
)
from fedsgld.clients.approve import app_files, approve, build_bundle
from fedsgld.clients.policy import SitePolicy
from fedsgld.deploy import shim
from fedsgld.deploy.staging import stage_app

DIGEST = "ab" * 32


def app_copy(dst: Path, extra_line: str | None = None) -> Path:
    """The repository's app (pyproject.toml and the fedsgld package) in ``dst``; with
    ``extra_line``, that line appended to the ClientApp's module."""
    dst.mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    shutil.copytree(ROOT / "fedsgld", dst / "fedsgld", ignore=shutil.ignore_patterns("__pycache__"))
    if extra_line is not None:
        with open(dst / "fedsgld" / "apps" / "client_app.py", "a") as f:
            f.write(extra_line + "\n")
    return dst


def flwr_build(app: Path, cwd: Path) -> bytes:
    """``flwr build --app APP`` run in ``cwd``: the bytes of the one .fab it writes."""
    cwd.mkdir(parents=True)
    res = subprocess.run(
        [str(BIN / "flwr"), "build", "--app", str(app)],
        cwd=cwd, env=flower_env(cwd / "home"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (fab,) = cwd.glob("*.fab")
    data = fab.read_bytes()
    assert fab.name.endswith(f".{hashlib.sha256(data).hexdigest()[:8]}.fab")  # Flower's name
    return data


@pytest.mark.slow  # 7-16 s
def test_flwr_build_digest_is_stable_and_is_what_site_approve_prints(tmp_path):
    """The README recipe's bundle (`flwr run .` at the top of the checkout) is approvable:
    two `flwr build` runs of the same tree, a copy of the tree made later (new mtimes,
    another directory) and `fedsgld site approve DIR` give the same SHA-256."""
    app = app_copy(tmp_path / "fedsgld")
    first = flwr_build(app, tmp_path / "b1")
    time.sleep(1.1)  # zip timestamps have 2 s resolution: Flower fixes them
    for p in app.rglob("*.py"):
        os.utime(p)
    second = flwr_build(app, tmp_path / "b2")
    assert first == second
    later = app_copy(tmp_path / "later" / "fedsgld")
    assert flwr_build(later, tmp_path / "b3") == first
    info, text = approve(app)
    assert info.sha256 == hashlib.sha256(first).hexdigest()
    assert info.sha256 in text and "fedsgld/apps/client_app.py" in text
    # the checkout itself (what the README recipe submits) builds the same way every time
    assert build_bundle(ROOT) == build_bundle(ROOT)
    # one changed line: another digest
    changed = app_copy(tmp_path / "changed" / "fedsgld", extra_line="x = 1")
    assert approve(changed)[0].sha256 != info.sha256


def test_site_approve_lists_the_files_and_appends_to_the_policy(tmp_path):
    app = app_copy(tmp_path / "fedsgld")
    fab = tmp_path / "app.fab"
    fab.write_bytes(build_bundle(app))
    policy = tmp_path / "policy.toml"
    original = "# hospital A\nepsilon = 4.0   # our budget\nmax_clip = 1.0\n"
    policy.write_text(original)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "fedsgld", "site", "approve", str(fab), "--policy", str(policy)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    digest = hashlib.sha256(fab.read_bytes()).hexdigest()
    assert f"sha256 {digest}" in res.stdout
    info = bundle_info(fab.read_bytes())
    for path, file_digest, _ in info.files:  # every file with its own digest
        assert f"{file_digest}" in res.stdout and path in res.stdout
    assert {p for p, _, _ in info.files} >= {"pyproject.toml", "fedsgld/apps/client_app.py"}
    text = policy.read_text()
    assert text.startswith(original)  # the file's own text is kept
    pol = SitePolicy.from_file(policy)
    assert pol.approved_apps == (ApprovedApp(digest, "fedsgld", info.version),)
    assert pol.epsilon == 4.0 and pol.max_clip == 1.0
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already approved" in again.stdout
    assert policy.read_text() == text
    broken = tmp_path / "broken.toml"
    broken.write_text("epsilon = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        approve(fab, broken)
    assert broken.read_text() == "epsilon = \n"  # never rewritten
    missing = subprocess.run(
        [sys.executable, "-m", "fedsgld", "site", "approve", str(tmp_path / "nope")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "no such app bundle" in missing.stderr


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"sha256": "abc", "name": "a", "version": "1"}, r"approved_apps\[0\]\.sha256 must be"),
        ({"sha256": "g" * 64, "name": "a", "version": "1"}, "64 hexadecimal digits"),
        ({"sha256": 123, "name": "a", "version": "1"}, r"approved_apps\[0\]\.sha256.*got 123"),
        ({"sha256": DIGEST, "name": "a"}, r"approved_apps\[0\]: missing version"),
        (
            {"sha256": DIGEST, "name": "a", "version": "1", "hash": "x"},
            "unknown key.*hash.*valid keys: sha256, name, version",
        ),
        ({"sha256": DIGEST, "name": "", "version": "1"}, r"approved_apps\[0\]\.name must be"),
    ],
)
def test_policy_approved_apps_bad_entries_name_the_key_and_the_valid_form(tmp_path, entry, message):
    p = tmp_path / "policy.toml"
    lines = ["[[approved_apps]]"] + [
        f"{k} = {v!r}" if isinstance(v, int) else f'{k} = "{v}"' for k, v in entry.items()
    ]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        SitePolicy.from_file(p)
    assert str(p.resolve()) in str(err.value)  # names the file
    with pytest.raises(ValueError, match=message):
        approval.read_approved(p)  # the site-side check reads it the same way


def test_policy_approved_apps_parsing(tmp_path):
    p = tmp_path / "policy.toml"
    p.write_text(
        f'epsilon = 2.0\n[[approved_apps]]\nsha256 = "{DIGEST.upper()}"\nname = "fedsgld"\n'
        'version = "0.1.0"\n[[approved_apps]]\nsha256 = "' + "cd" * 32 + '"\nname = "fedsgld"\n'
        'version = "0.2.0"\n'
    )
    pol = SitePolicy.from_file(p)
    assert [a.sha256 for a in pol.approved_apps] == [DIGEST, "cd" * 32]  # lower case
    assert SitePolicy().approved_apps == ()
    assert SitePolicy.deployment_default().approved_apps == ()
    with pytest.raises(ValueError, match="approved_apps must be a list of tables"):
        parse_approved_apps("abc", "policy x")
    p.write_text('approved_apps = "abc"\n')
    with pytest.raises(ValueError, match="approved_apps must be a list of tables"):
        SitePolicy.from_file(p)


def _fab(line: str = "") -> bytes:
    """A small bundle as Flower builds one (pyproject.toml and a module, with the manifest)."""
    from flwr.cli.build import build_fab_from_files

    return build_fab_from_files(
        {
            "pyproject.toml": (ROOT / "pyproject.toml").read_bytes(),
            "fedsgld/__init__.py": line.encode(),
        }
    )[0]


def test_check_refuses_any_bundle_its_policy_does_not_list(tmp_path, capfd):
    good, bad = _fab("a = 1\n"), _fab("a = 2\n")
    good_digest = hashlib.sha256(good).hexdigest()
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[[approved_apps]]\nsha256 = "{good_digest}"\nname = "fedsgld"\nversion = "0.1.0"\n'
    )
    node = {"site-id": 2, "site-data": "/x.npz", "privacy-policy": str(policy)}
    info = check_bundle(node, good, stated_hash=good_digest, env={})
    assert info is not None and info.sha256 == good_digest and info.name == "fedsgld"
    with pytest.raises(NotApproved) as err:
        check_bundle(node, bad, env={approval.ENV_NO_POLICY: "1"})  # a policy always counts
    msg = str(err.value)
    assert msg.startswith("site 2 refuses app bundle sha256 " + hashlib.sha256(bad).hexdigest())
    assert "not in approved_apps" in msg and str(policy) in msg
    assert len(msg) < 400  # the server keeps the last 500 characters of a reason
    assert "fedsgld site approval: site 2 refuses" in capfd.readouterr().err  # the site's log
    # the run must state what the bytes are: Flower loads from the directory it names
    with pytest.raises(NotApproved, match="states another hash"):
        check_bundle(node, good, stated_hash=hashlib.sha256(bad).hexdigest(), env={})
    with pytest.raises(NotApproved, match="names app other/app 0.1.0"):
        check_bundle(node, good, fab_id="other/app", fab_version="0.1.0", env={})
    with pytest.raises(NotApproved, match="not a Flower app bundle"):
        check_bundle(node, b"PK junk", env={})
    # no policy: refused, unless the site was started with --no-policy
    bare = {"site-id": 0, "site-data": "/x.npz"}
    with pytest.raises(NotApproved, match="site 0 refuses.*no privacy-policy.*--no-policy"):
        check_bundle(bare, good, env={})
    assert check_bundle(bare, good, env={approval.ENV_NO_POLICY: "1"}) is None
    # an empty list approves nothing; a policy that cannot be read refuses
    policy.write_text("epsilon = 4.0\n")
    with pytest.raises(NotApproved, match="not in approved_apps"):
        check_bundle(node, good, env={})
    policy.write_text('[[approved_apps]]\nsha256 = "nope"\nname = "a"\nversion = "1"\n')
    with pytest.raises(NotApproved, match=r"approved_apps\[0\]\.sha256 must be"):
        check_bundle(node, good, env={})


def test_guard_checks_before_flower_installs_and_only_on_a_checked_runtime(tmp_path, monkeypatch):
    """The guard wraps Flower's ClientApp runtime: a refused bundle never reaches Flower's
    install; a runtime whose file differs from the checked ones runs no task."""
    from flwr.supernode.runtime import run_clientapp as rc

    installed = []
    monkeypatch.setattr(rc, "install_from_fab", lambda fab, d=None, s=False: installed.append(fab))

    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    bad = _fab("import os; os.system('true')\n")
    context = Obj(node_config={"site-id": 1, "privacy-policy": str(tmp_path / "p.toml")})
    (tmp_path / "p.toml").write_text("")
    task = (
        "message",
        context,
        Obj(fab_id="fedsgld/fedsgld", fab_version="0.1.0"),
        Obj(hash_str=hashlib.sha256(bad).hexdigest(), content=bad),
    )
    monkeypatch.setattr(rc, "pull_task_input", lambda client: task)
    approval.guard_clientapp()
    assert rc.pull_task_input(None) == task
    with pytest.raises(NotApproved, match="site 1 refuses"):
        rc.install_from_fab(bad, skip_prompt=True)
    assert installed == []  # Flower's install never saw it
    monkeypatch.setattr(approval, "GUARDED_RUNTIME", set())
    monkeypatch.setattr(rc, "install_from_fab", lambda fab, d=None, s=False: None)
    with pytest.raises(RuntimeError, match="refusing to run the task"):
        approval.guard_clientapp()


def test_cold_launch_runs_flower_clientapp_through_the_check_without_importing_fedsgld():
    cmd = shim.checked_clientapp(["--help"])
    code = cmd[cmd.index("-c") + 1]
    probe = code.replace(
        "sys.exit(m.checked_clientapp())",
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'fedsgld'))",
    )
    res = subprocess.run(
        [*cmd[: cmd.index("-c") + 1], probe], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "usage: flwr-clientapp" in res.stdout, res.stderr


def test_fast_path_refuses_to_start_a_site_without_a_policy(tmp_path):
    env = flower_env(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    base = [sys.executable, "-m", "fedsgld.deploy", "supernode"]
    flower = [
        "--insecure",
        "--superlink",
        "127.0.0.1:1",
        "--node-config",
        "site-id=0 site-data='/x'",
    ]
    res = subprocess.run(
        [*base, "--", *flower], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res.stderr
    assert "refusing to start a deployed site without a policy" in res.stderr
    assert "--no-policy: this site runs whatever app bundle the server submits" in res.stderr
    bad = tmp_path / "policy.toml"
    bad.write_text('[[approved_apps]]\nsha256 = "12"\nname = "a"\nversion = "1"\n')
    flower[-1] += f" privacy-policy='{bad}'"
    res = subprocess.run(
        [*base, "--", *flower], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and r"approved_apps[0].sha256 must be" in res.stderr, res.stderr
    with pytest.raises(ValueError, match="--no-policy, but the node config names"):
        approval.check_site_start(flower, True)


def test_site_start_check(tmp_path, monkeypatch):
    monkeypatch.delenv(approval.ENV_NO_POLICY, raising=False)
    args = ["--insecure", "--node-config", "site-id=3 site-data='/d.npz'"]
    with pytest.raises(ValueError, match="without a policy"):
        approval.check_site_start(args, False)
    assert "runs whatever app bundle" in approval.check_site_start(args, True)
    assert os.environ[approval.ENV_NO_POLICY] == "1"  # the site's ClientApps see it
    p = tmp_path / "policy.toml"
    p.write_text("epsilon = 1.0\n")
    args[-1] += f" privacy-policy='{p}'"
    assert "approves no app bundle yet" in approval.check_site_start(args, False)
    assert approval.ENV_NO_POLICY not in os.environ
    with open(p, "a") as f:
        f.write(f'[[approved_apps]]\nsha256 = "{DIGEST}"\nname = "fedsgld"\nversion = "0.1.0"\n')
    assert "approves 1 app bundle(s): fedsgld 0.1.0" in approval.check_site_start(args, False)


def test_bundle_info_reads_without_running_anything():
    data = _fab("raise SystemExit('ran')\n")
    info = bundle_info(data)
    assert info.fab_id == "fedsgld/fedsgld" and "fedsgld/__init__.py" in {
        p for p, _, _ in info.files
    }
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert info.content_sha256 == hashlib.sha256(z.read(".info/CONTENT")).hexdigest()
    big = io.BytesIO()
    with zipfile.ZipFile(big, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pyproject.toml", "#" * (2 << 20))  # 4 kB compressed: read, 2 MB
        z.writestr(".info/CONTENT", "")
    with pytest.raises(ValueError, match="larger than"):
        bundle_info(big.getvalue())


def test_the_fast_build_and_the_staged_app_give_flowers_own_bytes(tmp_path):
    """``build_bundle`` skips the directories Flower's build always leaves out (a ``.venv``
    at the top, ``__pycache__`` anywhere) instead of walking them, and ``stage_app`` copies
    only what the bundle holds: both give the bytes of Flower's ``build_fab_from_disk`` of
    the project, so a digest a site approved still matches what ``flwr run`` submits."""
    from flwr.cli.build import build_fab_from_disk

    app = app_copy(tmp_path / "fedsgld")
    for junk in (".venv/lib/python3.11/site-packages/evil.py", "fedsgld/__pycache__/x.py",
                 "runs/out/results.json", "venv/bin/tool.py"):  # fmt: skip
        (app / junk).parent.mkdir(parents=True, exist_ok=True)
        (app / junk).write_text("x = 1\n")
    (app / ".gitignore").write_text("runs/\n")
    flower = build_fab_from_disk(app)
    assert build_bundle(app) == flower
    assert ".venv/lib/python3.11/site-packages/evil.py" not in app_files(app)
    staged = stage_app(app, tmp_path / "staged")
    assert build_fab_from_disk(staged) == flower
    assert not (staged / ".venv").exists() and not (staged / "runs").exists()
    assert (staged / "fedsgld" / "apps" / "client_app.py").is_file()
    # a file the bundle holds that changes changes both, alike
    with open(app / "fedsgld" / "apps" / "client_app.py", "a") as f:
        f.write("y = 2\n")
    assert build_bundle(app) == build_fab_from_disk(app) != flower
