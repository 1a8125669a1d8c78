"""kill -9 the worker mid-job, several times at random points; a new worker finishes the job with exactly one
result per document. Cancel stops a job and records it."""

import random
import time

from sqlalchemy import text

from tests.e2e.conftest import NOTES


def many_documents(folder, count):
    folder.mkdir()
    source = (NOTES / "note-02-pneumonia.txt").read_text()
    for i in range(count):
        (folder / f"doc-{i:02d}.txt").write_text(f"Document {i}.\n{source}")
    return folder


def counts(enclave, job):
    db = enclave.database()
    with db.engine.connect() as c:
        done = c.execute(
            text("SELECT count(*) FROM documents WHERE job_id = :j AND status IN ('done', 'failed')"),
            {"j": job},
        ).scalar_one()
        results = c.execute(text("SELECT count(*) FROM results WHERE job_id = :j"), {"j": job}).scalar_one()
    db.dispose()
    return done, results


def wait_for(predicate, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_kill_9_mid_job_then_resume(enclave, tmp_path):
    rng = random.Random(7)
    total = 20
    job = enclave.submit(
        str(many_documents(tmp_path / "docs", total)), "--kind", "summarize", "--param", "max_tokens=24"
    )
    killed_at = []
    for _ in range(3):
        before, _ = counts(enclave, job)
        worker = enclave.start_worker()
        # wait until this worker has made progress, then a random extra moment, then kill it hard
        assert wait_for(lambda before=before: counts(enclave, job)[0] > before)
        time.sleep(rng.uniform(0.0, 1.5))
        enclave.kill(worker)
        killed_at.append(counts(enclave, job)[0])
        if killed_at[-1] == total:
            break
    assert killed_at[0] < total, "the first worker finished before it could be killed"
    enclave.work()
    status = enclave.json("status", job)
    assert status["status"] == "completed" and status["done"] == total
    done, results = counts(enclave, job)
    assert (done, results) == (total, total)
    db = enclave.database()
    with db.engine.connect() as c:
        per_doc = c.execute(
            text(
                "SELECT d.id, count(r.document_id) FROM documents d "
                "LEFT JOIN results r ON r.document_id = d.id WHERE d.job_id = :j GROUP BY d.id"
            ),
            {"j": job},
        ).all()
        attempts = c.execute(
            text("SELECT max(attempts) FROM documents WHERE job_id = :j"), {"j": job}
        ).scalar()
    db.dispose()
    assert all(n == 1 for _, n in per_doc) and len(per_doc) == total
    assert attempts == 0  # crashes are not failures: they count in lease_expiries
    assert enclave.json("audit", "verify")["ok"] is True
    finished = [
        e
        for e in enclave.json("audit", "log", "--job", job, "--limit", "1000")
        if e["action"] in ("document_done", "document_failed")
    ]
    assert len(finished) == total  # one audit event per document, however many workers died


def test_cancel_stops_a_job_and_is_recorded(embedded, tmp_path):
    # Enough work that the job cannot finish in the seconds between the first result and the cancel (16
    # documents of 24 tokens once did, on a busy CI machine: "job ... is already completed").
    total = 64
    job = embedded.submit(
        str(many_documents(tmp_path / "docs", total)), "--kind", "summarize", "--param", "max_tokens=48"
    )
    worker = embedded.start_worker()
    assert wait_for(lambda: counts(embedded, job)[0] >= 1)
    cancelled = embedded.json("cancel", job)
    assert cancelled["status"] == "cancelled"
    embedded.kill(worker)
    embedded.work()
    status = embedded.json("status", job)
    assert status["status"] == "cancelled" and status["cancelled"] > 0
    assert status["done"] + status["failed"] + status["cancelled"] == total
    done, results = counts(embedded, job)
    assert results == done < total  # nothing was processed after the cancel
    events = [e["action"] for e in embedded.json("audit", "log", "--job", job, "--limit", "1000")]
    assert "cancelled" in events and "completed" not in events
    out = tmp_path / "out"
    embedded.run("results", job, "--out", str(out))
    assert "cancelled" in (out / "results.jsonl").read_text()
