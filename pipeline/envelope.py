"""HPKE envelopes for documents and results, and signed job manifests.

Documents are sealed to the service's X25519 key and results to the submitting client's. HPKE here has
no associated data, so the context (format version, purpose, job id, document id) is bound through
`info`: an envelope opens only for the exact job, document and purpose it was sealed for.
A manifest lists a job's documents with their ciphertext hashes and is signed by the client, so the
worker can check what it was asked to do before it opens anything. A job's parameters are sealed to the
service (`seal_params`, stored beside the job) and the manifest signs their hash (`params_sha256`, manifest
version 2); version 1 manifests, which carried the parameters in clear, are still accepted. A job's name is
sealed to its submitter (`seal_job_name`), like document names.

Manifests and payload headers are untrusted until checked: they are parsed within bounds
(`jobs.bounded_json`: nesting depth, size), and every failure is an `EnvelopeError` or `ManifestError`
whose one-line message quotes nothing from the input.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke
from cryptography.hazmat.primitives.asymmetric import x25519

from jobs.bounded_json import JSONInputError
from jobs.bounded_json import loads as load_json
from pipeline.canonical import canonical_json
from pipeline.errors import UserError
from pipeline.keys import Identity, PublicIdentity, verify_signature

FORMAT_VERSION = "enclave/1"
SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
MANIFEST_VERSION = 2  # 2: params sealed to the service, their hash signed; 1: params in clear
MANIFEST_VERSIONS = (1, 2)
_HEADER_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 64 * 2**10  # a payload header holds one path
MAX_PATH_CHARS = 4096
MAX_MANIFEST_CHARS = 512 * 2**20  # ids and hashes take ~110 characters a document: millions of documents
MAX_ID_CHARS = 200
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class EnvelopeError(UserError, ValueError):
    """An envelope or document payload cannot be sealed or opened; never carries content or keys."""


class ManifestError(UserError, ValueError):
    """A job manifest is malformed or its signature does not verify."""


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def _info(purpose: str, job_id: str, document_id: str) -> bytes:
    """HPKE info: version, purpose, job id, document id joined by NUL (ids may not contain NUL)."""
    for name, value in (("job id", job_id), ("document id", document_id)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if "\x00" in value:
            raise EnvelopeError(f"{name} must not contain a NUL character")
    return "\x00".join((FORMAT_VERSION, purpose, job_id, document_id)).encode("utf-8")


def _seal(purpose: str, plaintext: bytes, public_x25519: bytes, job_id: str, document_id: str) -> bytes:
    info = _info(purpose, job_id, document_id)
    try:
        public_key = x25519.X25519PublicKey.from_public_bytes(public_x25519)
    except ValueError:
        raise EnvelopeError(f"cannot seal {purpose} {document_id}: public key must be 32 raw bytes") from None
    return SUITE.encrypt(plaintext, public_key, info=info)


def _open(purpose: str, sealed: bytes, identity: Identity, job_id: str, document_id: str) -> bytes:
    info = _info(purpose, job_id, document_id)
    try:
        return SUITE.decrypt(sealed, identity.x25519_private, info=info)
    except (InvalidTag, ValueError):
        # A job's own envelopes (its name, its parameters) have no document id.
        what = f"the {purpose} of job {job_id}" if not document_id else f"{purpose} of document {document_id}"
        what = f"document {document_id}" if purpose == "document" else what
        raise EnvelopeError(f"cannot open {what}: wrong key or corrupted ciphertext") from None


def seal_document(plaintext: bytes, service_public_x25519: bytes, job_id: str, document_id: str) -> bytes:
    """Encrypt a document payload to the service, bound to this job and document."""
    return _seal("document", plaintext, service_public_x25519, job_id, document_id)


def open_document(sealed: bytes, service_identity: Identity, job_id: str, document_id: str) -> bytes:
    """Decrypt a sealed document with the service key; `EnvelopeError` on any mismatch or tampering."""
    return _open("document", sealed, service_identity, job_id, document_id)


def seal_result(plaintext: bytes, client_public_x25519: bytes, job_id: str, document_id: str) -> bytes:
    """Encrypt a document's result to the submitting client, bound to this job and document."""
    return _seal("result", plaintext, client_public_x25519, job_id, document_id)


