"""The workstation side: seal and submit documents, and open results. Plaintext stays in this process."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from jobs import make_kind
from jobs.base import INVALID_REQUEST
from jobs.openai_batch import BadLine, BatchFileError, read_batch_file
from jobs.scan import GitBlob, GitError, ScanOptions, scan_folder
from jobs.scan_record import ScanRecord
from pipeline import audit, envelope, keys, scan_records, store, upload
from pipeline.celery_app import make_celery
from pipeline.db import Database
from pipeline.models import Document, Job, Result
from pipeline.settings import Settings
from pipeline.tasks import dispatch_shard

EMPTY_SHA256 = envelope.sha256_hex(b"")
NAME_NOT_UNICODE = "the file name is not valid UTF-8; rename the file and submit it again"
MAX_JOB_NAME = 200  # characters of `--name`


class ClientError(ValueError):
    """A user error on the client side (bad path, unknown job, job of another client...)."""


class UnknownJob(ClientError):
    """This client has no such job: none by that id, or another client's (which it may not see)."""


@dataclass
class Submitted:
    job_id: str
    kind: str
    documents: int
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) failed at submit
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) not submitted at all
    dispatched: bool = True
    existing: bool = False  # the job id was already submitted: that job is returned, nothing was stored


@dataclass(frozen=True)
class NewDocument:
    """One document to seal and store; `data` None means it fails at submit, for the reason `error`."""

    name: str
    data: bytes | None
    size: int
    error: str | None = None


class ClientSession:
    """A client identity, the service's public key and the database."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.identity = keys.load_identity(settings.client_key_dir, settings.passphrase("client"))
        self.service = keys.load_public(settings.service_key_dir)
        self.db = Database(settings.database_url)

    @property
    def fingerprint(self) -> str:
        return self.identity.public.fingerprint

    def close(self) -> None:
        self.db.dispose()


def collect_files(
    paths: list[Path], kind: str, options: ScanOptions | None = None
) -> tuple[list[tuple[str, Path | GitBlob]], list[tuple[str, str]], ScanRecord | None]:
    """(document path, file) pairs for the given files and folders, what was skipped, and for code-review
    the scan record (else None).

    A file keeps its name; files in a folder are named relative to it (prefixed with the folder's name when
    several folders are given). Folders for code-review are scanned with `options` (`jobs.scan`: git's
    tracked files, or the folder walked honouring .gitignore); a file named on its own is always sent.
    """
    record = ScanRecord() if kind == "code-review" else None
    found: list[tuple[str, Path | GitBlob]] = []
    skipped: list[tuple[str, str]] = []
    folders = [p for p in paths if p.is_dir()]
    for path in paths:
        if not path.exists():
            raise ClientError(f"{path} does not exist")
        if path.is_file():
            found.append((path.name, path))
            continue
        prefix = f"{path.name}/" if len(folders) > 1 else ""
        if record is not None:
            try:
                repo = scan_folder(path, options)
            except GitError as exc:
                raise ClientError(str(exc)) from None
            found += [(prefix + rel, source) for rel, source in repo.files]
            skipped += [(prefix + rel, why) for rel, why in repo.skipped]
            record.sources.append(repo.source.model_copy(update={"name_prefix": prefix}))
        else:
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
                rel = file.relative_to(path)
                if any(part.startswith(".") for part in rel.parts):
                    continue
                found.append((prefix + rel.as_posix(), file))
    if dupes := sorted(n for n, times in Counter(name for name, _ in found).items() if times > 1):
        raise ClientError(f"two documents would both be named {dupes[0]!r}; submit them separately")
    if not found:
        raise ClientError("no documents to submit")
    if record is not None:
        record.skipped = skipped
    return found, skipped, record


def new_job_id() -> str:
    """A fresh job id, for a submit that can be repeated with the same id (`--job-id`)."""
    return str(uuid.uuid4())


def submit_files(
    session: ClientSession,
    paths: list[Path],
    kind: str,
    params: dict,
    name: str = "",
    priority: int = 0,
    job_id: str | None = None,
    announce: Callable[[str], None] | None = None,
) -> Submitted:
    """Seal the files under `paths` and store them as job `job_id` (default: a new id); workers are told by
    shard id. `announce(job_id)` is called once the job is claimed, before the first document is stored; a
    code-review job's scan record is stored then too (`pipeline.scan_records`)."""
    job_kind = make_kind(kind, params)  # validates before anything is read or stored
    files, skipped, scan = collect_files(paths, kind, ScanOptions.from_params(job_kind.params))
    documents = _read_files(files, session.settings.limits.max_document_bytes)

    def claimed(job: str) -> None:
        if scan is not None:
            scan_records.save(session.settings.home, session.identity, job, scan)
        if announce is not None:
            announce(job)

    result = _store(session, job_kind.name, job_kind.params, documents, name, priority, job_id, claimed)
    result.skipped = skipped
    return result


