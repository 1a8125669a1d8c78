"""Leases that live while work lives, on SQLite and PostgreSQL: a heartbeat renews the leases of documents in
flight, a gone worker's (silent past the heartbeat timeout, or stopped) are taken over long before they would
expire, a live worker's never are, and abandoned documents fail with their reason and audit event."""

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from pipeline import audit, migrate, store, workers
from pipeline.db import Database
from pipeline.models import Document, Worker, utcnow
from pipeline.status import WorkerState
from tests.pipeline.test_store import make_job

LONG_LEASE = 300.0  # the default: no lease here may expire during a test
TIMEOUT = 30.0


@pytest.fixture
def db(db_url):
    database = Database(db_url)
    migrate.upgrade(database.engine)
    yield database
    database.dispose()


def register(db, name: str) -> str:
    worker_id = workers.new_worker_id(f"enclave-{name}@host", 1)
    with db.transaction() as s:
        workers.register(
            s, workers.WorkerInfo(worker_id, f"enclave-{name}@host", "host", 1, "cpu", "celery", 2)
        )
    return worker_id


def silence(db, worker_id: str, seconds: float) -> None:
    """As if the worker's last heartbeat was `seconds` ago (it died then)."""
    with db.transaction() as s:
        s.execute(
            update(Worker)
            .where(Worker.id == worker_id)
            .values(heartbeat_at=utcnow() - timedelta(seconds=seconds))
        )


def lease(db, job, owner):
    with db.transaction() as s:
        leased, _ = store.lease(s, job, 0, owner, LONG_LEASE, 3, heartbeat_timeout=TIMEOUT)
        return leased


def test_a_live_workers_leases_are_never_taken_over(db):
    job = make_job(db)
    a, b = register(db, "a"), register(db, "b")
    assert len(lease(db, job, a)) == 2
    silence(db, a, TIMEOUT - 5)  # late, but within the timeout
    with db.transaction() as s:  # shard 1 was never dispatched; shard 0 is covered by a's live task
        assert store.shards_to_dispatch(s, LONG_LEASE, TIMEOUT) == [(job, 1)]
    assert lease(db, job, b) == []


@pytest.mark.parametrize("how", ["silent", "stopped"])
def test_a_gone_workers_documents_are_taken_over_at_once_counting_an_expiry(db, how):
    job = make_job(db)
    a, b = register(db, "a"), register(db, "b")
    lease(db, job, a)
    if how == "silent":
        silence(db, a, TIMEOUT + 1)
    else:
        with db.transaction() as s:
            workers.set_state(s, a, WorkerState.STOPPED)
    with db.transaction() as s:
        assert store.shards_to_dispatch(s, LONG_LEASE, TIMEOUT) == [(job, 0), (job, 1)]
        assert workers.alive(s, TIMEOUT) == 1
    taken = lease(db, job, b)
    assert [(d.lease_owner, d.attempts, d.lease_expiries) for d in taken] == [(b, 0, 1)] * 2
    with db.transaction() as s:  # the gone worker, should it come back, cannot record them
        assert not store.finish_document(s, taken[0].id, a, "done", b"late", None, a)
        assert store.renew(s, a, [d.id for d in taken], LONG_LEASE) == 0
        assert store.taken_over(s, a, [d.id for d in taken]) == 2
        assert store.finish_document(s, taken[0].id, b, "done", b"result", None, b)
        assert store.taken_over(s, a, [d.id for d in taken]) == 1  # a finished one is not held by anyone


def test_an_owner_never_registered_keeps_the_old_rule_its_lease_expiry(db):
    job = make_job(db)
    lease(db, job, "worker:legacy:1")
    with db.transaction() as s:
        assert store.shards_to_dispatch(s, LONG_LEASE, TIMEOUT) == [(job, 1)]
    assert lease(db, job, register(db, "b")) == []


def test_renew_extends_only_the_owners_documents_in_flight(db):
    job = make_job(db, documents=4)
    a = register(db, "a")
    with db.transaction() as s:
        leased, _ = store.lease(s, job, 0, a, lease_seconds=5, max_attempts=3)
        store.lease(s, job, 1, "someone-else", lease_seconds=5, max_attempts=3)
    ids = [d.id for d in leased]
    with db.transaction() as s:
        assert store.renew(s, a, [*ids, f"{job[:8]}-2"], lease_seconds=600) == 2
        until = dict(s.execute(select(Document.id, Document.lease_until).where(Document.job_id == job)).all())
    assert all(until[i] > utcnow() + timedelta(seconds=500) for i in ids)
    assert until[f"{job[:8]}-2"] < utcnow() + timedelta(seconds=10)


def test_abandoned_documents_fail_with_their_reason_and_event(db):
    job = make_job(db, documents=2)
    a = register(db, "a")
    ids = [d.id for d in lease(db, job, a)]
    with db.transaction() as s:
        assert store.abandon(s, [*ids, "not-leased"], a, "time_limit: hard", a) == 2
    with db.transaction() as s:
        docs = s.scalars(select(Document).where(Document.job_id == job)).all()
        events = s.scalars(select(audit.AuditEvent).where(audit.AuditEvent.job_id == job)).all()
        assert all(d.status == "failed" and d.error == "time_limit: hard" and d.attempts == 1 for d in docs)
        assert [e.action for e in events] == ["document_failed", "document_failed", "completed"]
        assert store.ended_jobs(s, [job]) == [job]


def test_workers_listing_shows_gone_and_live_workers(db):
    a, b = register(db, "a"), register(db, "b")
    silence(db, a, TIMEOUT + 1)
    with db.transaction() as s:
        workers.set_state(s, b, WorkerState.UNHEALTHY, "10 documents in a row failed")
        live = workers.listing(s, TIMEOUT)
        every = workers.listing(s, TIMEOUT, include_gone=True)
    assert [(v.row.id, v.health) for v in live] == [(b, "unhealthy")]
    assert [(v.row.id, v.health, v.alive) for v in every] == [(b, "unhealthy", True), (a, "gone", False)]