def open_result(sealed: bytes, client_identity: Identity, job_id: str, document_id: str) -> bytes:
    """Decrypt a sealed result with the client key; `EnvelopeError` on any mismatch or tampering."""
    return _open("result", sealed, client_identity, job_id, document_id)


def seal_name(path: str, client_public_x25519: bytes, job_id: str, document_id: str) -> bytes:
    """Encrypt a document's path to the submitting client, so it can name every document in its results
    (also those the service never opened) while the service sees ids only."""
    return _seal("name", path.encode("utf-8", "surrogateescape"), client_public_x25519, job_id, document_id)


def open_name(sealed: bytes, client_identity: Identity, job_id: str, document_id: str) -> str:
    """Decrypt a `seal_name` envelope with the client key."""
    return _open("name", sealed, client_identity, job_id, document_id).decode("utf-8", "replace")


def seal_job_name(name: str, client_public_x25519: bytes, job_id: str) -> bytes:
    """Encrypt a job's name to its submitter, bound to the job (the service stores it, never reads it)."""
    return _seal("jobname", name.encode("utf-8", "surrogateescape"), client_public_x25519, job_id, "")


def open_job_name(sealed: bytes, client_identity: Identity, job_id: str) -> str:
    """Decrypt a `seal_job_name` envelope with the client key."""
    return _open("jobname", sealed, client_identity, job_id, "").decode("utf-8", "replace")


def seal_params(params: dict[str, Any], service_public_x25519: bytes, job_id: str) -> bytes:
    """Encrypt a job's parameters (canonical JSON) to the service, bound to the job."""
    return _seal("params", canonical_json(params), service_public_x25519, job_id, "")


def open_params(sealed: bytes, service_identity: Identity, job_id: str) -> dict[str, Any]:
    """Decrypt and parse a `seal_params` envelope with the service key; `EnvelopeError` (content-free) when it
    does not open or is not a JSON object within bounds."""
    try:
        params = load_json(_open("params", sealed, service_identity, job_id, ""), "job parameters")
    except JSONInputError as exc:
        raise EnvelopeError(f"malformed sealed parameters: {exc}") from None
    if not isinstance(params, dict):
        raise EnvelopeError("malformed sealed parameters: not a JSON object")
    return params


def pack_document(path: str, data: bytes) -> bytes:
    """Payload = 4-byte big-endian header length, UTF-8 JSON header {"path": ...}, raw bytes.

    The path travels inside the envelope so file names stay encrypted too.
    """
    if not isinstance(path, str):
        raise TypeError(f"path must be a str, got {type(path).__name__}")
    try:
        header = canonical_json({"path": path})
    except UnicodeEncodeError:
        raise EnvelopeError("document path is not valid Unicode (undecodable file name?)") from None
    return _HEADER_LEN.pack(len(header)) + header + bytes(data)


def unpack_document(payload: bytes) -> tuple[str, bytes]:
    """Split a `pack_document` payload back into (path, data); `EnvelopeError` when malformed."""
    if len(payload) < _HEADER_LEN.size:
        raise EnvelopeError("malformed document payload: shorter than its header length")
    (length,) = _HEADER_LEN.unpack_from(payload)
    if length > MAX_HEADER_BYTES:
        raise EnvelopeError(f"malformed document payload: header is {length} bytes, over {MAX_HEADER_BYTES}")
    end = _HEADER_LEN.size + length
    if end > len(payload):
        raise EnvelopeError("malformed document payload: header runs past the end")
    try:
        header = load_json(bytes(payload[_HEADER_LEN.size : end]), "header", max_depth=4)
    except JSONInputError as exc:
        raise EnvelopeError(f"malformed document payload: {exc}") from None
    path = header.get("path") if isinstance(header, dict) else None
    if not isinstance(path, str):
        raise EnvelopeError("malformed document payload: header has no string 'path'")
    if len(path) > MAX_PATH_CHARS:
        raise EnvelopeError(
            f"malformed document payload: path is {len(path)} characters, over {MAX_PATH_CHARS}"
        )
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EnvelopeError(f"malformed document payload: path has a lone surrogate at {exc.start}") from None
    return path, bytes(payload[end:])


RESULT_STATEMENT = "enclave/1 result"


