"""Key pairs and key files for the service and client identities.

An identity is an X25519 key pair (HPKE: documents are sealed to the service, results to the client)
plus an Ed25519 key pair (signatures: clients sign manifests, the service signs audit checkpoints).
A key directory holds `x25519.pem` and `ed25519.pem` (PKCS8, 0600, optionally passphrase-protected)
and `public.json` (the public half, safe to share).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

from pipeline.errors import UserError
from pipeline.settings import PASSPHRASE_ENV  # named in the error for a protected key

X25519_FILE = "x25519.pem"
ED25519_FILE = "ed25519.pem"
PUBLIC_FILE = "public.json"

_ENCRYPTED_PEM = b"-----BEGIN ENCRYPTED PRIVATE KEY-----"
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


class KeyFileError(UserError, ValueError):
    """A key or key file is missing, malformed, unreadable or unsafe; the message says what to do."""


@dataclass(frozen=True)
class PublicIdentity:
    """Raw 32-byte public keys of one identity: X25519 for sealing to it, Ed25519 for its signatures."""

    x25519: bytes
    ed25519: bytes

    def __post_init__(self) -> None:
        for name in ("x25519", "ed25519"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 32:
                raise KeyFileError(f"{name} public key must be 32 raw bytes")

    @property
    def fingerprint(self) -> str:
        """Lowercase hex SHA-256 of ed25519 || x25519: the stable name of this identity (64 chars)."""
        return hashlib.sha256(self.ed25519 + self.x25519).hexdigest()

    def to_json(self) -> dict[str, str]:
        """A JSON-ready dict with base64 keys and the fingerprint (as written to public.json)."""
        return {
            "x25519": base64.b64encode(self.x25519).decode("ascii"),
            "ed25519": base64.b64encode(self.ed25519).decode("ascii"),
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PublicIdentity:
        """Parse `to_json` output; checks key lengths and, when present, the fingerprint."""
        if not isinstance(data, Mapping):
            raise KeyFileError("public identity must be a JSON object")
        raw = {}
        for name in ("x25519", "ed25519"):
            value = data.get(name)
            if not isinstance(value, str):
                raise KeyFileError(f"public identity is missing the {name} key")
            try:
                raw[name] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise KeyFileError(f"public identity {name} key is not valid base64") from None
        public = cls(x25519=raw["x25519"], ed25519=raw["ed25519"])
        expected = data.get("fingerprint")
        if expected is not None and expected != public.fingerprint:
            raise KeyFileError(f"public identity fingerprint {expected!r} does not match its keys")
        return public


class Identity:
    """The private half of an identity: signs with Ed25519 and opens HPKE envelopes with X25519."""

    __slots__ = ("_ed25519", "_public", "_x25519")

    def __init__(self, x25519_private: x25519.X25519PrivateKey, ed25519_private: ed25519.Ed25519PrivateKey):
        if not isinstance(x25519_private, x25519.X25519PrivateKey):
            raise TypeError("x25519_private must be an X25519PrivateKey")
        if not isinstance(ed25519_private, ed25519.Ed25519PrivateKey):
            raise TypeError("ed25519_private must be an Ed25519PrivateKey")
        self._x25519 = x25519_private
        self._ed25519 = ed25519_private
        self._public = PublicIdentity(
            x25519=x25519_private.public_key().public_bytes(*_RAW),
            ed25519=ed25519_private.public_key().public_bytes(*_RAW),
        )

    @property
    def public(self) -> PublicIdentity:
        """The public keys to share (allowlist entry, `public.json`)."""
        return self._public

    @property
    def x25519_private(self) -> x25519.X25519PrivateKey:
        """The X25519 private key, for HPKE `decrypt`."""
        return self._x25519

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) over `data`."""
        return self._ed25519.sign(data)

    def __repr__(self) -> str:
        return f"Identity(fingerprint={self._public.fingerprint})"


def generate_identity() -> Identity:
    """A fresh identity with new random X25519 and Ed25519 keys."""
    return Identity(x25519.X25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate())


