"""Celery tasks: thin, named, ids only, idempotent (leases make a repeated or late task harmless)."""

from __future__ import annotations

from celery import shared_task

from pipeline import worker_signals  # noqa: F401 (connects the worker's start, readiness and shutdown)
from pipeline.dispatch import PROCESS_SHARD, dispatch_shard

__all__ = ["PROCESS_SHARD", "dispatch_shard", "process_shard"]


@shared_task(name=PROCESS_SHARD, bind=True, acks_late=True, ignore_result=True)
def process_shard(self, job_id: str, shard: int) -> None:
    """Process the unfinished documents of one shard of a job."""
    from pipeline.worker import runtime_for

    runtime_for(self.app).process_shard(job_id, int(shard))
