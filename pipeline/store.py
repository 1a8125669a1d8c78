"""Job and document state transitions. The database is the source of truth: documents are leased, and a
result is written once, in the same transaction that finishes its document, together with its audit event.

Leases live while work lives: a worker's heartbeat renews the leases of the documents it works on
(`renew`), and a lease is taken over once it expires or its owner is gone (stopped, or silent for longer than
the heartbeat timeout: `pipeline.workers`).

Retries and crashes are counted apart. `attempts` counts the failures of the document itself (given back
after an error, or failed); `max_attempts` of them fail it for good. A lease that expires without a result
(the worker died or hung) is counted in `lease_expiries` instead and does not burn an attempt. So a document
that kills every worker still ends, `MAX_LEASE_EXPIRIES` expiries fail it as `worker_crashed`: ten, more
than any run of ordinary worker restarts or deploys, and few enough that a poisonous document stops
within ten lease periods.

Stored reasons (`documents.error`, `jobs.error`, audit details) are clipped to `MAX_REASON` characters, so
the audit log's length rule can never refuse the event of a failing document; what goes in them must be
content-free already (codes, JSON paths, offsets, sizes, counts).
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import and_, case, func, insert, not_, or_, select, update
from sqlalchemy.orm import Session

from pipeline import audit, workers
from pipeline.envelope import result_statement  # noqa: F401 (the worker signs it, the client checks it)
from pipeline.models import Document, Job, Result, utcnow
from pipeline.reasons import MAX_REASON, bounded  # noqa: F401 (store.bounded, store.MAX_REASON)
from pipeline.status import ACTIVE_JOB, OPEN_DOC, TERMINAL_DOC, DocState, JobState

MAX_LEASE_EXPIRIES = 10
WORKER_CRASHED = "worker_crashed"


def document_counts(session: Session, job_id: str) -> dict[str, int]:
    """The job's documents by status: {"done": 3, "pending": 1, ...} (statuses with none are absent)."""
    rows = session.execute(
        select(Document.status, func.count()).where(Document.job_id == job_id).group_by(Document.status)
    ).all()
    return {str(status): n for status, n in rows}


def _lapsed(now, heartbeat_timeout: float | None):
    """A leased document whose lease expired, or whose owner is gone (with a `heartbeat_timeout`)."""
    lapsed = Document.lease_until < now
    if heartbeat_timeout is not None:
        lapsed = or_(lapsed, Document.lease_owner.in_(workers.gone(heartbeat_timeout, now)))
    return and_(Document.status == DocState.LEASED, lapsed)


def lease(
    session: Session,
    job_id: str,
    shard: int,
    owner: str,
    lease_seconds: float,
    max_attempts: int,
    max_lease_expiries: int = MAX_LEASE_EXPIRIES,
    heartbeat_timeout: float | None = None,
) -> tuple[list[Document], list[Document]]:
    """Lease the shard's pending (or lapsed) documents to `owner`, in one atomic UPDATE.

    A lease lapses when it expires or, given `heartbeat_timeout`, when its owner is gone (`workers.gone`).
    Taking over a lapsed lease counts one more lease expiry, not an attempt. Returns (leased, exhausted):
    documents now leased, and documents that used `max_attempts` failures or `max_lease_expiries` expiries
    and must be failed by the caller (`give_up`).
    """
    now = utcnow()
    expired = _lapsed(now, heartbeat_timeout)
    available = and_(
        Document.job_id == job_id, Document.shard == shard, or_(Document.status == DocState.PENDING, expired)
    )
    # SET and WHERE both see the row as it was: status "leased" here means an expired lease taken over.
    expiries = Document.lease_expiries + case((Document.status == DocState.LEASED, 1), else_=0)
    leasable = and_(Document.attempts < max_attempts, expiries < max_lease_expiries)
    # A concurrent worker's UPDATE of the same rows waits for this one, then re-checks the WHERE clause and
    # finds them leased: each document goes to exactly one lease holder.
    ids = session.scalars(
        update(Document)
        .where(available, leasable)
        .values(
            status=DocState.LEASED,
            lease_owner=owner,
            lease_until=now + timedelta(seconds=lease_seconds),
            lease_expiries=expiries,
        )
        .returning(Document.id)
    ).all()
    leased = session.scalars(select(Document).where(Document.id.in_(ids)).order_by(Document.index)).all()
    exhausted = session.scalars(select(Document).where(available, not_(leasable))).all()
    return list(leased), list(exhausted)


def give_up(session: Session, doc: Document, max_attempts: int, actor: str) -> None:
    """Fail an exhausted document (see `lease`) with a reason saying which limit it reached."""
    if doc.attempts >= max_attempts:
        reason = f"gave up after {doc.attempts} failed attempts; the last: {doc.error or 'unknown'}"
    else:
        expiries = doc.lease_expiries + (doc.status == DocState.LEASED)
        reason = (
            f"{WORKER_CRASHED}: its lease expired {expiries} times without a result "
            "(a worker died or hung while processing it)"
        )
    fail_unopened(session, doc, reason, actor)


