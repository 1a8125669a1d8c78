"""Signed tree heads of the audit log, on SQLite and PostgreSQL: each head signs the RFC 9162 root of the
events (recomputed here from raw rows, independently of pipeline code), is copied outside the database after
its commit, and proves inclusion and consistency; `audit.verify` with the heads kept outside catches a log
rolled back, cut short, forked, stripped of a checkpoint or wiped, even when every remaining hash and
signature is valid, naming the rows."""

import hashlib
import json
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text

from pipeline import audit, audit_anchor, audit_proofs, audit_tree
from pipeline.audit_heads import SignedHead, legacy_payload
from pipeline.db import Database
from pipeline.models import Base
from tests.pipeline.test_merkle import mth

COLUMNS = ("seq", "at", "actor", "action", "job_id", "document_id", "outcome", "details", "prev_hash", "hash")


class Service:
    """A service key, its verifier, and the two heads files its publisher appends to."""

    def __init__(self, tmp: Path) -> None:
        self.private = Ed25519PrivateKey.generate()
        self.fingerprint = hashlib.sha256(self.private.public_key().public_bytes_raw()).hexdigest()
        self.local, self.external = tmp / "home-heads.jsonl", tmp / "worm" / "heads.jsonl"
        self.external.parent.mkdir(parents=True)
        self.publish = audit_anchor.Publisher(self.local, self.external)

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            self.private.public_key().verify(signature, data)
        except Exception:
            return False
        return True

    def checkpoint(self, session, every: int | None = None):
        if every is None:
            return audit.checkpoint(
                session, sign=self.private.sign, key_fingerprint=self.fingerprint, publish=self.publish
            )
        return audit.maybe_checkpoint(
            session, every, self.private.sign, self.fingerprint, publish=self.publish
        )


@pytest.fixture
def db(db_url):
    database = Database(db_url)
    Base.metadata.create_all(database.engine)  # no append-only triggers: raw SQL plays the attacker
    yield database
    database.dispose()


@pytest.fixture
def service(tmp_path) -> Service:
    return Service(tmp_path)


def _grow(db: Database, service: Service, n: int, every: int = 5, start: int = 0) -> None:
    for i in range(start, start + n):
        with db.transaction() as s:
            details = {"n": i, "ratio": i / 7, "name": "é" * (i % 3), "list": [i, None, True]}
            audit.append(
                s, actor=f"w{i % 2}", action=audit.DOCUMENT_DONE, job_id=f"job-{i // 4}", details=details
            )
            service.checkpoint(s, every)


def _sql(db: Database, statement: str, **params) -> list[dict]:
    with db.engine.begin() as c:
        result = c.execute(text(statement), params)
        return [dict(r._mapping) for r in result] if result.returns_rows else []


def _leaf_data(row: dict) -> bytes:
    """The documented leaf: canonical JSON of the row's ten columns, details as an object."""
    event = {name: row[name] for name in COLUMNS} | {"details": json.loads(row["details"])}
    return json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _rows(db: Database) -> list[dict]:
    return _sql(db, f"SELECT {', '.join(COLUMNS)} FROM audit_events ORDER BY seq")


def _checkpoints(db: Database) -> list[dict]:
    return _sql(db, "SELECT size, root_hash, head_hash, at, signature FROM audit_checkpoints ORDER BY size")


def _kept(path: Path) -> list[audit_anchor.KeptHead]:
    return audit_anchor.read(path)


def _verify(db: Database, service: Service, kept=()) -> audit.VerifyReport:
    with db.transaction() as s:
        return audit.verify(s, verify_signature=service.verify, kept=list(kept))


