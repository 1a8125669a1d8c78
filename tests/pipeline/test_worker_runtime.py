"""A worker's runtime on the demo engine, without Celery's consumer: it registers and loads before any task,
or fails in one line; the watchdog stops a cancelled job's engine requests and enforces the soft and hard
time limits; a run of internal errors makes it unhealthy and cancels its queues."""

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from engine import SamplingParams
from jobs.base import DocumentResult, EngineRequest, JobKind
from pipeline import envelope, keys, migrate, store
from pipeline.celery_app import make_celery
from pipeline.db import Database
from pipeline.models import AuditEvent, Client, Document, Job, Result, Worker
from pipeline.reasons import bounded
from pipeline.settings import Limits, Settings, WorkerSettings
from pipeline.shards import Leased
from pipeline.watchdog import Watchdog
from pipeline.worker import StartupError, WorkerRuntime


class Generate(JobKind):
    """Each document's bytes are a prompt, generated for `max_tokens` without stopping; "crash" raises in
    requests (an internal error); `hold` makes results wait (a shard stuck outside the engine)."""

    name = "generate"
    param_names = ()

    def __init__(self, max_tokens: int, hold: threading.Event | None = None) -> None:
        super().__init__({})
        self.max_tokens = max_tokens
        self.hold = hold

    def parse_params(self, params):
        return {}

    def requests(self, doc, model):
        if doc.data == b"crash":
            raise RuntimeError("a bug")
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        return [EngineRequest([1, *doc.data], sampling)]

    def result(self, doc, outputs):
        if self.hold is not None:
            self.hold.wait(30)
        return DocumentResult(status="done", output=len(outputs[0].token_ids))


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from engine.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("model"))


def runtime_for_test(tmp_path, model: Path, **worker) -> WorkerRuntime:
    settings = Settings(
        home=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'enclave.db'}",
        broker_url="memory://",
        model=model,
        device="cpu",
        dtype="float32",
        limits=Limits(lease_seconds=60),
        worker=WorkerSettings(metrics_port=0, **worker),
    )
    keys.save_identity(keys.generate_identity(), settings.service_key_dir)
    migrate.upgrade(Database(settings.database_url).engine)
    return WorkerRuntime(make_celery(settings), settings)


def make_job(rt, client, contents: list[bytes]):
    job_id = str(uuid.uuid4())
    with rt.db.transaction() as s:
        s.add(
            Client(
                fingerprint="c" * 64, name="c", x25519_public=client.public.x25519, ed25519_public=b"e" * 32
            )
        )
        s.flush()
        s.add(
            Job(
                id=job_id,
                kind="generate",
                client_fingerprint="c" * 64,
                manifest="{}",
                signature=b"",
                total=len(contents),
            )
        )
        s.flush()
        for i, data in enumerate(contents):
            doc_id = f"{job_id[:8]}-{i}"
            sealed = envelope.seal_document(
                envelope.pack_document(f"d{i}", data), rt.identity.public.x25519, job_id, doc_id
            )
            s.add(
                Document(
                    id=doc_id,
                    job_id=job_id,
                    index=i,
                    shard=0,
                    sealed=sealed,
                    sealed_name=b"n",
                    sha256=envelope.sha256_hex(sealed),
                    size=len(data),
                )
            )
    with rt.db.transaction() as s:
        leased, _ = store.lease(s, job_id, 0, rt.worker_id, lease_seconds=60, max_attempts=3)
        work = [Leased(d.id, d.index, d.sealed) for d in leased]
        return job_id, work, {d.id: d.sha256 for d in leased}


def start_shard(rt, client, kind, contents):
    """`ShardProcessor._run` of a new job's one shard, in a thread (as Celery's pool would)."""
    job_id, work, hashes = make_job(rt, client, contents)
    run = rt.inflight.begin(job_id, 0, [w.id for w in work])
    done: dict = {}

    def target():
        done["recorded"] = rt.shards._run(run, job_id, kind, work, hashes, 0, client.public.x25519)
        rt.inflight.end(run)

    thread = threading.Thread(target=target)
    thread.start()
    return job_id, run, thread, done


