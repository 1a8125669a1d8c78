"""Enclave job state -> the batch's OpenAI status, `request_counts` and the gateway's next step.

| gateway record | Enclave job | batch status | next step |
|---|---|---|---|
| validating (submitting) | none, or `uploading` | `validating` (`cancelling` if cancelled) | submit |
| submitted | `queued`, `running` | `in_progress` | none; `expire` past `expires_at` |
| submitted, cancel asked | `queued`, `running` | `cancelling` | cancel the job (again) |
| submitted | `completed` (every document finished) | `finalizing` | prepare the result files |
| submitted | `cancelled` | `cancelling` (`finalizing` when expiring) | prepare the result files |
| submitted | `failed` (the job itself was refused) | `failed` | record the failure |
| ended | any | the final status: `completed`, `cancelled`, `expired` or `failed` | none |

Counts while the job runs: `total` = the job's documents (one per line), `completed` = documents done,
`failed` = documents failed, plus cancelled ones once the job is cancelled (they go to the error file).
Once ended, the counts are those of the output and error files, which is what the client downloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.gateway.models import BatchStatus, RequestCounts
from pipeline.gateway.store import BatchRecord

Step = Literal["none", "submit", "cancel", "expire", "finalize", "fail"]
ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class JobView:
    """What the gateway reads of its Enclave job (`pipeline.client.job_status`)."""

    status: str
    total: int
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    error: str | None = None  # content-free: why the job itself failed


@dataclass(frozen=True)
class Observed:
    """The batch as the client sees it now, and what the gateway does next. `final` is the status the
    batch takes once its result files are ready (for `finalize`)."""

    status: BatchStatus
    counts: RequestCounts
    step: Step = "none"
    final: BatchStatus | None = None


def observe(record: BatchRecord, job: JobView | None, now: int) -> Observed:
    """The batch's state from its record and its job (None: not submitted yet, or no longer found)."""
    if record.phase == "ended":
        return Observed(record.status or "failed", record.counts or RequestCounts())
    if record.phase == "validating" or (job is not None and job.status == "uploading"):
        return Observed("cancelling" if record.cancelling_at else "validating", RequestCounts(), "submit")
    if job is None:
        return Observed("failed", RequestCounts(), "fail")
    cancelled = job.cancelled if job.status == "cancelled" else 0
    counts = RequestCounts(total=job.total, completed=job.done, failed=job.failed + cancelled)
    if job.status in ACTIVE:
        if record.cancelling_at is not None:
            return Observed("cancelling", counts, "cancel")
        return Observed("in_progress", counts, "expire" if now >= record.expires_at else "none")
    if job.status == "completed":
        return Observed("finalizing", counts, "finalize", "completed")
    if job.status == "cancelled":
        if record.expiring:
            return Observed("finalizing", counts, "finalize", "expired")
        return Observed("cancelling", counts, "finalize", "cancelled")
    return Observed("failed", counts, "fail")
