"""Issue 17's fault-injection test, on the embedded default and on PostgreSQL with Redis: a 200-document job
through ten kill -9s of workers, a broker that loses its messages mid-job (the embedded broker's file
deleted, then its first page overwritten; Redis restarted without persistence), and a shard that runs for
more than three lease periods. It ends with every document done with exactly one result, no attempt spent
(no document failed), each document leased again exactly once per kill that caught it holding it (so none
generated twice except after a kill), each broker loss noticed (the database's broker marker swapped by a
rebuild before the next kill), the slow shard never taken over, and the audit log intact.

Slow: about a minute per back-end on 2 cores (ten worker start-ups are most of it)."""

from __future__ import annotations

import json
import random
import socket
import sqlite3
import subprocess
import time
import uuid
from collections import Counter
from contextlib import closing
from datetime import datetime
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from tests.e2e.conftest import NOTES, Enclave, _env
from tests.e2e.test_exactly_once import wait_for

KILLS = 10
LEASE = 3.0  # seconds; heartbeats every 0.5 s renew it, and a worker silent for 5 s is gone
SLOW = (NOTES / "note-04-diabetes-review.txt").read_text()  # no end of text in its first 1,700 tokens


class RedisServer:
    """A redis-server of this test's own, on a free port, without persistence: a restart loses everything
    (the shared server on 6379 is never restarted)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=self.folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        assert wait_for(lambda: _pings(client), 10), "redis-server did not start"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        time.sleep(1.0)
        self.start()


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False


@pytest.fixture(params=["embedded", "servers"])
def faulty(request, tmp_path, demo_model):
    server = None
    overrides = {
        "ENCLAVE_LEASE_SECONDS": str(LEASE),
        "ENCLAVE_HEARTBEAT_SECONDS": "0.5",
        "ENCLAVE_HEARTBEAT_TIMEOUT": "5",
        "ENCLAVE_SHARD_SIZE": "4",
    }
    if request.param == "servers":
        server = RedisServer(tmp_path)
        server.start()
        overrides |= {
            "ENCLAVE_DATABASE_URL": request.getfixturevalue("pg_url"),
            "ENCLAVE_BROKER_URL": server.url,
        }
    e = Enclave(_env(tmp_path, demo_model, {}) | overrides, tmp_path, request.param)
    e.redis = server
    e.run("init")
    yield e
    if server is not None:
        server.stop()


def query(e: Enclave, sql: str, **params) -> list:
    db = e.database()
    try:
        with db.engine.connect() as c:
            return c.execute(text(sql), params).all()
    finally:
        db.dispose()


def marker(e: Enclave) -> str | None:
    """The database's copy of the marker written into the broker (`pipeline/rebuild.py`)."""
    rows = query(e, "SELECT marker FROM broker_marker WHERE id = 1")
    return rows[0].marker if rows else None


def holding(e: Enclave, owner: str) -> list[str]:
    rows = query(e, "SELECT id FROM documents WHERE lease_owner = :o AND status = 'leased'", o=owner)
    return [r.id for r in rows]


def start_worker(e: Enclave) -> subprocess.Popen:
    """A worker whose PostgreSQL connections carry a name of its own (libpq reads PGAPPNAME), for `kill`."""
    name = f"fault-worker-{uuid.uuid4().hex[:12]}"  # the server's connections are every test's
    proc = e.start_worker(env=e.env | {"PGAPPNAME": name})
    proc.app_name = name
    return proc


def may_commit(e: Enclave, name: str) -> int:
    """How many server connections of the worker `name` may still commit: all but those gone and those stuck
    on a lock inside a statement (the client sends COMMIT only after a statement's result: theirs never
    comes)."""
    return query(
        e,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = :name "
        "AND (wait_event_type IS DISTINCT FROM 'Lock' OR query = 'COMMIT')",
        name=name,
    )[0].n


def kill(e: Enclave, proc: subprocess.Popen) -> None:
    """kill -9 a worker. On PostgreSQL, then wait until the server settled what it had sent: a COMMIT sent
    just before the kill lands after it, so what the worker held is read only once its connections can no
    longer commit (SQLite: its commits are in the file, or not at all, once it is dead)."""
    if e.backend != "servers":
        e.kill(proc)
        return
    name = proc.app_name
    assert may_commit(e, name), "the worker's connections do not carry its name"
    e.kill(proc)
    left = "SELECT state, wait_event, query FROM pg_stat_activity WHERE application_name = :name"
    assert wait_for(lambda: may_commit(e, name) == 0, 60), query(e, left, name=name)


def write_documents(folder: Path, count: int) -> Path:
    folder.mkdir()
    source = (NOTES / "note-02-pneumonia.txt").read_text()
    for i in range(count):
        (folder / f"doc-{i:03d}.txt").write_text(f"Document {i}.\n{source}")
    return folder


