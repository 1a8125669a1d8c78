"""Rebuilding a broker that lost its messages, from the database, the source of truth.

The broker holds a marker, and the database (`broker_marker`) the same one. A broker whose marker is missing
or different lost whatever it held: the embedded file was deleted, replaced or moved aside as unreadable, or
Redis restarted without persistence. Then a new marker is written to both and every open shard of every
active job is dispatched again, with one log line. A shard still being worked on gets a message that finds
nothing to lease: duplicates are harmless. Workers check at start-up and at every sweep; `enclave broker
rebuild` does it by hand (and for brokers the probe cannot look into).
"""

from __future__ import annotations

import logging
import secrets

from celery import Celery
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError

from pipeline import embedded_broker, store
from pipeline.broker_probe import BrokerProbe, BrokerUnavailable, BrokerUnreadable
from pipeline.db import Database
from pipeline.dispatch import dispatch_shard
from pipeline.models import BrokerMarker, Job, utcnow

log = logging.getLogger("enclave.broker")


def check(app: Celery, db: Database, probe: BrokerProbe) -> int | None:
    """Rebuild the broker if it lost its marker: how many shards were dispatched again (0 when the broker is
    intact), or None when the broker cannot be looked into now."""
    if not probe.supported:
        return None
    try:
        held = _read(probe)
    except BrokerUnavailable:
        return None
    with db.transaction() as s:
        known = s.scalar(select(BrokerMarker.marker).where(BrokerMarker.id == 1))
    if known is None:  # the first check of this database: adopt the broker's marker, or give it one
        _adopt(db, probe, held)
        return 0
    if held == known:
        return 0
    return rebuild(app, db, probe, known)


def rebuild(app: Celery, db: Database, probe: BrokerProbe, expected: str | None = None) -> int:
    """A new marker, then every open shard dispatched again; how many. With `expected` (the database's marker
    when the loss was seen), only the first of several workers that saw it rebuilds."""
    marker = secrets.token_hex(16)
    with db.transaction() as s:
        if expected is None:
            _store_marker(s, marker)
        elif not s.execute(
            update(BrokerMarker)
            .where(BrokerMarker.id == 1, BrokerMarker.marker == expected)
            .values(marker=marker, set_at=utcnow())
        ).rowcount:
            return 0  # another worker rebuilt it
    if probe.supported:
        try:
            _write(probe, marker)
        except BrokerUnavailable:
            log.warning("the broker cannot be reached; its open shards are dispatched once it is back")
            return 0
    dispatched = redispatch(app, db)
    log.warning(
        "the broker lost its messages (its marker is gone: deleted, replaced, corrupted or restarted without "
        "persistence): %d open shards dispatched again from the database",
        dispatched,
    )
    return dispatched


def redispatch(app: Celery, db: Database) -> int:
    """Dispatch every open shard of every active job; the shards that reached the broker are marked."""
    with db.transaction() as s:
        shards = store.open_shards(s)
        priorities = dict(
            s.execute(select(Job.id, Job.priority).where(Job.id.in_({j for j, _ in shards}))).all()
        )
    sent = []
    for job_id, shard in shards:
        try:
            dispatch_shard(app, job_id, shard, priorities[job_id])
        except Exception as exc:  # the broker went away again: the sweeper sends the rest later
            log.warning(
                "dispatch stopped after %d of %d shards: %s", len(sent), len(shards), type(exc).__name__
            )
            break
        sent.append((job_id, shard))
    with db.transaction() as s:
        for job_id, shard in sent:
            store.mark_dispatched(s, job_id, shard)
    return len(sent)


def _read(probe: BrokerProbe) -> str | None:
    """The broker's marker; an unreadable embedded file is moved aside first (its marker is then gone)."""
    try:
        return probe.read()
    except BrokerUnreadable:
        embedded_broker.move_aside_if_unreadable(probe.path)
        return None


def _write(probe: BrokerProbe, marker: str) -> None:
    try:
        probe.write(marker)
    except BrokerUnreadable:
        embedded_broker.move_aside_if_unreadable(probe.path)
        probe.write(marker)


def _adopt(db: Database, probe: BrokerProbe, held: str | None) -> None:
    marker = held or secrets.token_hex(16)
    if held is None:
        _write(probe, marker)
    try:
        with db.transaction() as s:
            _store_marker(s, marker)
    except IntegrityError:  # another worker adopted one first: the next check compares with it
        pass


def _store_marker(session, marker: str) -> None:
    if session.get(BrokerMarker, 1) is None:
        session.execute(insert(BrokerMarker).values(id=1, marker=marker, set_at=utcnow()))
    else:
        session.execute(
            update(BrokerMarker).where(BrokerMarker.id == 1).values(marker=marker, set_at=utcnow())
        )
