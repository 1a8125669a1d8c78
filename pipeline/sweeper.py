"""The sweeper: a thread in every worker that re-dispatches shards whose leases expired or whose broker
messages may be lost (the embedded transport never redelivers, Redis only after its visibility timeout).
Dispatching twice is harmless: leases make a late or repeated task find nothing to do."""

from __future__ import annotations

import logging
import threading

from celery import Celery

from pipeline import store
from pipeline.db import Database
from pipeline.dispatch import dispatch_shard
from pipeline.errors import stack_without_message
from pipeline.models import Job
from pipeline.settings import Settings

log = logging.getLogger("enclave.worker")


class Sweeper:
    """Re-dispatches lost work every half lease (between 0.5 and 30 s)."""

    def __init__(self, app: Celery, db: Database, settings: Settings) -> None:
        self.app = app
        self.db = db
        self.settings = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> int:
        """Re-dispatch shards whose leases expired or whose messages may be lost. Returns how many."""
        with self.db.transaction() as s:
            pairs = store.shards_to_dispatch(s, self.settings.limits.lease_seconds)
            priorities = {j: s.get(Job, j).priority for j, _ in pairs}
            for job_id, shard in pairs:
                store.mark_dispatched(s, job_id, shard)
        for job_id, shard in pairs:
            dispatch_shard(self.app, job_id, shard, priorities[job_id])
        if pairs:
            log.info("sweeper re-dispatched %d shards", len(pairs))
        return len(pairs)

    def start(self) -> None:
        if self._thread is not None:
            return
        interval = min(30.0, max(0.5, self.settings.limits.lease_seconds / 2))

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sweep()
                except Exception as exc:
                    log.error("sweeper: %s", stack_without_message(exc))
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="enclave-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