def break_broker(e: Enclave, fault: str) -> None:
    broker = e.home / "broker.db"
    if fault == "delete":
        broker.unlink()
    elif fault == "corrupt":
        # A worker killed inside a broker transaction leaves a hot journal, from which SQLite would restore
        # the first page: the corruption is of the file as it stands, journal and all. A worker's commit in
        # flight writes its copy of the first page back, healing the file: then it is corrupted again, until
        # it stays unreadable (a transaction begun after the corruption cannot read the file, so none heals
        # it later).
        moved = set(broker.parent.glob("broker.db.unreadable-*"))
        for _ in range(20):
            broker.with_name("broker.db-journal").unlink(missing_ok=True)
            with open(broker, "r+b") as f:
                f.write(random.Random(1).randbytes(4096))  # the first page, its header included
            time.sleep(0.5)
            if set(broker.parent.glob("broker.db.unreadable-*")) - moved or not readable(broker):
                return  # a worker saw it (and moved it aside), or it is still unreadable
        raise AssertionError("the broker's file healed itself 20 times")
    elif fault == "restart":
        e.redis.restart()


def readable(path: Path) -> bool:
    """Whether SQLite can read the database at `path` (its schema)."""
    try:
        with closing(sqlite3.connect(path, timeout=5)) as c:
            c.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return True
    except sqlite3.OperationalError:  # locked by a writer: not known to be unreadable
        return True
    except sqlite3.DatabaseError:  # "file is not a database"
        return False


@pytest.mark.slow
def stop_all(workers: list[subprocess.Popen]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
    for proc in workers:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_job_survives_kills_a_lost_broker_and_a_shard_slower_than_three_leases(faulty, tmp_path, request):
    e = faulty
    rng = random.Random(17)
    faults = {4: "delete", 7: "corrupt"} if e.backend == "embedded" else {4: "restart"}
    job = e.submit(
        str(write_documents(tmp_path / "docs", 200)), "--kind", "summarize", "--param", "max_tokens=32"
    )
    workers = [start_worker(e), start_worker(e)]
    request.addfinalizer(lambda: stop_all(workers))  # a failure mid-test leaves no worker running
    held: Counter[str] = Counter()  # document -> kills that caught a worker holding it
    kills, start = 0, time.monotonic()
    while kills < KILLS:
        assert time.monotonic() - start < 300, f"only {kills} kills in 300 s"
        for proc in list(workers):
            owner = e.worker_id(proc.pid)
            if owner is None or not holding(e, owner):
                continue
            time.sleep(rng.uniform(0.0, 0.6))  # mid-shard: some of its documents may be recorded by now
            kill(e, proc)
            held.update(holding(e, owner))
            kills += 1
            workers.remove(proc)
            workers.append(start_worker(e))
            if kills in faults:
                before = marker(e)
                assert before is not None  # the workers' first broker check gave the database its marker
                break_broker(e, faults[kills])
                # Each loss is noticed: the worker that rebuilds the broker swaps the database's marker first
                # (its log line may die with it, when the next kill takes it right after).
                assert wait_for(lambda b=before: marker(e) != b, 60), f"{faults[kills]}: the loss went unseen"
            break
        time.sleep(0.05)
    status = e.json("status", job)
    assert status["done"] + status["failed"] < 200, "the job ended before the faults were all made"

    slow_env = e.env | {"ENCLAVE_SHARD_SIZE": "8"}  # one shard: 3 documents of 1,700 tokens each
    slow_docs = tmp_path / "slow"
    slow_docs.mkdir()
    for i in range(3):
        (slow_docs / f"long-{i}.txt").write_text(SLOW)
    slow = e.run(
        "submit", str(slow_docs), "--kind", "summarize", "--param", "max_tokens=1700", "--json", env=slow_env
    )
    slow_job = json.loads(slow.stdout)["job_id"]
    assert wait_for(lambda: {e.json("status", j)["status"] for j in (job, slow_job)} == {"completed"}, 300)
    stop_all(workers)

    docs = query(
        e,
        "SELECT d.id, d.job_id, d.status, d.attempts, d.lease_expiries, count(r.document_id) AS results "
        "FROM documents d LEFT JOIN results r ON r.document_id = d.id "
        "WHERE d.job_id IN (:a, :b) GROUP BY d.id, d.job_id, d.status, d.attempts, d.lease_expiries",
        a=job,
        b=slow_job,
    )
    assert len(docs) == 203
    assert all(d.status == "done" and d.results == 1 and d.attempts == 0 for d in docs), [
        d for d in docs if d.status != "done" or d.results != 1 or d.attempts
    ]
    twice = {d.id: (d.lease_expiries, held[d.id]) for d in docs if d.lease_expiries != held[d.id]}
    assert twice == {}, f"documents leased again other than after a kill: {twice}"
    assert sum(held.values()) > 0  # the kills did catch documents in flight

    events = query(
        e,
        "SELECT action, job_id, document_id, at FROM audit_events WHERE job_id IN (:a, :b) ORDER BY seq",
        a=job,
        b=slow_job,
    )
    finished = Counter(ev.document_id for ev in events if ev.action == "document_done")
    assert len(finished) == 203 and set(finished.values()) == {1}
    slow_events = [ev for ev in events if ev.job_id == slow_job]
    began = next(ev.at for ev in slow_events if ev.action == "started")
    ended = max(ev.at for ev in slow_events if ev.action == "document_done")
    seconds = _seconds(ended) - _seconds(began)
    assert seconds >= 3 * LEASE, f"the slow shard took {seconds:.1f} s, not three leases"
    assert e.json("audit", "verify")["ok"] is True

    if e.backend == "embedded":  # the corrupted file was moved aside, not opened again
        assert list(e.home.glob("broker.db.unreadable-*"))


def _seconds(at: str) -> float:
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
