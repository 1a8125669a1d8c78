"""Job and document state transitions. The database is the source of truth: documents are leased, and a
result is written once, in the same transaction that finishes its document, together with its audit event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.orm import Session

from pipeline import audit
from pipeline.models import TERMINAL_DOC, Document, Job, Result, utcnow

ACTIVE_JOB = ("queued", "running")


@dataclass(frozen=True)
class JobStatus:
    """A job's state and document counts, as `enclave status` reports them."""

    job_id: str
    name: str
    kind: str
    status: str
    priority: int
    total: int
    counts: dict[str, int] = field(default_factory=dict)
    created_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None

    @property
    def done(self) -> int:
        return self.counts.get("done", 0)

    @property
    def failed(self) -> int:
        return self.counts.get("failed", 0)

    def as_json(self) -> dict:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "priority": self.priority,
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "pending": self.counts.get("pending", 0) + self.counts.get("leased", 0),
            "cancelled": self.counts.get("cancelled", 0),
            "created_at": _iso(self.created_at),
            "finished_at": _iso(self.finished_at),
            "error": self.error,
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") + "Z" if value else None


def job_status(session: Session, job_id: str) -> JobStatus | None:
    job = session.get(Job, job_id)
    if job is None:
        return None
    rows = session.execute(
        select(Document.status, func.count()).where(Document.job_id == job_id).group_by(Document.status)
    ).all()
    return JobStatus(
        job.id,
        job.name,
        job.kind,
        job.status,
        job.priority,
        job.total,
        dict(rows),
        job.created_at,
        job.finished_at,
        job.error,
    )


def list_jobs(session: Session, limit: int = 100) -> list[JobStatus]:
    ids = session.scalars(select(Job.id).order_by(Job.created_at.desc()).limit(limit)).all()
    return [s for i in ids if (s := job_status(session, i)) is not None]


def lease(
    session: Session, job_id: str, shard: int, owner: str, lease_seconds: float, max_attempts: int
) -> tuple[list[Document], list[Document]]:
    """Lease the shard's pending (or expired) documents to `owner`, in one atomic UPDATE.

    Returns (leased, exhausted): documents now leased, and documents that already used `max_attempts`
    and must be failed by the caller.
    """
    now = utcnow()
    available = and_(
        Document.job_id == job_id,
        Document.shard == shard,
        or_(Document.status == "pending", and_(Document.status == "leased", Document.lease_until < now)),
    )
    # A concurrent worker's UPDATE of the same rows waits for this one, then re-checks the WHERE clause and
    # finds them leased: each document goes to exactly one lease holder.
    ids = session.scalars(
        update(Document)
        .where(available, Document.attempts < max_attempts)
        .values(
            status="leased",
            lease_owner=owner,
            lease_until=now + timedelta(seconds=lease_seconds),
            attempts=Document.attempts + 1,
        )
        .returning(Document.id)
    ).all()
    leased = session.scalars(select(Document).where(Document.id.in_(ids)).order_by(Document.index)).all()
    exhausted = session.scalars(select(Document).where(available, Document.attempts >= max_attempts)).all()
    return list(leased), list(exhausted)


def start_job(session: Session, job_id: str, actor: str) -> None:
    """queued -> running, once, with its audit event."""
    started = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(status="running", started_at=utcnow())
    ).rowcount
    if started:
        audit.append(session, actor=actor, action="started", job_id=job_id)


def finish_document(
    session: Session,
    doc_id: str,
    owner: str,
    status: str,
    sealed_result: bytes | None,
    error: str | None,
    actor: str,
    details: dict | None = None,
    complete: bool = True,
) -> bool:
    """Mark a leased document done or failed and store its sealed result, all or nothing.

    Returns False (and changes nothing) when `owner` no longer holds the lease: the document was finished
    by someone else or cancelled. With `complete`, also completes the job when this was its last document
    (pass False when finishing several documents in one transaction, then call complete_job_if_finished).
    """
    if status not in ("done", "failed"):
        raise ValueError(f"finish_document status must be done or failed, got {status!r}")
    job_id = session.scalars(
        update(Document)
        .where(Document.id == doc_id, Document.status == "leased", Document.lease_owner == owner)
        .values(status=status, error=error, lease_until=None)
        .returning(Document.job_id)
    ).first()
    if job_id is None:
        return False
    if sealed_result is not None:
        session.execute(insert(Result).values(document_id=doc_id, job_id=job_id, sealed=sealed_result))
    action = "document_done" if status == "done" else "document_failed"
    audit.append(
        session,
        actor=actor,
        action=action,
        job_id=job_id,
        document_id=doc_id,
        outcome="ok" if status == "done" else "error",
        details={"error": error, **(details or {})},
    )
    if complete:
        complete_job_if_finished(session, job_id, actor)
    return True


