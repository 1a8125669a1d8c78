"""Which signed head, if any, the audit log in the database fails: the heads the database holds (its
checkpoints) and heads kept outside it (the home's heads file, `--against FILE`), against the chain hashes and
Merkle roots `audit.verify` recomputed from the events.

A head can fail four ways, each named with the rows it concerns: its signature (forged or edited); the log
ends before its size (rows rolled back or cut short: the missing range runs to the largest size any valid head
signed); the chain or tree no longer matches it (rows rewritten since the last head that matches); or, for a
head kept outside, the database has lost its checkpoint (deleted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipeline.audit_anchor import KeptHead
from pipeline.audit_heads import Verifier, legacy_payload, payload
from pipeline.models import AuditCheckpoint


@dataclass(frozen=True)
class Claim:
    """What one signed head claims about the log, where it was found, and whether its signature holds."""

    size: int
    chain_hash: str
    root_hash: str | None  # None: a checkpoint from before tree heads
    signed: bool
    source: str  # "checkpoint at size N" or "FILE line N"
    in_database: bool


def claims(
    checkpoints: Iterable[AuditCheckpoint], kept: Iterable[KeptHead], verify_signature: Verifier
) -> list[Claim]:
    """Every head to check, in size order, the database's first where sizes tie."""
    found = []
    for c in checkpoints:
        signed_bytes = (
            legacy_payload(c.size, c.head_hash)
            if c.root_hash is None
            else payload(c.size, c.root_hash, c.head_hash, c.at)
        )
        signed = verify_signature(signed_bytes, c.signature)
        found.append(Claim(c.size, c.head_hash, c.root_hash, signed, f"checkpoint at size {c.size}", True))
    for k in kept:
        h = k.head
        found.append(
            Claim(h.tree_size, h.chain_hash, h.root_hash, h.signed_by(verify_signature), k.source, False)
        )
    return sorted(found, key=lambda c: (c.size, not c.in_database))


def first_failure(
    found: Sequence[Claim], last_seq: int, chain_at: Mapping[int, str], roots: Mapping[int, str]
) -> tuple[int, int, str] | None:
    """(first row that cannot be trusted, the failing head's size, one-line reason), or None if every head
    holds. `chain_at` and `roots` give the stored chain hash and the recomputed root at each head's size."""
    in_database = {(c.size, c.root_hash) for c in found if c.in_database and c.root_hash is not None}
    # The size of the last head that matches the log, and of the last one kept outside the database: after a
    # rollback the service goes on signing heads of the rolled-back log, so a head kept outside that fails is
    # measured from the last head kept outside that holds.
    matched = matched_outside = 0
    for c in found:
        first, reason = c.size, None
        if not c.signed:
            reason = f"{c.source} has a bad signature (forged or edited)"
        elif c.size > last_seq:
            end, source = max((x.size, x.source) for x in found if x.signed)
            first = last_seq + 1
            rows = f"row {first} is missing" if first == end else f"rows {first}..{end} are missing"
            reason = (
                f"{rows}: the log ends at row {last_seq}, but the service signed a head of {end} events "
                f"({source}): rolled back or cut short"
            )
        elif c.size not in chain_at:
            reason = f"row {c.size} is missing (the service signed a head at that size: {c.source})"
        elif chain_at[c.size] != c.chain_hash or (
            c.root_hash is not None and roots.get(c.size) != c.root_hash
        ):
            first = (matched if c.in_database else matched_outside) + 1
            reason = (
                f"rows {first}..{c.size} were rewritten: the log no longer matches the head signed at size "
                f"{c.size} ({c.source})"
            )
        elif not c.in_database and (c.size, c.root_hash) not in in_database:
            reason = f"the head signed at size {c.size} ({c.source}) is missing from the database (deleted)"
        if reason is not None:
            return first, c.size, reason
        matched = c.size
        if not c.in_database:
            matched_outside = c.size
    return None
