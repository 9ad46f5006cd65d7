"""Long-term site identities: Ed25519 signing keys and the consortium's key list.

A secure-aggregation round is only as private as its roster: a server that could invent
the other K - 1 sites (holding their keys) would rebuild the one real site's masks, and its
noise share, sized for K_eff honest shares, would protect it with 1/K_eff of the variance
its ledger paid for. So every site holds a long-term Ed25519 key (RFC 8032, from the
``cryptography`` library) that never leaves it, and a list of the consortium's public keys
(site id -> key) that it obtained outside the server's control. It signs its per-round
keys and the survivor set it saw (:mod:`.protocol`), and it verifies the others' against
that list. The list is the trust anchor: whoever writes it decides who the site counts as
a peer (docs/secure_aggregation.md, "What remains trusted").

* :func:`generate` writes a new private key (PEM, PKCS#8, unencrypted) with mode 0600 and
  returns its public key as hex (what the consortium's list holds);
* :func:`load` reads it back, refusing a file that others can read;
* :func:`sign` / :func:`verify`: Ed25519 signatures (64 bytes) over bytes;
* :func:`parse_peers`: the key list, inline ``{site-id = "hex"}`` or a TOML / JSON file of
  the same table, as a :class:`Consortium`;
* :class:`Credentials`: what a site's protocol party needs (its key, the list, ``min_peers``);
* simulations (one party plays every site): :func:`ephemeral_credentials` (fresh keys for one
  in-process run) and :func:`simulated_credentials` (keys derived from the run key, so that
  the processes of a Flower simulation agree on them: anyone can derive them, so they
  authenticate nothing; never for a deployment).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
MAX_SITE_ID = 999_999_999  # the wire format's largest site id (secagg/wire.py)


def generate(path: str | Path, *, overwrite: bool = False) -> str:
    """Write a new Ed25519 private key to ``path`` (PEM, PKCS#8, unencrypted; the file is
    created with mode 0600, its directory with 0700 if missing) and return the public key
    as 64 hex digits. Refuses (``ValueError``) an existing file unless ``overwrite``."""
    p = Path(path).expanduser()
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(p, flags, 0o600)
    except FileExistsError:
        raise ValueError(f"signing key {str(p)!r} exists; refusing to overwrite it") from None
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)  # also when overwriting a file of another mode
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    return public_hex(key)


def load(path: str | Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (:func:`generate`'s format). ``ValueError`` when
    the file is missing, readable by the group or others, or not an Ed25519 key."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"signing_key: no file {str(p)!r}")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"signing_key {str(p)!r} has mode {mode:04o}: a private key must be readable by "
            "its owner only (chmod 600)"
        )
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(f"signing_key {str(p)!r} is not a PEM private key: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"signing_key {str(p)!r} is a {type(key).__name__}, not Ed25519")
    return key


def public_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key (of a private key's public key)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes_raw()


def public_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    return public_bytes(key).hex()


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    """The 64-byte Ed25519 signature of ``message`` (deterministic, RFC 8032)."""
    return key.sign(message)


def verify(public: bytes, signature: Any, message: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``message`` under ``public``
    (32 raw bytes); False, never an exception, for anything malformed."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    if not isinstance(public, bytes) or not isinstance(message, bytes):
        return False
    return _valid(public, signature, message)


@functools.lru_cache(maxsize=8192)
def _valid(public: bytes, signature: bytes, message: bytes) -> bool:
    """Ed25519 verification of exactly these bytes, once per process: verification is a
    deterministic function of (key, signature, message), so a remembered answer is the
    answer. Only the parties of one process share it (the simulated sites of a run, which
    all check the same roster and survivor-set signatures); a deployed site checks every
    signature itself."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Consortium:
    """The public keys a site accepts as peers: ``keys`` ((site id, 32-byte key), ...),
    sorted by site. ``simulated``: no list at all (a simulation node; its keys are made
    per run by :func:`simulated_credentials`)."""

    keys: tuple[tuple[int, bytes], ...] = ()
    source: str = "inline"
    simulated: bool = False

    def key(self, site: int) -> bytes | None:
        """Site ``site``'s public key, or None if the list has no such site."""
        return dict(self.keys).get(site)

    @property
    def sites(self) -> tuple[int, ...]:
        return tuple(v for v, _ in self.keys)

    def __contains__(self, site: object) -> bool:
        return any(v == site for v, _ in self.keys)

    def __len__(self) -> int:
        return len(self.keys)


SIMULATED = Consortium(source="simulation", simulated=True)


