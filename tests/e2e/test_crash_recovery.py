"""Crashes are not failures: workers killed with SIGKILL while they hold a shard leave its documents pending
(their `attempts` untouched, each crash counted in `lease_expiries`), and the next worker completes them."""

import socket

from sqlalchemy import text

from tests.e2e.conftest import NOTES
from tests.e2e.test_exactly_once import wait_for

DOCS = [str(NOTES / "note-01-chest-pain.txt"), str(NOTES / "note-02-pneumonia.txt")]  # one shard of 2


def documents(enclave, job):
    db = enclave.database()
    with db.engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT status, attempts, lease_expiries, lease_owner FROM documents "
                'WHERE job_id = :j ORDER BY "index"'
            ),
            {"j": job},
        ).all()
    db.dispose()
    return rows


def test_three_kill_9s_holding_the_same_shard_leave_it_pending_and_the_next_worker_completes_it(enclave):
    job = enclave.submit(*DOCS, "--kind", "summarize", "--param", "max_tokens=48")
    host = socket.gethostname()
    for crash in range(3):
        worker = enclave.start_worker()
        owner = f"worker:{host}:{worker.pid}"
        # the shard is leased before the engine loads: kill the worker while it holds every document
        held = wait_for(lambda owner=owner: all(r.lease_owner == owner for r in documents(enclave, job)), 90)
        enclave.kill(worker)
        rows = documents(enclave, job)
        assert held, f"worker {crash + 1} never held the shard: {rows}"
        assert all(r.status == "leased" for r in rows), f"worker {crash + 1} finished before the kill: {rows}"
        assert [(r.attempts, r.lease_expiries) for r in rows] == [(0, crash)] * 2
    assert enclave.json("status", job)["status"] in ("queued", "running")
    assert enclave.json("status", job)["failed"] == 0

    enclave.work()

    status = enclave.json("status", job)
    assert status["status"] == "completed" and (status["done"], status["failed"]) == (2, 0)
    rows = documents(enclave, job)
    assert all(r.status == "done" and r.attempts == 0 and r.lease_expiries >= 3 for r in rows), rows
    assert enclave.json("audit", "verify")["ok"] is True
