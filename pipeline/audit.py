"""The tamper-evident audit log: hash-chained rows, a Merkle tree over them, and signed tree heads.

Each row's hash is SHA-256(previous hash || canonical JSON of the row), so editing, deleting or reordering a
row breaks the chain at that row. Someone with write access to the database can recompute every later hash;
the service's signed tree heads (checkpoints: size, RFC 9162 Merkle root, chain head hash, time) catch that
for every row up to the latest head, and let anyone holding a head check proofs (`audit_proofs`). Heads are
also appended outside the database after they commit (`audit_anchor`), so that `verify` can tell a log cut
short, rolled back or stripped of a checkpoint from an intact one. Rows after the latest head are protected
by the chain only, until the next head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, func, select, text
from sqlalchemy import event as orm_event
from sqlalchemy.orm import Session

from jobs.bounded_json import has_lone_surrogate
from pipeline import audit_tree, audit_verify
from pipeline.audit_anchor import KeptHead
from pipeline.audit_heads import SignedHead, Verifier
from pipeline.audit_proofs import event_leaf
from pipeline.canonical import canonical_json
from pipeline.merkle import CompactRange
from pipeline.models import AuditCheckpoint, AuditEvent

SUBMITTED = "submitted"
REJECTED = "rejected"
STARTED = "started"
DOCUMENT_DONE = "document_done"
DOCUMENT_FAILED = "document_failed"
CANCELLED = "cancelled"
COMPLETED = "completed"
RESULTS_FETCHED = "results_fetched"
CHECKPOINT = "checkpoint"
CLIENT_ADDED = "client_added"
CLIENT_REVOKED = "client_revoked"
UPLOAD_STARTED = "upload_started"  # a submit claimed its job id (new, or an interrupted upload taken over)
DOCUMENTS_STORED = "documents_stored"  # one chunk of a submit's sealed documents
PURGED = "purged"  # an administrator removed a job's ciphertext and results (`pipeline/purge.py`)
_JOB_ACTIONS = (
    UPLOAD_STARTED,
    DOCUMENTS_STORED,
    SUBMITTED,
    REJECTED,
    STARTED,
    DOCUMENT_DONE,
    DOCUMENT_FAILED,
    CANCELLED,
    COMPLETED,
    PURGED,
)
ACTIONS = frozenset((*_JOB_ACTIONS, RESULTS_FETCHED, CHECKPOINT, CLIENT_ADDED, CLIENT_REVOKED))

GENESIS = "0" * 64  # prev_hash of row 1
MAX_STRING = 200  # longest string (or key) allowed in details: ids and short codes, never content
MAX_DETAILS_BYTES = 4096  # canonical JSON of one row's details
MAX_DEPTH = 8  # lists and dicts inside one another in details
_LOCK_KEY = 0x454E434C41564541  # b"ENCLAVEA": pg_advisory_xact_lock key that serialises appends
_PENDING = "enclave.audit.heads"  # session.info: heads signed in this transaction, published after commit
log = logging.getLogger("enclave.audit")
Publish = Callable[[SignedHead], None]


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of `verify`: `first_bad_seq` is the first row that cannot be trusted, `reason` one line;
    `kept` counts the heads from outside the database that were checked too."""

    ok: bool
    rows: int
    checkpoints: int
    first_bad_seq: int | None = None
    reason: str | None = None
    kept: int = 0


def row_hash(fields: dict[str, Any]) -> str:
    """hex SHA-256(prev_hash bytes || canonical JSON of every row field except `hash`)."""
    return hashlib.sha256(bytes.fromhex(fields["prev_hash"]) + canonical_json(fields)).hexdigest()