def start_job(session: Session, job_id: str, actor: str) -> None:
    """queued -> running, once, with its audit event."""
    started = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobState.QUEUED)
        .values(status=JobState.RUNNING, started_at=utcnow())
    ).rowcount
    if started:
        audit.append(session, actor=actor, action=audit.STARTED, job_id=job_id)


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
    signature: bytes | None = None,
) -> bool:
    """Mark a leased document done or failed and store its sealed result (with the service's `signature`
    over `result_statement`), all or nothing. `error` is clipped to `MAX_REASON` characters.

    Returns False (and changes nothing) when `owner` no longer holds the lease: the document was finished
    by someone else or cancelled. With `complete`, also completes the job when this was its last document
    (pass False when finishing several documents in one transaction, then call complete_job_if_finished).
    """
    if status not in (DocState.DONE, DocState.FAILED):
        raise ValueError(f"finish_document status must be done or failed, got {status!r}")
    error = bounded(error)
    job_id = session.scalars(
        update(Document)
        .where(Document.id == doc_id, Document.status == DocState.LEASED, Document.lease_owner == owner)
        .values(
            status=status,
            error=error,
            lease_until=None,
            attempts=Document.attempts + (1 if status == DocState.FAILED else 0),
        )
        .returning(Document.job_id)
    ).first()
    if job_id is None:
        return False
    if sealed_result is not None:
        session.execute(
            insert(Result).values(
                document_id=doc_id, job_id=job_id, sealed=sealed_result, signature=signature
            )
        )
    action = audit.DOCUMENT_DONE if status == DocState.DONE else audit.DOCUMENT_FAILED
    audit.append(
        session,
        actor=actor,
        action=action,
        job_id=job_id,
        document_id=doc_id,
        outcome="ok" if status == DocState.DONE else "error",
        details={"error": error, **(details or {})},
    )
    if complete:
        complete_job_if_finished(session, job_id, actor)
    return True


def fail_unopened(session: Session, doc: Document, error: str, actor: str) -> None:
    """Fail a document that will never be processed (limits used up), without a result."""
    error = bounded(error)
    changed = session.execute(
        update(Document)
        .where(Document.id == doc.id, Document.status.in_(OPEN_DOC))
        .values(status=DocState.FAILED, error=error, lease_until=None)
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


def renew(session: Session, owner: str, doc_ids: list[str], lease_seconds: float) -> int:
    """Extend `owner`'s leases on `doc_ids` (the documents it is working on) by `lease_seconds` from now: a
    heartbeat. Returns how many it renewed.

    On PostgreSQL, rows another transaction is writing are skipped, not waited for (FOR UPDATE SKIP LOCKED):
    mostly this worker's own recording of them (`finish_document`, whose transaction then queues for the
    audit lock), which finishes them or rolls back; the next beat renews those still leased. Waiting there
    made the beat one side of a deadlock with that recording (the renew locks its rows in one order, the
    recording one at a time in another), found only after PostgreSQL's deadlock_timeout (1 s), and queued it
    behind every worker's audit appends: under load beats stalled for longer than the lease, and other
    workers took over the leases of a live worker's documents (generated twice, counted as lease expiries)."""
    if not doc_ids:
        return 0
    held = (
        select(Document.id)
        .where(Document.id.in_(doc_ids), Document.status == DocState.LEASED, Document.lease_owner == owner)
        .with_for_update(skip_locked=True)
    )
    return session.execute(
        update(Document)
        .where(Document.id.in_(held))
        .values(lease_until=utcnow() + timedelta(seconds=lease_seconds))
    ).rowcount


def taken_over(session: Session, owner: str, doc_ids: list[str]) -> int:
    """How many of `doc_ids` another owner holds now (leased again after `owner` was taken for gone)."""
    if not doc_ids:
        return 0
    return session.scalar(
        select(func.count())
        .select_from(Document)
        .where(Document.id.in_(doc_ids), Document.status == DocState.LEASED, Document.lease_owner != owner)
    )


def abandon(session: Session, doc_ids: list[str], owner: str, reason: str, actor: str) -> int:
    """Fail `owner`'s leased documents that will get no result from it (a shard that ran past its hard time
    limit), each with `reason` and its audit event; the attempt counts. Returns how many it still held."""
    reason = bounded(reason)
    failed = session.execute(
        update(Document)
        .where(Document.id.in_(doc_ids), Document.status == DocState.LEASED, Document.lease_owner == owner)
        .values(status=DocState.FAILED, error=reason, lease_until=None, attempts=Document.attempts + 1)
        .returning(Document.id, Document.job_id)
    ).all()
    for doc_id, job_id in failed:
        audit.append(
            session,
            actor=actor,
            action=audit.DOCUMENT_FAILED,
            job_id=job_id,
            document_id=doc_id,
            outcome="error",
            details={"error": reason, "code": "time_limit"},
        )
    for job_id in {job_id for _, job_id in failed}:
        complete_job_if_finished(session, job_id, actor)
    return len(failed)


def release(session: Session, doc_id: str, owner: str, error: str) -> None:
    """Give a lease back after a failure that may be transient; it counts one attempt, and the next lease
    retries until `max_attempts`."""
    session.execute(
        update(Document)
        .where(Document.id == doc_id, Document.status == DocState.LEASED, Document.lease_owner == owner)
        .values(
            status=DocState.PENDING,
            error=bounded(error),
            attempts=Document.attempts + 1,
            lease_owner=None,
            lease_until=None,
            dispatched_at=None,
        )
    )


def complete_job_if_finished(session: Session, job_id: str, actor: str) -> bool:
    """running/queued -> completed once every document is done or failed."""
    open_docs = select(Document.id).where(Document.job_id == job_id, Document.status.not_in(TERMINAL_DOC))
    completed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB), ~open_docs.exists())
        .values(status=JobState.COMPLETED, finished_at=utcnow())
    ).rowcount
    if completed:
        counts = dict(
            session.execute(
                select(Document.status, func.count())
                .where(Document.job_id == job_id)
                .group_by(Document.status)
            ).all()
        )
        audit.append(session, actor=actor, action=audit.COMPLETED, job_id=job_id, details=counts)
    return bool(completed)


