"""The sweeper: a thread in every worker that dispatches work no live task covers: shards whose leases lapsed
(expired, or held by a worker that is gone), pending documents never dispatched or whose message may be lost
(the embedded transport never redelivers, Redis only after its visibility timeout), and, when the broker lost
its marker, every open shard (`rebuild.py`). Dispatching twice is harmless: leases make a late or repeated
task find nothing to do."""

from __future__ import annotations

import logging
import threading

from celery import Celery

from pipeline import rebuild, store
from pipeline.broker_probe import BrokerProbe
from pipeline.db import Database
from pipeline.dispatch import dispatch_shard
from pipeline.errors import stack_without_message
from pipeline.models import Job
from pipeline.settings import Settings

log = logging.getLogger("enclave.worker")


class Sweeper:
    """Sweeps once per heartbeat interval, so a gone worker's documents run again within about the heartbeat
    timeout plus one interval."""

    def __init__(self, app: Celery, db: Database, settings: Settings) -> None:
        self.app = app
        self.db = db
        self.settings = settings
        self.probe = BrokerProbe(settings.broker_url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> int:
        """Dispatch the shards no live task covers; how many reached the broker. Only those are marked
        dispatched: a shard whose message could not be sent is tried again at the next sweep."""
        if rebuild.check(self.app, self.db, self.probe):
            return 0  # every open shard was just dispatched again
        limits, timeout = self.settings.limits, self.settings.worker.heartbeat_timeout
        with self.db.transaction() as s:
            pairs = store.shards_to_dispatch(s, limits.lease_seconds, timeout)
            priorities = {j: s.get(Job, j).priority for j, _ in pairs}
        sent = []
        for job_id, shard in pairs:
            try:
                dispatch_shard(self.app, job_id, shard, priorities[job_id])
            except Exception as exc:
                log.warning(
                    "sweeper: the broker refused a dispatch (%s); trying again later", type(exc).__name__
                )
                break
            sent.append((job_id, shard))
        with self.db.transaction() as s:
            for job_id, shard in sent:
                store.mark_dispatched(s, job_id, shard)
        if sent:
            log.info("sweeper dispatched %d shards", len(sent))
        return len(sent)

    def start(self) -> None:
        if self._thread is not None:
            return
        interval = self.settings.heartbeat_interval

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
