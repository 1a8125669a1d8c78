"""A client's own jobs, on the service side: the chunked submit (claim, documents, queue), list, status,
cancel and results pages; and telling the workers about a queued job's shards.

A job is another client's or nobody's alike: both answer 404, so a client learns nothing of others' jobs.
Every change is audited with the authenticated client as actor.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs import KINDS
from pipeline import audit, envelope, store, upload, workers
from pipeline.api.auth import Caller
from pipeline.api.errors import ApiError, conflict, malformed, not_found
from pipeline.db import Database
from pipeline.models import Document, Job, Result
from pipeline.settings import Settings
from pipeline.status import ACTIVE_JOB, DocState, JobState
from pipeline.wire import messages as m

log = logging.getLogger("enclave.api")
EMPTY_SHA256 = envelope.sha256_hex(b"")
MAX_PAGE_BYTES = 8 * 2**20  # sealed result bytes in one results page


def job_info(session: Session, job: Job) -> m.JobInfo:
    return m.JobInfo(
        job_id=job.id,
        kind=job.kind,
        status=job.status,
        priority=job.priority,
        total=job.total,
        counts=store.document_counts(session, job.id),
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        purged_at=job.purged_at,
        error=job.error,
        name=job.name,
        sealed_name=job.sealed_name,
    )


class Dispatcher:
    """Sends shard messages through one Celery app, made on first use (an in-process API that only reads
    never imports Celery's broker code)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._app = None

    def dispatch(self, job_id: str, shards: list[int], priority: int) -> bool:
        """Tell the workers; False when the broker is unreachable (the job stays queued and the sweeper
        dispatches it)."""
        from pipeline.celery_app import make_celery
        from pipeline.dispatch import dispatch_shard

        if self._app is None:
            self._app = make_celery(self.settings)
            self._app.conf.task_publish_retry_policy = {
                "max_retries": 2,
                "interval_start": 0.2,
                "interval_step": 0.5,
            }
        try:
            for shard in shards:
                dispatch_shard(self._app, job_id, shard, priority)
        except Exception as exc:
            log.warning(
                "job %s: broker unreachable (%s); the sweeper will dispatch it", job_id, type(exc).__name__
            )
            return False
        return True

    def close(self) -> None:
        if self._app is not None:
            self._app.close()


class Jobs:
    """The job routes' operations for an authenticated caller."""

    def __init__(self, db: Database, settings: Settings, dispatcher: Dispatcher) -> None:
        self.db = db
        self.settings = settings
        self.dispatcher = dispatcher

    def begin(self, caller: Caller, request: m.BeginUpload) -> m.UploadClaim:
        job_id = _job_id(request.job_id)
        if request.kind not in KINDS:
            raise malformed(f"unknown kind (known: {', '.join(sorted(KINDS))})")

        def audited(session: Session, resumed: bool) -> None:
            details = {"kind": request.kind, "resumed": resumed}
            self._audit(session, caller, audit.UPLOAD_STARTED, job_id, details)

        try:
            claimed = upload.begin(
                self.db,
                job_id,
                caller.fingerprint,
                request.kind,
                request.sealed_name,
                request.priority,
                on_claim=audited,
            )
        except upload.UploadError as exc:
            raise conflict(str(exc)) from None
        if isinstance(claimed, Job):
            with self.db.transaction() as s:
                return m.UploadClaim(state="existing", job=job_info(s, s.get(Job, job_id)))
        return m.UploadClaim(state="resumed" if claimed.resumed else "new", token=claimed.token)

    def add_documents(self, caller: Caller, job_id: str, chunk: m.DocumentChunk) -> m.ChunkStored:
        job_id = _job_id(job_id)
        rows = [self._row(job_id, doc) for doc in chunk.documents]
        target = upload.Upload(self.db, job_id, caller.fingerprint, chunk.token)
        details = {"documents": len(rows), "indexes": [rows[0]["index"], rows[-1]["index"]] if rows else []}
        try:
            target.insert(rows, lambda s: self._audit(s, caller, audit.DOCUMENTS_STORED, job_id, details))
        except upload.UploadError as exc:
            raise conflict(str(exc)) from None
        except IntegrityError:
            raise conflict(f"job {job_id}: a document id or index was sent twice") from None
        return m.ChunkStored(stored=len(rows))

    def _row(self, job_id: str, doc: m.DocumentRow) -> dict:
        try:
            doc_id = str(uuid.UUID(doc.id))
        except ValueError:
            raise malformed("a document id must be a UUID") from None
        row = {
            "id": doc_id,
            "job_id": job_id,
            "index": doc.index,
            "sealed_name": doc.sealed_name,
            "size": doc.size,
        }
        if doc.sealed is None:
            if not doc.error or doc.sha256 != EMPTY_SHA256:
                raise malformed(f"document {doc.index} has no sealed content and no reason it failed")
            reason = store.bounded(" ".join(doc.error.split()))
            return row | {
                "shard": -1,
                "sealed": None,
                "sha256": EMPTY_SHA256,
                "status": DocState.FAILED,
                "error": reason,
            }
        if envelope.sha256_hex(doc.sealed) != doc.sha256:
            raise malformed(f"document {doc.index}: its sealed bytes do not match its sha256")
        shard = doc.index // self.settings.limits.shard_size
        return row | {
            "shard": shard,
            "sealed": doc.sealed,
            "sha256": doc.sha256,
            "status": DocState.PENDING,
            "error": None,
        }

    def finish(self, caller: Caller, job_id: str, request: m.FinishUpload) -> m.Submitted:
        """Check the manifest's signature and fields against the stored upload, queue the job and tell the
        workers about each shard with work."""
        job_id = _job_id(job_id)
        try:
            manifest = envelope.verify_manifest(request.manifest, request.signature, caller.public)
        except envelope.ManifestError as exc:
            raise ApiError(400, "bad_manifest", f"the job's manifest is refused: {exc}") from None
        if manifest["version"] != envelope.MANIFEST_VERSION:
            raise ApiError(
                400, "bad_manifest", f"a new job's manifest must be version {envelope.MANIFEST_VERSION}"
            )
        if manifest["params_sha256"] != envelope.sha256_hex(request.sealed_params):
            raise ApiError(
                400, "bad_manifest", "the sealed parameters do not match the manifest's params_sha256"
            )
        with self.db.transaction() as s:
            job = s.get(Job, job_id)
            if job is None or job.client_fingerprint != caller.fingerprint:
                raise not_found(job_id)
            if manifest["job_id"] != job_id or manifest["kind"] != job.kind:
                raise ApiError(400, "bad_manifest", "the manifest belongs to another job")
            counts = store.document_counts(s, job_id)
        total = sum(counts.values())
        if total != len(manifest["documents"]):
            raise ApiError(
                400,
                "bad_manifest",
                f"the manifest lists {len(manifest['documents'])} documents; {total} were stored",
            )
        rejected = counts.get(DocState.FAILED, 0)
        details = {"kind": job.kind, "documents": total, "rejected_at_submit": rejected}
        target = upload.Upload(self.db, job_id, caller.fingerprint, request.token)
        try:
            target.finish(request.manifest, request.signature, request.sealed_params, total, details)
        except upload.UploadError as exc:
            raise conflict(str(exc)) from None
        with self.db.transaction() as s:
            shards = s.scalars(
                select(Document.shard)
                .where(Document.job_id == job_id, Document.status == DocState.PENDING)
                .distinct()
                .order_by(Document.shard)
            ).all()
        dispatched = self.dispatcher.dispatch(job_id, list(shards), job.priority) if shards else True
        return m.Submitted(
            job_id=job_id, kind=job.kind, documents=total, rejected=rejected, dispatched=dispatched
        )

    def list_jobs(self, caller: Caller, limit: int) -> m.JobList:
        with self.db.transaction() as s:
            jobs = s.scalars(
                select(Job)
                .where(Job.client_fingerprint == caller.fingerprint)
                .order_by(Job.created_at.desc(), Job.id)
                .limit(limit)
            ).all()
            return m.JobList(jobs=[job_info(s, job) for job in jobs])

    def status(self, caller: Caller, ref: str) -> m.JobInfo:
        with self.db.transaction() as s:
            info = job_info(s, self._own(s, caller, ref))
            info.workers = workers.alive(s, self.settings.worker.heartbeat_timeout)
            return info

    def cancel(self, caller: Caller, ref: str) -> m.Cancelled:
        with self.db.transaction() as s:
            job = self._own(s, caller, ref)
            if job.status == JobState.UPLOADING:
                raise conflict(
                    f"job {job.id} is still uploading: submit it again with --job-id {job.id}, then cancel"
                )
            cancelled = store.cancel_job(s, job.id, caller.fingerprint)
            s.refresh(job)
            return m.Cancelled(cancelled=cancelled, job=job_info(s, job))

    def results(
        self, caller: Caller, ref: str, after: int | None, limit: int, partial: bool
    ) -> m.ResultsPage:
        """One page of the job's results, after document index `after` (from the start when None: that first
        page is the fetch's audit event)."""
        with self.db.transaction() as s:
            job = self._own(s, caller, ref)
            info = job_info(s, job)
            if job.status == JobState.UPLOADING:
                raise conflict(
                    f"job {job.id} is still uploading: its submit did not finish; submit it again with "
                    f"--job-id {job.id}"
                )
            if job.purged_at is not None:
                raise ApiError(
                    410, "purged", f"job {job.id} was purged: its documents and results were deleted"
                )
            if job.status in ACTIVE_JOB and not partial:
                raise conflict(
                    f"job {job.id} is still {job.status} ({info.done + info.failed}/{info.total} documents "
                    "finished); wait for it, or pass --partial"
                )
            # The columns a page needs, never the documents' own ciphertext, a row at a time.
            query = (
                select(
                    Document.index,
                    Document.id,
                    Document.status,
                    Document.error,
                    Document.sealed_name,
                    Result.sealed,
                    Result.signature,
                )
                .outerjoin(Result, Result.document_id == Document.id)
                .where(Document.job_id == job.id, Document.index > (-1 if after is None else after))
                .order_by(Document.index)
                .limit(limit + 1)
            )
            rows, size = [], 0
            for index, doc_id, status, error, sealed_name, sealed, signature in s.execute(query):
                if len(rows) == limit or (rows and size + len(sealed or b"") > MAX_PAGE_BYTES):
                    break
                size += len(sealed or b"")
                rows.append(
                    m.ResultRow(
                        index=index,
                        document_id=doc_id,
                        status=status,
                        error=error,
                        sealed_name=sealed_name,
                        sealed=sealed,
                        signature=signature,
                    )
                )
            more = bool(rows) and s.scalar(
                select(
                    select(Document.id)
                    .where(Document.job_id == job.id, Document.index > rows[-1].index)
                    .exists()
                )
            )
            if after is None:
                results = s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job.id))
                details = {"documents": job.total, "results": results}
                self._audit(s, caller, audit.RESULTS_FETCHED, job.id, details)
        next_after = rows[-1].index if rows and more else None
        return m.ResultsPage(job=info, results=rows, next_after=next_after)

    def _own(self, session: Session, caller: Caller, ref: str) -> Job:
        """The caller's job `ref` (its id, or a unique prefix of it); 404 for another client's."""
        ref = ref.strip().lower()
        if not ref or len(ref) > 36:
            raise not_found(ref[:36])
        matches = session.scalars(
            select(Job)
            .where(Job.client_fingerprint == caller.fingerprint, Job.id.startswith(ref, autoescape=True))
            .limit(2)
        ).all()
        exact = [j for j in matches if j.id == ref]
        if exact:
            return exact[0]
        if not matches:
            raise not_found(ref)
        if len(matches) > 1:
            raise ApiError(400, "ambiguous_job", f"{ref} matches several jobs; give more of the id")
        return matches[0]

    @staticmethod
    def _audit(session: Session, caller: Caller, action: str, job_id: str, details: dict) -> None:
        audit.append(session, actor=caller.fingerprint, action=action, job_id=job_id, details=details)


def _job_id(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise malformed("a job id must be a UUID") from None