def cancel_job(session: Session, job_id: str, actor: str) -> bool:
    """Cancel a queued or running job: its unfinished documents are cancelled; finished ones keep results."""
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB))
        .values(status=JobState.CANCELLED, finished_at=utcnow())
    ).rowcount
    if not cancelled:
        return False
    n = session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.status.in_(OPEN_DOC))
        .values(status=DocState.CANCELLED, lease_owner=None, lease_until=None)
    ).rowcount
    audit.append(
        session, actor=actor, action=audit.CANCELLED, job_id=job_id, details={"documents_cancelled": n}
    )
    return True


def fail_job(session: Session, job_id: str, reason: str, actor: str) -> bool:
    """The job itself cannot run (e.g. a forged manifest): fail it and its unfinished documents."""
    reason = bounded(reason)
    failed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB))
        .values(status=JobState.FAILED, error=reason, finished_at=utcnow())
    ).rowcount
    if not failed:
        return False
    session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.status.in_(OPEN_DOC))
        .values(status=DocState.FAILED, error=f"job rejected: {reason}", lease_owner=None, lease_until=None)
    )
    audit.append(
        session,
        actor=actor,
        action=audit.REJECTED,
        job_id=job_id,
        outcome="error",
        details={"reason": reason},
    )
    return True


def shards_to_dispatch(
    session: Session, lease_seconds: float, heartbeat_timeout: float | None = None
) -> list[tuple[str, int]]:
    """(job, shard) pairs with work that no live task covers: lapsed leases (expired, or held by a gone
    worker), or pending documents never dispatched or whose dispatch is older than a lease (its message may be
    lost). Dispatching twice is harmless."""
    now = utcnow()
    stale = now - timedelta(seconds=lease_seconds)
    rows = session.execute(
        select(Document.job_id, Document.shard)
        .join(Job, Job.id == Document.job_id)
        .where(Job.status.in_(ACTIVE_JOB))
        .where(
            or_(
                _lapsed(now, heartbeat_timeout),
                and_(
                    Document.status == DocState.PENDING,
                    or_(Document.dispatched_at.is_(None), Document.dispatched_at < stale),
                ),
            )
        )
        .distinct()
        .order_by(Document.job_id, Document.shard)
    ).all()
    return [(job_id, shard) for job_id, shard in rows]


def open_shards(session: Session) -> list[tuple[str, int]]:
    """Every (job, shard) of an active job with a document not finished: what a broker that lost its
    messages must be told again."""
    rows = session.execute(
        select(Document.job_id, Document.shard)
        .join(Job, Job.id == Document.job_id)
        .where(Job.status.in_(ACTIVE_JOB), Document.status.in_(OPEN_DOC))
        .distinct()
        .order_by(Document.job_id, Document.shard)
    ).all()
    return [(job_id, shard) for job_id, shard in rows]


def ended_jobs(session: Session, job_ids: list[str]) -> list[str]:
    """Which of `job_ids` are no longer active (cancelled, or failed as a whole): their work should stop."""
    if not job_ids:
        return []
    return list(
        session.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.status.not_in(ACTIVE_JOB))).all()
    )


def mark_dispatched(session: Session, job_id: str, shard: int) -> None:
    """Stamp the shard's pending documents as dispatched now. Only theirs: `shards_to_dispatch` reads no
    leased document's stamp, and writing one would lock a live worker's rows, which its heartbeat then skips
    (`renew`) for as long as this transaction lasts."""
    session.execute(
        update(Document)
        .where(Document.job_id == job_id, Document.shard == shard, Document.status == DocState.PENDING)
        .values(dispatched_at=utcnow())
    )


def has_open_work(session: Session) -> bool:
    """Whether any active job still has a document that is not finished."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Document)
            .join(Job, Job.id == Document.job_id)
            .where(Job.status.in_(ACTIVE_JOB), Document.status.in_(OPEN_DOC))
        )
        > 0
    )
