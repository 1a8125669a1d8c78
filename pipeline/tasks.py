"""Celery tasks: thin, named, ids only, idempotent (leases make a repeated or late task harmless)."""

from __future__ import annotations

from celery import Celery, shared_task, signals

PROCESS_SHARD = "enclave.process_shard"


@shared_task(name=PROCESS_SHARD, bind=True, acks_late=True, ignore_result=True)
def process_shard(self, job_id: str, shard: int) -> None:
    """Process the unfinished documents of one shard of a job."""
    from pipeline.worker import runtime_for

    runtime_for(self.app).process_shard(job_id, int(shard))


def dispatch_shard(app: Celery, job_id: str, shard: int, priority: int = 0) -> None:
    """Tell the workers there is work on (job, shard). Priority 0..9, higher first where the broker can
    order messages (Redis); the embedded SQLite broker serves in submission order."""
    priority = max(0, min(9, priority))
    if str(app.conf.broker_url).startswith("redis"):
        priority = 9 - priority  # Redis priority queues serve 0 first
    app.send_task(PROCESS_SHARD, args=[job_id, shard], priority=priority)


@signals.worker_ready.connect
def _start_sweeper(sender=None, **_kwargs) -> None:
    from pipeline.worker import runtime_for

    runtime_for(sender.app).start_sweeper()


@signals.worker_shutdown.connect
def _stop_sweeper(sender=None, **_kwargs) -> None:
    from pipeline.worker import runtime_for

    runtime_for(sender.app).stop_sweeper()
