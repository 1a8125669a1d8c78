"""Per-document isolation in the worker, on SQLite and PostgreSQL: whatever one document raises (in its
requests, in the engine, in its result, in sealing or in recording), it fails or is given back alone and its
neighbours in the shard complete, each recorded once with a signed result and a bounded, content-free reason.

The engine is a stand-in (futures resolved at once): what is tested is the worker's bookkeeping."""

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from engine import EngineError, RequestError
from jobs.base import DocumentError, DocumentResult, EngineRequest, JobKind
from pipeline import audit, envelope, keys, migrate, store
from pipeline.db import Database
from pipeline.models import Client, Document, Job, Result
from pipeline.settings import Settings
from pipeline.shards import ENGINE_REFUSED, Leased
from pipeline.worker import WorkerRuntime

SECRET = "SECRET-d41c"


class Probe(JobKind):
    """Each document's bytes say how it misbehaves."""

    name = "probe"
    param_names = ()

    def parse_params(self, params):
        return {}

    def requests(self, doc, model):
        if doc.data == b"requests-crash":
            raise RuntimeError(SECRET)
        if doc.data == b"bad":
            raise DocumentError("body.x must be a number", code="invalid_request_error", detail=SECRET * 100)
        return [EngineRequest(doc.data.decode(), sampling=None)]

    def result(self, doc, outputs):
        if doc.data == b"result-crash":
            raise KeyError(SECRET)
        if doc.data == b"unserialisable":
            return DocumentResult(status="done", output=object())
        if doc.data == b"bad-status":
            return DocumentResult(status="maybe", output=None)
        if doc.data == b"long-error":
            return DocumentResult(status="failed", output=None, error="x" * 5000)
        return DocumentResult(status="done", output=outputs[0])


class StandInEngine:
    def submit(self, prompt, sampling, **_options):
        if prompt == "engine-refuses":
            raise RequestError(f"prompt {SECRET} has 9000 tokens; the limit is 8192")
        if prompt == "engine-closed":  # the engine's fault, not the document's: given back
            raise EngineError("the engine is closed")
        if prompt == "engine-crash":
            raise MemoryError
        future = Future()
        future.set_result(f"out:{prompt}")
        return future

    def abort(self, futures):
        return 0


class StandInModel:
    engine = StandInEngine()


@pytest.fixture
def runtime(db_url, tmp_path):
    settings = Settings(home=tmp_path, database_url=db_url, broker_url="memory://", model=Path("unused"))
    keys.save_identity(keys.generate_identity(), settings.service_key_dir)
    migrate.upgrade(Database(db_url).engine)
    rt = WorkerRuntime(app=None, settings=settings)
    rt._engine, rt._model = StandInModel.engine, StandInModel()
    yield rt
    rt.db.dispose()


BEHAVIOURS = [
    "fine-1",
    "requests-crash",
    "bad",
    "engine-refuses",
    "engine-crash",
    "engine-closed",
    "result-crash",
    "unserialisable",
    "bad-status",
    "stale-result",  # a results row is there already: the insert fails after the document's update
    "long-error",
    "fine-2",
]


def make_job(rt, client):
    job_id = str(uuid.uuid4())
    service = rt.identity.public
    with rt.db.transaction() as s:
        s.add(
            Client(
                fingerprint="c" * 64, name="c", x25519_public=client.public.x25519, ed25519_public=b"e" * 32
            )
        )
        s.flush()
        s.add(
            Job(
                id=job_id,
                kind="probe",
                client_fingerprint="c" * 64,
                manifest="{}",
                signature=b"",
                total=len(BEHAVIOURS),
            )
        )
        s.flush()
        for i, data in enumerate(BEHAVIOURS):
            doc_id = f"{job_id[:8]}-{i}"
            sealed = envelope.seal_document(
                envelope.pack_document(data, data.encode()), service.x25519, job_id, doc_id
            )
            s.add(
                Document(
                    id=doc_id,
                    job_id=job_id,
                    index=i,
                    shard=0,
                    sealed=sealed,
                    sealed_name=b"n",
                    sha256=envelope.sha256_hex(sealed),
                    size=len(data),
                )
            )
    return job_id


