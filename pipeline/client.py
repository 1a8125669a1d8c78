"""The workstation side: seal and submit documents, and open results. Plaintext stays in this process."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from jobs import make_kind
from jobs.openai_batch import parse_batch_file
from jobs.repository import walk_repository
from pipeline import audit, envelope, keys, store
from pipeline.celery_app import make_celery
from pipeline.db import Database
from pipeline.home import CLIENT_PASSPHRASE_ENV, passphrase
from pipeline.models import Client, Document, Job, Result
from pipeline.settings import Settings
from pipeline.tasks import dispatch_shard

EMPTY_SHA256 = envelope.sha256_hex(b"")


class ClientError(ValueError):
    """A user error on the client side (bad path, unknown job, job of another client...)."""


@dataclass
class Submitted:
    job_id: str
    kind: str
    documents: int
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) failed at submit
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) not submitted at all
    dispatched: bool = True


class ClientSession:
    """A client identity, the service's public key and the database."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.identity = keys.load_identity(settings.client_key_dir, passphrase(CLIENT_PASSPHRASE_ENV))
        self.service = keys.load_public(settings.service_key_dir)
        self.db = Database(settings.database_url)

    @property
    def fingerprint(self) -> str:
        return self.identity.public.fingerprint

    def close(self) -> None:
        self.db.dispose()


def collect_files(paths: list[Path], kind: str) -> tuple[list[tuple[str, Path]], list[tuple[str, str]]]:
    """(document path, file) pairs for the given files and folders, and what was skipped.

    A file keeps its name; files in a folder are named relative to it (prefixed with the folder's name when
    several folders are given). Repositories for code-review are walked honouring .gitignore.
    """
    found: list[tuple[str, Path]] = []
    skipped: list[tuple[str, str]] = []
    folders = [p for p in paths if p.is_dir()]
    for path in paths:
        if not path.exists():
            raise ClientError(f"{path} does not exist")
        if path.is_file():
            found.append((path.name, path))
            continue
        prefix = f"{path.name}/" if len(folders) > 1 else ""
        if kind == "code-review":
            repo = walk_repository(path)
            found += [(prefix + rel, path / rel) for rel in repo.files]
            skipped += [(prefix + rel, why) for rel, why in repo.skipped]
        else:
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
                rel = file.relative_to(path)
                if any(part.startswith(".") for part in rel.parts):
                    continue
                found.append((prefix + rel.as_posix(), file))
    names = [name for name, _ in found]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ClientError(f"two documents would both be named {dupes[0]!r}; submit them separately")
    if not found:
        raise ClientError("no documents to submit")
    return found, skipped


def submit_files(
    session: ClientSession, paths: list[Path], kind: str, params: dict, name: str = "", priority: int = 0
) -> Submitted:
    """Seal the files under `paths` and store them as one job; workers are told by shard id."""
    job_kind = make_kind(kind, params)  # validates before anything is read or stored
    files, skipped = collect_files(paths, kind)
    limit = session.settings.limits.max_document_bytes
    documents = []
    for doc_name, file in files:
        size = file.stat().st_size
        data = file.read_bytes() if size <= limit else None
        documents.append((doc_name, data, size))
    result = _store(session, job_kind.name, job_kind.params, documents, name, priority)
    result.skipped = skipped
    return result


def submit_openai_batch(session: ClientSession, file: Path, name: str = "", priority: int = 0) -> Submitted:
    """Store an OpenAI batch file as a `chat` job, one document per request; refused whole if malformed."""
    if not file.is_file():
        raise ClientError(f"{file} is not a file")
    lines = parse_batch_file(file.read_bytes())
    job_kind = make_kind("chat", {})
    documents = [(line.custom_id, line.raw, len(line.raw)) for line in lines]
    return _store(session, job_kind.name, job_kind.params, documents, name or file.name, priority)