def verify_signature(public: PublicIdentity, data: bytes, signature: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `data` by `public`; never raises for bad ones."""
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public.ed25519).verify(signature, data)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def save_identity(
    identity: Identity, directory: Path, passphrase: bytes | None = None, overwrite: bool = False
) -> None:
    """Write the key files into `directory` (created 0700); private keys are 0600 from their first byte."""
    directory = Path(directory)
    if passphrase is not None and len(passphrase) == 0:
        raise KeyFileError("passphrase must not be empty; pass None for unprotected key files")
    private_paths = [directory / X25519_FILE, directory / ED25519_FILE]
    if not overwrite:
        for path in private_paths:
            if path.exists():
                raise KeyFileError(f"key file {path} already exists; refusing to overwrite it")
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    for path, key in zip(private_paths, (identity.x25519_private, identity._ed25519), strict=True):
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
        _write_atomic(path, pem, 0o600)
    text = json.dumps(identity.public.to_json(), indent=2, sort_keys=True) + "\n"
    _write_atomic(directory / PUBLIC_FILE, text.encode("utf-8"), 0o644)


def save_public(public: PublicIdentity, directory: Path) -> None:
    """Write `public` as `directory`/public.json (a service key imported by a client: nothing private)."""
    directory = Path(directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    text = json.dumps(public.to_json(), indent=2, sort_keys=True) + "\n"
    _write_atomic(directory / PUBLIC_FILE, text.encode("utf-8"), 0o644)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write to a fresh temp file created with `mode`, then rename over `path`: no partial or exposed file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have cleared bits we want
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_identity(directory: Path, passphrase: bytes | None = None) -> Identity:
    """Read the private keys from `directory`; every failure is a one-line `KeyFileError`."""
    directory = Path(directory)
    paths = [directory / X25519_FILE, directory / ED25519_FILE]
    for path in paths:
        if not path.is_file():
            raise KeyFileError(f"no key in {directory}; run `enclave init` or `enclave keys create`")
    x_key = _load_private(paths[0], passphrase, x25519.X25519PrivateKey, "X25519")
    ed_key = _load_private(paths[1], passphrase, ed25519.Ed25519PrivateKey, "Ed25519")
    return Identity(x_key, ed_key)


def _load_private(path: Path, passphrase: bytes | None, key_type: type, type_name: str) -> Any:
    """One PEM private key of `key_type`, after checking the file is private to its owner."""
    mode = os.stat(path).st_mode & 0o777
    if os.name == "posix" and mode & 0o077:
        raise KeyFileError(f"key file {path} is readable by others (mode {mode:04o}); chmod 600 it")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from None
    encrypted = _ENCRYPTED_PEM in data
    if encrypted and not passphrase:
        variable = PASSPHRASE_ENV.get(path.parent.name) or " or ".join(PASSPHRASE_ENV.values())
        raise KeyFileError(f"key file {path} is passphrase-protected: set {variable} to its passphrase")
    try:
        key = serialization.load_pem_private_key(data, passphrase if encrypted else None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        if encrypted:
            raise KeyFileError(f"wrong passphrase for key file {path} (or the file is corrupt)") from None
        raise KeyFileError(f"key file {path} is corrupt: not a PEM private key") from None
    if not isinstance(key, key_type):
        raise KeyFileError(f"key file {path} is not an {type_name} private key")
    return key


def load_public(path: Path) -> PublicIdentity:
    """Read a `public.json` file, or the one inside directory `path`."""
    path = Path(path)
    if path.is_dir():
        path = path / PUBLIC_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeyFileError(
            f"no public key at {path}; run `enclave keys create` or ask for the file"
        ) from None
    except OSError as e:
        raise KeyFileError(f"cannot read public key {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"public key file {path} is not valid JSON") from None
    return parse_public(text, f"public key file {path}")


def parse_public(text: str, where: str) -> PublicIdentity:
    """A public identity from the text of a `public.json`; `where` names its origin in errors."""
    try:
        data = json.loads(text)
    except ValueError:
        raise KeyFileError(f"{where} is not valid JSON") from None
    try:
        return PublicIdentity.from_json(data)
    except KeyFileError as e:
        raise KeyFileError(f"{where}: {e}") from None
