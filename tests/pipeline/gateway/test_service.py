"""The gateway's batch lifecycle through `pipeline.client`, in process, on a real embedded database and broker
without a worker (jobs stay queued): cancellation, expiry past the completion window, a job cancelled from
the CLI, a restart mid-submit, an input file deleted before the submit."""

from __future__ import annotations

import json
import uuid

import pytest

from pipeline import client
from pipeline.gateway.models import WINDOW_SECONDS, CreateBatch
from pipeline.gateway.service import Gateway
from pipeline.gateway.store import BatchRecord, GatewayStore
from tests.pipeline.gateway.conftest import batch_file, until
from tests.pipeline.test_submit import make_session

CHAT = "/v1/chat/completions"


def create(gateway: Gateway, n: int = 3, **fields):
    uploaded = gateway.upload("batch", "in.jsonl", batch_file(n))
    request = CreateBatch(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", **fields)
    return gateway.create(request)


def running(gateway: Gateway, batch_id: str):
    return until(lambda: (b := gateway.batch(batch_id)).status == "in_progress" and b)


def ended(gateway: Gateway, batch_id: str):
    return until(
        lambda: (b := gateway.batch(batch_id)).status in ("completed", "cancelled", "expired", "failed") and b
    )


def error_lines(gateway: Gateway, file_id: str) -> list[dict]:
    return [json.loads(x) for x in b"".join(gateway.content(file_id)).splitlines()]


def test_a_running_batch_cancelled_ends_with_every_request_in_its_error_file(gateway):
    batch = create(gateway, metadata={"k": "v"})
    assert batch.status == "validating" and batch.request_counts.total == 0
    batch = running(gateway, batch.id)
    assert batch.request_counts.total == 3 and batch.in_progress_at >= batch.created_at
    cancelling = gateway.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert gateway.cancel(batch.id).status in ("cancelling", "cancelled")  # cancelling again changes nothing
    final = ended(gateway, batch.id)
    assert final.status == "cancelled" and final.cancelled_at >= final.cancelling_at
    assert final.output_file_id is None and final.metadata == {"k": "v"}
    assert (final.request_counts.total, final.request_counts.failed) == (3, 3)
    lines = error_lines(gateway, final.error_file_id)
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"]
    assert {x["error"]["code"] for x in lines} == {"batch_cancelled"}


def test_a_batch_past_its_completion_window_expires(gateway, clock):
    batch = running(gateway, create(gateway).id)
    clock.now += WINDOW_SECONDS - 5
    assert gateway.batch(batch.id).status == "in_progress"
    clock.now += 5
    final = ended(gateway, batch.id)
    assert (
        final.status == "expired" and final.expired_at == int(clock.now) and final.finalizing_at is not None
    )
    assert final.cancelled_at is None and final.completed_at is None
    assert {x["error"]["code"] for x in error_lines(gateway, final.error_file_id)} == {"batch_expired"}


def test_a_job_cancelled_from_the_cli_cancels_its_batch(gateway, session):
    batch = running(gateway, create(gateway).id)
    record = gateway.store.batch(batch.id)
    assert client.cancel_job(session, record.job_id)
    final = ended(gateway, batch.id)
    assert final.status == "cancelled" and final.cancelling_at is not None


def test_a_restarted_gateway_resumes_a_half_done_submit(gateway, session, clock):
    uploaded = gateway.upload("batch", "in.jsonl", batch_file(2))
    record = BatchRecord(  # as a gateway killed before its submit thread ran leaves it
        id=f"batch_{uuid.uuid4().hex}",
        job_id=str(uuid.uuid4()),
        input_file_id=uploaded.id,
        endpoint=CHAT,
        completion_window="24h",
        created_at=int(clock.now),
        expires_at=int(clock.now) + WINDOW_SECONDS,
    )
    gateway.store.put_batch(record)
    restarted = Gateway(session, GatewayStore(gateway.store.root, session.identity), clock)
    restarted.lifecycle.resume()
    until(lambda: restarted.store.batch(record.id).phase == "submitted")
    assert client.job_status(session, record.job_id).total == 2
    assert restarted.batch(record.id).status == "in_progress"


def test_an_input_file_deleted_before_the_submit_fails_the_batch(gateway, clock):
    uploaded = gateway.upload("batch", "in.jsonl", batch_file(2))
    record = BatchRecord(
        id=f"batch_{uuid.uuid4().hex}",
        job_id=str(uuid.uuid4()),
        input_file_id=uploaded.id,
        endpoint=CHAT,
        completion_window="24h",
        created_at=int(clock.now),
        expires_at=int(clock.now) + WINDOW_SECONDS,
    )
    gateway.store.put_batch(record)
    gateway.delete(uploaded.id)
    final = ended(gateway, record.id)
    assert final.status == "failed" and final.failed_at is not None
    assert [(e.code, e.param) for e in final.errors.data] == [("invalid_request", "input_file_id")]


def test_status_and_cancel_refuse_another_clients_job(gateway, session, tmp_path, db_url, service):
    batch = running(gateway, create(gateway).id)
    job_id = gateway.store.batch(batch.id).job_id
    other = make_session(tmp_path / "bob", db_url, service)
    try:
        for call in (client.job_status, client.cancel_job):
            for job in (job_id, str(uuid.uuid4())):  # another client's job is one this client does not have
                with pytest.raises(client.UnknownJob):
                    call(other, job)
    finally:
        other.close()
    assert client.job_status(session, job_id).status == "queued"
