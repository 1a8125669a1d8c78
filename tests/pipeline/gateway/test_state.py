"""The mapping from Enclave job state to the batch's OpenAI status, counts and the gateway's next step."""

import pytest

from pipeline.gateway.models import RequestCounts
from pipeline.gateway.state import JobView, observe
from pipeline.gateway.store import BatchRecord

NOW = 1_000_000


def record(**fields) -> BatchRecord:
    base = dict(
        id="batch_x",
        job_id="j",
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        created_at=NOW - 10,
        expires_at=NOW + 100,
    )
    return BatchRecord(**(base | fields))


def job(status: str, total=4, done=1, failed=1, cancelled=0) -> JobView:
    return JobView(status, total, done, failed, cancelled)


@pytest.mark.parametrize(
    "fields, seen, status, step, final",
    [
        ({}, None, "validating", "submit", None),
        ({"cancelling_at": NOW}, None, "cancelling", "submit", None),
        ({"phase": "submitted"}, job("uploading"), "validating", "submit", None),
        ({"phase": "submitted"}, job("queued", done=0, failed=0), "in_progress", "none", None),
        ({"phase": "submitted"}, job("running"), "in_progress", "none", None),
        ({"phase": "submitted", "expires_at": NOW}, job("running"), "in_progress", "expire", None),
        ({"phase": "submitted", "cancelling_at": NOW}, job("running"), "cancelling", "cancel", None),
        ({"phase": "submitted"}, job("completed", done=3), "finalizing", "finalize", "completed"),
        (
            {"phase": "submitted", "cancelling_at": NOW},
            job("completed", done=3),
            "finalizing",
            "finalize",
            "completed",
        ),
        (
            {"phase": "submitted", "cancelling_at": NOW},
            job("cancelled", cancelled=2),
            "cancelling",
            "finalize",
            "cancelled",
        ),
        (
            {"phase": "submitted"},
            job("cancelled", cancelled=2),
            "cancelling",
            "finalize",
            "cancelled",
        ),  # `enclave cancel`
        (
            {"phase": "submitted", "expiring": True},
            job("cancelled", cancelled=2),
            "finalizing",
            "finalize",
            "expired",
        ),
        ({"phase": "submitted"}, job("failed"), "failed", "fail", None),
        ({"phase": "submitted"}, None, "failed", "fail", None),  # the job is gone
    ],
)
def test_each_job_state_maps_to_one_batch_status(fields, seen, status, step, final):
    observed = observe(record(**fields), seen, NOW)
    assert (observed.status, observed.step, observed.final) == (status, step, final)


def test_counts_follow_the_job_and_cancelled_documents_count_as_failed():
    assert observe(record(), None, NOW).counts == RequestCounts()
    running = observe(record(phase="submitted"), job("running", total=5, done=2, failed=1), NOW)
    assert running.counts == RequestCounts(total=5, completed=2, failed=1)
    cancelled = observe(
        record(phase="submitted"), job("cancelled", total=5, done=2, failed=1, cancelled=2), NOW
    )
    assert cancelled.counts == RequestCounts(total=5, completed=2, failed=3)


def test_an_ended_batch_keeps_its_final_status_and_the_counts_of_its_files():
    counts = RequestCounts(total=5, completed=2, failed=3)
    for final in ("completed", "cancelled", "expired", "failed"):
        ended = record(phase="ended", status=final, counts=counts)
        observed = observe(ended, job("completed", total=9, done=9, failed=0), NOW + 10**6)
        assert (observed.status, observed.counts, observed.step) == (final, counts, "none")
