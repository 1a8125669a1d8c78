"""Signed tree heads of the audit log: what the service signs, and the one JSON line that carries a head
outside the database (the heads files, `enclave audit head`, exports).

A head says: the first `tree_size` events have the Merkle root `root_hash` (RFC 9162, `pipeline.merkle`),
and the hash chain's row `tree_size` has the hash `chain_hash`, at `timestamp`. The service signs the
canonical JSON of those fields with its Ed25519 key, so one signature covers both structures. Nothing here
touches the database: a client checks heads and proofs with the service's public key alone.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.canonical import canonical_json
from pipeline.errors import UserError

FORMAT = "enclave-tree-head/1"
MAX_LINE = 1024  # a head's JSON line is about 400 bytes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_FIELDS = ("format", "tree_size", "root_hash", "chain_hash", "timestamp", "key_fingerprint", "signature")

Verifier = Callable[[bytes, bytes], bool]  # (signed bytes, signature) -> valid under the service's key


class HeadError(UserError, ValueError):
    """Text that is not a signed tree head; the message names where it came from and what is wrong."""


@dataclass(frozen=True)
class SignedHead:
    """One signed tree head of the audit log."""

    tree_size: int
    root_hash: str  # hex MTH of the first tree_size events
    chain_hash: str  # hex hash of row tree_size in the hash chain
    timestamp: str  # UTC, as the log's `at`
    key_fingerprint: str  # the signing service identity
    signature: bytes  # Ed25519 over payload()

    def payload(self) -> bytes:
        """The bytes the signature covers."""
        return payload(self.tree_size, self.root_hash, self.chain_hash, self.timestamp)

    def signed_by(self, verify_signature: Verifier) -> bool:
        """True when the signature is valid under the key behind `verify_signature`."""
        return verify_signature(self.payload(), self.signature)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "chain_hash": self.chain_hash,
            "timestamp": self.timestamp,
            "key_fingerprint": self.key_fingerprint,
            "signature": base64.b64encode(self.signature).decode("ascii"),
        }

    def line(self) -> bytes:
        """The head as one canonical JSON line, newline included."""
        return canonical_json(self.to_json()) + b"\n"

    @classmethod
    def from_json(cls, data: Any, where: str) -> SignedHead:
        """Parse `to_json` output strictly: every field, nothing else, each of its type and shape."""
        if not isinstance(data, Mapping):
            raise HeadError(f"{where} is not a signed tree head (a JSON object)")
        if set(data) != set(_FIELDS):
            missing, extra = sorted(set(_FIELDS) - set(data)), sorted(set(data) - set(_FIELDS))
            what = f"lacks {', '.join(missing)}" if missing else f"has {len(extra)} unknown field(s)"
            raise HeadError(f"{where} is not a signed tree head: it {what}")
        if data["format"] != FORMAT:
            raise HeadError(f"{where} is not a signed tree head of format {FORMAT}")
        size = data["tree_size"]
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < 2**63:
            raise HeadError(f"{where}: tree_size must be a whole number from 1")
        for name in ("root_hash", "chain_hash", "key_fingerprint"):
            if not isinstance(data[name], str) or not _HEX64.fullmatch(data[name]):
                raise HeadError(f"{where}: {name} must be 64 lowercase hex digits")
        if not isinstance(data["timestamp"], str) or not _TIMESTAMP.fullmatch(data["timestamp"]):
            raise HeadError(f"{where}: timestamp must read YYYY-MM-DDTHH:MM:SS.ffffffZ")
        try:
            signature = base64.b64decode(data["signature"], validate=True)
        except (binascii.Error, ValueError, TypeError):
            signature = b""
        if len(signature) != 64:
            raise HeadError(f"{where}: signature must be 64 bytes in base64")
        hashes = data["root_hash"], data["chain_hash"]
        return cls(size, *hashes, data["timestamp"], data["key_fingerprint"], signature)

    @classmethod
    def parse(cls, text: str | bytes, where: str) -> SignedHead:
        """A head from one JSON line or document."""
        if len(text) > MAX_LINE:
            raise HeadError(f"{where} is longer than a signed tree head ({MAX_LINE} bytes at most)")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise HeadError(f"{where} is not valid JSON") from None
        return cls.from_json(data, where)


def payload(tree_size: int, root_hash: str, chain_hash: str, timestamp: str) -> bytes:
    """Canonical JSON of the signed fields, with the format: no other signed message can pass for a head."""
    fields = {"tree_size": tree_size, "root_hash": root_hash, "chain_hash": chain_hash}
    return canonical_json({"format": FORMAT, **fields, "timestamp": timestamp})


def legacy_payload(size: int, head_hash: str) -> bytes:
    """What a checkpoint signed before tree heads (migration 0007): the chain's size and head hash only."""
    return canonical_json({"size": size, "head_hash": head_hash})
