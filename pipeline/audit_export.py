"""`enclave audit export`: the audit log as JSON lines for a SIEM, provable without the database.

The first line is the latest signed tree head (`{"type": "tree_head", "head": {...}}`); with `after` > 0 the
second proves that head extends the tree of the first `after` events, which the previous export's head signed
(`{"type": "consistency", "old_size", "tree_size", "path"}`); then each event after `after` and within the
head: `{"type": "event", "event": {ten columns}, "leaf_index": seq - 1, "tree_size", "path"}`, whose path
is its RFC 9162 inclusion proof (hex). `pipeline.audit_proofs` checks any line with the service's public key.
Events after the head wait for the next export. The tree is held in memory, about 64 bytes per event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import audit_tree, merkle
from pipeline.audit_heads import SignedHead
from pipeline.audit_proofs import EVENT_FIELDS
from pipeline.audit_tree import TreeError
from pipeline.models import AuditEvent


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: the head it proves against, the events after `after`, those left for later."""

    head: SignedHead
    after: int
    events: int
    left: int


def export(session: Session, write: Callable[[str], None], after: int = 0) -> ExportSummary:
    """Write the lines of an export of the events after `after` to `write`, one call per line."""
    head = audit_tree.require_head(session)
    size = head.tree_size
    if after > size:
        raise TreeError(
            f"--after {after} is beyond the latest signed head ({size} events): the log was rolled back, or "
            "no head of that size was ever signed; run `enclave audit verify`"
        )
    tree = merkle.Tree(audit_tree.leaves(session, 1, size))
    if tree.root().hex() != head.root_hash:
        raise TreeError(
            f"the events no longer match the latest signed head ({size} events): run `enclave audit verify`"
        )
    write(_line({"type": "tree_head", "head": head.to_json()}))
    if after:
        path = [p.hex() for p in tree.consistency_path(after)]
        write(_line({"type": "consistency", "old_size": after, "tree_size": size, "path": path}))
    query = select(AuditEvent.__table__).where(AuditEvent.seq > after, AuditEvent.seq <= size)
    for row in session.execute(query.order_by(AuditEvent.seq).execution_options(yield_per=1000)):
        event = {name: row._mapping[name] for name in EVENT_FIELDS} | {"details": json.loads(row.details)}
        path = [p.hex() for p in tree.inclusion_path(row.seq - 1)]
        line = {"type": "event", "event": event, "leaf_index": row.seq - 1, "tree_size": size, "path": path}
        write(_line(line))
    left = session.scalar(select(func.count()).select_from(AuditEvent).where(AuditEvent.seq > size)) or 0
    return ExportSummary(head, after, size - after, left)


def _line(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