def submit_openai_batch(
    session: ClientSession,
    file: Path | bytes,
    name: str = "",
    priority: int = 0,
    job_id: str | None = None,
    announce: Callable[[str], None] | None = None,
) -> Submitted:
    """Store an OpenAI batch file (a path, or the file's bytes: the gateway holds them in memory only) as a
    `chat` job, one document per line. A malformed line fails alone at submit (named by its custom_id, else
    `line N`; its reason is content-free, with its code); a file without requests, or with a custom_id used
    twice (OpenAI refuses those), is refused whole. The file's name is not sent: only `name`, sealed."""
    if isinstance(file, Path) and not file.is_file():
        raise ClientError(f"{file} is not a file")
    lines = read_batch_file(file.read_bytes() if isinstance(file, Path) else file)
    if dupes := [f"line {x.line_no}: {x.problem}" for x in lines if isinstance(x, BadLine) and x.duplicate]:
        raise BatchFileError(dupes)
    if not lines:
        raise BatchFileError(["the file has no requests"])
    job_kind = make_kind("chat", {})
    documents = (_batch_document(line) for line in lines)
    return _store(session, job_kind.name, job_kind.params, documents, name, priority, job_id, announce)


def _batch_document(line) -> NewDocument:
    if isinstance(line, BadLine):
        reason = store.bounded(f"{INVALID_REQUEST}: line {line.line_no}: {line.problem}")
        return NewDocument(line.custom_id or f"line {line.line_no}", None, len(line.raw), reason)
    return NewDocument(line.custom_id, line.raw, len(line.raw))


def _read_files(files: list[tuple[str, Path | GitBlob]], limit: int) -> Iterator[NewDocument]:
    """Each file as a document, read only when its turn comes (memory holds one file at a time)."""
    for doc_name, file in files:
        size = file.stat().st_size
        if size > limit:
            yield NewDocument(doc_name, None, size, f"document is {size} bytes; the limit is {limit}")
        else:
            yield NewDocument(doc_name, file.read_bytes(), size)


