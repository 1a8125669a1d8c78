"""The workstation side: seal and submit documents, and open results, through the service API
(`pipeline.api_client`). Plaintext stays in this process: what leaves it is sealed to the service (documents,
parameters) or to this client (names), and results come back sealed to this client and signed by the service.
"""

from __future__ import annotations

import itertools
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
from jobs.records import Record, RecordsError, read_records
from jobs.scan import GitBlob, GitError, ScanOptions, scan_folder
from jobs.scan_record import ScanRecord
from pipeline import api_client, envelope, keys, scan_records
from pipeline.canonical import canonical_json
from pipeline.errors import UserError
from pipeline.reasons import bounded
from pipeline.settings import Settings
from pipeline.status import DocState
from pipeline.wire import messages as m

EMPTY_SHA256 = envelope.sha256_hex(b"")
NAME_NOT_UNICODE = "the file name is not valid UTF-8; rename the file and submit it again"
MAX_JOB_NAME = 200  # characters of `--name`
CHUNK_ROWS = 500  # documents per upload request
CHUNK_BYTES = 16_000_000  # sealed bytes per upload request (at most half the service's request bound)
RESULTS_PAGE = 200  # results per request


class ClientError(UserError, ValueError):
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
    """A client identity, the service's public key and a connection to the service API."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.identity = keys.load_identity(settings.client_key_dir, settings.passphrase("client"))
        try:
            self.service = keys.load_public(settings.service_key_dir)
        except keys.KeyFileError:
            raise ClientError(
                f"no service public key in {settings.service_key_dir}: get the service's public.json from "
                "its administrator and run `enclave keys import-service FILE`"
            ) from None
        self.api = api_client.connect(settings, self.identity, self.service.fingerprint)

    @property
    def fingerprint(self) -> str:
        return self.identity.public.fingerprint

    def close(self) -> None:
        self.api.close()


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


RECORD_KINDS = ("summarize", "extract")  # kinds whose documents a record export's rows can be


def submit_records(
    session: ClientSession,
    file: Path,
    kind: str,
    params: dict,
    key: str | None = None,
    fmt: str | None = None,
    name: str = "",
    priority: int = 0,
    job_id: str | None = None,
    announce: Callable[[str], None] | None = None,
) -> Submitted:
    """Store each row of a CSV, JSONL or Parquet file (`jobs.records`) as one document of a `summarize` or
    `extract` job, named by its `key` column's value (else `row N`) and sealed like a file. A row that
    cannot be read fails alone at submit, with its row number and why; the rest go on. Rows are read one at
    a time; a file that cannot be read at all is refused before the job is claimed."""
    if kind not in RECORD_KINDS:
        raise ClientError(f"--records takes --kind {' or '.join(RECORD_KINDS)}, not {kind}")
    if not file.is_file():
        raise ClientError(f"{file} is not a file")
    job_kind = make_kind(kind, params)
    limit = session.settings.limits.max_document_bytes
    try:
        rows = read_records(file, key, fmt)
        first = next(rows, None)  # reads the header (CSV) or the schema (Parquet)
    except RecordsError as exc:
        raise ClientError(str(exc)) from None
    if first is None:
        raise ClientError(f"{file.name} has no rows")

    def document(record: Record) -> NewDocument:
        if record.data is None:
            return NewDocument(record.key, None, 0, bounded(f"invalid_record: {record.error}"))
        if len(record.data) > limit:
            reason = f"invalid_record: the row is {len(record.data)} bytes; the limit is {limit}"
            return NewDocument(record.key, None, len(record.data), reason)
        return NewDocument(record.key, record.data, len(record.data))

    documents = (document(r) for r in itertools.chain([first], rows))
    return _store(session, job_kind.name, job_kind.params, documents, name, priority, job_id, announce)


def _batch_document(line) -> NewDocument:
    if isinstance(line, BadLine):
        reason = bounded(f"{INVALID_REQUEST}: line {line.line_no}: {line.problem}")
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
    """Claim the job id, send the documents chunk by chunk, then queue the job (the service tells the
    workers)."""
    job_id = _checked_job_id(job_id)
    client_key, service_key = session.identity.public.x25519, session.service.x25519
    try:
        sealed_params = envelope.seal_params(params, service_key, job_id)
        sealed_name = envelope.seal_job_name(name[:MAX_JOB_NAME], client_key, job_id) if name else None
    except (UnicodeEncodeError, ValueError, TypeError):
        raise ClientError("the job's name or parameters are not valid Unicode text") from None
    try:
        claim = session.api.begin(
            m.BeginUpload(job_id=job_id, kind=kind, sealed_name=sealed_name, priority=priority)
        )
        if claim.state == "existing":
            return Submitted(job_id, claim.job.kind, claim.job.total, existing=True)
        if announce is not None:
            announce(job_id)
        entries, rejected = _upload(session, job_id, claim.token, documents)
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
        finish = m.FinishUpload(
            token=claim.token,
            manifest=canonical_json(manifest).decode(),
            signature=signature,
            sealed_params=sealed_params,
        )
        submitted = session.api.finish(job_id, finish)
    except api_client.ServiceError as exc:
        if exc.status == 409:  # the id is another client's, another kind's, or its upload was taken over
            raise ClientError(exc.reason) from None
        raise
    return Submitted(job_id, kind, submitted.documents, rejected, dispatched=submitted.dispatched)


def _upload(
    session: ClientSession, job_id: str, token: str, documents: Iterable[NewDocument]
) -> tuple[list[dict], list[tuple[str, str]]]:
    """Seal and send every document; returns the manifest entries and the refused (name, reason) pairs.
    Sealed bytes are held for one chunk at a time; a chunk stays within half the service's request bound."""
    bound = session.api.health().max_request_bytes
    chunk_bytes_limit = min(CHUNK_BYTES, bound // 2)
    entries, rejected = [], []
    chunk: list[m.DocumentRow] = []
    chunk_bytes = 0

    def send() -> None:
        try:
            session.api.add_documents(job_id, m.DocumentChunk(token=token, documents=chunk))
        except api_client.ServiceError as exc:
            if exc.status != 413:
                raise
            raise ClientError(
                f"the service takes requests of at most {bound} bytes and document {chunk[0].index} alone is "
                f"larger once sealed (413 too_large): leave it out, or ask for a larger --max-request-mb"
            ) from None

    for index, doc in enumerate(documents):
        row = _sealed_row(session, job_id, index, doc)
        entries.append({"id": row.id, "sha256": row.sha256})
        if row.sealed is None:
            rejected.append((_printable(doc.name), row.error))
        size = len(row.sealed or b"") + len(row.sealed_name)
        if chunk and (len(chunk) >= CHUNK_ROWS or chunk_bytes + size > chunk_bytes_limit):
            send()
            chunk, chunk_bytes = [], 0
        chunk.append(row)
        chunk_bytes += size
    if chunk:
        send()
    return entries, rejected


def _sealed_row(session: ClientSession, job_id: str, index: int, doc: NewDocument) -> m.DocumentRow:
    """One document as the service stores it: its content sealed to the service, its name to this client,
    its size rounded up to a power of two.

    A document that cannot be sent (too large, a name that is not Unicode) fails alone, with a content-free
    reason."""
    doc_id = str(uuid.uuid4())
    sealed_name = envelope.seal_name(_printable(doc.name), session.identity.public.x25519, job_id, doc_id)
    error = doc.error if doc.error is not None or _is_unicode(doc.name) else NAME_NOT_UNICODE
    size = size_bucket(doc.size)
    if error is not None or doc.data is None:
        reason = bounded(error) if error else "not sent"
        return m.DocumentRow(
            id=doc_id, index=index, sealed_name=sealed_name, sha256=EMPTY_SHA256, size=size, error=reason
        )
    packed = envelope.pack_document(doc.name, doc.data)
    sealed = envelope.seal_document(packed, session.service.x25519, job_id, doc_id)
    return m.DocumentRow(
        id=doc_id,
        index=index,
        sealed_name=sealed_name,
        sealed=sealed,
        sha256=envelope.sha256_hex(sealed),
        size=size,
    )


def size_bucket(size: int) -> int:
    """`size` rounded up to a power of two (0 stays 0): the service sees sizes by bucket only."""
    return 0 if size <= 0 else 1 << (size - 1).bit_length()


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


def job_status(session: ClientSession, job_id: str) -> m.JobInfo:
    """This client's job `job_id` (or a unique prefix of its id): its status and document counts.
    `UnknownJob` when there is no such job, or it is another client's."""
    try:
        return session.api.job(job_id)
    except api_client.NotFound as exc:
        raise UnknownJob(exc.reason) from None


def list_jobs(session: ClientSession, limit: int = 100) -> list[m.JobInfo]:
    """This client's jobs, newest first."""
    return session.api.jobs(limit).jobs


def cancel_job(session: ClientSession, job_id: str) -> bool:
    """Cancel this client's queued or running job (documents already finished keep their results); False
    when the job had already ended. `UnknownJob` when there is no such job, or it is another client's."""
    return cancel(session, job_id).cancelled


def cancel(session: ClientSession, job_id: str) -> m.Cancelled:
    """`cancel_job`, with the job's state after it."""
    try:
        return session.api.cancel(job_id)
    except api_client.NotFound as exc:
        raise UnknownJob(exc.reason) from None
    except api_client.ServiceError as exc:
        if exc.status == 409:
            raise ClientError(exc.reason) from None
        raise


def iter_results(
    session: ClientSession, job_id: str, partial: bool = False
) -> tuple[m.JobInfo, Iterator[dict]]:
    """The job (as of the first page) and its results opened with the client key, one record per document in
    submission order, fetched a page at a time (neither side holds a large job whole).

    Each result must carry the service's signature over (job, document, hash of the sealed bytes, status),
    checked against the service key this client holds. A result that fails the check (forged, re-sealed,
    copied from another document, unsigned) is not opened: its record has status "refused" and an error
    naming the document; the other documents are opened as usual.
    """
    try:
        first = session.api.results_page(job_id, None, RESULTS_PAGE, partial)
    except api_client.NotFound as exc:
        raise UnknownJob(exc.reason) from None
    except api_client.ServiceError as exc:
        if exc.status == 409:  # still uploading, or still running without --partial
            raise ClientError(exc.reason) from None
        raise
    job = first.job

    def records() -> Iterator[dict]:
        page = first
        while True:
            for row in page.results:
                yield _open_record(session, job.job_id, row)
            if page.next_after is None:
                return
            page = session.api.results_page(job.job_id, page.next_after, RESULTS_PAGE, partial)

    return job, records()


def fetch_results(session: ClientSession, job_id: str, partial: bool = False) -> tuple[m.JobInfo, list[dict]]:
    """`iter_results`, as a list."""
    job, records = iter_results(session, job_id, partial)
    return job, list(records)


def _open_record(session: ClientSession, job_id: str, row: m.ResultRow) -> dict:
    """One document's record; status "refused" when its result is not the service's."""
    try:
        path = envelope.open_name(row.sealed_name, session.identity, job_id, row.document_id)
    except envelope.EnvelopeError:
        path = f"document {row.index}"
        return _refused(path, row, "its sealed name cannot be opened (altered)")
    record = {"document": path, "status": row.status, "output": None, "error": row.error}
    if row.sealed is None:
        if row.status == DocState.DONE:
            return _refused(path, row, "its result is missing")
        code, sep, _ = (row.error or "").partition(": ")
        if (
            row.status == DocState.FAILED and sep and code == INVALID_REQUEST
        ):  # a batch line refused at submit
            record["output"] = {"code": code}
        return record
    if row.signature is None:
        return _refused(path, row, "its result is not signed by the service")
    statement = envelope.result_statement(job_id, row.document_id, row.sealed, row.status)
    if not keys.verify_signature(session.service, statement, row.signature):
        return _refused(
            path, row, "its result's signature does not verify (forged, altered or another document's)"
        )
    try:
        opened = json.loads(envelope.open_result(row.sealed, session.identity, job_id, row.document_id))
    except (envelope.EnvelopeError, ValueError):
        return _refused(path, row, "its signed result cannot be opened with this client's key")
    if not isinstance(opened, dict) or opened.get("status") != row.status:
        return _refused(path, row, "its signed result does not match the document's status")
    record |= {"status": opened["status"], "output": opened.get("output"), "error": opened.get("error")}
    for key in ("detail", "raw", "usage", "reasoning"):
        if opened.get(key) is not None:
            record[key] = opened[key]
    return record


def job_name(session: ClientSession, job: m.JobInfo) -> str:
    """The job's name, opened with this client's key ("" when it has none or it is not this client's)."""
    return open_job_name(session.identity, job.job_id, job.sealed_name, job.name)


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


def _refused(path: str, row: m.ResultRow, why: str) -> dict:
    error = f"result of document {row.index} ({path!r}) refused: {why}"
    return {"document": path, "status": "refused", "output": None, "error": error}
