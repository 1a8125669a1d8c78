"""The audit log's Merkle tree, read from the database: leaf `seq - 1` is event `seq`
(`audit_proofs.event_leaf`).

Signing a head needs the root of every event so far; the tree's compact range is stored with each signed head
(`audit_checkpoints.tree_state`), so the next head reads only the events after the last one. Proofs stream
the events once and keep O(log n) hashes (`merkle.range_hashes`): proving costs a pass over the log, as
`audit verify` does, and no memory that grows with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import merkle
from pipeline.audit_heads import SignedHead
from pipeline.audit_proofs import event_leaf
from pipeline.errors import UserError
from pipeline.models import AuditCheckpoint, AuditEvent

log = logging.getLogger("enclave.audit")


class TreeError(UserError, ValueError):
    """The log cannot give what was asked (no such event, no signed head yet, rows missing); one line."""


def leaves(session: Session, start: int = 1, end: int | None = None) -> Iterator[bytes]:
    """Leaf hashes of events `start`..`end` (inclusive; `end` None: to the last), in order. TreeError if a row
    in that range is missing: a log with a hole has no well-defined tree."""
    query = select(AuditEvent.__table__).where(AuditEvent.seq >= start).order_by(AuditEvent.seq)
    if end is not None:
        query = query.where(AuditEvent.seq <= end)
    expected = start
    for row in session.execute(query.execution_options(yield_per=1000)):
        if row.seq != expected:
            raise TreeError(f"the audit log has no row {expected}: run `enclave audit verify`")
        yield event_leaf(row._mapping)
        expected += 1
    if end is not None and expected <= end:
        raise TreeError(
            f"the audit log ends at row {expected - 1}, before row {end}: run `enclave audit verify`"
        )


def head_of(row: AuditCheckpoint) -> SignedHead | None:
    """A checkpoint row as a signed tree head; None for a checkpoint from before tree heads (no root)."""
    if row.root_hash is None:
        return None
    return SignedHead(row.size, row.root_hash, row.head_hash, row.at, row.key_fingerprint, row.signature)


def latest_head(session: Session) -> SignedHead | None:
    """The signed tree head of the largest size, or None before the first."""
    row = session.scalars(
        select(AuditCheckpoint)
        .where(AuditCheckpoint.root_hash.is_not(None))
        .order_by(AuditCheckpoint.size.desc())
        .limit(1)
    ).first()
    return None if row is None else head_of(row)


def require_head(session: Session) -> SignedHead:
    """The latest signed tree head; TreeError when none is signed yet."""
    head = latest_head(session)
    if head is None:
        raise TreeError(
            "the audit log has no signed tree head yet: a worker signs one when a job ends (or every "
            "ENCLAVE_CHECKPOINT_EVERY events), and `enclave init` signs one"
        )
    return head


def state_at(session: Session, size: int) -> merkle.CompactRange:
    """The compact range of the first `size` events: the stored state of the latest signed head at or below
    `size`, if it still folds to the root that head signs, extended with the events after it."""
    row = session.scalars(
        select(AuditCheckpoint)
        .where(AuditCheckpoint.root_hash.is_not(None), AuditCheckpoint.size <= size)
        .order_by(AuditCheckpoint.size.desc())
        .limit(1)
    ).first()
    tree = merkle.CompactRange()
    if row is not None and row.tree_state is not None:
        try:
            stored = merkle.CompactRange.load(row.size, row.tree_state)
        except ValueError:
            stored = None
        if stored is not None and stored.root().hex() == row.root_hash:
            tree = stored
        else:
            log.warning(
                "the stored tree state of the audit head at size %d does not fold to its root", row.size
            )
    for leaf in leaves(session, tree.size + 1, size):
        tree.append(leaf)
    return tree


def inclusion_path(session: Session, seq: int, size: int) -> list[bytes]:
    """PATH(seq - 1, D[size]): event `seq`'s inclusion proof in the tree of the first `size` events."""
    if not 1 <= seq <= size:
        raise TreeError(f"event {seq} is not among the {size} events of the signed head")
    return merkle.range_hashes(merkle.inclusion_ranges(seq - 1, size), leaves(session, 1, size))


def consistency_path(session: Session, old: int, size: int) -> list[bytes]:
    """PROOF(old, D[size]): the tree of the first `old` events is a prefix of the tree of `size`."""
    if not 1 <= old <= size:
        raise TreeError(
            f"no consistency proof from {old} events: the service's latest signed head has {size} (a head of "
            f"more events than that means rows {size + 1}..{old} are missing)"
        )
    return merkle.range_hashes(merkle.consistency_ranges(old, size), leaves(session, 1, size))