def _store(
    session: ClientSession,
    kind: str,
    params: dict,
    documents: Iterable[NewDocument],
    name: str,
    priority: int,
    job_id: str | None,
    announce: Callable[[str], None] | None,
) -> Submitted:
    """Claim the job id, store the documents chunk by chunk, then queue the job and tell the workers."""
    job_id = _checked_job_id(job_id)
    client_key, service_key = session.identity.public.x25519, session.service.x25519
    try:
        sealed_params = envelope.seal_params(params, service_key, job_id)
        sealed_name = envelope.seal_job_name(name[:MAX_JOB_NAME], client_key, job_id) if name else None
    except (UnicodeEncodeError, ValueError, TypeError):
        raise ClientError("the job's name or parameters are not valid Unicode text") from None
    try:
        claimed = upload.begin(session.db, job_id, session.fingerprint, kind, sealed_name, priority)
        if isinstance(claimed, Job):
            return Submitted(job_id, claimed.kind, claimed.total, existing=True)
        if announce is not None:
            announce(job_id)
        entries, rejected, shards = _upload(session, claimed, documents)
        manifest = {
            "version": envelope.MANIFEST_VERSION,
            "job_id": job_id,
            "kind": kind,
            "params_sha256": envelope.sha256_hex(sealed_params),
            "client": session.fingerprint,
            "documents": entries,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        signature = envelope.sign_manifest(manifest, session.identity)
        details = {"kind": kind, "documents": len(entries), "rejected_at_submit": len(rejected)}
        claimed.finish(
            envelope.canonical_json(manifest).decode(), signature, sealed_params, len(entries), details
        )
    except upload.UploadError as exc:
        raise ClientError(str(exc)) from None
    dispatched = _dispatch(session.settings, job_id, sorted(shards), priority)
    return Submitted(job_id, kind, len(entries), rejected, dispatched=dispatched)


def _upload(
    session: ClientSession, target: upload.Upload, documents: Iterable[NewDocument]
) -> tuple[list[dict], list[tuple[str, str]], set[int]]:
    """Seal and insert every document; returns the manifest entries, the refused (name, reason) pairs and
    the shards that have work. Sealed bytes are held for one chunk at a time."""
    entries, rejected, shards = [], [], set()
    chunk, chunk_bytes = [], 0
    for index, doc in enumerate(documents):
        row = _sealed_row(session, target.job_id, index, doc)
        entries.append({"id": row["id"], "sha256": row["sha256"]})
        if row["status"] == "failed":
            rejected.append((_printable(doc.name), row["error"]))
        else:
            shards.add(row["shard"])
        chunk.append(row)
        chunk_bytes += len(row["sealed"] or b"")
        if len(chunk) >= upload.CHUNK_ROWS or chunk_bytes >= upload.CHUNK_BYTES:
            target.insert(chunk)
            chunk, chunk_bytes = [], 0
    if chunk:
        target.insert(chunk)
    return entries, rejected, shards


def _sealed_row(session: ClientSession, job_id: str, index: int, doc: NewDocument) -> dict:
    """The `documents` row of one document: its content sealed to the service, its name to this client.

    A document that cannot be sent (too large, a name that is not Unicode) fails alone, with a content-free
    reason, and takes no shard."""
    doc_id = str(uuid.uuid4())
    sealed_name = envelope.seal_name(_printable(doc.name), session.identity.public.x25519, job_id, doc_id)
    error = doc.error if doc.error is not None or _is_unicode(doc.name) else NAME_NOT_UNICODE
    row = {"id": doc_id, "job_id": job_id, "index": index, "sealed_name": sealed_name, "size": doc.size}
    if error is not None or doc.data is None:
        return row | {"shard": -1, "sealed": None, "sha256": EMPTY_SHA256, "status": "failed", "error": error}
    packed = envelope.pack_document(doc.name, doc.data)
    sealed = envelope.seal_document(packed, session.service.x25519, job_id, doc_id)
    digest = envelope.sha256_hex(sealed)
    shard = index // session.settings.limits.shard_size
    return row | {"shard": shard, "sealed": sealed, "sha256": digest, "status": "pending", "error": None}


def _is_unicode(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of a file name, kept by Python as lone surrogates
        return False
    return True


def _printable(name: str) -> str:
    """`name` as valid Unicode: bytes of a file name that are not UTF-8 show as \\xNN."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no file-name byte (from JSON, say)
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _checked_job_id(job_id: str | None) -> str:
    if job_id is None:
        return new_job_id()
    try:
        return str(uuid.UUID(job_id))
    except ValueError:
        raise ClientError(f"a job id must be a UUID, such as {new_job_id()}") from None


def _dispatch(settings: Settings, job_id: str, shards: list[int], priority: int) -> bool:
    """Tell the workers; if the broker is unreachable the job stays stored and the sweeper dispatches it."""
    if not shards:
        return True
    app = make_celery(settings)
    app.conf.task_publish_retry_policy = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5}
    try:
        for shard in shards:
            dispatch_shard(app, job_id, shard, priority)
    except Exception:
        return False
    finally:
        app.close()
    return True


def job_status(session: ClientSession, job_id: str) -> store.JobStatus:
    """This client's job `job_id`: its status and document counts. `UnknownJob` when there is no such job,
    or it is another client's."""
    with session.db.transaction() as s:
        _own_job(s, session, job_id)
        return store.job_status(s, job_id)


def cancel_job(session: ClientSession, job_id: str) -> bool:
    """Cancel this client's queued or running job (documents already finished keep their results); False
    when the job had already ended. `UnknownJob` when there is no such job, or it is another client's."""
    with session.db.transaction() as s:
        _own_job(s, session, job_id)
        return store.cancel_job(s, job_id, session.fingerprint)


def _own_job(s, session: ClientSession, job_id: str) -> Job:
    job = s.get(Job, job_id)
    if job is None:
        raise UnknownJob(f"no job {job_id}")
    if job.client_fingerprint != session.fingerprint:
        raise UnknownJob(f"job {job_id} was submitted by another client; only its submitter can see it")
    return job


def fetch_results(session: ClientSession, job_id: str, partial: bool = False) -> tuple[Job, list[dict]]:
    """Open the job's results with the client key: one record per document, in submission order.

    Each result must carry the service's signature over (job, document, hash of the sealed bytes, status),
    checked against the service key this client holds. A result that fails the check (forged, re-sealed,
    copied from another document, unsigned) is not opened: its record has status "refused" and an error
    naming the document; the other documents are opened as usual.
    """
    with session.db.transaction() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise ClientError(f"no job {job_id}")
        if job.client_fingerprint != session.fingerprint:
            raise ClientError(f"job {job_id} was submitted by another client; only its submitter can open it")
        if job.status == upload.UPLOADING:
            raise ClientError(
                f"job {job_id} is still uploading: its submit did not finish; submit it again with "
                f"--job-id {job_id}"
            )
        if job.status in store.ACTIVE_JOB and not partial:
            status = store.job_status(s, job_id)
            raise ClientError(
                f"job {job_id} is still {job.status} ({status.done + status.failed}/{status.total} documents "
                "finished); wait for it, or pass --partial"
            )
        docs = s.query(Document).filter(Document.job_id == job_id).order_by(Document.index).all()
        rows = {
            r.document_id: (r.sealed, r.signature) for r in s.query(Result).filter(Result.job_id == job_id)
        }
        audit.append(
            s,
            actor=session.fingerprint,
            action="results_fetched",
            job_id=job_id,
            details={"documents": len(docs), "results": len(rows)},
        )
    return job, [_open_record(session, job_id, doc, rows.get(doc.id)) for doc in docs]


def _open_record(
    session: ClientSession, job_id: str, doc: Document, row: tuple[bytes, bytes | None] | None
) -> dict:
    """One document's record; status "refused" when its result is not the service's."""
    try:
        path = envelope.open_name(doc.sealed_name, session.identity, job_id, doc.id)
    except envelope.EnvelopeError:
        path = f"document {doc.index}"
        return _refused(path, doc, "its sealed name cannot be opened (altered)")
    record = {"document": path, "status": doc.status, "output": None, "error": doc.error}
    if row is None:
        if doc.status == "done":
            return _refused(path, doc, "its result is missing")
        code, sep, _ = (doc.error or "").partition(": ")
        if doc.status == "failed" and sep and code == INVALID_REQUEST:  # a batch line refused at submit
            record["output"] = {"code": code}
        return record
    sealed, signature = row
    if signature is None:
        return _refused(path, doc, "its result is not signed by the service")
    statement = store.result_statement(job_id, doc.id, sealed, doc.status)
    if not keys.verify_signature(session.service, statement, signature):
        return _refused(
            path, doc, "its result's signature does not verify (forged, altered or another document's)"
        )
    try:
        opened = json.loads(envelope.open_result(sealed, session.identity, job_id, doc.id))
    except (envelope.EnvelopeError, ValueError):
        return _refused(path, doc, "its signed result cannot be opened with this client's key")
    if not isinstance(opened, dict) or opened.get("status") != doc.status:
        return _refused(path, doc, "its signed result does not match the document's status")
    record |= {"status": opened["status"], "output": opened.get("output"), "error": opened.get("error")}
    for key in ("detail", "raw", "usage", "reasoning"):
        if opened.get(key) is not None:
            record[key] = opened[key]
    return record


def job_name(session: ClientSession, job: Job) -> str:
    """The job's name, opened with this client's key ("" when it has none or it is not this client's)."""
    return open_job_name(session.identity, job.id, job.sealed_name, job.name)


def open_job_name(identity: keys.Identity | None, job_id: str, sealed: bytes | None, legacy: str = "") -> str:
    """A job's sealed name opened with `identity`; a job from before names were sealed shows `legacy`;
    a name that does not open (another client's, or no key) shows as ""."""
    if sealed is None:
        return legacy
    if identity is None:
        return ""
    try:
        return envelope.open_job_name(sealed, identity, job_id)
    except envelope.EnvelopeError:
        return ""


def _refused(path: str, doc: Document, why: str) -> dict:
    error = f"result of document {doc.index} ({path!r}) refused: {why}"
    return {"document": path, "status": "refused", "output": None, "error": error}
