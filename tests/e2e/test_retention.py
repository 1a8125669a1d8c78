"""Retention and backup through the CLI (issue 17 acceptance 5): after `enclave purge` a job's ciphertext and
results are gone (on the embedded default, from the database file itself), `audit verify` passes and the purge
is in the audit log; its results answer in one line that it was purged. `enclave db backup` copies the
embedded database (0600) and points PostgreSQL at pg_dump."""

from __future__ import annotations

import json
import os

from sqlalchemy import text

from tests.e2e.test_exactly_once import many_documents


def scalar(e, sql: str, **params):
    db = e.database()
    try:
        with db.engine.connect() as c:
            return c.execute(text(sql), params).scalar()
    finally:
        db.dispose()


def test_purge_removes_ciphertext_and_results_and_keeps_a_verifiable_audit_log(enclave, tmp_path):
    job = enclave.submit(
        str(many_documents(tmp_path / "docs", 6)), "--kind", "summarize", "--param", "max_tokens=8"
    )
    other = enclave.submit(
        str(many_documents(tmp_path / "more", 2)), "--kind", "summarize", "--param", "max_tokens=8"
    )
    enclave.work()
    enclave.run("results", job, "--out", str(tmp_path / "before"))
    ciphertext = scalar(enclave, "SELECT sealed FROM documents WHERE job_id = :j", j=job)[16:80]
    result = scalar(enclave, "SELECT sealed FROM results WHERE job_id = :j", j=job)[16:80]

    purged = enclave.json("purge", "--job", job[:8], "--yes")
    assert [(j["job_id"], j["documents"], j["results"]) for j in purged["jobs"]] == [(job, 6, 6)]
    assert scalar(enclave, "SELECT count(*) FROM documents WHERE job_id = :j", j=job) == 0
    assert scalar(enclave, "SELECT count(*) FROM results WHERE job_id = :j", j=job) == 0
    assert scalar(enclave, "SELECT count(*) FROM documents WHERE job_id = :j", j=other) == 2  # not that one
    assert enclave.json("audit", "verify")["ok"] is True
    [event] = [
        e for e in enclave.json("audit", "log", "--job", job, "--limit", "1000") if e["action"] == "purged"
    ]
    assert event["actor"] == enclave.json("keys", "show")["client"]["fingerprint"]
    assert (event["details"]["documents"], event["details"]["results"]) == (6, 6)
    refused = enclave.run("results", job, "--out", str(tmp_path / "after"), check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        f"error: the service refused the request (410 purged): job {job} was purged: its documents and "
        "results were deleted"
    )
    status = enclave.json("status", job)
    assert status["purged_at"] is not None and status["status"] == "completed"
    if enclave.backend == "embedded":  # deleted securely: the bytes are not left in the files either
        path = enclave.home / "enclave.db"
        files = b"".join(p.read_bytes() for p in (path, path.with_name("enclave.db-wal")) if p.exists())
        assert ciphertext not in files and result not in files

    everything = enclave.json("purge", "--older-than", "0s", "--yes")
    assert [j["job_id"] for j in everything["jobs"]] == [other]
    assert enclave.json("audit", "verify")["ok"] is True


def test_db_backup_copies_the_embedded_database_and_points_postgresql_at_pg_dump(enclave, tmp_path):
    target = tmp_path / "backups" / "enclave.db"
    proc = enclave.run("db", "backup", str(target), check=False)
    if enclave.backend == "servers":
        assert proc.returncode == 1
        assert proc.stderr.startswith("error: the database is postgresql: back it up with pg_dump")
        return
    copy = json.loads(enclave.run("db", "backup", str(tmp_path / "b2.db"), "--json").stdout)
    assert proc.returncode == 0 and target.exists() and copy["audit_events"] > 0
    assert os.stat(target).st_mode & 0o777 == 0o600
    again = enclave.run("db", "backup", str(target), check=False)
    assert again.returncode == 1 and "exists; give another file, or --force" in again.stderr
    verify = enclave.run(
        "audit", "verify", "--json", env=enclave.env | {"ENCLAVE_DATABASE_URL": f"sqlite:///{target}"}
    )
    assert json.loads(verify.stdout)["ok"] is True
