"""Telling the workers there is work: one broker message per shard, carrying the job id and the shard number
only. Sent by task name, so the senders (the service API, the sweeper) need not import the task itself."""

from __future__ import annotations

from celery import Celery

PROCESS_SHARD = "enclave.process_shard"


def dispatch_shard(app: Celery, job_id: str, shard: int, priority: int = 0) -> None:
    """Tell the workers there is work on (job, shard). Priority 0..9, higher first where the broker can
    order messages (Redis); the embedded SQLite broker serves in submission order."""
    priority = max(0, min(9, priority))
    if str(app.conf.broker_url).startswith("redis"):
        priority = 9 - priority  # Redis priority queues serve 0 first
    app.send_task(PROCESS_SHARD, args=[job_id, shard], priority=priority)
