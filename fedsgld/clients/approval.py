"""A site approves the code it runs: app bundle digests in its policy, checked before load.

A site lists the Flower app bundles (FABs) it has reviewed in its policy file
(``[[approved_apps]]``: ``sha256``, Flower's ``fab_hash``; ``name``; ``version``). The
process that starts each ClientApp at the site (:func:`guard_clientapp`) checks the
bundle's digest after Flower pulls the task and BEFORE it installs the bundle, running
nothing from it; a bundle not listed is refused. How the digest is built and compared:
docs/architecture.md, "Design notes". Standard library only, no other fedsgld module: the
warm fork server's children drop every fedsgld module before Flower loads the bundle, and
the cold launch loads this file by its path.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

ENV_NO_POLICY = "FEDSGLD_NO_POLICY"  # "1": the site was started with --no-policy
BUNDLE_ENV = "FEDSGLD_BUNDLE_SHA256"  # set in the ClientApp process once its bundle passed
KEPT = "bundles"  # beside the policy: the bundles the site checked, kept for review
POLICY_KEY = "privacy-policy"  # the node config key naming the site's policy file
ENTRY_KEYS = ("sha256", "name", "version")
_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_META_BYTES = 1 << 20  # a bundle's pyproject.toml and file list, read to name it
LOG = "fedsgld site approval"
SEE = "docs/deployment.md, section 10"
NO_POLICY_MEANS = (
    "this site runs whatever app bundle the server submits, unreviewed: no approved_apps "
    "list, and no privacy policy of its own (the ClientApp the server ships decides what "
    "is done with the site's records; fedsgld's own ClientApp answers nothing computed on "
    "them without a policy's lifetime budget)"
)

# Flower's ClientApp runtime (flwr.supernode.runtime.run_clientapp) whose structure the
# guard relies on: it pulls the task input (context, run, bundle) with pull_task_input,
# then calls install_from_fab, then loads the ClientApp; an exception raised in between
# becomes an error reply to the server. SHA-256 of the files checked (flwr 1.41.0, 1.42.0).
GUARDED_RUNTIME = {"fa6612aaeda9cd398de69199b0cf264a38f72c1b9cfdc53644c8d6dab0b70eb6"}


class NotApproved(RuntimeError):
    """A site refused an app bundle; the message names the site and the bundle."""


@dataclass(frozen=True)
class ApprovedApp:
    """One approved bundle: its SHA-256 and the name and version it stands for."""

    sha256: str
    name: str
    version: str


def parse_approved_apps(value: Any, source: str = "policy") -> tuple[ApprovedApp, ...]:
    """``approved_apps`` of a policy (a list of tables with ``sha256``, ``name`` and
    ``version``), checked; ``source`` names the file in the error."""
    if isinstance(value, tuple) and all(isinstance(a, ApprovedApp) for a in value):
        return value
    form = (
        "a list of tables [[approved_apps]] with sha256 (64 hexadecimal digits, as "
        "`fedsgld site approve` prints), name and version"
    )
    if not isinstance(value, list | tuple):
        raise ValueError(f"{source}: approved_apps must be {form}; got {value!r}")
    out = []
    for i, entry in enumerate(value):
        key = f"approved_apps[{i}]"
        if isinstance(entry, ApprovedApp):
            entry = {"sha256": entry.sha256, "name": entry.name, "version": entry.version}
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: {key} must be a table ({form}); got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        missing = [k for k in ENTRY_KEYS if k not in entry]
        if unknown or missing:
            what = "unknown key(s) " + ", ".join(unknown) if unknown else ""
            what += ("; " if what else "") + ("missing " + ", ".join(missing) if missing else "")
            raise ValueError(f"{source}: {key}: {what}; valid keys: {', '.join(ENTRY_KEYS)}")
        digest = entry["sha256"]
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest.strip().lower()):
            raise ValueError(
                f"{source}: {key}.sha256 must be the bundle's SHA-256 as 64 hexadecimal "
                f"digits (as `fedsgld site approve` prints it); got {digest!r}"
            )
        for k in ("name", "version"):
            if not isinstance(entry[k], str) or not entry[k].strip():
                raise ValueError(
                    f"{source}: {key}.{k} must be a non-empty string; got {entry[k]!r}"
                )
        out.append(ApprovedApp(digest.strip().lower(), entry["name"], entry["version"]))
    return tuple(out)


def read_approved(path: str | Path) -> tuple[ApprovedApp, ...]:
    """The ``approved_apps`` of the policy file at ``path`` (only that key is read here;
    the rest of the policy is the ClientApp's to check)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"privacy policy {str(p)!r} cannot be read ({e.strerror or e})") from None
    return parse_approved_apps(
        policy_toml(text, p).get("approved_apps", []), f"privacy policy {str(p)!r}"
    )


@dataclass(frozen=True)
class BundleInfo:
    """What a bundle says it is, read from its zip without running anything."""

    sha256: str  # of the .fab bytes (Flower's fab_hash)
    fab_id: str  # <publisher>/<name>, as Flower names the app
    name: str
    version: str
    files: tuple[tuple[str, str, int], ...]  # (path, sha256, bytes) from .info/CONTENT
    content_sha256: str  # of the .info/CONTENT manifest


def bundle_info(data: bytes) -> BundleInfo:
    """Name, version and manifest of the bundle ``data`` (a ValueError if it is not one)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for name in ("pyproject.toml", ".info/CONTENT"):
                if z.getinfo(name).file_size > MAX_META_BYTES:
                    raise ValueError(f"its {name} is larger than {MAX_META_BYTES} bytes")
            config = tomllib.loads(z.read("pyproject.toml").decode())
            content = z.read(".info/CONTENT")
    except (
        zipfile.BadZipFile,
        KeyError,
        UnicodeDecodeError,
        tomllib.TOMLDecodeError,
        ValueError,
    ) as e:
        raise ValueError(f"not a Flower app bundle ({e})") from None
    try:
        name = str(config["project"]["name"])
        version = str(config["project"]["version"])
        publisher = str(config["tool"]["flwr"]["app"]["publisher"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a Flower app bundle (pyproject.toml has no {e})") from None
    files = []
    for line in content.decode(errors="replace").strip().splitlines():
        try:
            path, digest, bits = line.rsplit(",", 2)
            files.append((path, digest, int(bits) // 8))
        except ValueError:
            raise ValueError(f"not a Flower app bundle (file list line {line[:80]!r})") from None
    return BundleInfo(
        sha256=hashlib.sha256(data).hexdigest(),
        fab_id=f"{publisher}/{name}",
        name=name,
        version=version,
        files=tuple(files),
        content_sha256=hashlib.sha256(content).hexdigest(),
    )


def _log(msg: str) -> None:
    print(f"{LOG}: {msg}", file=sys.stderr, flush=True)


def site_name(node_config: dict[str, Any]) -> str:
    for key in ("site-id", "partition-id"):
        if key in node_config:
            return f"site {node_config[key]}"
    return "this site (no site-id in its node config)"


def check_bundle(
    node_config: dict[str, Any],
    data: bytes,
    *,
    stated_hash: str | None = None,
    fab_id: str | None = None,
    fab_version: str | None = None,
    env: dict[str, str] | None = None,
) -> BundleInfo | None:
    """Accept the bundle ``data`` at the site whose node config is ``node_config``, or raise
    :class:`NotApproved` (after logging why). The bundle must be listed in ``approved_apps``
    of the node's policy; without a policy only a site started with ``--no-policy``
    (``FEDSGLD_NO_POLICY=1``) accepts it (None is returned: nothing was checked).
    ``stated_hash``, ``fab_id`` and ``fab_version``: what the run says the bundle is (Flower
    loads the ClientApp from the directory they name), which must be what it is."""
    env = os.environ if env is None else env
    site = site_name(node_config)
    digest = hashlib.sha256(data).hexdigest()

    def refuse(why: str) -> NotApproved:
        msg = f"{site} refuses app bundle sha256 {digest}: {why}"
        _log(msg)
        return NotApproved(msg)

    try:
        info = bundle_info(data)
    except ValueError as e:
        raise refuse(str(e)) from None
    label = f"{info.name} {info.version} (sha256 {digest})"
    policy = node_config.get(POLICY_KEY)
    if policy is None:
        if env.get(ENV_NO_POLICY) == "1":
            _log(f"{site} runs app bundle {label} unchecked: started with --no-policy")
            return None
        raise refuse(
            f"it has no {POLICY_KEY} in its node config, so it approves no app bundle; "
            "list this one in its policy's approved_apps (`fedsgld site approve`), or start "
            f"the site with --no-policy ({SEE})"
        )
    if stated_hash is not None and stated_hash != digest:
        raise refuse(f"the run states another hash ({stated_hash}) for these bytes")
    if (fab_id, fab_version) != (None, None) and (fab_id, fab_version) != (
        info.fab_id,
        info.version,
    ):
        raise refuse(
            f"the run names app {fab_id} {fab_version}, the bundle is {info.fab_id} {info.version}"
        )
    try:
        approved = read_approved(str(policy))
    except ValueError as e:
        raise refuse(str(e)) from None
    for app in approved:
        if app.sha256 == digest:
            env[BUNDLE_ENV] = digest  # the guard's audit log names the bundle that answered
            keep_bundle(str(policy), digest, data)
            _log(
                f"{site} runs app bundle {label}: approved in {policy} as {app.name} {app.version}"
            )
            return info
    keep_bundle(str(policy), digest, data)  # for the operator's review (the site console)
    raise refuse(
        f"{info.name} {info.version} is not in approved_apps of its policy {policy} "
        f"(review it with `fedsgld site approve`; {SEE})"
    )


def keep_bundle(policy: str, digest: str, data: bytes) -> None:
    """A copy of a checked bundle in ``bundles/`` beside the policy (best effort), so that
    its operator can compare a refused bundle with the approved one (``fedsgld site console``)."""
    try:
        (d := Path(policy).expanduser().parent / KEPT).mkdir(exist_ok=True)
        if not (f := d / f"{digest}.fab").exists():
            f.write_bytes(data)
    except OSError:
        pass


def guard_clientapp() -> None:
    """In a ClientApp process, before Flower's ``flwr-clientapp`` entry point runs: every
    task's bundle goes through :func:`check_bundle` after Flower has pulled the task input
    and before it installs the bundle. A refusal raises inside Flower's task handler, which
    logs it and sends the server an error reply with the message.

    Raises RuntimeError (the task must not run) when Flower's ClientApp runtime is not one
    whose structure was checked (:data:`GUARDED_RUNTIME`)."""
    from flwr.supernode.runtime import run_clientapp as rc

    try:
        got = hashlib.sha256(Path(rc.__file__).read_bytes()).hexdigest()
    except OSError as e:
        got = f"unreadable ({e})"
    if got not in GUARDED_RUNTIME or not callable(getattr(rc, "pull_task_input", None)):
        raise RuntimeError(
            f"flwr's ClientApp runtime {rc.__file__} is not one whose app bundle check was "
            f"verified (sha256 {got}); refusing to run the task (use flwr 1.41.0 or 1.42.0)"
        )
    if getattr(rc.install_from_fab, "fedsgld_guarded", False):
        return
    pull, install = rc.pull_task_input, rc.install_from_fab
    task: dict[str, Any] = {}

    def pull_task_input(client):
        message, context, run, fab = pull(client)
        task.update(context=context, run=run, fab=fab)
        return message, context, run, fab

    def install_from_fab(fab_file, install_dir=None, skip_prompt=False):
        if not task or not isinstance(fab_file, bytes):
            raise NotApproved("app bundle check: no task input was pulled before the install")
        check_bundle(
            dict(task["context"].node_config),
            fab_file,
            stated_hash=task["fab"].hash_str,
            fab_id=task["run"].fab_id,
            fab_version=task["run"].fab_version,
        )
        return install(fab_file, install_dir, skip_prompt)

    install_from_fab.fedsgld_guarded = True  # type: ignore[attr-defined]
    rc.pull_task_input = pull_task_input
    rc.install_from_fab = install_from_fab


def checked_clientapp() -> int:
    """Flower's ``flwr-clientapp`` with :func:`guard_clientapp` (the shim's cold launch,
    :func:`fedsgld.deploy.shim.checked_clientapp`, loads this file by its path, so that no
    fedsgld module is imported)."""
    try:
        guard_clientapp()
    except RuntimeError as e:
        _log(str(e))
        return 1
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    sys.argv = ["flwr-clientapp", *sys.argv[1:]]
    try:
        flwr_clientapp()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def node_config_of(flower_args: list[str]) -> dict[str, Any]:
    """The ``--node-config`` of ``flower-supernode`` arguments, parsed as Flower does."""
    values = []
    for i, a in enumerate(flower_args):
        if a == "--node-config" and i + 1 < len(flower_args):
            values.append(flower_args[i + 1])
        elif a.startswith("--node-config="):
            values.append(a.split("=", 1)[1])
    if not values:
        return {}
    from flwr.common.config import parse_config_args

    return dict(parse_config_args(values))


def check_site_start(flower_args: list[str], no_policy: bool) -> str:
    """Whether a deployed site may start with these ``flower-supernode`` arguments: the
    line to log when it may, a ValueError saying why not otherwise. Sets
    ``FEDSGLD_NO_POLICY`` (for its ClientApp processes) with ``no_policy``."""
    config = node_config_of(flower_args)
    policy = config.get(POLICY_KEY)
    if policy is None and not no_policy:
        raise ValueError(
            "refusing to start a deployed site without a policy: give the node "
            f"config {POLICY_KEY}='/path/policy.toml' listing the app bundles it approves "
            f"(`fedsgld site approve`), or pass --no-policy: {NO_POLICY_MEANS} ({SEE})"
        )
    if policy is not None and no_policy:
        raise ValueError(f"--no-policy, but the node config names {POLICY_KEY}={policy!r}")
    if no_policy:
        os.environ[ENV_NO_POLICY] = "1"
        return f"--no-policy: {NO_POLICY_MEANS}"
    os.environ.pop(ENV_NO_POLICY, None)
    approved = read_approved(str(policy))
    if not approved:
        return (
            f"policy {policy} approves no app bundle yet: every run is refused until "
            "`fedsgld site approve BUNDLE --policy` adds one"
        )
    names = ", ".join(f"{a.name} {a.version} ({a.sha256[:12]}...)" for a in approved)
    return f"policy {policy} approves {len(approved)} app bundle(s): {names}"


# -- fedsgld site approve ----------------------------------------------------------------


def policy_toml(text: str, path: Path) -> dict[str, Any]:
    """The policy file's TOML ``text`` (a ValueError naming ``path`` if it is not TOML)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"privacy policy {str(path)!r} is not valid TOML ({e})") from None