def test_each_head_signs_the_root_of_the_events_and_is_copied_outside(db, service):
    _grow(db, service, 23, every=5)
    rows, heads = _rows(db), _checkpoints(db)
    assert [h["size"] for h in heads] == [5, 10, 15, 20]
    for h in heads:
        assert h["root_hash"] == mth([_leaf_data(r) for r in rows[: h["size"]]]).hex()
        assert h["head_hash"] == rows[h["size"] - 1]["hash"]
        signed = {
            "format": "enclave-tree-head/1",
            "tree_size": h["size"],
            "root_hash": h["root_hash"],
            "chain_hash": h["head_hash"],
            "timestamp": h["at"],
        }
        payload = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
        assert service.verify(payload, bytes(h["signature"]))
    for path in (service.local, service.external):
        lines = path.read_text().splitlines()
        assert [json.loads(line)["root_hash"] for line in lines] == [h["root_hash"] for h in heads]
    assert _verify(db, service, _kept(service.external)) == audit.VerifyReport(True, 23, 4, kept=4)


def test_the_signer_does_not_trust_a_stored_tree_state(db, service):
    _grow(db, service, 10, every=5)
    bogus = "ab" * 32 * 2  # size 10 holds two subtrees (8 and 2)
    _sql(db, "UPDATE audit_checkpoints SET tree_state = :t WHERE size = 10", t=bogus)
    _grow(db, service, 5, every=5, start=10)
    rows, head = _rows(db), _checkpoints(db)[-1]
    assert head["size"] == 15 and head["root_hash"] == mth([_leaf_data(r) for r in rows]).hex()


def test_a_head_is_published_after_its_commit_only(db, service):
    published: list[SignedHead] = []
    sign = {"sign": service.private.sign, "key_fingerprint": service.fingerprint, "publish": published.append}
    with db.transaction() as s:
        audit.append(s, actor="w", action=audit.STARTED)
        head = audit.checkpoint(s, **sign)
        assert head is not None and published == []
    assert [p.tree_size for p in published] == [1]
    with pytest.raises(RuntimeError), db.transaction() as s:
        audit.append(s, actor="w", action=audit.COMPLETED)
        audit.checkpoint(s, **sign)
        raise RuntimeError("the state change failed")
    assert len(published) == 1 and len(_checkpoints(db)) == 1
    with db.transaction() as s:
        audit.append(s, actor="w", action=audit.COMPLETED)
        with s.begin_nested(), pytest.raises(ValueError, match="savepoints"):
            audit.checkpoint(s, **sign)
    failing = audit_anchor.Publisher(service.local, service.local.parent / "no-such-dir" / "heads.jsonl")
    with db.transaction() as s:  # an unwritable copy is logged and skipped; the other is still written
        audit.checkpoint(s, sign=service.private.sign, key_fingerprint=service.fingerprint, publish=failing)
    assert [h.head.tree_size for h in _kept(service.local)] == [2]


def test_inclusion_and_consistency_proofs_from_the_database(db, service):
    _grow(db, service, 37, every=6)
    events = _rows(db)
    with db.transaction() as s:
        head = audit_tree.require_head(s)
        for event in events[: head.tree_size]:
            path = [p.hex() for p in audit_tree.inclusion_path(s, event["seq"], head.tree_size)]
            audit_proofs.check_inclusion(event, head, path, service.verify)
            for tampered in ({"actor": "mallory"}, {"details": '{"n":999}'}, {"seq": event["seq"] % 36 + 1}):
                with pytest.raises(audit_proofs.ProofError):
                    audit_proofs.check_inclusion(event | tampered, head, path, service.verify)
            if path:
                bad = [("0" if path[0][0] != "0" else "1") + path[0][1:], *path[1:]]
                with pytest.raises(audit_proofs.ProofError, match="does not lead to the root"):
                    audit_proofs.check_inclusion(event, head, bad, service.verify)
        forged = SignedHead(**{**head.__dict__, "root_hash": "00" * 32})
        with pytest.raises(audit_proofs.ProofError, match="valid signature"):
            audit_proofs.check_inclusion(events[0], forged, [], service.verify)
        heads = [h.head for h in _kept(service.local)]
        for old in heads:
            path = [p.hex() for p in audit_tree.consistency_path(s, old.tree_size, head.tree_size)]
            audit_proofs.check_consistency(old, head, path, service.verify)
            if path:
                with pytest.raises(audit_proofs.ProofError, match="did not only grow"):
                    audit_proofs.check_consistency(
                        old, head, path[::-1] if len(path) > 1 else [], service.verify
                    )
        with pytest.raises(audit_proofs.ProofError, match=f"rows {heads[0].tree_size + 1}..{head.tree_size}"):
            audit_proofs.check_consistency(head, heads[0], [], service.verify)


