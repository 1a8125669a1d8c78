"""Workers as a fleet (issue 17 acceptance 2 and 7): a worker whose model cannot load exits 1 with one line
and touches nothing; a killed worker's documents run again within 60 s with the default lease; two workers
side by side on one host have their own node names, both answer Celery's ping without a node-name warning,
both work, and send the task events Flower reads; a prefork pool is refused.

This machine has no GPU: `--gpu N` means the device `cuda:N` (checked in tests/pipeline/test_worker_parts.py,
and here by its one-line refusal without CUDA); the two workers side by side run on `--device cpu`, named
apart by their pids as `--gpu` names them apart by their index."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import text

from pipeline.broker_probe import BrokerProbe
from pipeline.reasons import bounded
from tests.e2e.conftest import NOTES, ROOT
from tests.e2e.test_exactly_once import many_documents, wait_for

LONG = (NOTES / "note-04-diabetes-review.txt").read_text()  # no end of text in its first 1,700 tokens


def rows(e, sql: str, **params) -> list:
    db = e.database()
    try:
        with db.engine.connect() as c:
            return c.execute(text(sql), params).all()
    finally:
        db.dispose()


def awq_copy(e, demo_model):
    awq = e.tmp / "awq"
    shutil.copytree(demo_model, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    return awq


def test_a_worker_with_a_bad_model_exits_in_one_line_and_touches_nothing(enclave, demo_model, tmp_path):
    job = enclave.submit(str(many_documents(tmp_path / "docs", 4)), "--kind", "summarize")
    awq = awq_copy(enclave, demo_model)
    events_before = rows(enclave, "SELECT seq FROM audit_events")
    proc = enclave.run("worker", check=False, env=enclave.env | {"ENCLAVE_MODEL": str(awq)}, timeout=120)
    assert proc.returncode == 1
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line == (
        f"error: cannot load the model: {awq}/config.json: unsupported quantization method 'awq' (supported: "
        "fp8 with 128x128 blocks)"
    )
    assert "Traceback" not in proc.stderr and "ready" not in proc.stderr
    docs = rows(
        enclave,
        "SELECT status, attempts, lease_expiries, lease_owner FROM documents WHERE job_id = :j",
        j=job,
    )
    assert [tuple(d) for d in docs] == [("pending", 0, 0, None)] * 4
    assert rows(enclave, "SELECT seq FROM audit_events") == events_before
    assert (
        BrokerProbe(
            enclave.env.get("ENCLAVE_BROKER_URL") or f"sqla+sqlite:///{enclave.home / 'broker.db'}"
        ).queue_depth()
        == 2
    )
    [worker] = enclave.json("workers", "--all")
    assert (worker["health"], worker["engine_loaded"], worker["reason"]) == (
        "failed",
        False,
        bounded(line[7:]),
    )
    assert enclave.json("status", job)["workers"] == 0  # nothing can run it, and status says so


@pytest.mark.slow
def test_a_killed_workers_documents_run_again_within_60_s_with_the_default_lease(embedded, tmp_path):
    env = {k: v for k, v in embedded.env.items() if k != "ENCLAVE_LEASE_SECONDS"}  # 300 s, and heartbeats
    folder = tmp_path / "docs"  # of 10 s with a 30 s timeout, as shipped
    folder.mkdir()
    for i in range(2):
        (folder / f"long-{i}.txt").write_text(LONG)
    job = embedded.submit(str(folder), "--kind", "summarize", "--param", "max_tokens=1700")
    first = embedded.start_worker(env=env)
    assert wait_for(lambda: embedded.worker_id(first.pid) is not None, 60)
    owner = embedded.worker_id(first.pid)
    lease = "SELECT lease_owner FROM documents WHERE job_id = :j AND status = 'leased'"
    assert wait_for(lambda: {r.lease_owner for r in rows(embedded, lease, j=job)} == {owner}, 60)
    embedded.kill(first)
    killed = time.monotonic()
    second = embedded.start_worker(env=env)
    try:
        assert wait_for(lambda: embedded.worker_id(second.pid) is not None, 60)
        taker = embedded.worker_id(second.pid)
        assert wait_for(lambda: {r.lease_owner for r in rows(embedded, lease, j=job)} == {taker}, 75)
        seconds = time.monotonic() - killed
        assert seconds < 60, f"the dead worker's documents ran again after {seconds:.0f} s"
        assert [r.lease_expiries for r in rows(embedded, "SELECT lease_expiries FROM documents")] == [1, 1]
    finally:
        embedded.run("cancel", job)  # its requests are aborted: the worker stops at once
        second.terminate()
        second.wait(60)


def test_only_the_threads_pool_is_served(embedded):
    solo = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "pipeline.celery_app", "worker", "-P", "solo"],
        env=embedded.env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert solo.returncode == 1
    assert [x for x in solo.stderr.splitlines() if x.startswith("error:")] == [
        "error: enclave workers run Celery's threads pool (one engine per process, shared by its threads), "
        "not solo: drop --pool, or give --pool threads"
    ]
    # In Python, where prefork can be asked for explicitly (Celery's CLI turns -P prefork, its default, into
    # the configured threads pool), it is refused before anything is loaded.
    from pipeline.celery_app import make_celery
    from pipeline.settings import load_settings

    app = make_celery(load_settings(embedded.env))
    with pytest.raises(SystemExit) as refused:
        app.Worker(pool="prefork", concurrency=2, quiet=True)
    assert refused.value.code == 1


def test_gpu_n_asks_for_cuda_n_and_says_so_without_cuda(embedded):
    proc = embedded.run("worker", "--gpu", "1", check=False, timeout=120)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("device cuda was asked for, but CUDA is not available on this machine")
    )
    [worker] = embedded.json("workers", "--all")
    assert (worker["node"].split("@")[0], worker["device"]) == ("enclave-gpu1", "cuda:1")


@pytest.fixture
def on_redis(enclave):
    if enclave.backend != "servers":
        pytest.skip("Celery's ping and task events need a broker that broadcasts (Redis)")
    return enclave


def test_two_workers_side_by_side_have_their_own_names_and_both_work(on_redis, tmp_path):
    e = on_redis
    events: list[dict] = []
    receiver = threading.Thread(
        target=_capture_events, args=(e.env["ENCLAVE_BROKER_URL"], events), daemon=True
    )
    receiver.start()
    workers = [e.start_worker("--device", "cpu"), e.start_worker("--device", "cpu")]
    try:
        assert wait_for(lambda: all(e.worker_id(w.pid) for w in workers), 60)
        ids = [e.worker_id(w.pid) for w in workers]
        assert wait_for(
            lambda: len(e.json("workers")) == 2 and all(w["health"] == "ready" for w in e.json("workers")), 60
        )
        job = e.submit(
            str(many_documents(tmp_path / "docs", 16)), "--kind", "summarize", "--param", "max_tokens=64"
        )
        assert wait_for(lambda: e.json("status", job)["status"] == "completed", 120)
        ping = subprocess.run(
            [
                sys.executable,
                "-W",
                "always",
                "-m",
                "celery",
                "-A",
                "pipeline.celery_app",
                "inspect",
                "ping",
                "-j",
            ],
            env=e.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        nodes = {w["node"] for w in e.json("workers")}
        assert len(nodes) == 2 and all(n.startswith("enclave-cpu-") for n in nodes)
        assert set(json.loads(ping.stdout.strip().splitlines()[-1])) == nodes
        assert "DuplicateNodename" not in ping.stderr + ping.stdout
        done = {r.lease_owner for r in rows(e, "SELECT lease_owner FROM documents WHERE job_id = :j", j=job)}
        assert done <= set(ids)
        by_node = {w["node"]: w for w in e.json("workers")}
        assert all(w["done"] > 0 for w in by_node.values()), by_node  # both took shards
        assert len({w["metrics_url"] for w in by_node.values()}) == 2
        assert wait_for(
            lambda: {ev.get("hostname") for ev in events if ev["type"] == "task-succeeded"} == nodes, 30
        )
    finally:
        for w in workers:
            w.terminate()
            w.wait(60)
    logs = "".join(Path(p).read_text() for p in e.worker_logs)
    assert "DuplicateNodename" not in logs


def _capture_events(broker_url: str, events: list[dict]) -> None:
    """Celery task events, as Flower reads them, into `events` (until the test process ends)."""
    app = Celery(broker=broker_url)
    with app.connection() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": events.append})
        with contextlib.suppress(Exception):  # the timeout, or the broker going away, ends the capture
            receiver.capture(limit=None, timeout=120, wakeup=True)