def _store(
    session: ClientSession,
    kind: str,
    params: dict,
    documents: list[tuple[str, bytes | None, int]],
    name: str,
    priority: int,
) -> Submitted:
    settings = session.settings
    job_id = str(uuid.uuid4())
    rows, entries, rejected = [], [], []
    for index, (doc_name, data, size) in enumerate(documents):
        doc_id = str(uuid.uuid4())
        sealed_name = envelope.seal_name(doc_name, session.identity.public.x25519, job_id, doc_id)
        if data is None:
            reason = f"document is {size} bytes; the limit is {settings.limits.max_document_bytes}"
            rejected.append((doc_name, reason))
            rows.append(
                Document(
                    id=doc_id,
                    job_id=job_id,
                    index=index,
                    shard=-1,
                    sealed=None,
                    sealed_name=sealed_name,
                    sha256=EMPTY_SHA256,
                    size=size,
                    status="failed",
                    error=reason,
                )
            )
            entries.append({"id": doc_id, "sha256": EMPTY_SHA256})
            continue
        sealed = envelope.seal_document(
            envelope.pack_document(doc_name, data), session.service.x25519, job_id, doc_id
        )
        digest = envelope.sha256_hex(sealed)
        rows.append(
            Document(
                id=doc_id,
                job_id=job_id,
                index=index,
                shard=index // settings.limits.shard_size,
                sealed=sealed,
                sealed_name=sealed_name,
                sha256=digest,
                size=size,
                status="pending",
            )
        )
        entries.append({"id": doc_id, "sha256": digest})
    manifest = {
        "version": envelope.MANIFEST_VERSION,
        "job_id": job_id,
        "kind": kind,
        "params": params,
        "client": session.fingerprint,
        "documents": entries,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    signature = envelope.sign_manifest(manifest, session.identity)
    with session.db.transaction() as s:
        allowed = s.get(Client, session.fingerprint)
        if allowed is None or allowed.revoked_at is not None:
            raise ClientError(
                f"this client ({session.fingerprint[:16]}) is not on the service's allow-list: an "
                "administrator must run `enclave clients add NAME PUBLIC_FILE` with its public.json"
            )
        s.add(
            Job(
                id=job_id,
                name=name[:200],
                kind=kind,
                client_fingerprint=session.fingerprint,
                priority=priority,
                status="queued",
                manifest=envelope.canonical_json(manifest).decode(),
                signature=signature,
                total=len(rows),
            )
        )
        s.flush()
        s.add_all(rows)
        s.flush()
        audit.append(
            s,
            actor=session.fingerprint,
            action="submitted",
            job_id=job_id,
            details={"kind": kind, "documents": len(rows), "rejected_at_submit": len(rejected)},
        )
        store.complete_job_if_finished(s, job_id, session.fingerprint)
        shards = sorted({r.shard for r in rows if r.status == "pending"})
        for shard in shards:
            store.mark_dispatched(s, job_id, shard)
    dispatched = _dispatch(settings, job_id, shards, priority)
    return Submitted(job_id, kind, len(rows), rejected, dispatched=dispatched)


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


def fetch_results(session: ClientSession, job_id: str, partial: bool = False) -> tuple[Job, list[dict]]:
    """Open the job's results with the client key: one record per document, in submission order."""
    with session.db.transaction() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise ClientError(f"no job {job_id}")
        if job.client_fingerprint != session.fingerprint:
            raise ClientError(f"job {job_id} was submitted by another client; only its submitter can open it")
        if job.status in store.ACTIVE_JOB and not partial:
            status = store.job_status(s, job_id)
            raise ClientError(
                f"job {job_id} is still {job.status} ({status.done + status.failed}/{status.total} documents "
                "finished); wait for it, or pass --partial"
            )
        docs = s.query(Document).filter(Document.job_id == job_id).order_by(Document.index).all()
        sealed = {r.document_id: r.sealed for r in s.query(Result).filter(Result.job_id == job_id)}
        audit.append(
            s,
            actor=session.fingerprint,
            action="results_fetched",
            job_id=job_id,
            details={"documents": len(docs), "results": len(sealed)},
        )
    records = []
    for doc in docs:
        path = envelope.open_name(doc.sealed_name, session.identity, job_id, doc.id)
        record = {"document": path, "status": doc.status, "output": None, "error": doc.error}
        if doc.id in sealed:
            opened = json.loads(envelope.open_result(sealed[doc.id], session.identity, job_id, doc.id))
            record |= {"status": opened["status"], "output": opened["output"], "error": opened["error"]}
            if opened.get("raw") is not None:
                record["raw"] = opened["raw"]
            if opened.get("usage") is not None:
                record["usage"] = opened["usage"]
        records.append(record)
    return job, records