def _rollback(db: Database, size: int) -> None:
    """What someone who controls the database does: remove every event and head after `size`."""
    _sql(db, "DELETE FROM audit_events WHERE seq > :n", n=size)
    _sql(db, "DELETE FROM audit_checkpoints WHERE size > :n", n=size)


def test_a_rollback_passes_alone_and_fails_against_the_heads_kept_outside(db, service):
    _grow(db, service, 30, every=5)
    _rollback(db, 15)
    assert _verify(db, service).ok  # every remaining hash and signature is valid
    report = _verify(db, service, _kept(service.external))
    assert not report.ok and report.first_bad_seq == 16, report
    assert "rows 16..30 are missing" in report.reason and f"{service.external} line 6" in report.reason


def test_a_fork_after_a_rollback_names_the_rows_since_the_last_head_kept(db, service):
    """The service, unaware, signs heads of the rolled-back log: those verify, the kept ones fail."""
    _grow(db, service, 30, every=5)
    kept = _kept(service.external)
    _rollback(db, 12)
    _grow(db, service, 25, every=4, start=100)
    assert _verify(db, service).ok
    report = _verify(db, service, kept)
    assert not report.ok and report.first_bad_seq == 11, report
    assert "rows 11..15 were rewritten" in report.reason and "line 3" in report.reason


def test_a_deleted_checkpoint_a_cut_tail_and_a_wiped_log_fail(db, service):
    _grow(db, service, 20, every=5)
    kept = _kept(service.local)
    _sql(db, "DELETE FROM audit_checkpoints WHERE size = 10")
    assert _verify(db, service).ok
    report = _verify(db, service, kept)
    assert (
        not report.ok
        and report.first_bad_seq == 10
        and "missing from the database (deleted)" in report.reason
    )

    _sql(db, "DELETE FROM audit_events WHERE seq > 17")
    _sql(db, "DELETE FROM audit_checkpoints WHERE size > 17")
    report = _verify(db, service, kept)
    assert not report.ok and report.first_bad_seq == 10  # the deleted checkpoint comes first
    _sql(db, "DELETE FROM audit_checkpoints")
    _sql(db, "DELETE FROM audit_events")
    alone = _verify(db, service)
    assert not alone.ok and alone.first_bad_seq == 1 and "empty" in alone.reason
    report = _verify(db, service, kept)
    assert (
        not report.ok
        and "rows 1..20 are missing" in report.reason
        and "the log ends at row 0" in report.reason
    )


def test_a_forged_or_foreign_kept_head_is_named(db, service, tmp_path):
    _grow(db, service, 10, every=5)
    lines = service.local.read_text().splitlines()
    edited = json.loads(lines[1]) | {"tree_size": 9}
    service.local.write_text("\n".join([lines[0], json.dumps(edited)]) + "\n")
    report = _verify(db, service, _kept(service.local))
    assert not report.ok and f"{service.local} line 2 has a bad signature" in report.reason
    other = Service(tmp_path / "other")
    assert not _verify(db, other, _kept(service.external)).ok


