"""`enclave db backup`: a copy of the SQLite database in use holds every committed audit event, even those
still in its write-ahead log, which a plain file copy misses; it is 0600, verifies, and never overwrites a
file unasked. PostgreSQL gets one line of pg_dump guidance."""

import shutil
import sqlite3

import pytest

from pipeline import audit, migrate
from pipeline.backup import backup
from pipeline.db import Database
from pipeline.errors import UserError


def count_events(path) -> int:
    """Audit events in the file at `path` (0 when even the table is missing from it)."""
    connection = sqlite3.connect(path)
    try:
        if not connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'audit_events'").fetchone():
            return 0
        return connection.execute("SELECT count(*) FROM audit_events").fetchone()[0]
    finally:
        connection.close()


def test_a_backup_holds_what_a_plain_copy_of_a_database_in_use_misses(tmp_path):
    source = tmp_path / "enclave.db"
    db = Database(f"sqlite:///{source}")
    migrate.upgrade(db.engine)
    with db.engine.connect():  # an open connection keeps the write-ahead log from being folded in
        for i in range(31):
            with db.transaction() as s:
                audit.append(s, actor="worker", action=audit.SUBMITTED, details={"n": i})
        shutil.copy(source, tmp_path / "plain.db")
        assert count_events(tmp_path / "plain.db") < 31  # the plain copy lost what the log held
        copy = backup(db.url, tmp_path / "backups" / "enclave.db")
    db.dispose()
    assert copy.audit_events == 31 == count_events(copy.path)
    assert copy.path.stat().st_mode & 0o777 == 0o600
    copied = Database(f"sqlite:///{copy.path}")
    with copied.transaction() as s:
        assert audit.verify(s, verify_signature=lambda *_: True).ok
    copied.dispose()
    with pytest.raises(UserError, match="exists; give another file, or --force"):
        backup(db.url, copy.path)
    assert backup(db.url, copy.path, force=True).audit_events == 31


def test_postgresql_is_pointed_at_pg_dump_without_its_password(tmp_path):
    with pytest.raises(UserError) as info:
        backup("postgresql+psycopg://enclave:s3cret@db.example/enclave", tmp_path / "x.dump")
    line = str(info.value)
    assert "pg_dump --format=custom" in line and "postgresql://enclave:***@db.example/enclave" in line
    assert "s3cret" not in line and "\n" not in line


def test_no_database_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"no database at .*run `enclave init` first"):
        backup(f"sqlite:///{tmp_path / 'missing.db'}", tmp_path / "x.db")
