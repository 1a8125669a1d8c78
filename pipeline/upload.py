"""Storing a submitted job's sealed documents without holding up anyone else.

A submit claims its job id with status `uploading`, which workers, the sweeper and `store` ignore. It inserts
the documents in short transactions of at most CHUNK_ROWS rows or CHUNK_BYTES sealed bytes. Then one short
transaction queues the job with its signed manifest, marks its documents dispatched and appends its audit
event. The audit log's lock is taken only there, so other jobs keep progressing during a long upload, and a
SQLite writer never waits for more than one chunk.

The client chooses the job id, so a submit can be repeated safely:
- a job that is already queued (or further along) is returned as it is;
- one left `uploading` by a killed submit is taken over (its rows are cleared, then written again);
- another client's job is refused.

Every write checks the upload's token, so of two submits racing for one id the later owns it and the earlier
stops with an error.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pipeline import audit, store
from pipeline.db import Database
from pipeline.errors import UserError
from pipeline.models import Client, Document, Job, utcnow
from pipeline.status import DocState, JobState

CHUNK_ROWS = 500  # rows per insert transaction
CHUNK_BYTES = 16_000_000  # sealed bytes per insert transaction, and so held in memory at once
UPLOADING = JobState.UPLOADING


class UploadError(UserError, ValueError):
    """This submit cannot use the job id: not allow-listed, another client's job, or taken over."""


class Upload:
    """One submit's hold on its `uploading` job: `insert` chunks of document rows, then `finish`."""

    def __init__(self, db: Database, job_id: str, client: str, token: str, resumed: bool = False) -> None:
        self.db = db
        self.job_id = job_id
        self.client = client
        self.token = token
        self.resumed = resumed  # an interrupted upload was taken over (its rows were cleared)

    def insert(self, rows: list[dict[str, Any]], also: Callable[[Session], None] | None = None) -> None:
        """Store document rows (column name -> value) in one short transaction, with `also(session)` (its
        audit event) in the same transaction."""
        with self.db.transaction() as s:
            self._guard(s)
            if rows:
                s.execute(insert(Document.__table__), rows)
            if also is not None:
                also(s)

    def finish(
        self, manifest: str, signature: bytes, sealed_params: bytes, total: int, details: dict[str, Any]
    ) -> None:
        """Queue the job: manifest, sealed parameters, dispatch time and audit event in one short
        transaction."""
        with self.db.transaction() as s:
            values = {"manifest": manifest, "signature": signature, "sealed_params": sealed_params}
            self._guard(s, status=JobState.QUEUED, total=total, **values)
            s.execute(
                update(Document.__table__)
                .where(Document.job_id == self.job_id, Document.status == DocState.PENDING)
                .values(dispatched_at=utcnow())
            )
            audit.append(s, actor=self.client, action=audit.SUBMITTED, job_id=self.job_id, details=details)
            store.complete_job_if_finished(s, self.job_id, self.client)

    def clear(self) -> None:
        """Delete the rows a killed submit left, a chunk per transaction."""
        while True:
            with self.db.transaction() as s:
                self._guard(s)
                ids = s.scalars(
                    select(Document.id).where(Document.job_id == self.job_id).limit(CHUNK_ROWS)
                ).all()
                if not ids:
                    return
                s.execute(delete(Document.__table__).where(Document.id.in_(ids)))

    def _guard(self, session: Session, **values: Any) -> None:
        """Check this upload still owns the job, and lock its row (PostgreSQL) until the commit."""
        owned = session.execute(
            update(Job.__table__)
            .where(Job.id == self.job_id, Job.status == UPLOADING, Job.upload_token == self.token)
            .values(upload_token=None if values else self.token, **values)
        ).rowcount
        if not owned:
            raise UploadError(
                f"job {self.job_id} was taken over by another submit with the same job id; this one stopped"
            )


def begin(
    db: Database,
    job_id: str,
    client: str,
    kind: str,
    sealed_name: bytes | None,
    priority: int,
    on_claim: Callable[[Session, bool], None] | None = None,
) -> Upload | Job:
    """Claim `job_id` for a new upload by `client`, or return the job if it was already submitted.
    `sealed_name` is the job's name sealed to the client (`envelope.seal_job_name`), or None.
    `on_claim(session, resumed)` runs in the claim's transaction (its audit event) when the id is claimed."""
    token = uuid.uuid4().hex
    for attempt in range(2):
        try:
            with db.transaction() as s:
                claimed = _claim(s, job_id, client, token, kind, sealed_name, priority)
                if on_claim is not None and not isinstance(claimed, Job):
                    on_claim(s, claimed)
            break
        except IntegrityError:  # a concurrent submit created the same id first: take it over
            if attempt:
                raise
    if isinstance(claimed, Job):
        return claimed
    upload = Upload(db, job_id, client, token, resumed=claimed)
    if claimed:
        upload.clear()
    return upload


def _claim(
    session: Session,
    job_id: str,
    client: str,
    token: str,
    kind: str,
    sealed_name: bytes | None,
    priority: int,
) -> Job | bool:
    """The existing submitted job, or whether an interrupted upload was taken over (False: a new job)."""
    allowed = session.get(Client, client)
    if allowed is None or allowed.revoked_at is not None:
        raise UploadError(
            f"this client ({client[:16]}) is not on the service's allow-list: an "
            "administrator must run `enclave clients add NAME PUBLIC_FILE` with its public.json"
        )
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        session.add(
            Job(
                id=job_id,
                name="",
                sealed_name=sealed_name,
                kind=kind,
                client_fingerprint=client,
                priority=priority,
                status=UPLOADING,
                manifest="",
                signature=b"",
                total=0,
                upload_token=token,
            )
        )
        session.flush()
        return False
    if job.client_fingerprint != client:
        raise UploadError(f"job id {job_id} belongs to another client's job; submit with a new job id")
    if job.kind != kind:
        raise UploadError(f"job {job_id} is a {job.kind} job; submit a {kind} job with a new job id")
    if job.status != UPLOADING:
        return job
    job.sealed_name, job.priority, job.upload_token = sealed_name, priority, token
    return True