def append(
    session: Session,
    *,
    actor: str,
    action: str,
    job_id: str | None = None,
    document_id: str | None = None,
    outcome: str = "ok",
    details: dict[str, Any] | None = None,
) -> AuditEvent:
    """Append one event inside the caller's transaction: it commits or rolls back with the change it records.

    On PostgreSQL the transaction must be READ COMMITTED (the default), so the head is re-read after the lock.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown audit action {action!r}; use one of: {', '.join(sorted(ACTIONS))}")
    _check_str("actor", actor, 200, required=True)
    _check_str("outcome", outcome, 40, required=True)
    _check_str("job_id", job_id, 36)
    _check_str("document_id", document_id, 36)
    details_text = _details_text({} if details is None else details)

    _lock(session)
    last = _head(session)
    seq, prev_hash = (last.seq + 1, last.hash) if last else (1, GENESIS)
    fields = dict(seq=seq, at=_now(), actor=actor, action=action, job_id=job_id, document_id=document_id)
    fields.update(outcome=outcome, details=json.loads(details_text), prev_hash=prev_hash)
    event = AuditEvent(**{**fields, "details": details_text}, hash=row_hash(fields))
    session.add(event)
    session.flush()  # a clash on the seq primary key surfaces here, not at commit
    return event


def checkpoint(
    session: Session,
    *,
    sign: Callable[[bytes], bytes],
    key_fingerprint: str,
    publish: Publish | None = None,
) -> AuditCheckpoint | None:
    """Sign the tree head of the log as it stands (size, Merkle root, chain head hash, time); None if the log
    is empty or this size is signed. `publish` gets the head once the caller's transaction commits (never if
    it rolls back), to copy it outside the database; call this outside savepoints."""
    if session.in_nested_transaction():
        raise ValueError(
            "sign audit heads outside savepoints: a head must commit or roll back with its transaction"
        )
    _lock(session)
    head = _head(session)
    if head is None or session.get(AuditCheckpoint, head.seq) is not None:
        return None
    tree = audit_tree.state_at(session, head.seq)
    unsigned = SignedHead(head.seq, tree.root().hex(), head.hash, _now(), key_fingerprint, b"")
    signed = SignedHead(**{**unsigned.__dict__, "signature": sign(unsigned.payload())})
    row = AuditCheckpoint(
        size=signed.tree_size,
        head_hash=signed.chain_hash,
        at=signed.timestamp,
        key_fingerprint=key_fingerprint,
        signature=signed.signature,
        root_hash=signed.root_hash,
        tree_state=tree.dump(),
    )
    session.add(row)
    session.flush()
    if publish is not None:
        _publish_after_commit(session, signed, publish)
    return row


def maybe_checkpoint(
    session: Session,
    every: int,
    sign: Callable[[bytes], bytes],
    key_fingerprint: str,
    publish: Publish | None = None,
) -> AuditCheckpoint | None:
    """Checkpoint when the log has grown by at least `every` rows since the last checkpoint."""
    if every < 1:
        raise ValueError(f"checkpoint interval must be at least 1 row, got {every}")
    _lock(session)
    size = session.scalar(select(func.max(AuditEvent.seq))) or 0
    signed = session.scalar(select(func.max(AuditCheckpoint.size))) or 0
    if size - signed < every:
        return None
    return checkpoint(session, sign=sign, key_fingerprint=key_fingerprint, publish=publish)


def _publish_after_commit(session: Session, head: SignedHead, publish: Publish) -> None:
    session.info.setdefault(_PENDING, []).append((head, publish))
    if not orm_event.contains(session, "after_commit", _published):
        orm_event.listen(session, "after_commit", _published)
        orm_event.listen(session, "after_rollback", _dropped)


def _published(session: Session) -> None:
    for head, publish in session.info.pop(_PENDING, []):
        try:
            publish(head)
        except Exception:  # the head is committed: a failed copy must not fail the caller's work
            log.exception("publishing the signed audit head of size %d failed", head.tree_size)


def _dropped(session: Session) -> None:
    session.info.pop(_PENDING, None)


def verify(session: Session, *, verify_signature: Verifier, kept: Sequence[KeptHead] = ()) -> VerifyReport:
    """Recompute the chain and the Merkle tree, check every signed head in the database and every head `kept`
    outside it; report the first row that cannot be trusted.

    Breaks in the chain (an edited, missing, moved or inserted row) are named exactly. A head that no longer
    matches the chain or the tree at its size (rows rewritten and every later hash recomputed) is reported as
    the first row after the last head that still matches: the rewrite lies somewhere in that range. A log
    shorter than a head names the missing rows; a bad signature names the head (`audit_verify`). An empty
    log fails: `enclave init` records the first event, so a wiped log looks like that.
    """
    checkpoints = session.execute(select(AuditCheckpoint).order_by(AuditCheckpoint.size)).scalars().all()
    found = audit_verify.claims(checkpoints, kept, verify_signature)
    sizes = {c.size for c in found}
    chain_at: dict[int, str] = {}  # stored hash of each row whose seq is a head's size
    roots: dict[int, str] = {}  # recomputed Merkle root of the first n rows, for each head's size n
    tree = CompactRange()
    rows, last_seq, prev_hash = 0, 0, GENESIS
    chain_bad: tuple[int, str] | None = None
    query = select(AuditEvent.__table__).order_by(AuditEvent.seq).execution_options(yield_per=1000)
    for row in session.execute(query):
        rows += 1
        if chain_bad is None:
            chain_bad = _check_row(row, last_seq + 1, prev_hash)
        tree.append(event_leaf(row._mapping))
        if row.seq in sizes:
            chain_at[row.seq] = row.hash
        if rows in sizes:
            roots[rows] = tree.root().hex()
        last_seq, prev_hash = row.seq, row.hash

    failed = audit_verify.first_failure(found, last_seq, chain_at, roots)
    # A chain break at or before the failing head names the row exactly and explains the head too.
    if chain_bad is not None and (failed is None or chain_bad[0] <= failed[1]):
        bad: tuple[int, str] | None = chain_bad
    elif failed is not None:
        bad = (failed[0], failed[2])
    elif rows == 0:
        bad = (
            1,
            "the audit log is empty: `enclave init` records its first event, so a wiped log looks like this",
        )
    else:
        return VerifyReport(True, rows, len(checkpoints), kept=len(kept))
    return VerifyReport(False, rows, len(checkpoints), *bad, kept=len(kept))


def _check_row(row: Row[Any], seq: int, prev_hash: str) -> tuple[int, str] | None:
    """The first problem with `row`, expected at `seq` after a row whose stored hash is `prev_hash`."""
    if row.seq != seq:
        return seq, f"row {seq} is missing (the next row is {row.seq})"
    if row.prev_hash != prev_hash:
        before = (
            f"row {seq - 1}'s hash (row {seq - 1} or {seq} was altered)" if seq > 1 else "the genesis hash"
        )
        return seq, f"row {seq}: prev_hash does not match {before}"
    try:
        details = json.loads(row.details)
    except ValueError:
        return seq, f"row {seq}: details are not valid JSON (edited)"
    if not isinstance(details, dict) or canonical_json(details).decode() != row.details:
        return seq, f"row {seq}: details are not canonical JSON (edited)"
    fields = {name: getattr(row, name) for name in row._fields if name != "hash"}
    if row_hash({**fields, "details": details}) != row.hash:
        return seq, f"row {seq}: hash does not match the row's contents (edited)"
    return None


def _head(session: Session) -> Row[tuple[int, str]] | None:
    """(seq, hash) of the last row, or None for an empty log."""
    return session.execute(
        select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)
    ).first()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # UTC, microseconds, trailing Z


def _lock(session: Session) -> None:
    """On PostgreSQL, queue writers on one advisory lock held until commit (SQLite: BEGIN IMMEDIATE)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})


