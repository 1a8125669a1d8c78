"""The states of jobs and documents, as stored in `jobs.status` and `documents.status`.

StrEnum members compare equal to their text, so rows read back as plain strings still match them.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """uploading (the client is still storing documents; workers ignore the job) -> queued -> running ->
    completed (every document done or failed) | cancelled | failed (the job itself could not run, e.g. a
    forged manifest)."""

    UPLOADING = "uploading"
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class DocState(StrEnum):
    """pending -> leased -> done | failed; cancelled when its job is."""

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Role(StrEnum):
    """An allow-listed client's role: `client` submits and reads its own jobs; `admin` also manages the
    allow-list and reads and exports the audit log."""

    CLIENT = "client"
    ADMIN = "admin"


class WorkerState(StrEnum):
    """starting (loading its engine) -> ready | failed (could not start); ready -> unhealthy (stopped taking
    tasks after repeated internal errors or a hung shard) -> stopped. A worker whose heartbeat is older than
    the heartbeat timeout is gone, whatever its last state says."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    FAILED = "failed"


ACTIVE_JOB = (JobState.QUEUED, JobState.RUNNING)
TERMINAL_DOC = (DocState.DONE, DocState.FAILED, DocState.CANCELLED)
OPEN_DOC = (DocState.PENDING, DocState.LEASED)
