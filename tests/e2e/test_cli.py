"""CLI details: idempotent init, keys and allow-list commands, passphrase-protected keys, status --watch."""

import json
import os
import stat

from pipeline.migrate import head_revision
from tests.e2e.conftest import NOTES, Enclave, _env


def test_init_is_idempotent_and_keys_are_private(embedded):
    again = embedded.json("init")
    assert again["created"] == []
    for who in ("service", "client"):
        for name in ("x25519.pem", "ed25519.pem"):
            mode = stat.S_IMODE(os.stat(embedded.home / who / name).st_mode)
            assert mode == 0o600, (who, name, oct(mode))
    shown = embedded.json("keys", "show")
    assert shown["service"]["fingerprint"] == again["service_fingerprint"]
    listed = embedded.json("clients", "list")
    assert [c["fingerprint"] for c in listed] == [again["client_fingerprint"]] and listed[0][
        "revoked_at"
    ] is None


def test_passphrase_protected_keys(tmp_path, demo_model):
    env = _env(
        tmp_path,
        demo_model,
        {"ENCLAVE_SERVICE_PASSPHRASE": "service secret", "ENCLAVE_CLIENT_PASSPHRASE": "client secret"},
    )
    e = Enclave(env, tmp_path, "embedded")
    e.run("init")
    assert b"ENCRYPTED PRIVATE KEY" in (e.home / "client" / "x25519.pem").read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in (e.home / "service" / "ed25519.pem").read_bytes()
    job = e.submit(str(NOTES / "note-03-fracture.txt"), "--kind", "summarize", "--param", "max_tokens=8")
    e.work()
    assert e.json("status", job)["done"] == 1
    e.env.pop("ENCLAVE_CLIENT_PASSPHRASE")
    proc = e.run("results", job, "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 1 and "passphrase" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    e.env["ENCLAVE_CLIENT_PASSPHRASE"] = "wrong"
    proc = e.run("results", job, "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 1 and "wrong passphrase" in proc.stderr


def test_status_watch_and_results_before_completion(embedded, tmp_path):
    job = embedded.submit(
        str(NOTES / "note-03-fracture.txt"), "--kind", "summarize", "--param", "max_tokens=8"
    )
    early = embedded.run("results", job, "--out", str(tmp_path / "early"), check=False)
    assert early.returncode == 1 and "still queued" in early.stderr and "--partial" in early.stderr
    partial = embedded.json("results", job[:8], "--out", str(tmp_path / "partial"), "--partial")
    assert partial["documents"] == 1 and partial["done"] == 0
    embedded.work()
    watched = embedded.run("status", job, "--watch")
    assert "completed" in watched.stdout
    status = embedded.json("status", job[:10])  # a unique prefix of the id is enough
    assert status["job_id"] == job and status["status"] == "completed"
    assert {"job_id", "status", "total", "done", "failed"} <= set(status)
    line = json.loads((tmp_path / "partial" / "results.jsonl").read_text())
    assert line == {"document": "note-03-fracture.txt", "status": "pending", "output": None, "error": None}


def test_priority_orders_work_on_redis(tmp_path, demo_model, pg_url):
    import redis

    from tests.e2e.conftest import REDIS_DB

    client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    client.flushdb()
    e = Enclave(
        _env(
            tmp_path,
            demo_model,
            {"ENCLAVE_DATABASE_URL": pg_url, "ENCLAVE_BROKER_URL": f"redis://127.0.0.1:6379/{REDIS_DB}"},
        ),
        tmp_path,
        "servers",
    )
    e.run("init")
    notes = [str(NOTES / "note-01-chest-pain.txt"), str(NOTES / "note-02-pneumonia.txt")]
    low = e.submit(*notes, "--kind", "summarize", "--param", "max_tokens=8", "--priority", "0")
    high = e.submit(*notes, "--kind", "summarize", "--param", "max_tokens=8", "--priority", "9")
    e.run("worker", "--until-idle", "--concurrency", "1")
    started = {
        ev["job_id"]: ev["seq"]
        for ev in e.json("audit", "log", "--limit", "500")
        if ev["action"] == "started"
    }
    client.flushdb()
    assert started[high] < started[low]


def test_keys_create_and_db_commands(embedded, tmp_path):
    refused = embedded.run("keys", "create", check=False)
    assert refused.returncode == 1 and "overwrite" in refused.stderr.lower()
    other = Enclave({**embedded.env, "ENCLAVE_HOME": str(tmp_path / "other-home")}, tmp_path, "embedded")
    created = other.run("keys", "create")
    fingerprint = created.stdout.split()[-1]
    assert len(fingerprint) == 64 and (tmp_path / "other-home" / "client" / "public.json").exists()
    assert f"revision {head_revision()}" in embedded.run("db", "upgrade").stdout
    assert "revision 0001" in embedded.run("db", "downgrade", "0001").stdout
    assert f"revision {head_revision()}" in embedded.run("db", "upgrade").stdout
    assert embedded.json("jobs") == []


def test_plain_celery_worker_serves_jobs(embedded):
    import subprocess
    import sys
    import time

    job = embedded.submit(str(NOTES / "note-05-asthma.txt"), "--kind", "summarize", "--param", "max_tokens=8")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "pipeline.celery_app",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "2",
            "--loglevel",
            "WARNING",
        ],
        env=embedded.env,
        cwd=embedded.tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and embedded.json("status", job)["status"] != "completed":
            time.sleep(0.5)
    finally:
        embedded.kill(proc)
    assert embedded.json("status", job)["done"] == 1