def result_statement(job_id: str, document_id: str, sealed_result: bytes, status: str) -> bytes:
    """What the service signs for a result row and the client verifies: the job, the document, the SHA-256
    of the sealed result bytes and the document's final status, in canonical JSON."""
    return canonical_json(
        {
            "purpose": RESULT_STATEMENT,
            "job_id": job_id,
            "document_id": document_id,
            "sha256": sha256_hex(sealed_result),
            "status": status,
        }
    )


def sign_manifest(manifest: dict[str, Any], client_identity: Identity) -> bytes:
    """Ed25519 signature by the client over `canonical_json(manifest)`, after checking its fields."""
    _check_manifest(manifest)
    return client_identity.sign(_manifest_bytes(manifest))


def verify_manifest(manifest_json: str, signature: bytes, client_public: PublicIdentity) -> dict[str, Any]:
    """Parse a manifest, check the client's signature over its canonical form and its fields; return it."""
    try:
        manifest = load_json(manifest_json, "manifest", max_bytes=MAX_MANIFEST_CHARS)
    except JSONInputError as exc:
        raise ManifestError(str(exc)) from None
    if not isinstance(manifest, dict):
        raise ManifestError("manifest must be a JSON object")
    if not verify_signature(client_public, _manifest_bytes(manifest), signature):
        raise ManifestError("manifest signature does not verify")
    _check_manifest(manifest)
    fingerprint = client_public.fingerprint
    if manifest["client"] != fingerprint:
        raise ManifestError(f"manifest client does not match the verifying key {fingerprint}")
    return manifest


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    try:
        return canonical_json(manifest)
    except (ValueError, TypeError, RecursionError):  # NaN/infinity, a lone surrogate, a non-JSON value
        raise ManifestError("manifest cannot be encoded as canonical JSON") from None


_MANIFEST_FIELDS: dict[str, type] = {
    "version": int,
    "job_id": str,
    "kind": str,
    "client": str,
    "documents": list,
    "created_at": str,
}
_PARAMS_FIELD: dict[int, tuple[str, type]] = {1: ("params", dict), 2: ("params_sha256", str)}
_TYPE_WORDS = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


def _check_manifest(manifest: Any) -> None:
    """Raise `ManifestError` naming the first missing or mistyped field."""
    if not isinstance(manifest, dict):
        raise ManifestError("manifest must be a JSON object")
    _check_field(manifest, "version", int)
    version = manifest["version"]
    if version not in MANIFEST_VERSIONS:
        raise ManifestError(f"manifest version is not supported (expected 1 or {MANIFEST_VERSION})")
    for name, kind in (*_MANIFEST_FIELDS.items(), _PARAMS_FIELD[version]):
        _check_field(manifest, name, kind)
    if version > 1 and "params" in manifest:
        raise ManifestError(f"a version {version} manifest must not carry 'params' in clear")
    if version > 1 and not _SHA256_HEX.fullmatch(manifest["params_sha256"]):
        raise ManifestError("manifest field 'params_sha256' must be 64 lowercase hex characters")
    for name in ("job_id", "client"):
        if not 0 < len(manifest[name]) <= MAX_ID_CHARS:
            raise ManifestError(f"manifest field '{name}' must be 1 to {MAX_ID_CHARS} characters")
    seen: dict[str, int] = {}
    for i, doc in enumerate(manifest["documents"]):
        if not isinstance(doc, dict):
            raise ManifestError(f"manifest document {i} must be an object")
        doc_id = doc.get("id")
        if not isinstance(doc_id, str) or not 0 < len(doc_id) <= MAX_ID_CHARS:
            raise ManifestError(
                f"manifest document {i} needs a string 'id' of 1 to {MAX_ID_CHARS} characters"
            )
        if not isinstance(doc.get("sha256"), str) or not _SHA256_HEX.fullmatch(doc["sha256"]):
            raise ManifestError(f"manifest document {i} needs 'sha256' as 64 lowercase hex characters")
        if doc_id in seen:
            raise ManifestError(f"manifest lists one document id twice (documents {seen[doc_id]} and {i})")
        seen[doc_id] = i


def _check_field(manifest: dict[str, Any], name: str, kind: type) -> None:
    if name not in manifest:
        raise ManifestError(f"manifest is missing field '{name}'")
    value = manifest[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestError(f"manifest field '{name}' must be {_TYPE_WORDS[kind]}")
