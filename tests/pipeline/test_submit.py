"""Submit: idempotent by job id, resumable after a kill, invisible to workers while uploading, a bad file
name fails alone; and (slow) linear in the number of documents without stopping other jobs."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from pipeline import client, envelope, keys, migrate, store, upload
from pipeline.db import Database
from pipeline.home import add_client
from pipeline.models import AuditEvent, Document, Job
from pipeline.settings import Limits, Settings


def make_session(home: Path, db_url: str, service: keys.Identity, **limits) -> client.ClientSession:
    """A client identity in `home`, allow-listed in the database at `db_url`, submitting to `service`."""
    settings = Settings(
        home=home,
        database_url=db_url,
        broker_url=f"sqla+sqlite:///{home / 'broker.db'}",
        model=None,
        limits=Limits(**limits),
    )
    keys.save_identity(service, settings.service_key_dir, None)
    identity = keys.generate_identity()
    keys.save_identity(identity, settings.client_key_dir, None)
    db = Database(db_url)
    with db.transaction() as s:
        add_client(s, home.name, identity.public, actor=service.public.fingerprint)
    db.dispose()
    return client.ClientSession(settings)


@pytest.fixture
def service(db_url) -> keys.Identity:
    db = Database(db_url)
    migrate.upgrade(db.engine)
    db.dispose()
    return keys.generate_identity()


@pytest.fixture
def session(tmp_path, db_url, service):
    s = make_session(tmp_path / "alice", db_url, service)
    yield s
    s.close()


def notes(folder: Path, n: int, start: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        (folder / f"note-{i:05d}.txt").write_text(f"note {i}: nothing to report\n")
    return folder


def database(session: client.ClientSession) -> Database:
    """The database behind the session's (in-process) service, opened by the test to look at its rows."""
    return Database(session.settings.database_url)


def job_row(session: client.ClientSession, job_id: str) -> tuple[Job, list[Document]]:
    db = database(session)
    with db.transaction() as s:
        job = s.get(Job, job_id)
        docs = s.scalars(select(Document).where(Document.job_id == job_id).order_by(Document.index)).all()
    db.dispose()
    return job, list(docs)


def count(session: client.ClientSession, query) -> int:
    db = database(session)
    with db.transaction() as s:
        n = s.scalar(select(func.count()).select_from(query.subquery()))
    db.dispose()
    return n


def test_same_job_id_returns_the_submitted_job(session, tmp_path):
    folder = notes(tmp_path / "docs", 5)
    job_id = client.new_job_id()
    announced = []
    first = client.submit_files(session, [folder], "summarize", {}, job_id=job_id, announce=announced.append)
    assert (first.job_id, first.documents, first.existing, announced) == (job_id, 5, False, [job_id])
    again = client.submit_files(
        session, [folder], "summarize", {}, job_id=job_id.upper(), announce=announced.append
    )
    assert (again.job_id, again.documents, again.existing, announced) == (job_id, 5, True, [job_id])
    assert count(session, select(Job.id)) == 1
    assert count(session, select(Document.id)) == 5
    assert count(session, select(AuditEvent.seq).where(AuditEvent.action == "submitted")) == 1
    job, docs = job_row(session, job_id)
    assert job.status == "queued" and job.upload_token is None and job.total == 5
    assert all(d.dispatched_at is not None for d in docs)
    manifest = json.loads(job.manifest)
    assert [e["id"] for e in manifest["documents"]] == [d.id for d in docs]


def test_job_id_must_be_a_uuid(session, tmp_path):
    with pytest.raises(client.ClientError, match="must be a UUID"):
        client.submit_files(session, [notes(tmp_path / "docs", 1)], "summarize", {}, job_id="job-1")


def test_another_clients_job_id_is_refused(session, tmp_path, db_url, service):
    folder = notes(tmp_path / "docs", 2)
    job_id = client.submit_files(session, [folder], "summarize", {}).job_id
    bob = make_session(tmp_path / "bob", db_url, service)
    try:
        with pytest.raises(client.ClientError, match="another client"):
            client.submit_files(bob, [folder], "summarize", {}, job_id=job_id)
    finally:
        bob.close()
    job, docs = job_row(session, job_id)
    assert job.client_fingerprint == session.fingerprint and len(docs) == 2