def wait_until(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def watchdog(rt) -> Watchdog:
    return Watchdog(rt.db, rt.worker_id, rt.inflight, rt.health, rt.settings.worker, rt.abort)


def documents(rt, job_id):
    with rt.db.transaction() as s:
        return s.scalars(select(Document).where(Document.job_id == job_id).order_by(Document.index)).all()


def worker_row(rt):
    with rt.db.transaction() as s:
        return s.get(Worker, rt.worker_id)


class Consumer:
    """Records what the runtime asks of Celery's consumer."""

    def __init__(self):
        self.calls = []

    def call_soon(self, fn, *args):
        self.calls.append((fn.__name__, args))

    def cancel_task_queue(self, queue):  # named like Celery's; called through call_soon
        pass


@pytest.fixture
def prepared(tmp_path, demo_model):
    rt = runtime_for_test(tmp_path, demo_model, soft_time_limit=2, time_limit=4, max_consecutive_errors=3)
    rt.prepare("enclave-test@host", 2, "celery")
    yield rt
    rt.stop()


def test_prepare_registers_loads_and_serves_health_before_any_task(prepared):
    row = worker_row(prepared)
    assert (row.state, row.engine_loaded, row.node, row.device) == ("ready", True, "enclave-test@host", "cpu")
    health = json.loads(urllib.request.urlopen(row.metrics_url.replace("/metrics", "/healthz")).read())
    assert health == {
        "ready": True,
        "state": "ready",
        "reason": None,
        "engine_loaded": True,
        "in_flight": 0,
        "node": "enclave-test@host",
    }
    prepared.stop()
    assert worker_row(prepared).state == "stopped" and worker_row(prepared).stopped_at is not None


def test_a_model_that_cannot_load_fails_prepare_in_one_line(tmp_path, demo_model):
    awq = tmp_path / "awq"  # the demo checkpoint, as if it were an AWQ release
    shutil.copytree(demo_model, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    rt = runtime_for_test(tmp_path, awq)
    with pytest.raises(StartupError) as info:
        rt.prepare("enclave-bad@host", 1, "celery")
    line = str(info.value)
    assert line == (
        f"cannot load the model: {awq}/config.json: unsupported quantization method 'awq' (supported: fp8 "
        "with 128x128 blocks)"
    )
    row = worker_row(rt)
    assert (row.state, row.engine_loaded, row.reason) == ("failed", False, bounded(line))
    assert row.stopped_at is not None


def test_a_cancelled_jobs_requests_stop_within_a_check_and_nothing_is_recorded(prepared):
    client = keys.generate_identity()
    engine = prepared._engine
    job_id, _, thread, done = start_shard(prepared, client, Generate(4000), [b"\x05\x06", b"\x07"])
    assert wait_until(lambda: engine.stats().num_running == 2 and engine.stats().generated_tokens > 10)
    with prepared.db.transaction() as s:
        store.cancel_job(s, job_id, "client")
    watchdog(prepared).check()
    thread.join(10)
    assert not thread.is_alive() and done["recorded"] == []
    stats = engine.stats()
    assert (stats.num_running, stats.slots_used, stats.blocks_used) == (0, 0, 0)
    assert [d.status for d in documents(prepared, job_id)] == ["cancelled", "cancelled"]


def test_the_soft_time_limit_fails_the_unfinished_documents_with_a_reason(prepared):
    client = keys.generate_identity()
    job_id, _, thread, done = start_shard(prepared, client, Generate(4000), [b"\x05", b"\x06"])
    time.sleep(2.2)
    watchdog(prepared).check()
    thread.join(10)
    assert done["recorded"] == ["failed", "failed"]
    docs = documents(prepared, job_id)
    assert {d.error for d in docs} == {"time_limit: the shard ran past its soft time limit of 2 s"}
    with prepared.db.transaction() as s:
        sealed = s.get(Result, docs[0].id).sealed
        event = s.scalars(select(AuditEvent).where(AuditEvent.document_id == docs[0].id)).one()
    record = json.loads(envelope.open_result(sealed, client, job_id, docs[0].id))
    assert record["status"] == "failed" and record["error"] == docs[0].error
    assert json.loads(event.details) == {"code": "time_limit", "error": docs[0].error}
    assert prepared.health.healthy


def test_a_shard_hung_past_the_hard_limit_fails_its_documents_and_the_worker(prepared):
    client = keys.generate_identity()
    hold = threading.Event()
    prepared.consumer = Consumer()
    job_id, _, thread, done = start_shard(prepared, client, Generate(4, hold), [b"\x05"])
    time.sleep(4.2)
    watchdog(prepared).check()
    assert prepared.inflight.doc_ids() == []  # its lease is no longer renewed
    [doc] = documents(prepared, job_id)
    assert (doc.status, doc.error) == ("failed", "time_limit: the shard ran past its hard time limit of 4 s")
    row = worker_row(prepared)
    assert row.state == "unhealthy" and "ran past the hard time limit" in row.reason
    assert prepared.consumer.calls == [("cancel_task_queue", ("celery",))]
    hold.set()
    thread.join(10)
    assert done["recorded"] == []  # the abandoned shard records nothing when it comes back


def test_internal_errors_in_a_row_make_the_worker_unhealthy_and_stop_consuming(prepared):
    client = keys.generate_identity()
    prepared.consumer = Consumer()
    job_id, _, thread, _ = start_shard(prepared, client, Generate(4), [b"crash"] * 3)
    thread.join(10)
    assert [(d.status, d.attempts, d.error) for d in documents(prepared, job_id)] == [
        ("pending", 1, "internal error (RuntimeError)")
    ] * 3
    row = worker_row(prepared)
    assert row.state == "unhealthy" and row.reason.startswith("3 documents in a row failed")
    assert prepared.consumer.calls == [("cancel_task_queue", ("celery",))]
    health = (
        json.loads(urllib.request.urlopen(row.metrics_url.replace("/metrics", "/healthz")).read())
        if False
        else prepared.health_state()
    )
    assert health["ready"] is False and health["state"] == "unhealthy"
