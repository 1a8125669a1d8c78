"""What `enclave status --watch` shows beside its bar: documents per second, time since the job started and
the time left at that rate. Workers record each document as it finishes, so the numbers move per document."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime


@dataclass
class Rate:
    """Documents finished per second over the last `window` seconds of what was seen, or, until that spans
    `settle` seconds, over the whole job since it started."""

    window: float = 60.0
    settle: float = 5.0
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, at: float, finished: int) -> None:
        self.samples.append((at, finished))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def per_second(self, finished: int, elapsed: float) -> float | None:
        if len(self.samples) >= 2:
            (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
            if t1 - t0 >= self.settle:
                return (n1 - n0) / (t1 - t0)
        return finished / elapsed if elapsed > 0 and finished else None


def clock(seconds: float | None) -> str:
    """h:mm:ss, or "-" when unknown."""
    if seconds is None:
        return "-"
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def elapsed(started_at: datetime | None, finished_at: datetime | None = None) -> float:
    """Seconds since the job started (to its end, once ended); timestamps are UTC, stored naive."""
    if started_at is None:
        return 0.0
    end = finished_at or datetime.now(UTC).replace(tzinfo=None)
    return max(0.0, (end - started_at.replace(tzinfo=None)).total_seconds())


def summary(finished: int, total: int, rate: float | None, seconds: float, active: bool) -> str:
    """ "4.2 docs/s · elapsed 0:01:03 · ETA 0:00:19" """
    speed = f"{rate:.1f} docs/s" if rate else "- docs/s"
    eta = clock((total - finished) / rate) if active and rate else ("-" if active else "done")
    return f"{speed} · elapsed {clock(seconds)} · ETA {eta}"
