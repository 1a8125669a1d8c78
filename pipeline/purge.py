"""Retention: purging a job removes its ciphertext and results, keeps its audit trail, and is audited itself.

What goes: the job's results (sealed to its submitter), its documents (the sealed bytes and names, hashes,
sizes and states) and its sealed name and parameters. What stays: the job's row (id, kind, owner, counts,
times, the signed manifest: document ids and ciphertext hashes, nothing sealed) with `purged_at`, and the
audit log, untouched (its rows name jobs and documents by id only, so its chain and checkpoints verify as
before), plus one `purged` event that names the administrator and the counts.

Only ended jobs are purged (completed, cancelled, failed), and uploads abandoned before the cut-off. On SQLite
the deletion runs with `secure_delete` (freed pages are zeroed) and the write-ahead log is checkpointed and
truncated afterwards, so no ciphertext lingers in the files; PostgreSQL frees the rows' space at its next
VACUUM (autovacuum), and `VACUUM FULL` rewrites the tables at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, or_, select, text, update
from sqlalchemy.orm import Session

from pipeline import audit
from pipeline.db import Database
from pipeline.models import Document, Job, Result, utcnow
from pipeline.status import JobState

log = logging.getLogger("enclave.purge")
ENDED = (JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED)


class PurgeRefused(ValueError):
    """The job cannot be purged now (still running, or still uploading); one line that says what to do."""


@dataclass(frozen=True)
class Purged:
    """One purged job: how many documents and results were deleted."""

    job_id: str
    documents: int
    results: int


def purge_job(db: Database, job_id: str, actor: str) -> Purged:
    """Purge one job (the caller resolved its id); a job purged before purges nothing more."""
    with db.transaction() as s:
        job = s.get(Job, job_id)
        if job.status not in ENDED and job.purged_at is None:
            what = "cancel it first" if job.status != JobState.UPLOADING else "its upload has not ended"
            raise PurgeRefused(f"job {job.id} is {job.status}: {what} (or purge it later with --older-than)")
        purged = _purge(s, job, actor, {"rule": "job"})
    _scrub(db)
    return purged


def purge_older_than(db: Database, seconds: float, actor: str) -> list[Purged]:
    """Purge every job that ended more than `seconds` ago, and every upload abandoned that long ago; one
    transaction and one audit event per job."""
    cutoff = utcnow() - timedelta(seconds=seconds)
    with db.transaction() as s:
        ids = s.scalars(select(Job.id).where(_older(cutoff)).order_by(Job.created_at)).all()
    done = []
    for job_id in ids:
        with db.transaction() as s:
            job = s.scalars(select(Job).where(Job.id == job_id, _older(cutoff))).first()
            if job is None:
                continue  # changed since it was listed
            done.append(_purge(s, job, actor, {"rule": "older_than", "older_than_s": int(seconds)}))
    if done:
        _scrub(db)
    return done


def _older(cutoff: datetime):
    return (Job.purged_at.is_(None)) & or_(
        Job.status.in_(ENDED) & (Job.finished_at < cutoff),
        (Job.status == JobState.UPLOADING) & (Job.created_at < cutoff),
    )


def _purge(session: Session, job: Job, actor: str, rule: dict) -> Purged:
    if job.purged_at is not None:
        return Purged(job.id, 0, 0)
    if session.get_bind().dialect.name == "sqlite":
        session.execute(text("PRAGMA secure_delete = ON"))  # deleted pages are zeroed, not left in the file
    counts = dict(
        session.execute(
            select(Document.status, func.count()).where(Document.job_id == job.id).group_by(Document.status)
        ).all()
    )
    results = session.execute(delete(Result).where(Result.job_id == job.id)).rowcount
    documents = session.execute(delete(Document).where(Document.job_id == job.id)).rowcount
    session.execute(
        update(Job)
        .where(Job.id == job.id)
        .values(sealed_name=None, sealed_params=None, upload_token=None, purged_at=utcnow())
    )
    details = {**rule, "status": str(job.status), "documents": documents, "results": results}
    details["by_status"] = {str(k): v for k, v in counts.items()}
    audit.append(session, actor=actor, action=audit.PURGED, job_id=job.id, details=details)
    log.info("job %s purged: %d documents, %d results", job.id, documents, results)
    return Purged(job.id, documents, results)


def _scrub(db: Database) -> None:
    """SQLite: fold the write-ahead log into the file and truncate it, so deleted pages are gone from both."""
    if db.engine.dialect.name != "sqlite":
        return
    raw = db.engine.raw_connection()
    try:
        busy = raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
    finally:
        raw.close()
    if busy:
        log.warning("the write-ahead log was not truncated now (a reader holds it); SQLite does it later")
