"""Purging through the service API, on SQLite and PostgreSQL: administrators only; a job still running is
refused; a purged job's documents, results and sealed name are gone (on SQLite, from the database file and
its write-ahead log too), its row says when, its results answer 410, the audit log still verifies and
records the purge; --older-than purges exactly the jobs that ended before the cut-off."""

import json
import os
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from pipeline import api_client, audit, client, store
from pipeline.models import AuditEvent, Client, Document, Job, Result, utcnow
from pipeline.wire.messages import PurgeRequest
from tests.pipeline.test_submit import database, make_session, notes, service  # noqa: F401 (a fixture)

SECRET = b"RESULT-CANARY-7f3e"  # the sealed result bytes a worker would store


@pytest.fixture
def alice(tmp_path, db_url, service):  # noqa: F811
    s = make_session(tmp_path / "alice", db_url, service)
    yield s
    s.close()


@pytest.fixture
def admin(tmp_path, db_url, service):  # noqa: F811
    s = make_session(tmp_path / "admin", db_url, service)
    db = database(s)
    with db.transaction() as t:
        t.execute(update(Client).where(Client.fingerprint == s.fingerprint).values(role="admin"))
    db.dispose()
    yield s
    s.close()


def finish(session, job_id: str) -> None:
    """Finish every document of the job as a worker would: leased, then done with a sealed result."""
    db = database(session)
    with db.transaction() as s:
        shards = s.scalars(select(Document.shard).where(Document.job_id == job_id).distinct()).all()
        for shard in shards:
            leased, _ = store.lease(s, job_id, shard, "w", 60, 3)
            for doc in leased:
                store.finish_document(s, doc.id, "w", "done", SECRET + doc.id.encode(), None, "w")
    db.dispose()


def submit(session, tmp_path, name: str, count: int = 3) -> str:
    return client.submit_files(session, [notes(tmp_path / name, count)], "summarize", {}).job_id


def files_of(db_url: str) -> bytes:
    """The SQLite database's bytes, its write-ahead log's included."""
    path = db_url.removeprefix("sqlite:///")
    return b"".join(open(p, "rb").read() for p in (path, path + "-wal") if os.path.exists(p))


def sealed_documents(session, job_id: str) -> list[bytes]:
    db = database(session)
    with db.transaction() as s:
        found = s.scalars(select(Document.sealed).where(Document.job_id == job_id)).all()
    db.dispose()
    return found


def test_purge_removes_a_jobs_ciphertext_and_results_and_is_audited(alice, admin, tmp_path, db_url):
    job = submit(alice, tmp_path, "docs")
    with pytest.raises(api_client.ServiceError) as refused:
        admin.api.purge(PurgeRequest(job=job[:8]))
    assert refused.value.status == 409 and "cancel it first" in str(refused.value)
    ciphertexts = sealed_documents(alice, job)
    finish(alice, job)
    with pytest.raises(api_client.ServiceError) as forbidden:
        alice.api.purge(PurgeRequest(job=job))
    assert forbidden.value.status == 403

    sqlite = db_url.startswith("sqlite")
    if sqlite:  # before: the ciphertext and the results are in the files
        assert SECRET in files_of(db_url) and all(c[16:80] in files_of(db_url) for c in ciphertexts)
    report = admin.api.purge(PurgeRequest(job=job[:8]))
    assert [(j.job_id, j.documents, j.results) for j in report.jobs] == [(job, 3, 3)]
    db = database(alice)
    with db.transaction() as s:
        row = s.get(Job, job)
        assert (row.status, row.sealed_name, row.sealed_params) == ("completed", None, None)
        assert row.purged_at is not None and row.manifest  # ids and hashes stay, signed
        assert s.scalar(select(func.count()).select_from(Document).where(Document.job_id == job)) == 0
        assert s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job)) == 0
        assert audit.verify(s, verify_signature=lambda *_: True).ok
        event = s.scalars(select(AuditEvent).where(AuditEvent.action == "purged")).one()
        assert (event.job_id, event.actor) == (job, admin.fingerprint)
    db.dispose()
    assert client.job_status(alice, job).purged_at is not None
    with pytest.raises(api_client.ServiceError) as gone:
        list(client.iter_results(alice, job)[1])
    assert gone.value.status == 410
    assert admin.api.purge(PurgeRequest(job=job)).jobs[0].documents == 0  # again: nothing more
    if sqlite:  # after: secure_delete and a truncated WAL leave none of it in the files
        files = files_of(db_url)
        assert SECRET not in files and not any(c[16:80] in files for c in ciphertexts)


def test_older_than_purges_the_jobs_that_ended_before_the_cut_off(alice, admin, tmp_path):
    old, recent, running = (submit(alice, tmp_path, name) for name in ("old", "recent", "running"))
    for job in (old, recent):
        finish(alice, job)
    db = database(alice)
    with db.transaction() as s:
        s.execute(update(Job).where(Job.id == old).values(finished_at=utcnow() - timedelta(days=40)))
    report = admin.api.purge(PurgeRequest(older_than_seconds=30 * 86_400))
    assert [j.job_id for j in report.jobs] == [old]
    assert admin.api.purge(PurgeRequest(older_than_seconds=30 * 86_400)).jobs == []
    with db.transaction() as s:
        kept = s.scalar(
            select(func.count()).select_from(Document).where(Document.job_id.in_([recent, running]))
        )
        assert kept == 6
        [event] = s.scalars(select(AuditEvent).where(AuditEvent.action == "purged")).all()
        assert json.loads(event.details) == {
            "rule": "older_than",
            "older_than_s": 30 * 86_400,
            "status": "completed",
            "documents": 3,
            "results": 3,
            "by_status": {"done": 3},
        }
    db.dispose()


def test_a_purge_request_names_a_job_or_an_age_not_both():
    with pytest.raises(ValueError, match="not both"):
        PurgeRequest(job="x", older_than_seconds=1)
    with pytest.raises(ValueError, match="not both"):
        PurgeRequest()
