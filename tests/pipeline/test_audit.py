"""The audit log on SQLite and PostgreSQL: an intact chain verifies, and each kind of tampering that an
attacker with database access can do through raw SQL is caught and named."""

import hashlib
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from pipeline import audit
from pipeline.audit_heads import legacy_payload
from pipeline.db import Database
from pipeline.models import Base

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
FIELDS = ("seq", "at", "actor", "action", "job_id", "document_id", "outcome", "details", "prev_hash")
COLUMNS = (*FIELDS, "hash")
CYCLE = (audit.SUBMITTED, audit.STARTED, audit.DOCUMENT_DONE, audit.DOCUMENT_FAILED, audit.COMPLETED)


@dataclass
class Keys:
    sign: Callable[[bytes], bytes]
    verify_signature: Callable[[bytes, bytes], bool]
    fingerprint: str


def _keys() -> Keys:
    private = Ed25519PrivateKey.generate()
    public = private.public_key()

    def verify_signature(payload: bytes, signature: bytes) -> bool:
        try:
            public.verify(signature, payload)
        except InvalidSignature:
            return False
        return True

    return Keys(private.sign, verify_signature, hashlib.sha256(public.public_bytes_raw()).hexdigest())


@pytest.fixture
def keys() -> Keys:
    return _keys()


def _sqlite(tmp_path) -> Database:
    db = Database(f"sqlite:///{tmp_path}/a.db")
    Base.metadata.create_all(db.engine)
    return db


@contextmanager
def _postgresql() -> Iterator[Database]:
    """A Database whose search_path is a fresh schema, dropped afterwards: tests never share rows."""
    admin = create_engine(PG_URL, connect_args={"connect_timeout": 3})
    try:
        with admin.connect():
            pass
    except OperationalError as e:
        admin.dispose()
        pytest.skip(
            f"PostgreSQL at 127.0.0.1:5432 is unreachable ({type(e).__name__}); start it to run this case"
        )
    schema = f"audit_test_{uuid.uuid4().hex[:12]}"
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    db = Database(f"{PG_URL}?options=-csearch_path%3D{schema}")
    try:
        Base.metadata.create_all(db.engine)
        yield db
    finally:
        db.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = _sqlite(tmp_path)
        yield database
        database.dispose()
    else:
        with _postgresql() as database:
            yield database


@pytest.fixture
def sqlite_db(tmp_path) -> Iterator[Database]:
    database = _sqlite(tmp_path)
    yield database
    database.dispose()


def _append(session, i: int) -> audit.AuditEvent:
    return audit.append(
        session,
        actor=f"worker-{i % 3}",
        action=CYCLE[i % len(CYCLE)],
        job_id=f"job-{i // 5}",
        document_id=f"doc-{i}" if i % 2 else None,
        outcome="ok" if i % 4 else "failed",
        details={
            "n": i,
            "tokens": [i, 2 * i],
            "ratio": i / 7,
            "flag": i % 2 == 0,
            "none": None,
            "sub": {"k": "é"},
        },
    )


def _fill(db: Database, keys: Keys, n: int, every: int | None = 5) -> None:
    """n events, one transaction each, checkpointing every `every` rows."""
    for i in range(n):
        with db.transaction() as session:
            _append(session, i)
            if every:
                audit.maybe_checkpoint(session, every, keys.sign, keys.fingerprint)


def _verify(db: Database, keys: Keys) -> audit.VerifyReport:
    with db.transaction() as session:
        return audit.verify(session, verify_signature=keys.verify_signature)


def _sql(db: Database, statement: str, **params) -> list[dict]:
    """Raw SQL, as an attacker with database access would issue it."""
    with db.engine.begin() as conn:
        result = conn.execute(text(statement), params)
        return [dict(row._mapping) for row in result] if result.returns_rows else []


def _rows(db: Database) -> list[dict]:
    return _sql(db, f"SELECT {', '.join(COLUMNS)} FROM audit_events ORDER BY seq")


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _event(row: dict) -> dict:
    return row | {"details": json.loads(row["details"])}


def _attacker_hash(row: dict) -> str:
    """The documented formula, reimplemented independently of pipeline.audit."""
    fields = {name: row[name] for name in FIELDS} | {"details": json.loads(row["details"])}
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(bytes.fromhex(row["prev_hash"]) + payload).hexdigest()


