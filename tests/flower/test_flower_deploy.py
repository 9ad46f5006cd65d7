"""A real Flower deployment on loopback: one SuperLink, one SuperNode per site, ``flwr run``.

``pytest -k deploy`` selects these. Each SuperNode reads only its own site's ``.npz``
(``--node-config "site-id=K site-data='...'"``, files written by
``python -m fedsgld.deploy.export_sites``), as a hospital would. The second test runs the
same federation over TLS with SuperNode authentication (certificates and keys generated
here) and checks that an unregistered SuperNode is refused. Every process has its own
FLWR_HOME under the test's tmp directory and is stopped at teardown. Rounds in a
deployment take seconds (Flower's polling sleeps), so these runs are short: 3 rounds.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from flower_support import BIN, DEPLOYED, SMALL, flower_env, flwr, free_port, run_config_arg

from fedsgld.config import load_config
from fedsgld.deploy.export_sites import export_sites
from fedsgld.deploy.loopback import link_address_args, supernode_args, write_connection

# a few minutes each (stock SuperNodes, cold tasks): slow
pytestmark = [pytest.mark.deploy, pytest.mark.slow]

SITES = 3
RUN = {
    **SMALL,
    "rounds": 3,
    "eval_every": 0,
    "checkpoint_every": 0,
    **DEPLOYED,
    "threads": 1,
}


# Each site's own policy: a lifetime budget, and trust in the server's noise (this run's
# placement), as a consortium that trusts its server says in every site's policy.
POLICY = "epsilon = 1000.0\npublic_records = 'exact'\npublic_test_records = 'exact'\nplacements = ['server']\n"


def _site_files(root: Path) -> list[Path]:
    files = export_sites(
        load_config(None, {k: v for k, v in RUN.items() if "-" not in k}), root / "data"
    )
    for k in range(len(files)):
        (root / f"site{k}").mkdir(exist_ok=True)
        (root / f"site{k}" / "policy.toml").write_text(POLICY)
    return files


def _supernode_args(
    link_port: int, node_port: int, site: int, data: Path, security: list[str]
) -> list[str]:
    policy = data.parents[1] / f"site{site}" / "policy.toml"
    node = f"site-id={site} site-data='{data}' privacy-policy='{policy}'"
    return supernode_args(link_port, node_port, node, security)


def _run_and_check(root: Path, cli_env: dict, connection: str, out: Path) -> dict:
    t0 = time.monotonic()
    res = flwr(
        [
            "run",
            ".",
            connection,
            "--stream",
            "--run-config",
            run_config_arg({**RUN, "out": str(out)}),
        ],
        cli_env,
        timeout=600,
    )
    took = time.monotonic() - t0
    log = res.stdout + res.stderr
    (root / "flwr-run.log").write_text(log)
    assert res.returncode == 0, log[-3000:]
    # `flwr run --stream` can exit 0 for a failed run: the result file is the proof
    assert (out / "results.json").is_file(), log[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["engine"] == "flower"
    p = r["privacy"]
    assert p["steps"] == 3 and p["ledger_steps"] == 3
    # a deployment: every party drew its own OS randomness, hardened Gaussian noise
    assert p["randomness"]["mode"] == "os" and p["randomness"]["secure_noise"] is True
    assert p["epsilon"][p["rigorous_accountant"]] <= RUN["epsilon"]
    assert sorted(r["metrics"]["sites"]) == ["0", "1", "2"]
    assert r["flower"]["dropped_replies"] == []
    assert len(set(r["flower"]["nodes"].values())) == SITES  # one SuperNode per site
    print(f"deployment run: {took:.1f} s, {r['round_wall_time_s']}")
    return r


def _check_argument_names() -> None:
    """Flower >= 1.41 serves Fleet and Control APIs on one HTTP port (--host/--port): fail clearly."""
    for exe in ("flower-superlink", "flower-supernode"):
        out = subprocess.run([str(BIN / exe), "--help"], capture_output=True, text=True).stdout
        assert "--port PORT" in out, f"{exe} has no --port"


def test_deploy_insecure_loopback_three_supernodes(flower_tmp):
    root, procs = flower_tmp
    _check_argument_names()
    files = _site_files(root)
    port = free_port()
    procs.start(
        "superlink",
        [
            str(BIN / "flower-superlink"),
            "--insecure",
            *link_address_args(port),
        ],
        flower_env(root / "home-link"),
    )
    procs.wait_listening("superlink", port)
    for k, f in enumerate(files):
        procs.start(
            f"supernode-{k}",
            _supernode_args(port, free_port(), k, f, ["--insecure"]),
            flower_env(root / f"home-node{k}"),
        )
    cli_home = root / "home-cli"
    write_connection(cli_home, "loop", _control_port(port))
    r = _run_and_check(root, flower_env(cli_home), "loop", root / "out")
    assert r["config"]["sites"] == SITES


# -- TLS and SuperNode authentication ---------------------------------------------------------


def _certificates(d: Path) -> dict[str, Path]:
    """A CA and a server certificate with SAN DNS:localhost, IP:127.0.0.1 (as the openssl
    commands of docs/deployment.md make them)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("fedsgld test CA")).issuer_name(name("fedsgld test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP384R1())
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
        .add_extension(san, critical=False).sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "server.pem").write_bytes(cert.public_bytes(pem))
    (d / "server.key").write_bytes(
        key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    return {"ca": d / "ca.crt", "cert": d / "server.pem", "key": d / "server.key"}


def _node_key(d: Path, name: str) -> Path:
    """An EC P-384 key pair, the public key in OpenSSH format (what `flwr supernode register`
    takes; `ssh-keygen -t ecdsa -b 384` makes the same)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    (d / name).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    (d / f"{name}.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return d / name


def test_deploy_tls_with_supernode_authentication_refuses_unregistered_nodes(flower_tmp):
    root, procs = flower_tmp
    _check_argument_names()
    files = _site_files(root)
    certs = _certificates(root / "certs")
    keys = root / "keys"
    keys.mkdir()
    port = free_port()
    procs.start(
        "superlink",
        [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(certs["ca"]),
            "--ssl-certfile", str(certs["cert"]),
            "--ssl-keyfile", str(certs["key"]),
            "--enable-supernode-auth",
            *link_address_args(port),
        ],
        flower_env(root / "home-link"),
    )  # fmt: skip
    procs.wait_listening("superlink", port)
    cli_home = root / "home-cli"
    write_connection(cli_home, "tlslink", _control_port(port), ca=certs["ca"])
    cli_env = flower_env(cli_home)
    for k in range(SITES):
        key = _node_key(keys, f"site{k}")
        reg = flwr(["supernode", "register", str(key) + ".pub", "tlslink"], cli_env, timeout=60)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    stranger = _node_key(keys, "stranger")  # never registered
    for k, f in enumerate(files):
        procs.start(
            f"supernode-{k}",
            _supernode_args(
                port, free_port(), k, f,
                ["--root-certificates", str(certs["ca"]), "--auth-supernode-private-key", str(keys / f"site{k}")],
            ),
            flower_env(root / f"home-node{k}"),
        )  # fmt: skip
    procs.start(
        "supernode-stranger",
        _supernode_args(
            port, free_port(), 0, files[0],
            ["--root-certificates", str(certs["ca"]), "--auth-supernode-private-key", str(stranger)],
        ),
        flower_env(root / "home-stranger"),
    )  # fmt: skip
    r = _run_and_check(root, cli_env, "tlslink", root / "out")
    # the stranger never joined: three nodes served the three sites, and its own log says why
    assert len(r["flower"]["nodes"]) == SITES
    listed = flwr(["supernode", "list", "tlslink", "--format", "json"], cli_env, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    stranger_log = procs.log("supernode-stranger")
    assert (
        "Unable to parse" not in stranger_log
    )  # refused for not being registered, not for its key
    assert "Failed to activate SuperNode" in stranger_log, stranger_log[-2000:]
    pub = Path(str(stranger) + ".pub").read_text().split()[1]
    assert pub not in listed.stdout


def _control_port(port: int) -> int:
    return port  # the `flwr` CLI talks to the same port as the SuperNodes
