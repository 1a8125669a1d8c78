"""The store's state transitions on SQLite and PostgreSQL: leases, retries, crashes, finishing exactly once,
cancel, bounded reasons."""

import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from pipeline import audit, migrate, store
from pipeline.db import Database
from pipeline.models import Client, Document, Job, Result, utcnow


@pytest.fixture
def db(db_url):
    database = Database(db_url)
    migrate.upgrade(database.engine)
    yield database
    database.dispose()


def make_job(db, documents=4, shard_size=2):
    job_id = str(uuid.uuid4())
    with db.transaction() as s:
        if s.get(Client, "c" * 64) is None:
            s.add(Client(fingerprint="c" * 64, name="c", x25519_public=b"x" * 32, ed25519_public=b"e" * 32))
            s.flush()
        s.add(
            Job(
                id=job_id,
                kind="summarize",
                client_fingerprint="c" * 64,
                manifest="{}",
                signature=b"",
                total=documents,
            )
        )
        s.flush()
        for i in range(documents):
            s.add(
                Document(
                    id=f"{job_id[:8]}-{i}",
                    job_id=job_id,
                    index=i,
                    shard=i // shard_size,
                    sealed=b"s",
                    sealed_name=b"n",
                    sha256="0" * 64,
                    size=1,
                )
            )
    return job_id


def test_a_shard_is_leased_to_one_owner(db):
    job = make_job(db)
    with db.transaction() as s:
        first, _ = store.lease(s, job, 0, "a", lease_seconds=60, max_attempts=3)
    with db.transaction() as s:
        second, _ = store.lease(s, job, 0, "b", lease_seconds=60, max_attempts=3)
    assert [d.index for d in first] == [0, 1] and second == []
    assert all(d.attempts == 0 and d.lease_expiries == 0 and d.lease_owner == "a" for d in first)


def test_expired_leases_are_taken_over_and_the_old_owner_cannot_finish(db):
    job = make_job(db)
    with db.transaction() as s:
        (doc, _), _ = store.lease(s, job, 0, "a", lease_seconds=0.05, max_attempts=3)
    time.sleep(0.1)
    with db.transaction() as s:
        assert (job, 0) in store.shards_to_dispatch(s, lease_seconds=60)
        taken, _ = store.lease(s, job, 0, "b", lease_seconds=60, max_attempts=3)
    # the takeover counts a lease expiry (the holder died or hung), not a failure of the document
    assert taken[0].id == doc.id and (taken[0].attempts, taken[0].lease_expiries) == (0, 1)
    with db.transaction() as s:
        assert not store.finish_document(s, doc.id, "a", "done", b"late", None, "a")
        assert store.finish_document(s, doc.id, "b", "done", b"result", None, "b")
    with db.transaction() as s:
        assert not store.finish_document(s, doc.id, "b", "done", b"again", None, "b")
        assert s.scalar(select(func.count()).select_from(Result).where(Result.document_id == doc.id)) == 1
        assert s.get(Result, doc.id).sealed == b"result"


def test_transient_failures_retry_until_max_attempts_then_fail_with_the_reason(db):
    job = make_job(db, documents=1)
    for attempt in range(2):
        with db.transaction() as s:
            (doc,), exhausted = store.lease(s, job, 0, f"w{attempt}", lease_seconds=60, max_attempts=2)
            assert exhausted == []
            store.release(s, doc.id, f"w{attempt}", "internal error (RuntimeError)")
    with db.transaction() as s:
        leased, exhausted = store.lease(s, job, 0, "w9", lease_seconds=60, max_attempts=2)
        assert leased == [] and [d.attempts for d in exhausted] == [2]
        store.give_up(s, exhausted[0], 2, "w9")
    with db.transaction() as s:
        doc = s.get(Document, exhausted[0].id)
        assert doc.status == "failed"
        assert doc.error == "gave up after 2 failed attempts; the last: internal error (RuntimeError)"
        assert s.get(Job, job).status == "completed"  # the job goes on (here: it had one document)


def test_job_completes_when_its_last_document_finishes(db):
    job = make_job(db, documents=3, shard_size=3)
    with db.transaction() as s:
        docs, _ = store.lease(s, job, 0, "w", lease_seconds=60, max_attempts=3)
        store.start_job(s, job, "w")
        store.start_job(s, job, "w")  # once only
        for d in docs[:2]:
            store.finish_document(s, d.id, "w", "done", b"r", None, "w")
        assert s.get(Job, job).status == "running"
        store.finish_document(s, docs[2].id, "w", "failed", b"r", "document is empty", "w")
        assert s.get(Job, job).status == "completed"
        actions = [
            e.action for e in s.scalars(select(audit.AuditEvent).where(audit.AuditEvent.job_id == job))
        ]
    assert actions.count("started") == 1 and actions.count("completed") == 1
    assert actions.count("document_done") == 2 and actions.count("document_failed") == 1


