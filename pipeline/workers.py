"""The `workers` table: each worker process registers itself when it starts, beats while it lives, and
records when it turns unhealthy, fails to start or stops. A worker is *gone* once it stopped or its heartbeat
is older than the heartbeat timeout: the documents it leased may then run elsewhere (`store.lease`), so a dead
worker is noticed within tens of seconds instead of a whole lease. `enclave workers` reads the same rows.

Times are the workers' own UTC clocks, as for leases: keep the hosts' clocks in sync (NTP)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Select, delete, func, insert, or_, select, update
from sqlalchemy.orm import Session

from pipeline.models import Worker, utcnow
from pipeline.reasons import bounded
from pipeline.status import WorkerState

KEEP_GONE = timedelta(days=7)  # rows of workers gone longer than this are deleted when a worker registers


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself when it registers."""

    id: str
    node: str
    host: str
    pid: int
    device: str | None
    queues: str
    concurrency: int


def new_worker_id(node: str, pid: int) -> str:
    """A lease owner unique to this process start: a restarted container may reuse the host name and pid, and
    must not inherit its predecessor's leases."""
    return f"worker:{node}:{pid}:{secrets.token_hex(4)}"  # "worker:" marks workers' events in the audit log


def register(session: Session, info: WorkerInfo) -> None:
    """Insert the worker's row (state `starting`), and forget workers gone for more than a week."""
    now = utcnow()
    session.execute(delete(Worker).where(Worker.heartbeat_at < now - KEEP_GONE))
    session.execute(
        insert(Worker).values(
            id=info.id,
            node=info.node,
            host=info.host,
            pid=info.pid,
            device=info.device,
            queues=info.queues,
            concurrency=info.concurrency,
            state=WorkerState.STARTING,
            engine_loaded=False,
            in_flight=0,
            done=0,
            errors=0,
            started_at=now,
            heartbeat_at=now,
        )
    )


def beat(session: Session, worker_id: str, in_flight: int, done: int, errors: int) -> bool:
    """The worker is alive, working on `in_flight` documents; False if its row is gone (it was pruned)."""
    return bool(
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id)
            .values(heartbeat_at=utcnow(), in_flight=in_flight, done=done, errors=errors)
        ).rowcount
    )


def set_state(
    session: Session,
    worker_id: str,
    state: WorkerState,
    reason: str | None = None,
    *,
    engine_loaded: bool | None = None,
    metrics_url: str | None = None,
    done: int = 0,
    errors: int = 0,
) -> None:
    """Record a change of state (with its content-free reason and the worker's counts); `stopped` and
    `failed` also end the worker."""
    values: dict = {"state": state, "reason": bounded(reason), "heartbeat_at": utcnow()}
    values |= {"done": done, "errors": errors}
    if engine_loaded is not None:
        values["engine_loaded"] = engine_loaded
    if metrics_url is not None:
        values["metrics_url"] = metrics_url
    if state in (WorkerState.STOPPED, WorkerState.FAILED):
        values |= {"stopped_at": utcnow(), "in_flight": 0}
    session.execute(update(Worker).where(Worker.id == worker_id).values(**values))


def gone(heartbeat_timeout: float, now: datetime | None = None) -> Select:
    """The ids of workers that stopped or went silent for longer than `heartbeat_timeout` seconds."""
    cutoff = (now or utcnow()) - timedelta(seconds=heartbeat_timeout)
    return select(Worker.id).where(or_(Worker.stopped_at.is_not(None), Worker.heartbeat_at < cutoff))


def alive(session: Session, heartbeat_timeout: float) -> int:
    """How many workers are running and have beaten within the timeout (unhealthy ones included)."""
    cutoff = utcnow() - timedelta(seconds=heartbeat_timeout)
    return session.scalar(
        select(func.count())
        .select_from(Worker)
        .where(Worker.stopped_at.is_(None), Worker.heartbeat_at >= cutoff)
    )


@dataclass(frozen=True)
class WorkerView:
    """One worker as `enclave workers` shows it: its row, whether it is alive, and its heartbeat's age."""

    row: Worker
    alive: bool
    silent_s: float

    @property
    def health(self) -> str:
        """Its state, or `gone` for a worker that went silent without saying it stopped."""
        if not self.alive and self.row.stopped_at is None:
            return "gone"
        return str(self.row.state)


def listing(session: Session, heartbeat_timeout: float, include_gone: bool = False) -> list[WorkerView]:
    """Workers, live ones first, then by node name; gone ones only with `include_gone`."""
    now = utcnow()
    rows = session.scalars(select(Worker).order_by(Worker.node, Worker.started_at)).all()
    views = []
    for row in rows:
        silent = (now - row.heartbeat_at).total_seconds()
        live = row.stopped_at is None and silent <= heartbeat_timeout
        if live or include_gone:
            views.append(WorkerView(row, live, max(0.0, silent)))
    return sorted(views, key=lambda v: (not v.alive, v.row.node))