def test_each_document_fails_or_is_given_back_alone(runtime):
    client = keys.generate_identity()
    job = make_job(runtime, client)
    with runtime.db.transaction() as s:
        leased, _ = store.lease(s, job, 0, runtime.worker_id, lease_seconds=60, max_attempts=3)
        work = [Leased(d.id, d.index, d.sealed) for d in leased]
        stale = leased[BEHAVIOURS.index("stale-result")]
        s.add(Result(document_id=stale.id, job_id=job, sealed=b"stale"))
        hashes = {d.id: d.sha256 for d in leased}
    run = runtime.inflight.begin(job, 0, [w.id for w in work])
    recorded = runtime.shards._run(run, job, Probe(), work, hashes, 0, client.public.x25519)
    assert sorted(recorded) == ["done", "done", "failed", "failed", "failed"]
    assert run.doc_ids == set()  # recorded or given back: no lease left to renew

    with runtime.db.transaction() as s:
        docs = {BEHAVIOURS[d.index]: d for d in s.scalars(select(Document).where(Document.job_id == job))}
        results = {r.document_id: r for r in s.scalars(select(Result).where(Result.job_id == job))}
        events = s.scalars(select(audit.AuditEvent).where(audit.AuditEvent.action == "document_failed")).all()
        assert audit.verify(s, verify_signature=lambda *_: True).ok
    given_back = {
        "requests-crash",
        "engine-crash",
        "engine-closed",
        "result-crash",
        "unserialisable",
        "bad-status",
        "stale-result",
    }
    assert {name for name, d in docs.items() if d.status == "pending"} == given_back
    assert (runtime.health.done, runtime.health.errors) == (5, len(given_back))
    assert all(docs[n].attempts == 1 and docs[n].error.startswith("internal error (") for n in given_back)
    assert {name for name, d in docs.items() if d.status == "done"} == {"fine-1", "fine-2"}
    assert {name for name, d in docs.items() if d.status == "failed"} == {
        "bad",
        "engine-refuses",
        "long-error",
    }
    assert len(docs["long-error"].error) == store.MAX_REASON
    assert {json.loads(e.details)["code"] for e in events} == {"invalid_request_error", "processing_error"}
    for name in ("fine-1", "bad", "engine-refuses", "long-error", "fine-2"):
        doc, row = docs[name], results[docs[name].id]
        statement = store.result_statement(job, doc.id, row.sealed, doc.status)
        assert keys.verify_signature(runtime.identity.public, statement, row.signature)
    opened = json.loads(envelope.open_result(results[docs["bad"].id].sealed, client, job, docs["bad"].id))
    assert opened["detail"] == SECRET * 100 and opened["error"] == "body.x must be a number"
    refused = docs["engine-refuses"]
    opened = json.loads(envelope.open_result(results[refused.id].sealed, client, job, refused.id))
    assert refused.error == opened["error"] == f"{ENGINE_REFUSED}: RequestError"
    assert opened["detail"] == f"prompt {SECRET} has 9000 tokens; the limit is 8192"  # sealed only
    clear = [d.error or "" for d in docs.values()] + [e.details for e in events]
    assert not any(SECRET in text for text in clear)


@pytest.fixture
def pg_runtime(pg_url, tmp_path):
    settings = Settings(home=tmp_path, database_url=pg_url, broker_url="memory://", model=Path("unused"))
    keys.save_identity(keys.generate_identity(), settings.service_key_dir)
    migrate.upgrade(Database(pg_url).engine)
    rt = WorkerRuntime(app=None, settings=settings)
    rt._engine, rt._model = StandInModel.engine, StandInModel()
    yield rt
    rt.db.dispose()


def test_a_document_that_loses_a_deadlock_is_recorded_again_without_an_attempt(pg_runtime, caplog):
    """A real PostgreSQL deadlock: another transaction holds the shard's last document and then asks for its
    first, which the worker's recording transaction holds while it waits for the last. PostgreSQL aborts the
    worker's statement (40P01, the worker waited first); the document is recorded again in a new
    transaction, so it ends done with one result and no attempt spent, and the other transaction commits."""
    rt = pg_runtime
    client = keys.generate_identity()
    job = make_job(rt, client)
    with rt.db.transaction() as s:
        leased, _ = store.lease(s, job, 0, rt.worker_id, lease_seconds=60, max_attempts=3)
        work = [Leased(d.id, d.index, d.sealed) for d in leased]
        hashes = {d.id: d.sha256 for d in leased}
    first, last = work[0].id, work[-1].id  # fine-1 and fine-2: recorded first and last
    other = create_engine(rt.db.url)
    holder = other.connect()
    holder.begin()
    holder.execute(text("UPDATE documents SET size = size WHERE id = :id"), {"id": last})
    holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar()
    outcome: dict[str, object] = {}

    def close_the_cycle() -> None:
        try:
            with other.connect() as watch:  # wait until the worker's transaction waits for `last`
                # Only a backend blocked by the holder: other tests' lock waits on this server do not count.
                blocked = text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                )
                for _ in range(500):
                    waiting = watch.execute(blocked, {"pid": holder_pid}).scalar()
                    if waiting:
                        break
                    time.sleep(0.02)
            holder.execute(text("UPDATE documents SET size = size WHERE id = :id"), {"id": first})
            holder.commit()
            outcome["committed"] = True
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=close_the_cycle)
    thread.start()
    run = rt.inflight.begin(job, 0, [w.id for w in work])
    with caplog.at_level(logging.WARNING, logger="enclave.worker"):
        recorded = rt.shards._run(run, job, Probe(), work, hashes, 0, client.public.x25519)
    thread.join(30)
    holder.close()
    other.dispose()
    assert outcome == {"committed": True}
    assert "lost a database race" in caplog.text  # the deadlock happened, and was retried
    # fine-1, fine-2 and stale-result (no results row put in its way here) done; three failed
    assert sorted(recorded) == ["done", "done", "done", "failed", "failed", "failed"]
    with rt.db.transaction() as s:
        docs = {d.id: d for d in s.scalars(select(Document).where(Document.job_id == job))}
        results = [r.document_id for r in s.scalars(select(Result).where(Result.job_id == job))]
    for doc_id in (first, last):
        assert (docs[doc_id].status, docs[doc_id].attempts, results.count(doc_id)) == ("done", 0, 1)
