"""The watchdog: a thread in every worker that stops work that should not go on, twice a second.

- A job that ended while its shards run here (cancelled, or failed as a whole): their engine requests are
  aborted, so the engine frees their slots and blocks within a step or two and the GPU moves on.
- A shard past the soft time limit: its requests are aborted and its unfinished documents fail with a
  `time_limit` reason (the shard's own thread records them, `shards.py`).
- A shard past the hard time limit (its thread is stuck beyond the engine): its documents fail here with a
  `time_limit` reason, their leases are no longer renewed, and the worker turns unhealthy.

Celery's own time limits need its prefork pool, which would load one engine per child; the threads pool that
shares one engine has none, so Enclave keeps its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from pipeline import store
from pipeline.db import Database
from pipeline.errors import stack_without_message
from pipeline.health import Health
from pipeline.inflight import InFlight, ShardRun, Stop
from pipeline.settings import WorkerSettings

log = logging.getLogger("enclave.worker")
INTERVAL = 0.5  # seconds: a cancel stops the engine's work within about this plus a step


def time_limit_reason(limit: str, seconds: float) -> str:
    """The content-free reason of a document stopped by a time limit."""
    return f"time_limit: the shard ran past its {limit} time limit of {seconds:g} s"


class Watchdog:
    """Checks the shards in flight every INTERVAL seconds; `abort(futures)` stops engine requests (the
    engine's `abort`), `on_stopped(why, n)` counts them."""

    def __init__(
        self,
        db: Database,
        worker_id: str,
        inflight: InFlight,
        health: Health,
        limits: WorkerSettings,
        abort: Callable[[list[Future]], int],
        on_stopped: Callable[[Stop, int], None] = lambda why, n: None,
    ) -> None:
        self.db = db
        self.worker_id = worker_id
        self.inflight = inflight
        self.health = health
        self.limits = limits
        self.abort = abort
        self.on_stopped = on_stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """One look at the shards in flight."""
        jobs = self.inflight.job_ids()
        if not jobs:
            return
        with self.db.transaction() as s:
            ended = store.ended_jobs(s, jobs)
        for job_id in ended:
            aborted = self.abort(self.inflight.stop_job(job_id, Stop.CANCELLED))
            if aborted:
                log.info("job %s ended (cancelled): %d engine requests aborted", job_id, aborted)
                self.on_stopped(Stop.CANCELLED, aborted)
        for run in self.inflight.runs():
            if run.stopped is None and run.seconds > self.limits.soft_time_limit:
                aborted = self.abort(self.inflight.stop(run, Stop.SOFT_TIME_LIMIT))
                log.warning(
                    "job %s shard %d: past the soft time limit (%g s): %d engine requests aborted",
                    run.job_id,
                    run.shard,
                    self.limits.soft_time_limit,
                    aborted,
                )
                self.on_stopped(Stop.SOFT_TIME_LIMIT, aborted)
            if run.stopped is not Stop.HARD_TIME_LIMIT and run.seconds > self.limits.time_limit:
                self._abandon(run)

    def _abandon(self, run: ShardRun) -> None:
        """Fail a hung shard's documents here; its thread, should it ever return, records nothing."""
        self.abort(self.inflight.abandon(run))
        reason = time_limit_reason("hard", self.limits.time_limit)
        with self.db.transaction() as s:
            failed = store.abandon(s, sorted(run.doc_ids), self.worker_id, reason, self.worker_id)
        self.on_stopped(Stop.HARD_TIME_LIMIT, failed)
        self.health.trip(
            f"job {run.job_id} shard {run.shard} ran past the hard time limit of "
            f"{self.limits.time_limit:g} s ({failed} documents failed)"
        )

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(INTERVAL):
                try:
                    self.check()
                except Exception as exc:
                    log.error("watchdog: %s", stack_without_message(exc))

        self._thread = threading.Thread(target=loop, name="enclave-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