def _rechain(db: Database) -> None:
    """Recompute every prev_hash and hash so the chain itself looks intact."""
    prev = "0" * 64
    for row in _rows(db):
        digest = _attacker_hash(row | {"prev_hash": prev})
        _sql(
            db,
            "UPDATE audit_events SET prev_hash = :p, hash = :h WHERE seq = :s",
            p=prev,
            h=digest,
            s=row["seq"],
        )
        prev = digest


def _shift(db: Database, from_seq: int, by: int) -> None:
    """Renumber rows from `from_seq` on by `by`, in two steps so the primary key never clashes midway."""
    _sql(db, "UPDATE audit_events SET seq = seq + 100000 WHERE seq >= :s", s=from_seq)
    _sql(db, "UPDATE audit_events SET seq = seq - 100000 + :by WHERE seq >= 100000", by=by)


def _insert(db: Database, seq: int, prev_hash: str, digest: str | None = None) -> None:
    """A forged row; with no `digest`, its hash is computed correctly for its place."""
    row = dict(
        seq=seq,
        at="2030-01-01T00:00:00.000000Z",
        actor="mallory",
        action=audit.RESULTS_FETCHED,
        job_id="job-0",
        document_id=None,
        outcome="ok",
        details="{}",
        prev_hash=prev_hash,
    )
    row["hash"] = digest or _attacker_hash(row)
    _sql(db, f"INSERT INTO audit_events ({', '.join(COLUMNS)}) VALUES (:{', :'.join(COLUMNS)})", **row)


def _hash_of(db: Database, seq: int) -> str:
    return _sql(db, "SELECT hash FROM audit_events WHERE seq = :s", s=seq)[0]["hash"]


def _assert_bad(report: audit.VerifyReport, seq: int, *words: str) -> None:
    assert not report.ok
    assert report.first_bad_seq == seq, report.reason
    assert report.reason and "\n" not in report.reason
    for word in words:
        assert word in report.reason


def test_intact_log_verifies(db, keys):
    _fill(db, keys, 150, every=16)
    report = _verify(db, keys)
    assert report == audit.VerifyReport(ok=True, rows=150, checkpoints=9)


