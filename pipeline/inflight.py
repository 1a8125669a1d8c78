"""What a worker process is working on now: each running shard's documents and engine requests.

The heartbeat renews these documents' leases, the watchdog stops the requests of shards whose job ended
(cancelled) or that ran past a time limit, and the metrics and `enclave workers` count them. Shard threads,
the heartbeat and the watchdog share one `InFlight`, under its lock."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum


class Stop(StrEnum):
    """Why a shard's engine requests were aborted."""

    CANCELLED = "cancelled"  # its job was cancelled (or failed as a whole): nothing of it is recorded
    SOFT_TIME_LIMIT = "soft_time_limit"  # its unfinished documents fail with a time_limit reason
    HARD_TIME_LIMIT = "hard_time_limit"  # the watchdog failed its documents; the shard records nothing


@dataclass(eq=False)
class ShardRun:
    """One shard being processed in this process: its unfinished documents and their engine requests."""

    job_id: str
    shard: int
    doc_ids: set[str]
    started: float = field(default_factory=time.monotonic)
    futures: list[Future] = field(default_factory=list)
    stopped: Stop | None = None

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


class InFlight:
    """The shards this process runs; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: set[ShardRun] = set()

    def begin(self, job_id: str, shard: int, doc_ids: list[str]) -> ShardRun:
        run = ShardRun(job_id, shard, set(doc_ids))
        with self._lock:
            self._runs.add(run)
        return run

    def end(self, run: ShardRun) -> None:
        with self._lock:
            self._runs.discard(run)

    def add_futures(self, run: ShardRun, futures: list[Future]) -> bool:
        """Attach a document's engine requests; False when the shard was stopped meanwhile (the caller aborts
        them itself: the watchdog has already looked)."""
        with self._lock:
            if run.stopped is not None:
                return False
            run.futures.extend(futures)
            return True

    def finished(self, run: ShardRun, doc_ids: list[str]) -> None:
        """These documents are recorded (or given back): their leases need no more renewing."""
        with self._lock:
            run.doc_ids.difference_update(doc_ids)

    def stop(self, run: ShardRun, why: Stop) -> list[Future]:
        """Mark the shard stopped (the first reason wins); the requests to abort."""
        with self._lock:
            if run.stopped is None:
                run.stopped = why
            return [f for f in run.futures if not f.done()]

    def abandon(self, run: ShardRun) -> list[Future]:
        """Mark the shard abandoned (past the hard time limit, whatever stopped it before): its leases are no
        longer renewed and it records nothing; the requests to abort."""
        with self._lock:
            run.stopped = Stop.HARD_TIME_LIMIT
            return [f for f in run.futures if not f.done()]

    def stop_job(self, job_id: str, why: Stop) -> list[Future]:
        """Stop every shard of `job_id` running here; the requests to abort."""
        with self._lock:
            runs = [r for r in self._runs if r.job_id == job_id]
        return [f for run in runs for f in self.stop(run, why)]

    def runs(self) -> list[ShardRun]:
        with self._lock:
            return list(self._runs)

    def doc_ids(self) -> list[str]:
        """The documents whose leases the heartbeat renews: unfinished ones of shards not abandoned."""
        with self._lock:
            return [d for r in self._runs if r.stopped is not Stop.HARD_TIME_LIMIT for d in r.doc_ids]

    def job_ids(self) -> list[str]:
        with self._lock:
            return sorted({r.job_id for r in self._runs})

    def documents(self) -> int:
        with self._lock:
            return sum(len(r.doc_ids) for r in self._runs)
