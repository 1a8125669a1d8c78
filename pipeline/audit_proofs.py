"""The verifier's side of the audit log's proofs: an event's leaf in the Merkle tree, and checking that an
event is in a signed head (inclusion) and that a later head extends an earlier one (consistency). It needs the
service's public key and what the service sent, never the database, so it runs on a client or in a SIEM.

An event's leaf data is the canonical JSON (`pipeline.canonical`: sorted keys, no spaces, UTF-8) of its ten
columns, `details` as an object: seq, at, actor, action, job_id, document_id, outcome, details, prev_hash and
hash. Leaf `seq - 1` of the tree is event `seq`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline import merkle
from pipeline.audit_heads import SignedHead, Verifier
from pipeline.canonical import canonical_json
from pipeline.errors import UserError

EVENT_FIELDS = (
    *("seq", "at", "actor", "action", "job_id", "document_id", "outcome", "details"),
    *("prev_hash", "hash"),
)


class ProofError(UserError, ValueError):
    """A proof or head does not check out; the message is one line saying what that means."""


def event_leaf(event: Mapping[str, Any]) -> bytes:
    """The leaf hash of one audit event (a row or an exported event: `details` as a dict or its JSON text)."""
    fields = {name: event[name] for name in EVENT_FIELDS}
    if isinstance(fields["details"], str):
        with contextlib.suppress(ValueError):  # an edited row keeps a leaf, which matches no signed head
            fields["details"] = json.loads(fields["details"])
    return merkle.leaf_hash(canonical_json(fields))


def hashes_of(path: Sequence[str], what: str) -> list[bytes]:
    """Hex proof elements as bytes; ProofError for anything but 32-byte hashes."""
    try:
        values = [bytes.fromhex(p) for p in path]
    except (TypeError, ValueError):
        values = []
    if len(values) != len(path) or any(len(v) != merkle.HASH_SIZE for v in values):
        raise ProofError(f"the {what} holds something that is not a SHA-256 hash")
    return values


def check_head(head: SignedHead, verify_signature: Verifier, what: str) -> None:
    """ProofError unless `head` carries the service's valid signature."""
    if not head.signed_by(verify_signature):
        raise ProofError(
            f"{what} (size {head.tree_size}) does not carry the service's valid signature: forged or edited, "
            "or signed by another key than this home's service key"
        )


def check_inclusion(
    event: Mapping[str, Any], head: SignedHead, path: Sequence[str], verify: Verifier
) -> None:
    """ProofError unless `path` proves `event` is leaf seq-1 of the tree `head` signs."""
    check_head(head, verify, "the service's latest signed head")
    seq = event["seq"]
    if not isinstance(seq, int) or not 1 <= seq <= head.tree_size:
        raise ProofError(f"event {seq} is not within the signed head's {head.tree_size} events")
    leaf, proof = event_leaf(event), hashes_of(path, "inclusion proof")
    if not merkle.verify_inclusion(seq - 1, head.tree_size, leaf, proof, _raw(head)):
        raise ProofError(
            f"the inclusion proof of event {seq} does not lead to the root the service signed at size "
            f"{head.tree_size}: the event or the proof was altered, or the log no longer matches its head"
        )


def check_consistency(old: SignedHead, new: SignedHead, path: Sequence[str], verify: Verifier) -> None:
    """ProofError unless `new` extends `old`: both signed, and `path` proves old's tree a prefix of new's."""
    check_head(old, verify, "the head you kept")
    check_head(new, verify, "the service's latest signed head")
    if new.tree_size < old.tree_size:
        raise ProofError(
            f"rows {new.tree_size + 1}..{old.tree_size} are missing: the service's latest signed head has "
            f"{new.tree_size} events, but it signed {old.tree_size} in the head you kept (rolled back or cut "
            "short)"
        )
    proof = hashes_of(path, "consistency proof")
    if not merkle.verify_consistency(old.tree_size, new.tree_size, _raw(old), _raw(new), proof):
        raise ProofError(
            f"the log did not only grow: the service's tree of {new.tree_size} events does not extend the "
            f"tree of {old.tree_size} it signed in the head you kept (events up to {old.tree_size} were "
            "rewritten)"
        )


def _raw(head: SignedHead) -> bytes:
    return bytes.fromhex(head.root_hash)