def test_rows_follow_the_documented_format(sqlite_db, keys):
    with sqlite_db.transaction() as session:
        first, second = _append(session, 0), _append(session, 1)
        assert (first.seq, second.seq) == (1, 2)
        cp = audit.checkpoint(session, sign=keys.sign, key_fingerprint=keys.fingerprint)
    rows = _rows(sqlite_db)
    assert rows[0]["prev_hash"] == "0" * 64 and rows[1]["prev_hash"] == rows[0]["hash"]
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", row["at"])
        canonical = json.dumps(
            json.loads(row["details"]), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        assert row["details"] == canonical
        assert row["hash"] == _attacker_hash(row)
    assert cp is not None and (cp.size, cp.head_hash) == (2, rows[1]["hash"])
    # The signed tree head, recomputed here from RFC 9162 and the documented leaf (the row's ten columns in
    # canonical JSON): MTH of two leaves is H(0x01 || H(0x00 || leaf 1) || H(0x00 || leaf 2)).
    leaves = [hashlib.sha256(b"\x00" + _canonical(_event(row))).digest() for row in rows]
    root = hashlib.sha256(b"\x01" + leaves[0] + leaves[1]).hexdigest()
    assert cp.root_hash == root
    signed = {
        "format": "enclave-tree-head/1",
        "tree_size": 2,
        "root_hash": root,
        "chain_hash": rows[1]["hash"],
        "timestamp": cp.at,
    }
    assert keys.verify_signature(_canonical(signed), cp.signature)


def test_checkpoints_skip_empty_logs_and_signed_sizes(sqlite_db, keys):
    sign = dict(sign=keys.sign, key_fingerprint=keys.fingerprint)
    with sqlite_db.transaction() as session:
        assert audit.checkpoint(session, **sign) is None
        for i in range(3):
            _append(session, i)
        assert audit.checkpoint(session, **sign).size == 3
        assert audit.checkpoint(session, **sign) is None
        for i in range(4):
            _append(session, i)
        assert audit.maybe_checkpoint(session, 5, keys.sign, keys.fingerprint) is None
        _append(session, 9)
        assert audit.maybe_checkpoint(session, 5, keys.sign, keys.fingerprint).size == 8
    assert _verify(sqlite_db, keys) == audit.VerifyReport(ok=True, rows=8, checkpoints=2)


EDITS = {
    "at": "2020-01-01T00:00:00.000000Z",
    "actor": "mallory",
    "action": audit.CANCELLED,
    "job_id": "job-x",
    "document_id": "doc-x",
    "outcome": "tampered",
    "details": '{"n":999}',
    "prev_hash": "ab" * 32,
    "hash": "cd" * 32,
}


@pytest.mark.parametrize("column", list(EDITS))
def test_edited_row_is_named(db, keys, column):
    _fill(db, keys, 20)
    _sql(db, f"UPDATE audit_events SET {column} = :v WHERE seq = 7", v=EDITS[column])
    _assert_bad(_verify(db, keys), 7, "row 7")


def test_reformatted_details_are_named(sqlite_db, keys):
    _fill(sqlite_db, keys, 10)
    details = json.loads(_rows(sqlite_db)[6]["details"])
    _sql(sqlite_db, "UPDATE audit_events SET details = :v WHERE seq = 7", v=json.dumps(details, indent=1))
    _assert_bad(_verify(sqlite_db, keys), 7, "row 7", "canonical")


def test_deleted_row_is_named(db, keys):
    _fill(db, keys, 20)
    _sql(db, "DELETE FROM audit_events WHERE seq = 7")
    _assert_bad(_verify(db, keys), 7, "row 7 is missing")


def test_swapped_rows_are_named(db, keys):
    _fill(db, keys, 20)
    rows = {row["seq"]: row for row in _rows(db)}
    assignments = ", ".join(f"{name} = :{name}" for name in COLUMNS if name != "seq")
    for seq, other in ((5, 9), (9, 5)):
        _sql(db, f"UPDATE audit_events SET {assignments} WHERE seq = :seq", **(rows[other] | {"seq": seq}))
    _assert_bad(_verify(db, keys), 5, "row 5")


@pytest.mark.parametrize(("linked", "named"), [(False, 7), (True, 8)], ids=["bad-hash", "linked"])
def test_inserted_row_is_named_by_the_chain(db, keys, linked, named):
    """A forged row placed at 7 (later rows renumbered, hashes not recomputed). When the attacker linked it
    correctly to row 6, the chain first breaks at row 8, whose prev_hash no longer matches."""
    _fill(db, keys, 20)
    _shift(db, 7, +1)
    _insert(db, 7, _hash_of(db, 6), None if linked else "ef" * 32)
    _assert_bad(_verify(db, keys), named, f"row {named}")


REWRITES = {
    "insert": lambda db: (_shift(db, 7, +1), _insert(db, 7, "0" * 64)),
    "delete": lambda db: (_sql(db, "DELETE FROM audit_events WHERE seq = 7"), _shift(db, 8, -1)),
    "edit": lambda db: _sql(db, "UPDATE audit_events SET outcome = 'ok', actor = 'mallory' WHERE seq = 7"),
    "replace-last": lambda db: (
        _sql(db, "DELETE FROM audit_events WHERE seq = 20"),
        _insert(db, 20, "0" * 64),
    ),
}


@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_rewritten_chain_is_caught_by_checkpoints(db, keys, rewrite):
    """Every later hash recomputed: the first checkpoint at or after the rewrite no longer matches, and the
    report names the first row after the last checkpoint that still does."""
    _fill(db, keys, 20)  # checkpoints at 5, 10, 15, 20
    REWRITES[rewrite](db)
    _rechain(db)
    expected, size = (16, 20) if rewrite == "replace-last" else (6, 10)
    _assert_bad(_verify(db, keys), expected, f"rows {expected}..{size}", f"checkpoint at size {size}")


def test_appended_forgery_after_the_last_checkpoint_is_caught_only_if_unlinked(sqlite_db, keys):
    """Rows after the last checkpoint are protected by the chain alone: a correctly linked forgery there looks
    like a legitimate append until the next checkpoint (documented limit)."""
    _fill(sqlite_db, keys, 20)
    _insert(sqlite_db, 21, "12" * 32)
    _assert_bad(_verify(sqlite_db, keys), 21, "row 21")
    _sql(sqlite_db, "DELETE FROM audit_events WHERE seq = 21")
    _insert(sqlite_db, 21, _hash_of(sqlite_db, 20))
    assert _verify(sqlite_db, keys).ok


def test_deleted_tail_is_named(db, keys):
    _fill(db, keys, 20)
    _sql(db, "DELETE FROM audit_events WHERE seq >= 18")
    _assert_bad(_verify(db, keys), 18, "rows 18..20 are missing", "size 20")


CHECKPOINT_FORGERIES = {
    "head_hash": lambda db: _sql(
        db, "UPDATE audit_checkpoints SET head_hash = :h WHERE size = 10", h=_hash_of(db, 9)
    ),
    "signature": lambda db: _sql(
        db, "UPDATE audit_checkpoints SET signature = :s WHERE size = 10", s=bytes(64)
    ),
    "size": lambda db: _sql(
        db, "UPDATE audit_checkpoints SET size = 12, head_hash = :h WHERE size = 10", h=_hash_of(db, 12)
    ),
    "other-key": lambda db: _sql(
        db,
        "INSERT INTO audit_checkpoints (size, head_hash, at, key_fingerprint, signature)"
        " VALUES (12, :h, :a, :f, :s)",
        h=_hash_of(db, 12),
        a="2030-01-01T00:00:00.000000Z",
        f="mallory",
        s=_keys().sign(legacy_payload(12, _hash_of(db, 12))),
    ),
}


@pytest.mark.parametrize("forgery", list(CHECKPOINT_FORGERIES))
def test_forged_checkpoint_is_named(db, keys, forgery):
    _fill(db, keys, 20)
    CHECKPOINT_FORGERIES[forgery](db)
    expected = 10 if forgery in ("head_hash", "signature") else 12
    _assert_bad(_verify(db, keys), expected, f"checkpoint at size {expected}", "bad signature")


def test_concurrent_appends_form_one_chain(db, keys):
    threads, per_thread = 8, 25
    start, errors = threading.Barrier(threads), []

    def worker(t: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                with db.transaction() as session:
                    _append(session, t * per_thread + i)
                    audit.maybe_checkpoint(session, 10, keys.sign, keys.fingerprint)
        except Exception as e:  # reported below, with the thread that raised it
            errors.append((t, e))

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert not errors
    assert [row["seq"] for row in _rows(db)] == list(range(1, threads * per_thread + 1))
    report = _verify(db, keys)
    assert report.ok and report.rows == 200 and report.checkpoints == 20, report


def test_rolled_back_append_leaves_no_row(db, keys):
    _fill(db, keys, 3)
    with pytest.raises(RuntimeError), db.transaction() as session:
        _append(session, 3)
        raise RuntimeError("the state change failed")
    assert len(_rows(db)) == 3
    assert _verify(db, keys).ok
    with db.transaction() as session:
        assert _append(session, 3).seq == 4
    assert _verify(db, keys) == audit.VerifyReport(ok=True, rows=4, checkpoints=0)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "details",
    [
        {"text": "x" * 10_000},
        {"deep": {"list": ["y" * 201]}},
        {"k" * 201: 1},
        {"blob": b"bytes"},
        {"obj": object()},
        {"nan": float("nan")},
        {"many": ["z" * 200] * 40},
        {"deep": _nested(100_000)},
        {"huge": 10**5000},
        {"surrogate": "\ud800"},
    ],
    ids=[
        "10k-string",
        "nested-long-string",
        "long-key",
        "bytes",
        "object",
        "nan",
        "too-big",
        "100k-deep",
        "huge-int",
        "lone-surrogate",
    ],
)
def test_details_with_possible_content_are_rejected(sqlite_db, details):
    with pytest.raises(ValueError, match="details"), sqlite_db.transaction() as session:
        audit.append(session, actor="worker-1", action=audit.DOCUMENT_DONE, details=details)
    assert _rows(sqlite_db) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, None),
        ("short reason", "short reason"),
        ("two\nlines  and   tabs\t", "two lines and tabs"),
        ("r" * 500, "r" * 197 + "..."),
    ],
)
def test_bounded_text_always_passes_the_string_rule(sqlite_db, text, expected):
    assert audit.bounded(text) == expected
    with sqlite_db.transaction() as session:
        event = audit.append(
            session,
            actor="w",
            action=audit.DOCUMENT_FAILED,
            outcome="error",
            details={"error": audit.bounded(text)},
        )
    assert json.loads(event.details) == {"error": expected}
    assert audit.bounded("abcdef", 5) == "ab..."


def test_unknown_action_is_rejected_and_short_details_pass(sqlite_db):
    with sqlite_db.transaction() as session:
        with pytest.raises(ValueError, match="unknown audit action 'deleted'"):
            audit.append(session, actor="worker-1", action="deleted")
        event = audit.append(
            session, actor="w", action=audit.CLIENT_ADDED, details={"name": "n" * 200, "ids": []}
        )
    assert event.seq == 1 and json.loads(event.details)["name"] == "n" * 200