def test_cancel_stops_unfinished_documents(db):
    job = make_job(db, documents=4)
    with db.transaction() as s:
        (first, second), _ = store.lease(s, job, 0, "w", lease_seconds=60, max_attempts=3)
        store.finish_document(s, first.id, "w", "done", b"r", None, "w")
    with db.transaction() as s:
        assert store.cancel_job(s, job, "client")
        assert not store.cancel_job(s, job, "client")
    with db.transaction() as s:
        assert not store.finish_document(
            s, second.id, "w", "done", b"r", None, "w"
        )  # in flight when cancelled
        assert store.lease(s, job, 1, "w", lease_seconds=60, max_attempts=3) == ([], [])
        assert store.document_counts(s, job) == {"done": 1, "cancelled": 3}
        assert not store.has_open_work(s)


def expire(db, doc_id):
    with db.transaction() as s:
        s.get(Document, doc_id).lease_until = utcnow() - timedelta(seconds=1)


def test_crashes_do_not_burn_attempts_and_a_document_that_kills_every_worker_still_ends(db):
    job = make_job(db, documents=2)
    for crash in range(store.MAX_LEASE_EXPIRIES):
        with db.transaction() as s:
            leased, exhausted = store.lease(s, job, 0, f"w{crash}", lease_seconds=60, max_attempts=3)
            assert exhausted == [] and [d.attempts for d in leased] == [0, 0]
            assert [d.lease_expiries for d in leased] == [crash, crash]
        for d in leased:  # the worker dies holding the shard
            expire(db, d.id)
    with db.transaction() as s:
        assert store.document_counts(s, job) == {"leased": 2}  # not failed after 3 crashes, nor 9
        leased, exhausted = store.lease(s, job, 0, "last", lease_seconds=60, max_attempts=3)
        assert leased == [] and len(exhausted) == 2
        for d in exhausted:
            store.give_up(s, d, 3, "last")
    with db.transaction() as s:
        docs = s.scalars(select(Document).where(Document.job_id == job)).all()
        assert {d.status for d in docs} == {"failed"}
        assert all(d.error.startswith(f"{store.WORKER_CRASHED}: its lease expired 10 times") for d in docs)
        assert s.get(Job, job).status == "completed"


def test_failures_count_attempts_and_a_final_failure_counts_one(db):
    job = make_job(db, documents=2)
    with db.transaction() as s:
        (a, b), _ = store.lease(s, job, 0, "w", lease_seconds=60, max_attempts=3)
        store.release(s, a.id, "w", "internal error (OSError)")
        assert store.finish_document(s, b.id, "w", "failed", b"r", "bad", "w", signature=b"sig")
    with db.transaction() as s:
        assert [s.get(Document, d.id).attempts for d in (a, b)] == [1, 1]
        assert s.get(Result, b.id).signature == b"sig"


def test_long_reasons_are_clipped_so_the_audit_log_never_refuses_a_failure(db):
    job = make_job(db, documents=3, shard_size=3)
    long = "x" * 5000
    with db.transaction() as s:
        (a, b, c), _ = store.lease(s, job, 0, "w", lease_seconds=60, max_attempts=1)
        assert store.finish_document(s, a.id, "w", "failed", b"r", long, "w", details={"code": "c"})
        store.release(s, b.id, "w", long)
        store.fail_unopened(s, c, long, "w")
    with db.transaction() as s:
        errors = [s.get(Document, d.id).error for d in (a, b, c)]
        assert all(len(e) == store.MAX_REASON and e.endswith("...") for e in errors)
        (exhausted,) = store.lease(s, job, 0, "w2", lease_seconds=60, max_attempts=1)[1]
        store.give_up(s, exhausted, 1, "w2")  # "gave up ...; the last: <clipped>" is clipped again
        assert len(s.get(Document, b.id).error) == store.MAX_REASON
    other = make_job(db, documents=1)
    with db.transaction() as s:
        assert store.fail_job(s, other, long, "w2")
        assert len(s.get(Job, other).error) == store.MAX_REASON
    with db.transaction() as s:
        assert audit.verify(s, verify_signature=lambda *_: True).ok


def test_result_statement_binds_job_document_ciphertext_and_status():
    base = store.result_statement("j", "d", b"sealed", "done")
    assert base == store.result_statement("j", "d", b"sealed", "done")
    others = [
        store.result_statement("j2", "d", b"sealed", "done"),
        store.result_statement("j", "d2", b"sealed", "done"),
        store.result_statement("j", "d", b"sealed2", "done"),
        store.result_statement("j", "d", b"sealed", "failed"),
    ]
    assert base not in others and len(set(others)) == 4
