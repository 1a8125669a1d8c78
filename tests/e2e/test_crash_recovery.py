"""Crashes are not failures: workers killed with SIGKILL while they hold a shard leave its documents leased
to a worker that is gone (their `attempts` untouched, each crash counted in `lease_expiries` when they are
taken over), and the next worker completes them."""

from sqlalchemy import text

from tests.e2e.conftest import NOTES
from tests.e2e.test_exactly_once import wait_for

LONG = (NOTES / "note-04-diabetes-review.txt").read_text()  # no end of text in its first 1,700 tokens


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


def test_three_kill_9s_holding_the_same_shard_leave_it_pending_and_the_next_worker_completes_it(
    enclave, tmp_path
):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):  # one shard of 2, each document generating for seconds
        (folder / name).write_text(LONG)
    job = enclave.submit(str(folder), "--kind", "summarize", "--param", "max_tokens=300")  # ~2 s
    for crash in range(3):
        worker = enclave.start_worker()
        assert wait_for(lambda w=worker: enclave.worker_id(w.pid) is not None, 90)
        owner = enclave.worker_id(worker.pid)
        # the engine loads before any task: kill the worker once it holds every document of the shard
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
    assert all(r.status == "done" and r.attempts == 0 and r.lease_expiries == 3 for r in rows), rows
    assert enclave.json("audit", "verify")["ok"] is True