def bounded(text: str | None, limit: int = MAX_STRING) -> str | None:
    """`text` on one line and cut to at most `limit` characters, so that it always passes `append`'s
    string rule. For content-free reasons (codes, paths, sizes) that may run long: it does not make
    content safe, and details must never carry content in the first place."""
    if text is None:
        return None
    text = " ".join(str(text).encode("utf-8", "replace").decode("utf-8").split())  # lone surrogates: "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_str(name: str, value: str | None, limit: int, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValueError(f"audit {name} must be a non-empty string of at most {limit} characters")


def _details_text(details: dict[str, Any]) -> str:
    """Canonical JSON of `details`, refusing anything that could carry document content."""
    if not isinstance(details, dict):
        raise ValueError("audit details must be a dict")
    _check_value(details, "details")
    encoded = canonical_json(details)
    if len(encoded) > MAX_DETAILS_BYTES:
        raise ValueError(
            f"audit details are {len(encoded)} bytes; keep them to {MAX_DETAILS_BYTES} (ids, counts)"
        )
    return encoded.decode()


def _check_value(details: Any, root: str) -> None:
    """Walk `details` without recursion: bounded depth, short strings and keys, JSON scalars only."""
    stack = [(details, root, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"audit {root} are nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, list):
            stack += [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str) or len(key) > MAX_STRING or has_lone_surrogate(key):
                    raise ValueError(f"audit {path}: keys must be strings of at most {MAX_STRING} characters")
                stack.append((item, f"{path}.{key}", depth + 1))
        elif isinstance(value, str):
            if len(value) > MAX_STRING:
                raise ValueError(
                    f"audit {path} is a {len(value)}-character string; details hold ids and short codes "
                    f"(at most {MAX_STRING} characters), never document content"
                )
            if has_lone_surrogate(value):
                raise ValueError(f"audit {path} is not valid Unicode (a lone surrogate)")
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"audit {path} is an integer beyond 64 bits")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"audit {path} is {value}; JSON has no NaN or infinity")
        else:
            raise ValueError(
                f"audit {path} is a {type(value).__name__}; use str, int, float, bool, None, list, dict"
            )
