"""Database tables (SQLAlchemy 2 typed models). Rows hold ids, hashes, counts, timings and sealed bytes only:
never document or result plaintext."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Boolean, ForeignKey, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from pipeline.status import DocState, JobState, Role


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)  # stored naive, always UTC


class Base(DeclarativeBase):
    pass


class Client(Base):
    """An allow-listed submitter: its public keys and their fingerprint."""

    __tablename__ = "clients"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    x25519_public: Mapped[bytes] = mapped_column(LargeBinary)  # results are sealed to this key
    ed25519_public: Mapped[bytes] = mapped_column(LargeBinary)  # manifests are signed with its private half
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # `client` submits and reads its own jobs; `admin` also manages the allow-list and reads the audit log.
    role: Mapped[str] = mapped_column(String(16), default=Role.CLIENT, server_default=Role.CLIENT)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")  # jobs before 0005 only; now always ""
    # The job's name (`--name`), sealed to the submitter; None when it has none.
    sealed_name: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    kind: Mapped[str] = mapped_column(String(40))
    client_fingerprint: Mapped[str] = mapped_column(ForeignKey("clients.fingerprint"))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED)
    manifest: Mapped[str] = mapped_column(Text)  # canonical JSON: kind, params hash, document ids and hashes
    # The job's parameters, sealed to the service; the manifest signs their SHA-256 (manifest version 2).
    sealed_params: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    signature: Mapped[bytes] = mapped_column(LargeBinary)  # Ed25519 over the manifest
    # While `uploading`: the token of the submit that owns the upload (a resubmit takes it over); else None.
    upload_token: Mapped[str | None] = mapped_column(String(32), default=None)
    total: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, default=None)  # content-free reason
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    # When `enclave purge` removed its documents and results (the row stays: ids, counts, timings).
    purged_at: Mapped[datetime | None] = mapped_column(default=None)

    documents: Mapped[list[Document]] = relationship(back_populates="job", order_by="Document.index")


class Document(Base):
    __tablename__ = "documents"
    __table_args__ = (
        UniqueConstraint("job_id", "index", name="uq_documents_job_index"),
        Index("ix_documents_job_shard", "job_id", "shard"),
        Index("ix_documents_status_lease", "status", "lease_until"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    index: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer, default=0)
    sealed: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)  # None: never uploaded (too big)
    sealed_name: Mapped[bytes] = mapped_column(LargeBinary)  # the document's path, sealed to the submitter
    sha256: Mapped[str] = mapped_column(String(64))  # of the sealed bytes, as signed in the manifest
    size: Mapped[int] = mapped_column(Integer, default=0)  # plaintext bytes, as the client measured them
    status: Mapped[str] = mapped_column(String(16), default=DocState.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # failures of this document (retried or final)
    # Leases that expired without a result: a worker died or hung while holding the document. Counted apart
    # from `attempts`, so crashes do not burn the document's retries (store.MAX_LEASE_EXPIRIES bounds them).
    lease_expiries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)  # content-free reason
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    job: Mapped[Job] = relationship(back_populates="documents")


class Result(Base):
    """The sealed outcome of one document, written once, in the transaction that finishes the document."""

    __tablename__ = "results"

    document_id: Mapped[str] = mapped_column(ForeignKey("documents.id"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    sealed: Mapped[bytes] = mapped_column(LargeBinary)  # sealed to the submitter's X25519 key
    # The service's Ed25519 signature over store.result_statement(job, document, sealed, status): the client
    # refuses a result without a valid one (forged, re-sealed, or copied from another document).
    signature: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEvent(Base):
    """One append-only row of the hash-chained audit log."""

    __tablename__ = "audit_events"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[str] = mapped_column(String(32), index=True)  # UTC, ISO 8601 with microseconds
    actor: Mapped[str] = mapped_column(String(200))  # key fingerprint or worker id
    action: Mapped[str] = mapped_column(String(40))
    job_id: Mapped[str | None] = mapped_column(String(36), default=None, index=True)
    document_id: Mapped[str | None] = mapped_column(String(36), default=None)
    outcome: Mapped[str] = mapped_column(String(40), default="ok")
    details: Mapped[str] = mapped_column(Text, default="{}")  # canonical JSON, no content
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AuditCheckpoint(Base):
    """A signed tree head: the service's signature over the log's size, the Merkle root of its first `size`
    events, the chain's head hash and the time (`pipeline.audit_heads`). Rows from before migration 0007 have
    no root and sign (size, head hash) only."""

    __tablename__ = "audit_checkpoints"

    size: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    head_hash: Mapped[str] = mapped_column(String(64))  # hash of row `size` in the chain
    at: Mapped[str] = mapped_column(String(32))
    key_fingerprint: Mapped[str] = mapped_column(String(64))
    signature: Mapped[bytes] = mapped_column(LargeBinary)
    root_hash: Mapped[str | None] = mapped_column(String(64), default=None)  # hex RFC 9162 MTH
    # The tree's compact range at `size` (merkle.CompactRange.dump()): the next head extends it. Not signed:
    # the signer checks it against `root_hash` before use.
    tree_state: Mapped[str | None] = mapped_column(Text, default=None)


class RequestNonce(Base):
    """A signed API request's nonce, kept while its timestamp is inside the window: a replay finds it here."""

    __tablename__ = "request_nonces"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    client: Mapped[str] = mapped_column(String(64))
    seen_at: Mapped[datetime] = mapped_column(index=True)


class Worker(Base):
    """A worker process as it reports itself: registered at start, its heartbeat renewed while it lives. A
    worker whose heartbeat is older than the heartbeat timeout, or that stopped, is gone: the documents it
    leased run elsewhere. Rows hold names, counts and content-free reasons only."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # documents.lease_owner of its leases
    node: Mapped[str] = mapped_column(String(200))  # its Celery node name (unique per worker on a host)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    device: Mapped[str | None] = mapped_column(String(64), default=None)
    queues: Mapped[str] = mapped_column(String(200), default="")
    concurrency: Mapped[int] = mapped_column(Integer, default=1)
    state: Mapped[str] = mapped_column(String(16))  # status.WorkerState
    reason: Mapped[str | None] = mapped_column(Text, default=None)  # why unhealthy or failed, content-free
    engine_loaded: Mapped[bool] = mapped_column(Boolean, default=False)
    in_flight: Mapped[int] = mapped_column(Integer, default=0)  # documents it works on now
    done: Mapped[int] = mapped_column(Integer, default=0)  # documents it finished, done or failed
    errors: Mapped[int] = mapped_column(Integer, default=0)  # documents it gave back after internal errors
    metrics_url: Mapped[str | None] = mapped_column(String(200), default=None)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)


class BrokerMarker(Base):
    """The marker last written into the broker: a broker that no longer holds it lost its messages (deleted,
    corrupted, restarted without persistence), and the open shards are dispatched again from the database."""

    __tablename__ = "broker_marker"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # always 1
    marker: Mapped[str] = mapped_column(String(64))
    set_at: Mapped[datetime] = mapped_column(default=utcnow)
