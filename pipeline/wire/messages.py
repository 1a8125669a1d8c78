"""The service API's messages: one pydantic model per request and answer body, shared by the server
(`pipeline/api/`) and the client (`pipeline/api_client.py`). Sealed bytes travel as base64 text.

What is in clear here is what the service may see: ids, kinds, counts, sizes rounded to a bucket, statuses,
content-free reasons and timestamps. Names, parameters, documents and results are sealed envelopes.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, model_validator


def _decode(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise ValueError("expected base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None


Sealed = Annotated[
    bytes,
    PlainValidator(_decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str),
]
MAX_ROWS = 1000  # documents in one upload chunk, results in one page
MAX_ID = 64


class Message(BaseModel):
    """A message body: unknown fields are refused, so a typo is an error rather than silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ErrorBody(Message):
    code: str
    message: str


class ErrorEnvelope(Message):
    """Every refusal: `{"error": {"code", "message"}}` with its HTTP status."""

    error: ErrorBody


class Health(Message):
    status: Literal["ok"] = "ok"
    max_request_bytes: int


class BeginUpload(Message):
    """Claim a job id for a submit (`POST /v1/jobs`)."""

    job_id: str = Field(max_length=MAX_ID)
    kind: str = Field(min_length=1, max_length=40)
    sealed_name: Sealed | None = None  # the job's name, sealed to the submitter
    priority: int = Field(0, ge=0, le=9)


class JobInfo(Message):
    """A job as its submitter sees it: state and document counts; its name sealed to the submitter."""

    job_id: str
    kind: str
    status: str
    priority: int
    total: int
    counts: dict[str, int] = Field(default_factory=dict)
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    purged_at: datetime | None = None  # its documents and results were deleted (`enclave purge`)
    error: str | None = None
    name: str = ""  # only jobs from before names were sealed
    sealed_name: Sealed | None = None
    workers: int | None = None  # live workers, in a job's own status: 0 says nothing can run it now

    @property
    def done(self) -> int:
        return self.counts.get("done", 0)

    @property
    def failed(self) -> int:
        return self.counts.get("failed", 0)


class UploadClaim(Message):
    """`new` or `resumed` (an interrupted upload taken over: its rows were cleared) with the upload's token,
    or `existing` with the job already submitted under that id."""

    state: Literal["new", "resumed", "existing"]
    token: str | None = None
    job: JobInfo | None = None


class DocumentRow(Message):
    """One document of a submit: its content sealed to the service (None: it failed at submit, for the
    content-free reason `error`), its name sealed to the submitter, the SHA-256 of the sealed bytes and its
    size rounded up to a power of two."""

    id: str = Field(max_length=MAX_ID)
    index: int = Field(ge=0)
    sealed_name: Sealed
    sealed: Sealed | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    error: str | None = Field(None, max_length=160)


class DocumentChunk(Message):
    """A chunk of a submit's documents (`POST /v1/jobs/{id}/documents`)."""

    token: str = Field(max_length=64)
    documents: list[DocumentRow] = Field(max_length=MAX_ROWS)


class ChunkStored(Message):
    stored: int


class FinishUpload(Message):
    """Queue the job (`POST /v1/jobs/{id}/submit`): its signed manifest and its parameters sealed to the
    service (the manifest signs their hash)."""

    token: str = Field(max_length=64)
    manifest: str
    signature: Sealed
    sealed_params: Sealed


class Submitted(Message):
    job_id: str
    kind: str
    documents: int
    rejected: int
    dispatched: bool


class JobList(Message):
    jobs: list[JobInfo]


class Cancelled(Message):
    cancelled: bool  # False: the job had already ended
    job: JobInfo


class ResultRow(Message):
    """One document's outcome as stored: its result sealed to the submitter and signed by the service."""

    index: int
    document_id: str
    status: str
    error: str | None = None
    sealed_name: Sealed
    sealed: Sealed | None = None
    signature: Sealed | None = None


class ResultsPage(Message):
    """Results in submission order; `next_after` is the cursor of the next page (None: the last page)."""

    job: JobInfo
    results: list[ResultRow]
    next_after: int | None = None


class ClientInfo(Message):
    name: str
    fingerprint: str
    role: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None


class ClientList(Message):
    clients: list[ClientInfo]


class AddClient(Message):
    """Allow-list a client's public keys (`POST /v1/clients`, administrators)."""

    name: str = Field(min_length=1, max_length=200)
    x25519: Sealed
    ed25519: Sealed
    role: Literal["client", "admin"] = "client"


class PurgeRequest(Message):
    """Purge one job (`job`: its id, or a unique prefix) or every job that ended more than
    `older_than_seconds` ago (`POST /v1/purge`, administrators)."""

    job: str | None = Field(None, min_length=1, max_length=MAX_ID)
    older_than_seconds: int | None = Field(None, ge=0, le=100 * 366 * 86_400)

    @model_validator(mode="after")
    def _one(self) -> PurgeRequest:
        if (self.job is None) == (self.older_than_seconds is None):
            raise ValueError("give job or older_than_seconds, not both")
        return self


class PurgedJob(Message):
    job_id: str
    documents: int
    results: int


class PurgeReport(Message):
    """The jobs purged (none when nothing matched) and the database kind (what reclaims the space)."""

    jobs: list[PurgedJob]
    database: str


class AuditRow(Message):
    seq: int
    at: str
    actor: str
    action: str
    job_id: str | None = None
    document_id: str | None = None
    outcome: str
    details: dict
    prev_hash: str
    hash: str


class AuditPage(Message):
    """Audit events (`GET /v1/audit`, administrators), oldest first (`next_after` continues) or newest first
    (`next_before` continues)."""

    events: list[AuditRow]
    next_after: int | None = None
    next_before: int | None = None


class TreeHead(Message):
    """A signed tree head of the audit log, as `pipeline.audit_heads.SignedHead.to_json` writes it (the client
    checks it with that class and the service's public key)."""

    format: str
    tree_size: int
    root_hash: str
    chain_hash: str
    timestamp: str
    key_fingerprint: str
    signature: str


class AuditProof(Message):
    """Event `event.seq` and its inclusion proof (hex hashes, RFC 9162 PATH) in the tree `head` signs
    (`GET /v1/audit/proof?event=`, administrators)."""

    event: AuditRow
    head: TreeHead
    path: list[str]


class AuditConsistency(Message):
    """A consistency proof (hex hashes, RFC 9162 PROOF) from the tree of `old_size` events to the tree `head`
    signs (`GET /v1/audit/consistency?from=`, administrators); empty when `head` is not larger."""

    head: TreeHead
    old_size: int
    path: list[str]
