"""Migrations upgrade and downgrade cleanly on SQLite and PostgreSQL, producing exactly the models' schema."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError

from pipeline import migrate
from pipeline.db import Database
from pipeline.models import Base


def test_upgrade_downgrade_upgrade(db_url):
    db = Database(db_url)
    migrate.upgrade(db.engine)
    assert migrate.current_revision(db.engine) == migrate.head_revision()
    with db.engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    migrate.downgrade(db.engine, "0001")
    migrate.downgrade(db.engine, "base")
    assert migrate.current_revision(db.engine) is None
    tables = set(inspect(db.engine).get_table_names()) - {"alembic_version"}
    assert tables == set()
    migrate.upgrade(db.engine)
    assert {"jobs", "documents", "results", "clients", "audit_events", "audit_checkpoints"} <= set(
        inspect(db.engine).get_table_names()
    )
    db.dispose()


def test_audit_tables_refuse_update_and_delete(db_url):
    db = Database(db_url)
    migrate.upgrade(db.engine)
    with db.engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO audit_events VALUES (1, 't', 'a', 'submitted', NULL, NULL, 'ok', '{}', 'p', 'h')"
            )
        )
    statements = ["UPDATE audit_events SET actor = 'mallory'", "DELETE FROM audit_events"]
    if db.is_postgresql:
        statements.append("TRUNCATE audit_events")
    for statement in statements:
        with pytest.raises(DBAPIError, match="append-only"), db.engine.begin() as c:
            c.execute(text(statement))
    with db.engine.connect() as c:
        assert c.execute(text("SELECT actor FROM audit_events")).scalar_one() == "a"
    db.dispose()