def test_killed_upload_is_invisible_then_restarted_cleanly(session, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "CHUNK_ROWS", 3)
    folder = notes(tmp_path / "docs", 10)
    job_id = client.new_job_id()

    read_files = client._read_files

    def killed(files, limit):  # the submit dies while reading the 8th file: two chunks are stored
        for i, doc in enumerate(read_files(files, limit)):
            if i == 7:
                raise KeyboardInterrupt
            yield doc

    with monkeypatch.context() as m:
        m.setattr(client, "_read_files", killed)
        with pytest.raises(KeyboardInterrupt):
            client.submit_files(session, [folder], "summarize", {}, job_id=job_id)
    job, docs = job_row(session, job_id)
    assert job.status == "uploading" and len(docs) == 6
    db = database(session)
    with db.transaction() as s:  # workers, the sweeper and idle checks ignore the job
        assert store.shards_to_dispatch(s, lease_seconds=0) == []
        assert not store.has_open_work(s)
        assert not store.complete_job_if_finished(s, job_id, "worker:test")
    db.dispose()
    assert count(session, select(AuditEvent.seq).where(AuditEvent.action == "submitted")) == 0

    (folder / "note-00010.txt").write_text("added before the resubmit\n")
    result = client.submit_files(session, [folder], "summarize", {}, job_id=job_id)
    assert (result.documents, result.existing) == (11, False)
    job, docs = job_row(session, job_id)
    assert job.status == "queued" and job.total == 11 and [d.index for d in docs] == list(range(11))
    assert {e["id"] for e in json.loads(job.manifest)["documents"]} == {d.id for d in docs}
    assert count(session, select(AuditEvent.seq).where(AuditEvent.action == "submitted")) == 1


def test_a_later_submit_with_the_same_id_takes_the_upload_over(session):
    job_id = client.new_job_id()
    db = database(session)
    first = upload.begin(db, job_id, session.fingerprint, "summarize", None, 0)
    second = upload.begin(db, job_id, session.fingerprint, "summarize", None, 0)
    with pytest.raises(upload.UploadError, match="taken over"):
        first.insert([])
    with pytest.raises(upload.UploadError, match="taken over"):
        first.finish("{}", b"", b"", 0, {})
    second.finish("{}", b"", b"", 0, {})  # the owner can queue it (an empty job completes at once)
    db.dispose()
    assert job_row(session, job_id)[0].status == "completed"


def test_results_of_a_job_still_uploading_are_refused(session):
    job_id = client.new_job_id()
    db = database(session)
    upload.begin(db, job_id, session.fingerprint, "summarize", None, 0)
    db.dispose()
    for partial in (False, True):
        with pytest.raises(client.ClientError, match=f"still uploading.*--job-id {job_id}"):
            client.fetch_results(session, job_id, partial=partial)


