"""The tamper-evident audit log: hash-chained rows plus signed checkpoints.

Each row's hash is SHA-256(previous hash || canonical JSON of the row), so editing, deleting or reordering a
row breaks the chain at that row. Someone with write access to the database can recompute every later hash;
the service's signed checkpoints (size, head hash) catch that for every row up to the latest checkpoint. Rows
after the latest checkpoint are protected by the chain only, and deleting checkpoint rows themselves is not
detected here: keep checkpoints frequent and copy them out of the database (receipts, exports).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, func, select, text
from sqlalchemy.orm import Session

from jobs.bounded_json import has_lone_surrogate
from pipeline.canonical import canonical_json
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


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of `verify`: `first_bad_seq` is the first row that cannot be trusted, `reason` one line."""

    ok: bool
    rows: int
    checkpoints: int
    first_bad_seq: int | None = None
    reason: str | None = None


def checkpoint_payload(size: int, head_hash: str) -> bytes:
    """The bytes a checkpoint signature covers."""
    return canonical_json({"size": size, "head_hash": head_hash})


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
    session: Session, *, sign: Callable[[bytes], bytes], key_fingerprint: str
) -> AuditCheckpoint | None:
    """Sign (size, head hash) of the log as it stands; None if the log is empty or this size is signed."""
    _lock(session)
    head = _head(session)
    if head is None or session.get(AuditCheckpoint, head.seq) is not None:
        return None
    signature = sign(checkpoint_payload(head.seq, head.hash))
    row = AuditCheckpoint(
        size=head.seq, head_hash=head.hash, at=_now(), key_fingerprint=key_fingerprint, signature=signature
    )
    session.add(row)
    session.flush()
    return row


def maybe_checkpoint(
    session: Session, every: int, sign: Callable[[bytes], bytes], key_fingerprint: str
) -> AuditCheckpoint | None:
    """Checkpoint when the log has grown by at least `every` rows since the last checkpoint."""
    if every < 1:
        raise ValueError(f"checkpoint interval must be at least 1 row, got {every}")
    _lock(session)
    size = session.scalar(select(func.max(AuditEvent.seq))) or 0
    signed = session.scalar(select(func.max(AuditCheckpoint.size))) or 0
    if size - signed < every:
        return None
    return checkpoint(session, sign=sign, key_fingerprint=key_fingerprint)


def verify(session: Session, *, verify_signature: Callable[[bytes, bytes], bool]) -> VerifyReport:
    """Recompute the chain and check every checkpoint; report the first row that cannot be trusted.

    Breaks in the chain (an edited, missing, moved or inserted row) are named exactly. A checkpoint whose head
    hash no longer matches the chain at its size (rows rewritten and every later hash recomputed) is reported
    as the first row after the last checkpoint that still matches: the rewrite lies somewhere in that range.
    A log shorter than a checkpoint names its first missing row; a bad signature names the checkpoint's size.
    """
    checkpoints = session.execute(select(AuditCheckpoint).order_by(AuditCheckpoint.size)).scalars().all()
    sizes = {c.size for c in checkpoints}
    heads: dict[int, str] = {}  # stored hash of each row whose seq is a checkpoint size
    rows, last_seq, prev_hash = 0, 0, GENESIS
    chain_bad: tuple[int, str] | None = None
    query = select(AuditEvent.__table__).order_by(AuditEvent.seq).execution_options(yield_per=1000)
    for row in session.execute(query):
        rows += 1
        if row.seq in sizes:
            heads[row.seq] = row.hash
        if chain_bad is None:
            chain_bad = _check_row(row, last_seq + 1, prev_hash)
        last_seq, prev_hash = row.seq, row.hash

    cp_bad: tuple[int, str] | None = None
    cp_size = 0  # size of the first checkpoint that fails
    matched = 0  # size of the last checkpoint that matches the chain
    for c in checkpoints:
        cp_size = c.size
        if not verify_signature(checkpoint_payload(c.size, c.head_hash), c.signature):
            cp_bad = (c.size, f"checkpoint at size {c.size} has a bad signature (forged or edited)")
        elif c.size > last_seq:
            missing = f"the log ends at row {last_seq}, but a checkpoint was signed at size {c.size}"
            cp_bad = (last_seq + 1, f"row {last_seq + 1} is missing: {missing}")
        elif c.size not in heads:
            cp_bad = (c.size, f"row {c.size} is missing (a checkpoint was signed at that size)")
        elif heads[c.size] != c.head_hash:
            rewritten = f"the chain no longer matches the signed checkpoint at size {c.size}"
            cp_bad = (matched + 1, f"rows {matched + 1}..{c.size} were rewritten: {rewritten}")
        else:
            matched = c.size
            continue
        break

    # A chain break at or before the failing checkpoint names the row exactly and explains the checkpoint too.
    bad = chain_bad if chain_bad is not None and (cp_bad is None or chain_bad[0] <= cp_size) else cp_bad
    if bad is None:
        return VerifyReport(ok=True, rows=rows, checkpoints=len(checkpoints))
    return VerifyReport(False, rows, len(checkpoints), *bad)


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