def test_checkpoints_from_before_tree_heads_still_verify_and_are_extended(db, service):
    """A database upgraded through migration 0007: old checkpoints sign (size, head hash) only."""
    for i in range(8):
        with db.transaction() as s:
            event = audit.append(s, actor="w", action=audit.SUBMITTED, details={"i": i})
            if i % 4 == 3:
                s.execute(
                    text(
                        "INSERT INTO audit_checkpoints (size, head_hash, at, key_fingerprint, signature) "
                        "VALUES (:n, :h, :a, :f, :s)"
                    ),
                    {
                        "n": event.seq,
                        "h": event.hash,
                        "a": event.at,
                        "f": service.fingerprint,
                        "s": service.private.sign(legacy_payload(event.seq, event.hash)),
                    },
                )
    assert _verify(db, service) == audit.VerifyReport(True, 8, 2)
    _grow(db, service, 3, every=3, start=8)
    head = _checkpoints(db)[-1]
    assert head["size"] == 11 and head["root_hash"] == mth([_leaf_data(r) for r in _rows(db)]).hex()
    assert _verify(db, service, _kept(service.local)).ok


def test_heads_files_append_whole_lines_and_refuse_garbage(tmp_path, service):
    head = SignedHead(1, "11" * 32, "22" * 32, "2026-01-01T00:00:00.000000Z", "33" * 32, b"\x01" * 64)
    path = tmp_path / "heads.jsonl"

    def writer(k: int) -> None:
        for i in range(50):
            audit_anchor.append(path, SignedHead(**{**head.__dict__, "tree_size": k * 1000 + i + 1}))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = audit_anchor.read(path)
    assert sorted(k.head.tree_size for k in kept) == sorted(
        k * 1000 + i + 1 for k in range(4) for i in range(50)
    )
    with path.open("a") as f:
        f.write("\n" + json.dumps(head.to_json() | {"extra": 1}) + "\n")
    with pytest.raises(
        audit_anchor.HeadsFileError, match=r"line 202 is not a signed tree head: it has 1 unknown field"
    ):
        audit_anchor.read(path)
    with pytest.raises(audit_anchor.HeadsFileError, match="no heads file"):
        audit_anchor.read(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"format": "other/1"}, "format"),
        ({"tree_size": 0}, "tree_size"),
        ({"tree_size": True}, "tree_size"),
        ({"root_hash": "AB" * 32}, "root_hash"),
        ({"chain_hash": "ab"}, "chain_hash"),
        ({"timestamp": "yesterday"}, "timestamp"),
        ({"signature": "not base64!"}, "signature"),
        ({"signature": "AAAA"}, "signature"),
    ],
)
def test_a_head_is_parsed_strictly(change, words):
    head = SignedHead(3, "11" * 32, "22" * 32, "2026-01-01T00:00:00.000000Z", "33" * 32, b"\x01" * 64)
    assert SignedHead.parse(head.line(), "x") == head
    with pytest.raises(ValueError, match=words) as caught:
        SignedHead.from_json(head.to_json() | change, "the file line 4")
    assert "the file line 4" in str(caught.value) and "\n" not in str(caught.value)


def test_migration_0007_keeps_the_audit_tables_append_only_and_the_signed_roots_across_a_downgrade(
    db_url, service
):
    from sqlalchemy.exc import DBAPIError

    from pipeline import migrate

    db = Database(db_url)
    migrate.upgrade(db.engine)
    _grow(db, service, 3, every=3)
    for statement in ("UPDATE audit_checkpoints SET root_hash = NULL", "DELETE FROM audit_checkpoints"):
        with pytest.raises(DBAPIError, match="append-only"), db.engine.begin() as c:
            c.execute(text(statement))
    roots = [c["root_hash"] for c in _checkpoints(db)]
    migrate.downgrade(db.engine, "0006")
    assert [c["root_hash"] for c in _checkpoints(db)] == roots  # evidence is not dropped with the index
    migrate.upgrade(db.engine)
    assert migrate.current_revision(db.engine) == migrate.head_revision()
    _grow(db, service, 3, every=3, start=3)
    assert _verify(db, service, _kept(service.external)) == audit.VerifyReport(True, 6, 2, kept=2)
    db.dispose()