def parse_peers(value: Any, *, what: str = "peers") -> Consortium:
    """The consortium's key list from ``value``: a :class:`Consortium`; a table
    {site id: hex public key} (site ids as ints or decimal strings); or the path of a TOML
    or JSON file holding that table (a relative path is taken from the working directory:
    a policy file resolves it first). ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, Consortium):
        return value
    source = "inline"
    if isinstance(value, str | Path):
        p = Path(value).expanduser()
        if not p.is_file():
            raise ValueError(f"{what}: no key-list file {str(p)!r}")
        text = p.read_bytes()
        try:
            value = json.loads(text) if p.suffix == ".json" else tomllib.loads(text.decode())
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{what}: key-list file {str(p)!r} does not parse: {err}") from None
        source = str(p.resolve())
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{what} must be a non-empty table {{site-id = \"hex public key\"}} or a "
                         f"path to a TOML/JSON file of one, got {type(value).__name__}")  # fmt: skip
    keys: dict[int, bytes] = {}
    for k, v in value.items():
        site = _site_id(k, what)
        if site in keys:
            raise ValueError(f"{what}: site {site} listed twice")
        keys[site] = _public_key(v, f"{what}: site {site}'s key")
    return Consortium(tuple(sorted(keys.items())), source=source)


def _site_id(k: Any, what: str) -> int:
    if isinstance(k, str) and k.isdigit() and (k == "0" or not k.startswith("0")):
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, int) or not (0 <= k <= MAX_SITE_ID):
        raise ValueError(f"{what}: site id {k!r} must be an integer in [0, {MAX_SITE_ID}]")
    return k


def _public_key(v: Any, what: str) -> bytes:
    try:
        raw = bytes.fromhex(v) if isinstance(v, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != PUBLIC_BYTES:
        raise ValueError(f"{what} must be {2 * PUBLIC_BYTES} hex digits (an Ed25519 public key)")
    try:
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ValueError(f"{what} is not an Ed25519 public key") from None
    return raw


@dataclass(frozen=True)
class Credentials:
    """What one site's protocol party needs: its long-term ``signing_key``, the ``peers``
    it accepts, and ``min_peers``, the fewest authenticated sites (itself included) a round
    may count on."""

    signing_key: Ed25519PrivateKey
    peers: Consortium
    min_peers: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.min_peers, bool) or not isinstance(self.min_peers, int):
            raise ValueError(f"min_peers must be an integer >= 1, got {self.min_peers!r}")
        if self.min_peers < 1:
            raise ValueError(f"min_peers must be an integer >= 1, got {self.min_peers}")
        if self.peers.simulated:
            raise ValueError("credentials need a key list, not the simulation marker")

    def check_site(self, site: int) -> None:
        """``ValueError`` unless the list holds this key for ``site``."""
        if self.peers.key(site) != public_bytes(self.signing_key):
            raise ValueError(
                f"the key list (policy peers) does not hold this node's public key "
                f"{public_hex(self.signing_key)} for site {site}"
            )


def ephemeral_credentials(sites: Iterable[int], *, min_peers: int = 2) -> dict[int, Credentials]:
    """Fresh keys for every site of a run that ONE party plays (the in-process engine, a
    test): each site's credentials list all of them. ``min_peers`` is capped at the number
    of sites."""
    keys = {int(v): Ed25519PrivateKey.generate() for v in sites}
    return _credentials(keys, min_peers, "ephemeral keys of an in-process run")


def simulated_key(run_key: str, site: int) -> Ed25519PrivateKey:
    """Site ``site``'s key in a simulation of run ``run_key``: SHA-256 of a public label, so
    every process of the simulation derives the same keys, and so can anyone else."""
    label = f"fedsgld simulated site identity|{run_key}|{int(site)}".encode()
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label).digest())


def simulated_credentials(
    run_key: str, sites: Iterable[int], site: int, *, min_peers: int = 2
) -> Credentials:
    """Site ``site``'s credentials in a simulation of run ``run_key`` over ``sites``
    (:func:`simulated_key`): the protocol signs and verifies as deployed, but the keys are
    public, so a simulation authenticates nobody (a simulation is one party)."""
    keys = {int(v): simulated_key(run_key, v) for v in sites}
    return _credentials(keys, min_peers, f"simulated keys of run {run_key!r}")[int(site)]


def _credentials(
    keys: Mapping[int, Ed25519PrivateKey], min_peers: int, source: str
) -> dict[int, Credentials]:
    peers = Consortium(tuple(sorted((v, public_bytes(k)) for v, k in keys.items())), source)
    floor = max(1, min(min_peers, len(keys)))
    return {v: Credentials(k, peers, floor) for v, k in keys.items()}


def consortium_files(directory: str | Path, sites: Iterable[int]) -> tuple[dict[int, Path], Path]:
    """For tests and loopback deployments on one machine: a key file per site
    (``site-<k>.key``, :func:`generate`) and the key list of all (``peers.toml``) in
    ``directory``; ({site: key file}, key-list file). A real consortium generates each key
    at its site and collects only the public keys."""
    d = Path(directory)
    files = {int(v): d / f"site-{int(v)}.key" for v in sites}
    public = {v: generate(f) for v, f in files.items()}
    peers = d / "peers.toml"
    peers.write_text("".join(f'{v} = "{h}"\n' for v, h in sorted(public.items())))
    return files, peers


__all__ = [
    "SIMULATED",
    "Consortium",
    "Credentials",
    "consortium_files",
    "ephemeral_credentials",
    "generate",
    "load",
    "parse_peers",
    "public_bytes",
    "public_hex",
    "sign",
    "simulated_credentials",
    "simulated_key",
    "verify",
]
