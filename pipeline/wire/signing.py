"""Signed requests: every call to the service API carries an Ed25519 signature by the client's key over a
canonical form of the request, so the service knows who asks, and a copy replayed later is refused.

The signed statement is the canonical JSON (`pipeline.canonical`) of
`{purpose, method, target (path?query), timestamp, nonce, body_sha256, client, service}`; the headers carry
the client's fingerprint, the fingerprint of the service the request is for (its audience: the key the
client seals to, from `enclave keys import-service`), the timestamp (Unix seconds), a random nonce, the
body's SHA-256 and the signature (base64). The service refuses a request meant for another service (so one
that saw it cannot replay it to a second service that allows the same client), accepts a timestamp within
`WINDOW_SECONDS` of its clock and each nonce once (it keeps them for the window), checks the allow-list and
revocation, then the signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.canonical import canonical_json
from pipeline.keys import Identity, PublicIdentity, verify_signature

PURPOSE = "enclave-request/2"  # /1 had no service (audience)
WINDOW_SECONDS = 300  # how far a request's timestamp may be from the service's clock, either way
CLIENT = "x-enclave-client"
SERVICE = "x-enclave-service"
TIMESTAMP = "x-enclave-timestamp"
NONCE = "x-enclave-nonce"
BODY_SHA256 = "x-enclave-content-sha256"
SIGNATURE = "x-enclave-signature"
HEADERS = (CLIENT, SERVICE, TIMESTAMP, NONCE, BODY_SHA256, SIGNATURE)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{32}")


class SignatureError(ValueError):
    """A request's signature headers are missing or malformed; `code` names which refusal it is."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SignedRequest:
    """The signature headers of one request, parsed (not yet verified)."""

    client: str
    service: str  # the fingerprint of the service it is for
    timestamp: int
    nonce: str
    body_sha256: str
    signature: bytes

    def statement(self, method: str, target: str) -> bytes:
        """The bytes its signature covers, for the request's method and target."""
        fields = (self.timestamp, self.nonce, self.body_sha256, self.client, self.service)
        return statement(method, target, *fields)


def statement(
    method: str, target: str, timestamp: int, nonce: str, body_sha256: str, client: str, service: str
) -> bytes:
    """The bytes a request's signature covers."""
    return canonical_json(
        {
            "purpose": PURPOSE,
            "method": method.upper(),
            "target": target,
            "timestamp": timestamp,
            "nonce": nonce,
            "body_sha256": body_sha256,
            "client": client,
            "service": service,
        }
    )


def target_of(path: str, query: str) -> str:
    """The request target as signed: the path, and `?query` when there is one."""
    return f"{path}?{query}" if query else path


def sign(
    identity: Identity, service: str, method: str, target: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The signature headers for one request by `identity` to the service whose fingerprint is `service`."""
    timestamp = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    client = identity.public.fingerprint
    signature = identity.sign(statement(method, target, timestamp, nonce, digest, client, service))
    return {
        CLIENT: client,
        SERVICE: service,
        TIMESTAMP: str(timestamp),
        NONCE: nonce,
        BODY_SHA256: digest,
        SIGNATURE: base64.b64encode(signature).decode("ascii"),
    }


def parse(headers: Mapping[str, str]) -> SignedRequest:
    """The signature headers of a request; `SignatureError` (`unsigned` or `bad_signature`) when absent or
    malformed. Nothing is verified here."""
    if not any(headers.get(name) for name in HEADERS):
        raise SignatureError(
            "unsigned", "the request is not signed: use `enclave` (or sign it with your key)"
        )
    missing = [name for name in HEADERS if not headers.get(name)]
    if missing:
        raise SignatureError("bad_signature", f"the request's signature lacks the {missing[0]} header")
    client, service, timestamp, nonce = headers[CLIENT], headers[SERVICE], headers[TIMESTAMP], headers[NONCE]
    digest = headers[BODY_SHA256]
    hexes = (client, service, digest)
    if not all(_HEX64.fullmatch(h) for h in hexes) or not _NONCE.fullmatch(nonce):
        raise SignatureError("bad_signature", "the request's signature headers are malformed")
    if not timestamp.isdigit() or len(timestamp) > 12:
        raise SignatureError("bad_signature", "the request's timestamp is not a whole number of seconds")
    try:
        signature = base64.b64decode(headers[SIGNATURE], validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("bad_signature", "the request's signature is not valid base64") from None
    return SignedRequest(client, service, int(timestamp), nonce, digest, signature)


def check_service(signed: SignedRequest, service: str) -> None:
    """`SignatureError` `wrong_service` when the request was signed for another service than `service`."""
    if signed.service != service:
        raise SignatureError(
            "wrong_service",
            f"the request was signed for service {signed.service[:16]}, and this is {service[:16]}: check "
            "ENCLAVE_SERVICE_URL and the service key imported with `enclave keys import-service`",
        )


def verify(
    signed: SignedRequest, public: PublicIdentity, method: str, target: str, body: bytes, now: float
) -> None:
    """Check a parsed request against the client's key, its body and the clock; `SignatureError` with code
    `bad_signature` (body or signature) or `stale_request` (timestamp outside the window). The service it
    names is checked apart (`check_service`), before the client is looked up."""
    if abs(now - signed.timestamp) > WINDOW_SECONDS:
        raise SignatureError(
            "stale_request",
            f"the request's timestamp is more than {WINDOW_SECONDS} s from the service's clock: "
            "check this machine's clock",
        )
    if hashlib.sha256(body).hexdigest() != signed.body_sha256:
        raise SignatureError("bad_signature", "the request's body does not match its signed hash")
    if not verify_signature(public, signed.statement(method, target), signed.signature):
        raise SignatureError("bad_signature", "the request's signature does not verify with the client's key")