def fail_unopened(session: Session, doc: Document, error: str, actor: str) -> None:
    """Fail a document that will never be processed (attempts used up), without a result."""
    changed = session.execute(
        update(Document)
        .where(Document.id == doc.id, Document.status.in_(("pending", "leased")))
        .values(status="failed", error=error, lease_until=None)
    ).rowcount
    if changed:
        audit.append(
            session,
            actor=actor,
            action="document_failed",
            job_id=doc.job_id,
            document_id=doc.id,
            outcome="error",
            details={"error": error},
        )
        complete_job_if_finished(session, doc.job_id, actor)


def release(session: Session, doc_id: str, owner: str, error: str) -> None:
    """Give a lease back after a transient failure; the next lease retries (attempts already counted)."""
    session.execute(
        update(Document)
        .where(Document.id == doc_id, Document.status == "leased", Document.lease_owner == owner)
        .values(status="pending", error=error, lease_owner=None, lease_until=None, dispatched_at=None)
    )


def complete_job_if_finished(session: Session, job_id: str, actor: str) -> bool:
    """running/queued -> completed once every document is done or failed."""
    open_docs = select(Document.id).where(Document.job_id == job_id, Document.status.not_in(TERMINAL_DOC))
    completed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB), ~open_docs.exists())
        .values(status="completed", finished_at=utcnow())
    ).rowcount
    if completed:
        counts = dict(
            session.execute(
                select(Document.status, func.count())
                .where(Document.job_id == job_id)
                .group_by(Document.status)
            ).all()
        )
        audit.append(session, actor=actor, action="completed", job_id=job_id, details=counts)
    return bool(completed)


def cancel_job(session: Session, job_id: str, actor: str) -> bool:
    """Cancel a queued or running job: its unfinished documents are cancelled; finished ones keep results."""
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB))
        .values(status="cancelled", finished_at=utcnow())
    ).rowcount
    if not cancelled:
        return False
    n = session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.status.in_(("pending", "leased")))
        .values(status="cancelled", lease_owner=None, lease_until=None)
    ).rowcount
    audit.append(session, actor=actor, action="cancelled", job_id=job_id, details={"documents_cancelled": n})
    return True


def fail_job(session: Session, job_id: str, reason: str, actor: str) -> bool:
    """The job itself cannot run (e.g. a forged manifest): fail it and its unfinished documents."""
    failed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB))
        .values(status="failed", error=reason, finished_at=utcnow())
    ).rowcount
    if not failed:
        return False
    session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.status.in_(("pending", "leased")))
        .values(status="failed", error=f"job rejected: {reason}", lease_owner=None, lease_until=None)
    )
    audit.append(
        session, actor=actor, action="rejected", job_id=job_id, outcome="error", details={"reason": reason}
    )
    return True


def shards_to_dispatch(session: Session, lease_seconds: float) -> list[tuple[str, int]]:
    """(job, shard) pairs with work that no live task covers: expired leases, or pending documents whose
    dispatch is older than a lease (its message may be lost). Dispatching twice is harmless."""
    now = utcnow()
    stale = now - timedelta(seconds=lease_seconds)
    rows = session.execute(
        select(Document.job_id, Document.shard)
        .join(Job, Job.id == Document.job_id)
        .where(Job.status.in_(ACTIVE_JOB))
        .where(
            or_(
                and_(Document.status == "leased", Document.lease_until < now),
                and_(
                    Document.status == "pending",
                    or_(Document.dispatched_at.is_(None), Document.dispatched_at < stale),
                ),
            )
        )
        .distinct()
        .order_by(Document.job_id, Document.shard)
    ).all()
    return [(job_id, shard) for job_id, shard in rows]


def mark_dispatched(session: Session, job_id: str, shard: int) -> None:
    session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.shard == shard, Document.status.in_(("pending", "leased")))
        .values(dispatched_at=utcnow())
    )


def has_open_work(session: Session) -> bool:
    """Whether any active job still has a document that is not finished."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Document)
            .join(Job, Job.id == Document.job_id)
            .where(Job.status.in_(ACTIVE_JOB), Document.status.in_(("pending", "leased")))
        )
        > 0
    )
