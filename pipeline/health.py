"""Whether a worker should keep taking tasks. A document given back after an internal error (an engine that
fails every request, a checkpoint that cannot serve) is the worker's failure, not the document's; after
`max_consecutive_errors` of them in a row, or a shard that outlived the hard time limit, the worker is
unhealthy: it stops consuming, says why in one log line, and reports it (`workers.state`, `/healthz`, the
`enclave_worker_healthy` metric) until it is restarted. A document that runs, done or failed for its own
reasons, resets the count."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("enclave.worker")


class Health:
    """Counts the worker's documents and its consecutive internal errors; trips once."""

    def __init__(self, max_consecutive_errors: int, on_unhealthy: Callable[[str], None]) -> None:
        self.limit = max_consecutive_errors
        self.on_unhealthy = on_unhealthy
        self._lock = threading.Lock()
        self._streak = 0
        self.done = 0  # documents finished (done, or failed for their own reasons)
        self.errors = 0  # documents given back after internal errors
        self.reason: str | None = None  # why the worker is unhealthy; None while healthy

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def success(self, count: int = 1) -> None:
        with self._lock:
            self.done += count
            if count:
                self._streak = 0

    def error(self, reason: str) -> None:
        """One document given back with the content-free `reason`."""
        with self._lock:
            self.errors += 1
            self._streak += 1
            tripped = self._streak >= self.limit
        if tripped:
            self.trip(f"{self._streak} documents in a row failed with internal errors (the last: {reason})")

    def trip(self, reason: str) -> None:
        """Mark the worker unhealthy (the first reason is kept) and tell its owner, once."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        log.error("worker unhealthy: %s; it takes no more tasks (restart it once the cause is fixed)", reason)
        self.on_unhealthy(reason)
