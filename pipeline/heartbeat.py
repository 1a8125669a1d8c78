"""The heartbeat: a thread in every worker that says, once per heartbeat interval, that the worker lives
(`workers.beat`, with its in-flight and finished counts) and renews the leases of the documents it works on
(`store.renew`). A shard slower than the lease therefore keeps its documents; a worker that dies stops beating
and its documents run elsewhere after the heartbeat timeout."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pipeline import store, workers
from pipeline.db import Database
from pipeline.health import Health
from pipeline.inflight import InFlight

log = logging.getLogger("enclave.worker")


class Heartbeat:
    """Beats every `interval` seconds until stopped; `on_renewed(n)` counts the leases renewed."""

    def __init__(
        self,
        db: Database,
        worker_id: str,
        inflight: InFlight,
        health: Health,
        lease_seconds: float,
        interval: float,
        on_renewed: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.db = db
        self.worker_id = worker_id
        self.inflight = inflight
        self.health = health
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.on_renewed = on_renewed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> int:
        """One heartbeat; how many leases it renewed. Documents another worker took over (this one was taken
        for gone after a long pause) are logged: this worker will not record them. (A document recorded
        while the beat ran is simply no longer leased.)"""
        held = self.inflight.doc_ids()
        with self.db.transaction() as s:
            workers.beat(s, self.worker_id, self.inflight.documents(), self.health.done, self.health.errors)
            renewed = store.renew(s, self.worker_id, held, self.lease_seconds)
            taken = store.taken_over(s, self.worker_id, held) if renewed < len(held) else 0
        if taken:
            log.warning("%d of %d leases were taken over by other workers", taken, len(held))
        self.on_renewed(renewed)
        return renewed

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.beat()
                except Exception as exc:  # the database is away: beat again next time
                    log.warning(
                        "heartbeat failed (%s); trying again in %.1f s", type(exc).__name__, self.interval
                    )

        self._thread = threading.Thread(target=loop, name="enclave-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
