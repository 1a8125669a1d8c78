"""Administrators' view of the audit log: pages of events (oldest or newest first, by job, action and time),
the latest signed tree head, and the proofs a client checks against it with the service's public key alone
(`pipeline.audit_proofs`). Reading is not audited: it changes nothing."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sqlalchemy import select

from pipeline import audit, audit_tree
from pipeline.api.auth import Caller
from pipeline.api.errors import ApiError, malformed
from pipeline.audit_heads import SignedHead
from pipeline.db import Database
from pipeline.models import AuditEvent
from pipeline.wire import messages as m

_AT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@dataclass(frozen=True)
class AuditQuery:
    """Which events a page holds: after/before a seq (the cursor), one job (an id or a prefix), some actions,
    a time range [since, until) in the log's UTC format, newest first or oldest first."""

    limit: int = 1000
    after: int = 0
    before: int | None = None
    job: str | None = None
    actions: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    newest_first: bool = False

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and not _AT.fullmatch(value):
                raise malformed(f"the query parameter {name} must read YYYY-MM-DDTHH:MM:SS.ffffffZ (UTC)")
        if not set(self.actions) <= audit.ACTIONS:
            raise malformed(
                f"the query parameter action names an unknown action; use {', '.join(sorted(audit.ACTIONS))}"
            )


class AuditLog:
    """The audit routes' operations (administrators only: 403 otherwise)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    def check(caller: Caller) -> None:
        if not caller.admin:
            raise ApiError(
                403, "forbidden", "this needs an administrator's key (role admin on the allow-list)"
            )

    def page(self, caller: Caller, q: AuditQuery) -> m.AuditPage:
        self.check(caller)
        order = AuditEvent.seq.desc() if q.newest_first else AuditEvent.seq
        query = select(AuditEvent).order_by(order).limit(q.limit + 1)
        if q.after:
            query = query.where(AuditEvent.seq > q.after)
        if q.before is not None:
            query = query.where(AuditEvent.seq < q.before)
        if q.job:
            query = query.where(AuditEvent.job_id.startswith(q.job.strip().lower(), autoescape=True))
        if q.actions:
            query = query.where(AuditEvent.action.in_(q.actions))
        if q.since:
            query = query.where(AuditEvent.at >= q.since)
        if q.until:
            query = query.where(AuditEvent.at < q.until)
        with self.db.transaction() as s:
            rows = s.scalars(query).all()
            events = [row(e) for e in rows[: q.limit]]
        more = len(rows) > q.limit
        return m.AuditPage(
            events=events,
            next_after=events[-1].seq if more and not q.newest_first else None,
            next_before=events[-1].seq if more and q.newest_first else None,
        )

    def head(self, caller: Caller) -> m.TreeHead:
        self.check(caller)
        with self.db.transaction() as s:
            return _head(_latest(s))

    def proof(self, caller: Caller, seq: int) -> m.AuditProof:
        """Event `seq` and its inclusion proof against the latest signed head."""
        self.check(caller)
        with self.db.transaction() as s:
            head = _latest(s)
            event = s.get(AuditEvent, seq)
            if event is None:
                raise ApiError(404, "not_found", f"the audit log has no event {seq}")
            if seq > head.tree_size:
                raise ApiError(
                    409,
                    "not_yet_signed",
                    f"event {seq} comes after the latest signed head ({head.tree_size} events): the next "
                    "head (a job's end, or every ENCLAVE_CHECKPOINT_EVERY events) will cover it",
                )
            path = _tree(audit_tree.inclusion_path, s, seq, head.tree_size)
            return m.AuditProof(event=row(event), head=_head(head), path=[p.hex() for p in path])

    def consistency(self, caller: Caller, old_size: int) -> m.AuditConsistency:
        """A proof that the latest signed head extends the tree of `old_size` events. When the latest head is
        not larger, the path is empty: the client then names the missing rows, or compares the roots."""
        self.check(caller)
        with self.db.transaction() as s:
            head = _latest(s)
            path = []
            if old_size < head.tree_size:
                path = _tree(audit_tree.consistency_path, s, old_size, head.tree_size)
            return m.AuditConsistency(head=_head(head), old_size=old_size, path=[p.hex() for p in path])


def _latest(session) -> SignedHead:
    try:
        return audit_tree.require_head(session)
    except audit_tree.TreeError as exc:
        raise ApiError(409, "not_signed", str(exc)) from None


def _tree(proof, session, *args: int) -> list[bytes]:
    try:
        return proof(session, *args)
    except audit_tree.TreeError as exc:  # a hole in the log: the proof cannot be made
        raise ApiError(409, "broken_log", str(exc)) from None


def _head(head: SignedHead) -> m.TreeHead:
    return m.TreeHead(**head.to_json())


def row(event: AuditEvent) -> m.AuditRow:
    return m.AuditRow(
        seq=event.seq,
        at=event.at,
        actor=event.actor,
        action=event.action,
        job_id=event.job_id,
        document_id=event.document_id,
        outcome=event.outcome,
        details=json.loads(event.details),
        prev_hash=event.prev_hash,
        hash=event.hash,
    )