def test_a_batch_file_with_bad_lines_stores_each_as_failed_alone(session, tmp_path):
    good = {"custom_id": "good", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": ' + "[" * 100_000
    batch = tmp_path / "secret-batch-name.jsonl"
    batch.write_text(json.dumps(good) + "\n" + deep + "]" * 100_000 + "}\n" + '{"no": "id"' + "\n")
    result = client.submit_openai_batch(session, batch, name="ward 3")
    job, docs = job_row(session, result.job_id)
    assert job.name == "" and client.job_name(session, client.job_status(session, job.id)) == "ward 3"
    names = [envelope.open_name(d.sealed_name, session.identity, job.id, d.id) for d in docs]
    assert names == ["good", "deep", "line 3"]
    assert [d.status for d in docs] == ["pending", "failed", "failed"]
    assert docs[1].error == "invalid_request_error: line 2: body is nested more than 63 levels deep"
    assert docs[2].error.startswith("invalid_request_error: line 3: is not valid JSON (")
    assert [r[0] for r in result.rejected] == ["deep", "line 3"]

    dupes = tmp_path / "dupes.jsonl"
    dupes.write_text(json.dumps(good) + "\n" + json.dumps(good | {"body": {"prompt": "SECRET"}}) + "\n")
    with pytest.raises(client.BatchFileError) as excinfo:
        client.submit_openai_batch(session, dupes)
    assert str(excinfo.value) == "the batch file has 1 problem: line 2: duplicate custom_id (first on line 1)"


def test_a_job_id_of_another_kind_is_refused(session, tmp_path):
    folder = notes(tmp_path / "docs", 1)
    job_id = client.submit_files(session, [folder], "summarize", {}).job_id
    with pytest.raises(client.ClientError, match="is a summarize job"):
        client.submit_files(session, [folder], "code-review", {}, job_id=job_id)


@pytest.mark.skipif(os.uname().sysname == "Darwin", reason="macOS refuses file names that are not UTF-8")
def test_an_undecodable_file_name_fails_alone(session, tmp_path):
    folder = notes(tmp_path / "docs", 1)
    (folder / os.fsdecode(b"caf\xe9-secret.txt")).write_text("private\n")
    result = client.submit_files(session, [folder], "summarize", {})
    assert result.documents == 2
    assert result.rejected == [("caf\\xe9-secret.txt", client.NAME_NOT_UNICODE)]
    job, docs = job_row(session, result.job_id)
    assert [(d.status, d.sealed is None, d.error) for d in docs] == [
        ("failed", True, client.NAME_NOT_UNICODE),
        ("pending", False, None),
    ]
    sealed_name = envelope.open_name(docs[0].sealed_name, session.identity, job.id, docs[0].id)
    assert sealed_name == "caf\\xe9-secret.txt"  # what the submitter's results will call it


def test_chunks_are_bounded_in_rows_and_bytes(session, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "CHUNK_ROWS", 4)
    monkeypatch.setattr(client, "CHUNK_BYTES", 600)  # a sealed note and its sealed name are about 300 bytes
    chunks = []
    send = session.api.add_documents
    monkeypatch.setattr(
        session.api, "add_documents", lambda job, chunk: (chunks.append(chunk), send(job, chunk))[1]
    )
    result = client.submit_files(session, [notes(tmp_path / "docs", 10)], "summarize", {})
    assert sum(len(c.documents) for c in chunks) == result.documents == 10
    sizes = [sum(len(r.sealed) + len(r.sealed_name) for r in c.documents) for c in chunks]
    assert all(len(c.documents) <= 4 for c in chunks) and max(sizes) <= 600, sizes
    assert len(chunks) > 10 / 4


# Acceptance (issue 12): submit time is linear, and other jobs keep going during a large submit. Shards of 100
# documents keep the broker's share small (one message per shard, one SQLite commit each in broker.db).


WORKER = "worker:test"


def _timed_submit(session: client.ClientSession, folder: Path) -> float:
    start = time.perf_counter()
    client.submit_files(session, [folder], "summarize", {})
    return time.perf_counter() - start


@pytest.mark.slow  # about 35 s per back-end on 2 cores
def test_submit_time_is_linear(tmp_path, db_url, service):
    """10,000 documents take about 4x the time of 2,500 (the quadratic submit this replaces took over 10x).

    A linear submit sits just under 4x: its fixed costs are all that keep it below, and its time is mostly
    sealing, measured here at 3.97x in CPU time (sorting the file names is n log n). On a shared machine one
    slow run moves the ratio by 10% or more (4.40x with `make test`'s other pytest-xdist worker on the second
    core), so each size runs twice, the best run counts, and 5.5x is allowed: a quadratic submit is 16x."""
    session = make_session(tmp_path / "alice", db_url, service, shard_size=100)
    try:
        small, large = notes(tmp_path / "small", 2_500), notes(tmp_path / "large", 10_000)
        _timed_submit(session, notes(tmp_path / "warm", 50))
        runs = [(_timed_submit(session, small), _timed_submit(session, large)) for _ in range(2)]
    finally:
        session.close()
    t_small, t_large = (min(times) for times in zip(*runs, strict=True))
    print(f"submit: 2,500 documents {t_small:.2f} s, 10,000 {t_large:.2f} s, {t_large / t_small:.2f}x")
    assert t_large <= 5.5 * t_small, runs


@pytest.mark.slow  # about 20 s per back-end on 2 cores
def test_other_jobs_progress_during_a_large_submit(tmp_path, db_url, service):
    """A worker (direct store calls) finishes another job's documents while 4,000 documents upload."""
    session = make_session(tmp_path / "alice", db_url, service, shard_size=100)
    other = client.submit_files(session, [notes(tmp_path / "other", 1_000)], "summarize", {}).job_id
    large = notes(tmp_path / "large", 4_000)
    failures: list[BaseException] = []
    ended: list[float] = []

    def submit() -> None:
        try:
            client.submit_files(session, [large], "summarize", {})
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        ended.append(time.perf_counter())

    worker = Database(db_url)
    finished: list[float] = []
    thread = threading.Thread(target=submit)
    start = time.perf_counter()
    thread.start()
    try:
        for shard in range(10):
            if not thread.is_alive():
                break
            with worker.transaction() as s:
                ids = [d.id for d in store.lease(s, other, shard, WORKER, 300, 3)[0]]
            for doc_id in ids:
                try:
                    with worker.transaction() as s:
                        store.finish_document(
                            s, doc_id, "worker:test", "done", b"sealed", None, "worker:test"
                        )
                except OperationalError as exc:
                    failures.append(exc)
                finished.append(time.perf_counter())
                if not thread.is_alive():
                    break
    finally:
        thread.join()
        worker.dispose()
        session.close()
    assert not failures, failures  # no "database is locked", no error in the submit
    during = [t for t in finished if t <= ended[0]]
    gaps = [b - a for a, b in zip([start, *during], during, strict=False)]
    upload_s, longest = ended[0] - start, max(gaps)
    print(
        f"upload {upload_s:.1f} s: the other job finished {len(during)} documents, longest gap {longest:.2f}s"
    )
    # Inserts go in chunks of 500 rows, each its own short transaction: no wait comes near a fifth of the
    # upload. (One transaction for the whole submit, as before, stopped the other job for about half of it.)
    assert len(during) >= 20 and longest < min(2.0, upload_s / 5), (upload_s, len(during), longest)
